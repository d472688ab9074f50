package initramfs

import (
	"bytes"
	"compress/gzip"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/u-root/u-root/pkg/cpio"
)

type readEntry struct {
	mode uint64
	data string
}

// readBack parses a newc archive with u-root's reader.
func readBack(t *testing.T, archive []byte) ([]string, map[string]readEntry) {
	t.Helper()
	recs, err := cpio.ReadAllRecords(cpio.Newc.Reader(bytes.NewReader(archive)))
	if err != nil {
		t.Fatalf("reading archive back: %v", err)
	}
	var names []string
	got := map[string]readEntry{}
	for _, r := range recs {
		if r.MTime != 0 || r.UID != 0 || r.GID != 0 {
			t.Errorf("%s: mtime %d uid %d gid %d, want zeros", r.Name, r.MTime, r.UID, r.GID)
		}
		var data []byte
		if r.ReaderAt != nil {
			data, err = io.ReadAll(io.NewSectionReader(r.ReaderAt, 0, int64(r.FileSize)))
			if err != nil {
				t.Fatal(err)
			}
		}
		names = append(names, r.Name)
		got[r.Name] = readEntry{mode: r.Mode, data: string(data)}
	}
	return names, got
}

func build(t *testing.T, b *Builder) []byte {
	t.Helper()
	var buf bytes.Buffer
	n, err := b.WriteTo(&buf)
	if err != nil {
		t.Fatal(err)
	}
	if n != int64(buf.Len()) {
		t.Fatalf("WriteTo returned %d, wrote %d bytes", n, buf.Len())
	}
	return buf.Bytes()
}

func TestRoundTrip(t *testing.T) {
	host := filepath.Join(t.TempDir(), "hostfile")
	if err := os.WriteFile(host, []byte("from the host"), 0o640); err != nil {
		t.Fatal(err)
	}
	b := New()
	for _, err := range []error{
		b.AddFile("/etc/motd", []byte("hello\n"), 0o644),
		b.AddFile("usr/bin/tool", []byte("#!/bin/sh\n"), 0o755|fs.ModeSetuid),
		b.AddHostFile("opt/hostfile", host, 0),
		b.AddHostFile("opt/forced", host, 0o600),
		b.AddSymlink("bin/sh", "busybox"),
		b.AddDir("tmp", 0o777|fs.ModeSticky),
		b.AddDir("usr", 0o700), // implicit parent made explicit
		b.AddFile("empty", nil, 0o600),
	} {
		if err != nil {
			t.Fatal(err)
		}
	}
	archive := build(t, b)
	if len(archive)%4 != 0 || !bytes.Contains(archive[len(archive)-128:], []byte(cpio.Trailer+"\x00")) {
		t.Errorf("archive does not end with a padded %s record", cpio.Trailer)
	}
	names, got := readBack(t, archive)
	wantNames := []string{"bin", "bin/sh", "empty", "etc", "etc/motd", "opt", "opt/forced", "opt/hostfile",
		"tmp", "usr", "usr/bin", "usr/bin/tool"}
	if strings.Join(names, " ") != strings.Join(wantNames, " ") {
		t.Fatalf("entries = %q, want %q", names, wantNames)
	}
	want := map[string]readEntry{
		"bin":          {mode: cpio.S_IFDIR | 0o755},
		"bin/sh":       {mode: cpio.S_IFLNK | 0o777, data: "busybox"},
		"empty":        {mode: cpio.S_IFREG | 0o600},
		"etc":          {mode: cpio.S_IFDIR | 0o755},
		"etc/motd":     {mode: cpio.S_IFREG | 0o644, data: "hello\n"},
		"opt/forced":   {mode: cpio.S_IFREG | 0o600, data: "from the host"},
		"opt/hostfile": {mode: cpio.S_IFREG | 0o640, data: "from the host"},
		"tmp":          {mode: cpio.S_IFDIR | cpio.S_ISVTX | 0o777},
		"usr":          {mode: cpio.S_IFDIR | 0o700},
		"usr/bin/tool": {mode: cpio.S_IFREG | cpio.S_ISUID | 0o755, data: "#!/bin/sh\n"},
	}
	for name, w := range want {
		if got[name] != w {
			t.Errorf("%s = {%#o %q}, want {%#o %q}", name, got[name].mode, got[name].data, w.mode, w.data)
		}
	}
}

