package main

import (
	"context"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	kilnclient "github.com/kilnvm/kiln/daemon/client"
)

// tree is a directory tree as the cp tests compare them: slash path
// relative to its top -> "dir 0750" or "file 0644 <contents>".
type tree map[string]string

func (tr tree) String() string {
	var b strings.Builder
	for _, k := range slices.Sorted(maps.Keys(tr)) {
		fmt.Fprintf(&b, "\n\t%s: %.40q", k, tr[k])
	}
	return b.String()
}

// srcTree is what makeSrcTree writes, less its symlinks.
var srcTree = tree{
	"a.txt":          "file 0644 alpha\n",
	"run.sh":         "file 0755 #!/bin/sh\necho hi\n",
	"secret":         "file 0600 s3cret",
	"empty":          "dir 0755",
	"ro":             "dir 0555",
	"ro/f":           "file 0444 read only",
	"sub":            "dir 0750",
	"sub/deep":       "dir 0700",
	"sub/deep/x.bin": "file 0640 " + strings.Repeat("\x00\x01binary\xff", 20000),
}

// makeSrcTree writes srcTree under dir/name, with a symlink inside the
// tree and one leading out of it.
func makeSrcTree(t *testing.T, dir, name string) string {
	t.Helper()
	top := filepath.Join(dir, name)
	if err := os.Mkdir(top, 0o755); err != nil {
		t.Fatal(err)
	}
	writeTree(t, top, srcTree)
	if err := os.Symlink("a.txt", filepath.Join(top, "link")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/etc", filepath.Join(top, "sub", "escape")); err != nil {
		t.Fatal(err)
	}
	return top
}

