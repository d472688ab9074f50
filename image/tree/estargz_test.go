package tree

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/stargz-snapshotter/estargz"
	"golang.org/x/sys/unix"
)

// data returns n bytes that differ at every offset and between seeds.
func data(seed, n int) string {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*31 + i/256 + seed*17)
	}
	return string(b)
}

// A file capability (VFS_CAP_REVISION_2, cap_net_raw+ep), as setcap writes it.
const capNetRaw = "\x01\x00\x00\x02\x00\x20\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00"

var mtime = time.Date(2024, 5, 6, 7, 8, 9, 0, time.UTC)

// imageLayers are two estargz layers with every kind of entry, built for
// real; files holds every regular file's expected contents.
func imageLayers(t testing.TB) (layers []Layer, readers []*memChunks, files map[string]string) {
	t.Helper()
	l0 := []tarFile{
		{name: "./", typ: tar.TypeDir, mode: 0o755},
		{name: "./etc/", typ: tar.TypeDir, mode: 0o755},
		{name: "./etc/empty", typ: tar.TypeReg, mode: 0o644},
		{name: "./etc/owned", typ: tar.TypeReg, mode: 0o640, uid: 1000, gid: 1001, data: "mine\n", mtime: mtime},
		{name: "./bin/", typ: tar.TypeDir, mode: 0o755},
		{name: "./bin/su", typ: tar.TypeReg, mode: 0o4755, data: data(1, 700)},
		{name: "./bin/sh", typ: tar.TypeSymlink, link: "dash"},
		{name: "./usr/bin/ping", typ: tar.TypeReg, mode: 0o755, data: data(2, 300), xattrs: map[string]string{"security.capability": capNetRaw, "user.note": "hi"}},
		{name: "./usr/bin/ping6", typ: tar.TypeLink, link: "./usr/bin/ping"},
		{name: "./usr/lib/big", typ: tar.TypeReg, mode: 0o644, data: data(3, 256*7+5)},
		{name: "./dev/null", typ: tar.TypeChar, mode: 0o666, major: 1, minor: 3},
		{name: "./dev/loop0", typ: tar.TypeBlock, mode: 0o660, major: 7, minor: 0},
		{name: "./run/ctl", typ: tar.TypeFifo, mode: 0o600},
		{name: "./tmp/", typ: tar.TypeDir, mode: 0o1777},
		{name: "./opt/gone/file", typ: tar.TypeReg, mode: 0o644, data: "bye"},
		{name: "./opt/dir/a", typ: tar.TypeReg, mode: 0o644, data: "a"},
		{name: "./opt/dir/sub/deep", typ: tar.TypeReg, mode: 0o644, data: "deep"},
		{name: "./opt/keep", typ: tar.TypeReg, mode: 0o644, data: "kept"},
	}
	l1 := []tarFile{
		{name: "opt/.wh.gone", typ: tar.TypeReg},
		{name: "opt/dir/.wh..wh..opq", typ: tar.TypeReg},
		{name: "opt/dir/b", typ: tar.TypeReg, mode: 0o644, data: "b"},
		{name: "etc/hostname", typ: tar.TypeReg, mode: 0o644, data: "kiln\n"},
		{name: "etc/ping", typ: tar.TypeLink, link: "usr/bin/ping"},
		{name: "etc/empty", typ: tar.TypeReg, mode: 0o600, data: data(4, 600)},
	}
	a, ra := estargzLayer(t, l0, 256, 0)
	b, rb := estargzLayer(t, l1, 256, 512)
	files = map[string]string{
		"/etc/owned": "mine\n", "/bin/su": data(1, 700), "/usr/bin/ping": data(2, 300), "/usr/bin/ping6": data(2, 300),
		"/etc/ping": data(2, 300), "/usr/lib/big": data(3, 256*7+5), "/opt/dir/b": "b", "/opt/keep": "kept",
		"/etc/hostname": "kiln\n", "/etc/empty": data(4, 600),
	}
	return []Layer{a, b}, []*memChunks{ra, rb}, files
}