func TestDeterministic(t *testing.T) {
	host := filepath.Join(t.TempDir(), "h")
	if err := os.WriteFile(host, bytes.Repeat([]byte("kiln"), 5000), 0o644); err != nil {
		t.Fatal(err)
	}
	mk := func(reverse bool) *Builder {
		b := New()
		adds := []func() error{
			func() error { return b.AddFile("a/b/c", []byte("c"), 0o644) },
			func() error { return b.AddHostFile("h", host, 0) },
			func() error { return b.AddSymlink("a/link", "b/c") },
			func() error { return b.AddDir("z", 0o755) },
		}
		for i := range adds {
			if reverse {
				i = len(adds) - 1 - i
			}
			if err := adds[i](); err != nil {
				t.Fatal(err)
			}
		}
		return b
	}
	one, two := build(t, mk(false)), build(t, mk(true))
	if !bytes.Equal(one, two) {
		t.Fatal("two builds of the same entries differ")
	}
	var g1, g2 bytes.Buffer
	if _, err := mk(false).WriteGzip(&g1); err != nil {
		t.Fatal(err)
	}
	if _, err := mk(true).WriteGzip(&g2); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(g1.Bytes(), g2.Bytes()) {
		t.Fatal("two gzip builds of the same entries differ")
	}
	zr, err := gzip.NewReader(&g1)
	if err != nil {
		t.Fatal(err)
	}
	plain, err := io.ReadAll(zr)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(plain, one) {
		t.Fatal("WriteGzip does not decompress to WriteTo's bytes")
	}
}

func TestBadPaths(t *testing.T) {
	tests := []struct {
		name    string
		add     func(b *Builder) error
		wantErr string
	}{
		{"empty", func(b *Builder) error { return b.AddFile("", nil, 0o644) }, "empty path"},
		{"dotdot", func(b *Builder) error { return b.AddFile("../etc/passwd", nil, 0o644) }, `".."`},
		{"inner dotdot", func(b *Builder) error { return b.AddFile("a/../../b", nil, 0o644) }, `".."`},
		{"absolute dotdot", func(b *Builder) error { return b.AddDir("/../x", 0o755) }, `".."`},
		{"root", func(b *Builder) error { return b.AddDir("/", 0o755) }, "archive root"},
		{"dot", func(b *Builder) error { return b.AddDir("./", 0o755) }, "archive root"},
		{"nul", func(b *Builder) error { return b.AddFile("a\x00b", nil, 0o644) }, "NUL"},
		{"duplicate file", func(b *Builder) error {
			if err := b.AddFile("/x", nil, 0o644); err != nil {
				return err
			}
			return b.AddFile("x", nil, 0o644)
		}, "duplicate path x"},
		{"duplicate explicit dir", func(b *Builder) error {
			if err := b.AddDir("d", 0o755); err != nil {
				return err
			}
			return b.AddDir("d/", 0o755)
		}, "duplicate path d"},
		{"file over implicit dir", func(b *Builder) error {
			if err := b.AddFile("d/f", nil, 0o644); err != nil {
				return err
			}
			return b.AddFile("d", nil, 0o644)
		}, "duplicate path d"},
		{"parent is a file", func(b *Builder) error {
			if err := b.AddFile("f", nil, 0o644); err != nil {
				return err
			}
			return b.AddFile("f/g", nil, 0o644)
		}, "parent f is not a directory"},
		{"type bits in mode", func(b *Builder) error { return b.AddFile("f", nil, fs.ModeDir|0o755) }, "permission bits"},
		{"empty symlink", func(b *Builder) error { return b.AddSymlink("l", "") }, "bad target"},
		{"missing host file", func(b *Builder) error { return b.AddHostFile("f", "/nonexistent/kiln", 0) }, "/nonexistent/kiln"},
		{"host dir", func(b *Builder) error { return b.AddHostFile("f", t.TempDir(), 0) }, "not a regular file"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.add(New())
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("error = %v, want one containing %q", err, tt.wantErr)
			}
		})
	}
}