// writeTree writes tr under top, directories' modes set last.
func writeTree(t *testing.T, top string, tr tree) {
	t.Helper()
	keys := slices.Sorted(maps.Keys(tr))
	for _, k := range keys {
		kind, mode, data := parseEntry(t, tr[k])
		p := filepath.Join(top, filepath.FromSlash(k))
		var err error
		if kind == "dir" {
			err = os.Mkdir(p, 0o700)
		} else {
			err = os.WriteFile(p, []byte(data), 0o600)
			if err == nil {
				err = os.Chmod(p, mode)
			}
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	slices.Reverse(keys)
	for _, k := range keys {
		if kind, mode, _ := parseEntry(t, tr[k]); kind == "dir" {
			if err := os.Chmod(filepath.Join(top, filepath.FromSlash(k)), mode); err != nil {
				t.Fatal(err)
			}
		}
	}
}

func parseEntry(t *testing.T, e string) (kind string, mode fs.FileMode, data string) {
	t.Helper()
	kind, rest, _ := strings.Cut(e, " ")
	m, data, _ := strings.Cut(rest, " ")
	var n uint32
	if _, err := fmt.Sscanf(m, "%o", &n); err != nil {
		t.Fatalf("tree entry %q: %v", e, err)
	}
	return kind, fs.FileMode(n), data
}

// localTree reads the tree under top; symlinks and special files are
// listed as such, to catch their copies.
func localTree(t *testing.T, top string) tree {
	t.Helper()
	tr := tree{}
	err := filepath.WalkDir(top, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == top {
			return err
		}
		rel, _ := filepath.Rel(top, p)
		rel = filepath.ToSlash(rel)
		info, err := d.Info()
		if err != nil {
			return err
		}
		switch {
		case d.IsDir():
			tr[rel] = fmt.Sprintf("dir %04o", info.Mode().Perm())
		case info.Mode().IsRegular():
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			tr[rel] = fmt.Sprintf("file %04o %s", info.Mode().Perm(), b)
		default:
			tr[rel] = "other " + info.Mode().String()
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return tr
}

// remoteTree reads the tree under top in a sandbox.
func remoteTree(t *testing.T, c *kilnclient.Client, id, top string) tree {
	t.Helper()
	ctx := context.Background()
	tr := tree{}
	var walk func(dir, rel string)
	walk = func(dir, rel string) {
		ents, err := c.ListDir(ctx, id, dir)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range ents {
			p, r := path.Join(dir, e.GetName()), path.Join(rel, e.GetName())
			switch e.GetMode() & sIFMT {
			case sIFDIR:
				tr[r] = fmt.Sprintf("dir %04o", e.GetMode()&0o777)
				walk(p, r)
			case sIFREG:
				var b strings.Builder
				if _, err := c.ReadFile(ctx, id, p, &b); err != nil {
					t.Fatal(err)
				}
				tr[r] = fmt.Sprintf("file %04o %s", e.GetMode()&0o777, b.String())
			default:
				tr[r] = fmt.Sprintf("other %o", e.GetMode())
			}
		}
	}
	walk(top, "")
	return tr
}

// under is tr with every path under prefix.
func under(prefix string, tr tree) tree {
	out := tree{prefix: "dir 0755"}
	for k, v := range tr {
		out[prefix+"/"+k] = v
	}
	return out
}

func dial(t *testing.T, host string) *kilnclient.Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := kilnclient.Dial(ctx, host)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// TestSandboxCopyDirs: kiln sandbox cp copies directory trees both ways,
// with docker cp's destination rules, modes kept, symlinks skipped with a
// warning, and clear errors.
func TestSandboxCopyDirs(t *testing.T) {
	host := startKilnd(t)
	c := dial(t, host)
	ctx := context.Background()
	code, out, errOut := kilnIn(t, "", "sandbox", "create", "--image", "busybox")
	if code != 0 {
		t.Fatalf("create: exit %d: %s", code, errOut)
	}
	id := oneID(t, "create", out)
	dir := t.TempDir()
	src := makeSrcTree(t, dir, "src")
	if err := syscall.Mkfifo(filepath.Join(dir, "fifo"), 0o644); err != nil {
		t.Fatal(err)
	}

	// Upload: where things land in the sandbox.
	for _, p := range []string{"/up-into", "/up-contents", "/up-merge"} {
		if _, err := c.MakeDir(ctx, id, p, kilnclient.MakeDirOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	uploads := []struct {
		name string
		args []string
		top  string // where to read the sandbox's tree
		want tree
	}{
		{name: "to a new path", args: []string{src, id + ":/up-new"}, top: "/up-new", want: srcTree},
		{name: "to a new path, trailing slash", args: []string{src, id + ":/up-slash/"}, top: "/up-slash", want: srcTree},
		{name: "with missing parents (-p)", args: []string{"-p", src, id + ":/up-p/a/b"}, top: "/up-p/a/b", want: srcTree},
		{name: "into an existing directory", args: []string{src, id + ":/up-into"}, top: "/up-into", want: under("src", srcTree)},
		{name: "its contents, with /.", args: []string{src + "/.", id + ":/up-contents"}, top: "/up-contents", want: srcTree},
		{name: "merged into a copy there", args: []string{src, id + ":/up-into"}, top: "/up-into", want: under("src", srcTree)},
		{name: "a file into a directory", args: []string{filepath.Join(src, "run.sh"), id + ":/up-merge"}, top: "/up-merge", want: tree{"run.sh": srcTree["run.sh"]}},
		{name: "an empty directory", args: []string{filepath.Join(src, "empty"), id + ":/up-empty"}, top: "/", want: nil},
	}
	for _, tt := range uploads {
		t.Run("upload "+tt.name, func(t *testing.T) {
			code, out, errOut := kilnIn(t, "", append([]string{"sandbox", "cp"}, tt.args...)...)
			if code != 0 || out != "" {
				t.Fatalf("exit %d, stdout %q, stderr %q", code, out, errOut)
			}
			if fi, err := os.Stat(filepath.Join(src, "empty")); tt.want == nil {
				// The empty directory: made, with its mode, and empty.
				rfi, rerr := c.Stat(ctx, id, "/up-empty")
				if err != nil || rerr != nil || !rfi.GetIsDir() || rfi.GetMode()&0o777 != uint32(fi.Mode().Perm()) {
					t.Fatalf("/up-empty: %v, %v, %v", rfi, err, rerr)
				}
				if got := remoteTree(t, c, id, "/up-empty"); len(got) != 0 {
					t.Errorf("/up-empty holds %v", got)
				}
				return
			}
			if got := remoteTree(t, c, id, tt.top); !maps.Equal(got, tt.want) {
				t.Errorf("%s holds:%v\nwant:%v", tt.top, got, tt.want)
			}
			if strings.Contains(strings.Join(tt.args, " "), "run.sh") {
				return
			}
			// The symlinks, skipped with a warning each; /etc not copied.
			if strings.Count(errOut, "skipped symlink") != 2 || !strings.Contains(errOut, "link -> a.txt") || !strings.Contains(errOut, "escape -> /etc") {
				t.Errorf("stderr %q; want a warning for each of the two symlinks", errOut)
			}
		})
	}

	// Download: where things land here. The sandbox's tree also holds a
	// symlink out of it.
	if code, _, errOut := kilnIn(t, "", "sandbox", "run", id, `ln -s /etc "$KILN_TEST_ROOT/up-new/sub/etc"`); code != 0 {
		t.Fatalf("ln -s in the sandbox: exit %d: %s", code, errOut)
	}
	outDir := t.TempDir()
	for _, d := range []string{"into", "contents", "merge"} {
		if err := os.Mkdir(filepath.Join(outDir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	downloads := []struct {
		name string
		args []string
		top  string
		want tree
	}{
		{name: "to a new path", args: []string{id + ":/up-new", filepath.Join(outDir, "new")}, top: "new", want: srcTree},
		{name: "to a new path, trailing slash", args: []string{id + ":/up-new/", filepath.Join(outDir, "slash") + "/"}, top: "slash", want: srcTree},
		{name: "into an existing directory", args: []string{id + ":/up-new", filepath.Join(outDir, "into")}, top: "into", want: under("up-new", srcTree)},
		{name: "merged into a copy there", args: []string{id + ":/up-new", filepath.Join(outDir, "into")}, top: "into", want: under("up-new", srcTree)},
		{name: "its contents, with /.", args: []string{id + ":/up-new/.", filepath.Join(outDir, "contents")}, top: "contents", want: srcTree},
		{name: "a file into a directory", args: []string{id + ":/up-new/sub/deep/x.bin", filepath.Join(outDir, "merge")}, top: "merge", want: tree{"x.bin": srcTree["sub/deep/x.bin"]}},
		{name: "an empty directory", args: []string{id + ":/up-new/empty", filepath.Join(outDir, "empty")}, top: "empty", want: tree{}},
	}
	for _, tt := range downloads {
		t.Run("download "+tt.name, func(t *testing.T) {
			code, out, errOut := kilnIn(t, "", append([]string{"sandbox", "cp"}, tt.args...)...)
			if code != 0 || out != "" {
				t.Fatalf("exit %d, stdout %q, stderr %q", code, out, errOut)
			}
			top := filepath.Join(outDir, tt.top)
			if got := localTree(t, top); !maps.Equal(got, tt.want) {
				t.Errorf("%s holds:%v\nwant:%v", top, got, tt.want)
			}
			if strings.Contains(tt.name, "file") || strings.Contains(tt.name, "empty") {
				return
			}
			if strings.Count(errOut, "skipped symlink") != 1 || !strings.Contains(errOut, "/up-new/sub/etc -> /etc") {
				t.Errorf("stderr %q; want a warning for the symlink", errOut)
			}
		})
	}
	if fi, err := os.Stat(filepath.Join(outDir, "empty")); err != nil || fi.Mode().Perm() != 0o755 {
		t.Errorf("the empty directory came back with %v, %v; want 0755", fi, err)
	}

	// Errors: each exits 1 with a line that says what is wrong, and
	// a copy that stops partway says what it had copied.
	if err := os.WriteFile(filepath.Join(outDir, "file"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := c.WriteFile(ctx, id, "/afile", strings.NewReader("x"), kilnclient.WriteFileOptions{}); err != nil {
		t.Fatal(err)
	}
	// Partway: the destination already has a file where the tree has the
	// directory sub (after a.txt, empty, ro, ro/f and run.sh, secret).
	if _, err := c.WriteFile(ctx, id, "/partial/src/sub", strings.NewReader("in the way"), kilnclient.WriteFileOptions{MakeParents: true}); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(outDir, "partial", "up-new"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(outDir, "partial", "up-new", "sub"), []byte("in the way"), 0o644); err != nil {
		t.Fatal(err)
	}
	errs := []struct {
		name string
		args []string
		want []string
	}{
		{"missing local source", []string{filepath.Join(dir, "nope"), id + ":/x"}, []string{"nope", "no such file"}},
		{"local special file", []string{filepath.Join(dir, "fifo"), id + ":/x"}, []string{"fifo is not a regular file or a directory"}},
		{"directory onto a sandbox file", []string{src, id + ":/afile"}, []string{"cannot copy directory", ":/afile, which is not a directory"}},
		{"file onto a sandbox file as a directory", []string{filepath.Join(src, "a.txt"), id + ":/afile/"}, []string{"/afile is not a directory"}},
		{"directory under a missing sandbox directory", []string{src, id + ":/no/such"}, []string{"/no/such", "NotFound"}},
		{"stdin to a directory", []string{"-", id + ":/up-into/"}, []string{"name the file"}},
		{"upload stopped partway", []string{src, id + ":/partial"}, []string{"/partial/src/sub", "copied 4 files (", ") and 3 directories to " + id + ":/partial/src before that"}},
		{"missing sandbox source", []string{id + ":/nope", filepath.Join(outDir, "x")}, []string{"/nope", "NotFound"}},
		{"directory onto a local file", []string{id + ":/up-new", filepath.Join(outDir, "file")}, []string{"cannot copy directory", "file, which is not a directory"}},
		{"file onto a local file as a directory", []string{id + ":/afile", filepath.Join(outDir, "file") + "/"}, []string{"file/ is not a directory"}},
		{"file into a missing local directory", []string{id + ":/afile", filepath.Join(outDir, "nodir") + "/"}, []string{"directory", "nodir/ does not exist"}},
		{"directory under a missing local directory", []string{id + ":/up-new", filepath.Join(outDir, "no", "such")}, []string{"no such file"}},
		{"directory to stdout", []string{id + ":/up-new", "-"}, []string{"is a directory: - (stdout) takes a single file"}},
		{"download stopped partway", []string{id + ":/up-new", filepath.Join(outDir, "partial")}, []string{"cannot overwrite", "partial/up-new/sub, which is not a directory", "copied 4 files (", ") and 2 directories to " + filepath.Join(outDir, "partial", "up-new") + " before that"}},
	}
	for _, tt := range errs {
		t.Run("error "+tt.name, func(t *testing.T) {
			code, out, errOut := kilnIn(t, "", append([]string{"sandbox", "cp"}, tt.args...)...)
			lines := strings.Split(strings.TrimSuffix(errOut, "\n"), "\n")
			last := lines[len(lines)-1]
			t.Log(last)
			if code != exitFailed || out != "" || !strings.HasPrefix(last, "kiln: ") {
				t.Errorf("exit %d, stdout %q, stderr %q; want exit 1 and an error", code, out, errOut)
			}
			for _, w := range tt.want {
				if !strings.Contains(last, w) {
					t.Errorf("error %q lacks %q", last, w)
				}
			}
		})
	}
	if _, err := os.Stat(filepath.Join(outDir, "no")); !os.IsNotExist(err) {
		t.Errorf("a failed download made %s: %v", filepath.Join(outDir, "no"), err)
	}
	if ents, _ := os.ReadDir(filepath.Join(outDir, "partial", "up-new")); len(ents) == 0 || slices.ContainsFunc(ents, func(e os.DirEntry) bool {
		return strings.HasPrefix(e.Name(), ".kiln-cp-")
	}) {
		t.Errorf("the partial download left %v", ents)
	}
}

func TestEntryName(t *testing.T) {
	tests := []struct {
		name string
		ok   bool
	}{
		{"a.txt", true}, {".hidden", true}, {"...", true}, {"a b", true},
		{"", false}, {".", false}, {"..", false}, {"a/b", false}, {"/", false}, {"../x", false}, {"a\x00b", false},
	}
	for _, tt := range tests {
		if err := entryName(tt.name); (err == nil) != tt.ok {
			t.Errorf("entryName(%q) = %v; want ok %v", tt.name, err, tt.ok)
		}
	}
}

// FuzzEntryName: a name from a sandbox's listing that passes lands
// directly inside the directory being copied.
func FuzzEntryName(f *testing.F) {
	for _, s := range []string{"a", ".", "..", "a/b", "", "x\x00", "..."} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		err := entryName(s)
		if err != nil {
			if err.Error() == "" {
				t.Fatalf("entryName(%q): an empty error", s)
			}
			return
		}
		p := filepath.Join("/top", s)
		if filepath.Dir(p) != "/top" || filepath.Base(p) != s || path.Join("/r", s) != "/r/"+s {
			t.Fatalf("entryName(%q) passed, but it joins as %q", s, p)
		}
	})
}

func TestCopyBases(t *testing.T) {
	tests := []struct {
		p, local, remote string
	}{
		{"/a/b", "b", "b"},
		{"/a/b/", "b", "b"},
		{"/a/b/.", "", ""},
		{"/", "", ""},
		{".", "", "."},
	}
	for _, tt := range tests {
		if got := localBase(tt.p); got != tt.local {
			t.Errorf("localBase(%q) = %q; want %q", tt.p, got, tt.local)
		}
		if got := remoteBase(tt.p); got != tt.remote {
			t.Errorf("remoteBase(%q) = %q; want %q", tt.p, got, tt.remote)
		}
	}
}