func TestEstargzImage(t *testing.T) {
	layers, readers, files := imageLayers(t)
	tr, err := Build(layers, Options{Name: "image"})
	if err != nil {
		t.Fatalf("Build: %v", err)
	}
	want := map[string]string{
		"/": "dir 755", "/etc": "dir 755", "/bin": "dir 755", "/usr": "dir 755", "/usr/bin": "dir 755",
		"/usr/lib": "dir 755", "/dev": "dir 755", "/run": "dir 755", "/tmp": "dir 1777", "/opt": "dir 755", "/opt/dir": "dir 755",
		"/etc/empty": "reg 600 600", "/etc/owned": "reg 640 5", "/etc/hostname": "reg 644 5", "/etc/ping": "reg 755 300",
		"/bin/su": "reg 4755 700", "/bin/sh": "lnk dash",
		"/usr/bin/ping": "reg 755 300", "/usr/bin/ping6": "reg 755 300", "/usr/lib/big": "reg 644 1797",
		"/dev/null": "chr 666 " + itoa(unix.Mkdev(1, 3)), "/dev/loop0": "blk 660 " + itoa(unix.Mkdev(7, 0)),
		"/run/ctl": "fifo 600", "/opt/dir/b": "reg 644 1", "/opt/keep": "reg 644 4",
	}
	if got := dump(t, tr); !maps.Equal(got, want) {
		for p := range maps.Keys(got) {
			if got[p] != want[p] {
				t.Errorf("%s: %q, want %q", p, got[p], want[p])
			}
		}
		for p := range maps.Keys(want) {
			if _, ok := got[p]; !ok {
				t.Errorf("%s missing", p)
			}
		}
	}

	ping := resolve(t, tr, "/usr/bin/ping")
	for _, p := range []string{"/usr/bin/ping6", "/etc/ping"} {
		if ino := resolve(t, tr, p); ino != ping {
			t.Errorf("%s: inode %d, want ping's %d", p, ino, ping)
		}
	}
	if a, _ := tr.Getattr(ping); a.Nlink != 3 {
		t.Errorf("ping: nlink %d, want 3", a.Nlink)
	}
	if p, _ := tr.Path(ping); p != "/etc/ping" {
		t.Errorf("Path(ping) = %s, want its first path in sorted order, /etc/ping", p)
	}
	if v, err := tr.Getxattr(ping, "security.capability"); err != nil || string(v) != capNetRaw {
		t.Errorf("getcap: %q, %v", v, err)
	}
	if names, _ := tr.Listxattr(ping); !slices.Equal(names, []string{"security.capability", "user.note"}) {
		t.Errorf("Listxattr(ping) = %q", names)
	}
	if _, err := tr.Getxattr(ping, "trusted.overlay.opaque"); !errors.Is(err, syscall.ENODATA) {
		t.Errorf("missing xattr: %v, want ENODATA", err)
	}
	owned, _ := tr.Getattr(resolve(t, tr, "/etc/owned"))
	if owned.UID != 1000 || owned.GID != 1001 || !owned.Mtime.Equal(mtime) {
		t.Errorf("/etc/owned: %d:%d %s, want 1000:1001 %s", owned.UID, owned.GID, owned.Mtime, mtime)
	}
	if made, _ := tr.Getattr(resolve(t, tr, "/usr")); made.UID != 0 || made.Mtime.Unix() != 0 {
		t.Errorf("made /usr: uid %d mtime %s, want root and the epoch", made.UID, made.Mtime)
	}

	ctx := context.Background()
	for p, want := range files {
		got := readAll(t, tr, resolve(t, tr, p))
		if got != want {
			t.Errorf("%s: read %d bytes, differing from the %d written", p, len(got), len(want))
		}
	}
	// /etc/ping is layer 1's name for layer 0's file: layer 0 serves it.
	readers[0].reset()
	readers[1].reset()
	if _, err := tr.ReadAt(ctx, resolve(t, tr, "/etc/ping"), make([]byte, 10), 0); err != nil {
		t.Fatal(err)
	}
	if _, r0 := readers[0].stats(); r0 != 1 {
		t.Errorf("layer 0 read %d chunks for /etc/ping, want 1", r0)
	}
	if _, r1 := readers[1].stats(); r1 != 0 {
		t.Errorf("layer 1 read %d chunks for /etc/ping, want 0", r1)
	}

	st := tr.StatFS()
	var blocks uint64
	inos := map[uint64]bool{}
	for _, ino := range walk(t, tr) {
		if !inos[ino] {
			a, _ := tr.Getattr(ino)
			blocks += (uint64(a.Size) + BlockSize - 1) / BlockSize
			inos[ino] = true
		}
	}
	if st.Files != uint64(tr.Len()) || st.Files != uint64(len(inos)) || st.Blocks != blocks || st.BlockSize != BlockSize || st.NameLen != MaxNameLen {
		t.Errorf("StatFS %+v; want %d files, %d blocks", st, len(inos), blocks)
	}
}