func TestWriteFile(t *testing.T) {
	b := New()
	if err := b.AddFile("init", []byte("x"), 0o755); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	for _, compress := range []bool{false, true} {
		p := filepath.Join(dir, "out")
		if err := b.WriteFile(p, compress); err != nil {
			t.Fatal(err)
		}
		data, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		if compress {
			zr, err := gzip.NewReader(bytes.NewReader(data))
			if err != nil {
				t.Fatal(err)
			}
			if data, err = io.ReadAll(zr); err != nil {
				t.Fatal(err)
			}
		}
		if !bytes.Equal(data, build(t, b)) {
			t.Fatalf("WriteFile(compress=%v) wrote other bytes than WriteTo", compress)
		}
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 1 {
		t.Fatalf("WriteFile left %d files behind, want 1", len(entries))
	}
}

// TestGNUCpioReads checks that GNU cpio, when installed, lists the archive.
func TestGNUCpioReads(t *testing.T) {
	if _, err := exec.LookPath("cpio"); err != nil {
		t.Skip("GNU cpio not installed")
	}
	b := New()
	if err := b.AddFile("dir/file", []byte("data"), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("cpio", "-it", "--quiet")
	cmd.Stdin = bytes.NewReader(build(t, b))
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("cpio -it: %v", err)
	}
	if got := string(out); got != "dir\ndir/file\n" {
		t.Fatalf("cpio -it listed %q", got)
	}
}

func TestBusyboxInit(t *testing.T) {
	fake := filepath.Join(t.TempDir(), "busybox")
	if err := os.WriteFile(fake, []byte("\x7fELF fake busybox"), 0o755); err != nil {
		t.Fatal(err)
	}
	b, err := busyboxInit(fake, "echo hi\npoweroff -f\n")
	if err != nil {
		t.Fatal(err)
	}
	_, got := readBack(t, build(t, b))
	checks := map[string]readEntry{
		"init":         {mode: cpio.S_IFREG | 0o755, data: "#!/bin/busybox sh\necho hi\npoweroff -f\n"},
		"bin/busybox":  {mode: cpio.S_IFREG | 0o755, data: "\x7fELF fake busybox"},
		"bin/sh":       {mode: cpio.S_IFLNK | 0o777, data: "busybox"},
		"bin/poweroff": {mode: cpio.S_IFLNK | 0o777, data: "busybox"},
		"bin/nproc":    {mode: cpio.S_IFLNK | 0o777, data: "busybox"},
		"proc":         {mode: cpio.S_IFDIR | 0o755},
		"tmp":          {mode: cpio.S_IFDIR | cpio.S_ISVTX | 0o777},
	}
	for name, w := range checks {
		if got[name] != w {
			t.Errorf("%s = {%#o %q}, want {%#o %q}", name, got[name].mode, got[name].data, w.mode, w.data)
		}
	}
	for _, a := range BusyboxApplets() {
		if _, ok := got["bin/"+a]; !ok {
			t.Errorf("no /bin/%s applet link", a)
		}
	}
}

func TestBusyboxInitMissing(t *testing.T) {
	dir := t.TempDir()
	notExec := filepath.Join(dir, "plain")
	if err := os.WriteFile(notExec, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	for path, want := range map[string]string{
		filepath.Join(dir, "none"): "busybox-static",
		notExec:                    "not an executable",
		dir:                        "not an executable",
	} {
		if _, err := busyboxInit(path, "true"); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("busyboxInit(%s) error = %v, want one containing %q", path, err, want)
		}
	}
}

func FuzzCleanPath(f *testing.F) {
	for _, s := range []string{"bin/sh", "/init", "../x", "a//b/./c", "/", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, p string) {
		c, err := CleanPath(p)
		if err != nil {
			return
		}
		if c == "" || c == "." || strings.HasPrefix(c, "/") || strings.ContainsRune(c, 0) {
			t.Fatalf("CleanPath(%q) = %q", p, c)
		}
		for _, el := range strings.Split(c, "/") {
			if el == ".." || el == "." || el == "" {
				t.Fatalf("CleanPath(%q) = %q has element %q", p, c, el)
			}
		}
		b := New()
		if err := b.AddFile(p, []byte("x"), 0o644); err != nil {
			t.Fatalf("AddFile(%q) after CleanPath accepted it: %v", p, err)
		}
	})
}