func resolve(t testing.TB, tr *Tree, p string) uint64 {
	t.Helper()
	ino, err := tr.Resolve(p)
	if err != nil {
		t.Fatalf("Resolve(%s): %v", p, err)
	}
	return ino
}

func readAll(t testing.TB, tr *Tree, ino uint64) string {
	t.Helper()
	var out []byte
	buf := make([]byte, 100)
	for off := int64(0); ; {
		n, err := tr.ReadAt(context.Background(), ino, buf, off)
		out = append(out, buf[:n]...)
		off += int64(n)
		if err == io.EOF {
			return string(out)
		}
		if err != nil {
			t.Fatalf("ReadAt(%d, %d): %v", ino, off, err)
		}
	}
}

// TestReadAtEveryOffset reads multi-chunk files at every offset with reads
// shorter than, as long as and longer than a chunk, from blobs with a gzip
// member per chunk and with chunks sharing members (InnerOffset).
func TestReadAtEveryOffset(t *testing.T) {
	const chunk = 64
	for _, tc := range []struct {
		name     string
		size     int
		minChunk int
	}{
		{"chunk per member, ragged end", 5*chunk + 13, 0},
		{"chunk per member, whole chunks", 5 * chunk, 0},
		{"shared members", 5*chunk + 13, 3 * chunk},
		{"one chunk", chunk - 1, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			content := data(9, tc.size)
			l, mc := estargzLayer(t, []tarFile{{name: "f", typ: tar.TypeReg, mode: 0o644, data: content}}, chunk, tc.minChunk)
			tr, err := Build([]Layer{l}, Options{})
			if err != nil {
				t.Fatal(err)
			}
			ino := resolve(t, tr, "/f")
			size := int64(tc.size)
			for off := int64(0); off <= size+2; off++ {
				for _, n := range []int64{0, 1, 5, chunk - 1, chunk, chunk + 1, 3 * chunk, size + 10} {
					mc.reset()
					p := make([]byte, n)
					got, err := tr.ReadAt(context.Background(), ino, p, off)
					wantN := max(0, min(n, size-off))
					var wantErr error
					if off >= size || off+n > size {
						wantErr = io.EOF
					}
					if int64(got) != wantN || err != wantErr {
						t.Fatalf("ReadAt(%d bytes at %d) = %d, %v; want %d, %v", n, off, got, err, wantN, wantErr)
					}
					if got > 0 && string(p[:got]) != content[off:off+int64(got)] {
						t.Fatalf("ReadAt(%d bytes at %d): wrong bytes", n, off)
					}
					fetches, _ := mc.stats()
					first, last := off/chunk, (off+wantN-1)/chunk
					if wantN > 0 && last > first {
						if len(fetches) != 1 || len(fetches[0]) != int(last-first+1) || fetches[0][0].ChunkOffset != first*chunk {
							t.Fatalf("ReadAt(%d bytes at %d): fetches %v, want one of chunks %d..%d", n, off, offsets(fetches), first, last)
						}
					} else if len(fetches) != 0 {
						t.Fatalf("ReadAt(%d bytes at %d) in one chunk fetched %v", n, off, offsets(fetches))
					}
				}
			}
		})
	}
}

func offsets(fetches [][]*estargz.TOCEntry) [][]int64 {
	var out [][]int64
	for _, f := range fetches {
		var o []int64
		for _, ce := range f {
			o = append(o, ce.ChunkOffset)
		}
		out = append(out, o)
	}
	return out
}

// failChunks fails every call with err.
type failChunks struct{ err error }

func (f failChunks) Fetch(ctx context.Context, ces []*estargz.TOCEntry) error { return f.err }
func (f failChunks) ReadChunk(ctx context.Context, ce *estargz.TOCEntry, p []byte, off int64) (int, error) {
	return 0, f.err
}

func TestReadAtErrors(t *testing.T) {
	layers, readers, _ := imageLayers(t)
	tr, err := Build(layers, Options{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	big := resolve(t, tr, "/usr/lib/big")
	buf := make([]byte, 10)
	for _, tc := range []struct {
		name string
		ino  uint64
		off  int64
		want error
	}{
		{"directory", resolve(t, tr, "/etc"), 0, syscall.EISDIR},
		{"symlink", resolve(t, tr, "/bin/sh"), 0, syscall.EINVAL},
		{"device", resolve(t, tr, "/dev/null"), 0, syscall.EINVAL},
		{"fifo", resolve(t, tr, "/run/ctl"), 0, syscall.EINVAL},
		{"negative offset", big, -1, syscall.EINVAL},
		{"inode 0", 0, 0, syscall.ENOENT},
		{"inode past the end", uint64(tr.Len() + 1), 0, syscall.ENOENT},
	} {
		if n, err := tr.ReadAt(ctx, tc.ino, buf, tc.off); n != 0 || !errors.Is(err, tc.want) {
			t.Errorf("%s: ReadAt = %d, %v; want %v", tc.name, n, err, tc.want)
		}
	}
	if n, err := tr.ReadAt(ctx, resolve(t, tr, "/etc/owned"), nil, 0); n != 0 || err != nil {
		t.Errorf("empty read: %d, %v; want 0, nil", n, err)
	}
	if n, err := tr.ReadAt(ctx, big, buf, 1<<62); n != 0 || err != io.EOF {
		t.Errorf("read far past EOF: %d, %v", n, err)
	}

	// A chunk failing its check: EIO, with the file's path.
	for _, e := range layers[0].TOC.Entries {
		if e.Type == "chunk" && e.ChunkOffset == 512 && strings.HasSuffix(e.Name, "usr/lib/big") {
			readers[0].corrupt[e] = true
		}
	}
	p := make([]byte, 600)
	n, err := tr.ReadAt(ctx, big, p, 100)
	if !errors.Is(err, syscall.EIO) || !strings.Contains(err.Error(), "/usr/lib/big") {
		t.Errorf("corrupt chunk: %v; want EIO naming /usr/lib/big", err)
	}
	if n != 512-100 || string(p[:n]) != data(3, 512)[100:] {
		t.Errorf("corrupt chunk: %d bytes before the error, want the %d before the bad chunk", n, 512-100)
	}
	clear(readers[0].corrupt)

	// A reader returning less than asked with no error.
	readers[0].truncate = true
	if _, err := tr.ReadAt(ctx, big, p, 0); !errors.Is(err, syscall.EIO) || !strings.Contains(err.Error(), "short chunk") {
		t.Errorf("short chunk: %v; want EIO", err)
	}
	readers[0].truncate = false

	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := tr.ReadAt(cctx, big, p, 0); !errors.Is(err, context.Canceled) {
		t.Errorf("canceled: %v", err)
	}

	// A reader that fails: its error, wrapped with the path; Fetch's too.
	boom := fmt.Errorf("registry down: %w", syscall.EIO)
	l, err := Build([]Layer{layerOf(regE("x/f", 0o644, 100)), {TOC: &estargz.JTOC{Entries: []*estargz.TOCEntry{
		func() *estargz.TOCEntry { e := regE("y/g", 0o644, 100); e.ChunkSize = 50; return e }(), chunkE("y/g", 50, 50),
	}}, Chunks: failChunks{boom}}}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		path string
		off  int64
		says string
	}{
		{"/y/g", 30, "fetch 2 chunks"},
		{"/y/g", 60, "chunk at 50"},
		{"/y/g", 0, "chunk at 0"},
	} {
		_, err := l.ReadAt(ctx, resolve(t, l, tc.path), make([]byte, 30), tc.off)
		if !errors.Is(err, boom) || !errors.Is(err, syscall.EIO) || !strings.Contains(err.Error(), tc.path) || !strings.Contains(err.Error(), tc.says) {
			t.Errorf("failing reader at %d: %v", tc.off, err)
		}
	}
	if got := readAll(t, l, resolve(t, l, "/x/f")); got != string(patternBytes(100)) {
		t.Errorf("pattern file: %q", got)
	}
}

func patternBytes(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = pattern(int64(i))
	}
	return b
}

func TestLookupErrors(t *testing.T) {
	layers, _, _ := imageLayers(t)
	tr, err := Build(layers, Options{})
	if err != nil {
		t.Fatal(err)
	}
	etc := resolve(t, tr, "/etc")
	for _, tc := range []struct {
		dir  uint64
		name string
		ino  uint64
		want error
	}{
		{etc, "hostname", resolve(t, tr, "/etc/hostname"), nil},
		{etc, ".", etc, nil},
		{etc, "..", RootIno, nil},
		{RootIno, "..", RootIno, nil},
		{etc, "nothing", 0, syscall.ENOENT},
		{etc, "", 0, syscall.ENOENT},
		{etc, "hostname/x", 0, syscall.ENOENT},
		{resolve(t, tr, "/etc/hostname"), "x", 0, syscall.ENOTDIR},
		{resolve(t, tr, "/bin/sh"), "x", 0, syscall.ENOTDIR},
		{9999, "x", 0, syscall.ENOENT},
	} {
		ino, err := tr.Lookup(tc.dir, tc.name)
		if ino != tc.ino || !errors.Is(err, tc.want) || (tc.want == nil) != (err == nil) {
			t.Errorf("Lookup(%d, %q) = %d, %v; want %d, %v", tc.dir, tc.name, ino, err, tc.ino, tc.want)
		}
	}
	for _, tc := range []struct {
		path string
		want error
	}{
		{"", nil}, {"/", nil}, {"//etc//hostname", nil}, {"etc/./hostname", nil}, {"/etc/../bin/su", nil},
		{"/etc/nothing", syscall.ENOENT},
		{"/etc/hostname/x", syscall.ENOTDIR},
		{"/bin/sh/x", syscall.ENOTDIR}, // symlinks are not followed
		{"/opt/gone", syscall.ENOENT},
		{"/opt/dir/a", syscall.ENOENT},
		{"/opt/.wh.gone", syscall.ENOENT},
	} {
		_, err := tr.Resolve(tc.path)
		if !errors.Is(err, tc.want) || (tc.want == nil) != (err == nil) {
			t.Errorf("Resolve(%q): %v, want %v", tc.path, err, tc.want)
		}
		if err != nil && !strings.Contains(err.Error(), tc.path) {
			t.Errorf("Resolve(%q): %v does not name the path", tc.path, err)
		}
	}
	if _, err := tr.ReadDir(resolve(t, tr, "/etc/hostname")); !errors.Is(err, syscall.ENOTDIR) {
		t.Errorf("ReadDir(file): %v", err)
	}
	if _, err := tr.Readlink(etc); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("Readlink(dir): %v", err)
	}
	if _, err := tr.Getattr(0); !errors.Is(err, syscall.ENOENT) {
		t.Errorf("Getattr(0): %v", err)
	}
	for _, f := range []func() error{
		func() error { _, err := tr.Getxattr(0, "x"); return err },
		func() error { _, err := tr.Listxattr(uint64(tr.Len() + 1)); return err },
		func() error { _, err := tr.Path(0); return err },
		func() error { _, err := tr.Readlink(0); return err },
		func() error { _, err := tr.ReadDir(0); return err },
	} {
		if err := f(); !errors.Is(err, syscall.ENOENT) {
			t.Errorf("unknown inode: %v, want ENOENT", err)
		}
	}
	// Results are the caller's.
	ents, _ := tr.ReadDir(etc)
	ents[0].Name = "changed"
	if again, _ := tr.ReadDir(etc); again[0].Name == "changed" {
		t.Error("ReadDir shares its slice")
	}
	ping := resolve(t, tr, "/usr/bin/ping")
	v, _ := tr.Getxattr(ping, "user.note")
	v[0] = 'X'
	if again, _ := tr.Getxattr(ping, "user.note"); string(again) != "hi" {
		t.Error("Getxattr shares its value")
	}
}

// TestInodesStable checks inode numbers: the root 1, then sorted path order;
// the same for two Builds and for any order of a layer's TOC entries.
func TestInodesStable(t *testing.T) {
	layers, _, _ := imageLayers(t)
	tr, err := Build(layers, Options{})
	if err != nil {
		t.Fatal(err)
	}
	want := fullDump(t, tr)
	again, err := Build(layers, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if got := fullDump(t, again); !slices.Equal(got, want) {
		t.Fatalf("a second Build differs:\n%s\nvs\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}

	// Numbers in depth-first sorted order: each new inode seen is the next.
	next := uint64(2)
	var visit func(dir uint64)
	visit = func(dir uint64) {
		ents, _ := tr.ReadDir(dir)
		for _, e := range ents {
			if e.Ino == next {
				next++
			} else if e.Ino > next {
				t.Fatalf("%s: inode %d, want %d", tr.path(e.Ino), e.Ino, next)
			}
			if e.Mode == syscall.S_IFDIR {
				visit(e.Ino)
			}
		}
	}
	visit(RootIno)
	if int(next-1) != tr.Len() {
		t.Errorf("numbered %d inodes, Len() = %d", next-1, tr.Len())
	}

	// Shuffled TOCs (a file's chunks kept together and in order).
	for seed := range uint64(8) {
		rng := rand.New(rand.NewPCG(seed, 1))
		shuffled := make([]Layer, len(layers))
		for i, l := range layers {
			var groups [][]*estargz.TOCEntry
			for _, e := range l.TOC.Entries {
				if e.Type == "chunk" {
					groups[len(groups)-1] = append(groups[len(groups)-1], e)
				} else {
					groups = append(groups, []*estargz.TOCEntry{e})
				}
			}
			rng.Shuffle(len(groups), func(a, b int) { groups[a], groups[b] = groups[b], groups[a] })
			shuffled[i] = Layer{TOC: &estargz.JTOC{Version: 1, Entries: slices.Concat(groups...)}, Chunks: l.Chunks}
		}
		st, err := Build(shuffled, Options{})
		if err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		if got := fullDump(t, st); !slices.Equal(got, want) {
			t.Fatalf("seed %d: shuffled TOC gives another tree:\n%s\nvs\n%s", seed, strings.Join(got, "\n"), strings.Join(want, "\n"))
		}
	}
}

// TestConcurrent walks and reads one tree from many goroutines (run with
// -race).
func TestConcurrent(t *testing.T) {
	layers, _, files := imageLayers(t)
	tr, err := Build(layers, Options{})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			walk(t, tr)
			for p, want := range files {
				if got := readAll(t, tr, resolve(t, tr, p)); got != want {
					t.Errorf("%s: wrong bytes", p)
				}
			}
		})
	}
	wg.Wait()
}

func TestBuildLogs(t *testing.T) {
	var buf bytes.Buffer
	layers, _, _ := imageLayers(t)
	if _, err := Build(layers, Options{Name: "img", Logger: slogTo(&buf)}); err != nil {
		t.Fatal(err)
	}
	if s := buf.String(); !strings.Contains(s, "image tree built") || !strings.Contains(s, "tree=img") || !strings.Contains(s, "ignored=2") {
		t.Errorf("log: %q", s)
	}
}

func slogTo(w io.Writer) *slog.Logger {
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelDebug}))
}
