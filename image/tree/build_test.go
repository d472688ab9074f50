package tree

import (
	"errors"
	"maps"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/stargz-snapshotter/estargz"
	"golang.org/x/sys/unix"
)

func TestBuildMerge(t *testing.T) {
	withUID := func(e *estargz.TOCEntry, uid int) *estargz.TOCEntry { e.UID = uid; return e }
	tests := []struct {
		name   string
		layers []Layer
		want   map[string]string
	}{
		{
			name:   "no layers: an empty root",
			layers: nil,
			want:   map[string]string{"/": "dir 755"},
		},
		{
			name:   "parents made",
			layers: []Layer{layerOf(regE("a/b/c", 0o644, 3))},
			want:   map[string]string{"/": "dir 755", "/a": "dir 755", "/a/b": "dir 755", "/a/b/c": "reg 644 3"},
		},
		{
			name:   "names cleaned",
			layers: []Layer{layerOf(dirE("./", 0o700), dirE("./etc/", 0o750), regE("/etc/passwd", 0o644, 0), regE(".//x", 0o600, 0))},
			want:   map[string]string{"/": "dir 700", "/etc": "dir 750", "/etc/passwd": "reg 644 0", "/x": "reg 600 0"},
		},
		{
			name: "whiteout removes a lower file",
			layers: []Layer{
				layerOf(regE("a/x", 0o644, 0), regE("a/y", 0o644, 0)),
				layerOf(regE("a/.wh.x", 0, 0)),
			},
			want: map[string]string{"/": "dir 755", "/a": "dir 755", "/a/y": "reg 644 0"},
		},
		{
			name: "whiteout removes a lower subtree",
			layers: []Layer{
				layerOf(dirE("d", 0o755), dirE("d/e", 0o755), regE("d/e/f", 0o644, 0), regE("keep", 0o644, 0)),
				layerOf(regE(".wh.d", 0, 0)),
			},
			want: map[string]string{"/": "dir 755", "/keep": "reg 644 0"},
		},
		{
			name: "whiteout spares its own layer, whatever the order",
			layers: []Layer{
				layerOf(regE("x", 0o600, 0)),
				layerOf(regE("x", 0o644, 0), regE(".wh.x", 0, 0), regE(".wh.y", 0, 0), regE("y", 0o640, 0)),
			},
			want: map[string]string{"/": "dir 755", "/x": "reg 644 0", "/y": "reg 640 0"},
		},
		{
			name: "whiteout of something absent makes its directory",
			layers: []Layer{
				layerOf(regE("f", 0o644, 0)),
				layerOf(regE("d/.wh.nothing", 0, 0), regE("f/.wh.g", 0, 0)),
			},
			want: map[string]string{"/": "dir 755", "/d": "dir 755", "/f": "dir 755"},
		},
		{
			name: "opaque directory hides the lower entries, keeps its own",
			layers: []Layer{
				layerOf(dirE("d", 0o700), regE("d/a", 0o644, 0), dirE("d/sub", 0o755), regE("d/sub/b", 0o644, 0), regE("other", 0o644, 0)),
				layerOf(regE("d/c", 0o644, 0), regE("d/.wh..wh..opq", 0, 0)),
			},
			want: map[string]string{"/": "dir 755", "/d": "dir 700", "/d/c": "reg 644 0", "/other": "reg 644 0"},
		},
		{
			name: "opaque root",
			layers: []Layer{
				layerOf(regE("a", 0o644, 0)),
				layerOf(regE(".wh..wh..opq", 0, 0), regE("b", 0o644, 0)),
			},
			want: map[string]string{"/": "dir 755", "/b": "reg 644 0"},
		},
		{
			name: "file over directory drops the subtree",
			layers: []Layer{
				layerOf(dirE("d", 0o755), regE("d/a", 0o644, 0)),
				layerOf(regE("d", 0o600, 2)),
			},
			want: map[string]string{"/": "dir 755", "/d": "reg 600 2"},
		},
		{
			name: "directory over file replaces it",
			layers: []Layer{
				layerOf(regE("d", 0o600, 2)),
				layerOf(dirE("d", 0o711), regE("d/x", 0o644, 0)),
			},
			want: map[string]string{"/": "dir 755", "/d": "dir 711", "/d/x": "reg 644 0"},
		},
		{
			name: "symlink over directory",
			layers: []Layer{
				layerOf(dirE("lib", 0o755), regE("lib/libc.so", 0o755, 0)),
				layerOf(symE("lib", "usr/lib")),
			},
			want: map[string]string{"/": "dir 755", "/lib": "lnk usr/lib"},
		},
		{
			name: "made parent over a lower file",
			layers: []Layer{
				layerOf(regE("a", 0o644, 1)),
				layerOf(regE("a/b", 0o644, 0)),
			},
			want: map[string]string{"/": "dir 755", "/a": "dir 755", "/a/b": "reg 644 0"},
		},
		{
			name: "directory over directory merges, attributes from above",
			layers: []Layer{
				layerOf(dirE("d", 0o700), regE("d/a", 0o644, 0)),
				layerOf(dirE("d", 0o755), regE("d/b", 0o644, 0)),
				layerOf(regE("d/c", 0o644, 0)), // a made parent keeps d's attributes
			},
			want: map[string]string{"/": "dir 755", "/d": "dir 755", "/d/a": "reg 644 0", "/d/b": "reg 644 0", "/d/c": "reg 644 0"},
		},
		{
			name:   "directory listed after its entries",
			layers: []Layer{layerOf(regE("d/a", 0o644, 0), dirE("d", 0o700))},
			want:   map[string]string{"/": "dir 755", "/d": "dir 700", "/d/a": "reg 644 0"},
		},
		{
			name:   "later entry of a path wins",
			layers: []Layer{layerOf(regE("f", 0o600, 1), withUID(regE("f", 0o644, 2), 5))},
			want:   map[string]string{"/": "dir 755", "/f": "reg 644 2"},
		},
		{
			name: "landmarks and AUFS metadata are not part of the tree",
			layers: []Layer{layerOf(
				regE(estargz.NoPrefetchLandmark, 0o644, 1), regE(estargz.PrefetchLandmark, 0o644, 1),
				regE("d/"+estargz.PrefetchLandmark, 0o644, 0),
				dirE(".wh..wh.plnk", 0o700), regE(".wh..wh.plnk/123", 0o644, 0), regE(".wh..wh.aufs", 0o644, 0),
			)},
			want: map[string]string{"/": "dir 755", "/d": "dir 755", "/d/" + estargz.PrefetchLandmark: "reg 644 0"},
		},
		{
			name: "types, setuid, setgid, sticky",
			layers: []Layer{layerOf(
				&estargz.TOCEntry{Name: "dev/null", Type: "char", Mode: 0o666, DevMajor: 1, DevMinor: 3},
				&estargz.TOCEntry{Name: "dev/sda", Type: "block", Mode: 0o660, DevMajor: 8, DevMinor: 0},
				&estargz.TOCEntry{Name: "dev/big", Type: "block", Mode: 0o600, DevMajor: 259, DevMinor: 1 << 20},
				&estargz.TOCEntry{Name: "run/fifo", Type: "fifo", Mode: 0o620},
				regE("bin/su", 0o4755, 0),
				regE("bin/wall", 0o2755, 0),
				dirE("tmp", 0o1777),
				dirE("srv", 0o2775),
				regE("typed", 0o100644, 0), // tar writers that add the type bits
				symE("bin/sh", "dash"),
			)},
			want: map[string]string{
				"/": "dir 755", "/dev": "dir 755", "/run": "dir 755", "/bin": "dir 755",
				"/dev/null": "chr 666 " + itoa(unix.Mkdev(1, 3)),
				"/dev/sda":  "blk 660 " + itoa(unix.Mkdev(8, 0)),
				"/dev/big":  "blk 600 " + itoa(unix.Mkdev(259, 1<<20)),
				"/run/fifo": "fifo 620",
				"/bin/su":   "reg 4755 0", "/bin/wall": "reg 2755 0",
				"/tmp": "dir 1777", "/srv": "dir 2775",
				"/typed":  "reg 644 0",
				"/bin/sh": "lnk dash",
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tr, err := Build(tc.layers, Options{Name: "test"})
			if err != nil {
				t.Fatalf("Build: %v", err)
			}
			got := dump(t, tr)
			if !maps.Equal(got, tc.want) {
				t.Errorf("tree:\n got %v\nwant %v", got, tc.want)
			}
			if tr.Len() != countInodes(t, tr) {
				t.Errorf("Len() = %d, the walk finds %d inodes", tr.Len(), countInodes(t, tr))
			}
		})
	}
}

func itoa(v uint64) string { return strconv.FormatUint(v, 10) }

func countInodes(t testing.TB, tr *Tree) int {
	inos := map[uint64]bool{}
	for _, ino := range walk(t, tr) {
		inos[ino] = true
	}
	return len(inos)
}

func TestBuildHardlinks(t *testing.T) {
	// want: path -> "group/nlink"; paths of one group must share an inode.
	tests := []struct {
		name   string
		layers []Layer
		want   map[string]string
	}{
		{
			name:   "same layer",
			layers: []Layer{layerOf(regE("a", 0o644, 0), linkE("b", "a"))},
			want:   map[string]string{"/a": "x/2", "/b": "x/2"},
		},
		{
			name:   "link before its target",
			layers: []Layer{layerOf(linkE("b", "./a"), regE("a", 0o644, 0))},
			want:   map[string]string{"/a": "x/2", "/b": "x/2"},
		},
		{
			name:   "chain out of order",
			layers: []Layer{layerOf(linkE("d/c", "b"), linkE("b", "a"), regE("a", 0o644, 0))},
			want:   map[string]string{"/a": "x/3", "/b": "x/3", "/d/c": "x/3"},
		},
		{
			name:   "to a lower layer",
			layers: []Layer{layerOf(regE("a", 0o644, 0)), layerOf(linkE("b", "a"))},
			want:   map[string]string{"/a": "x/2", "/b": "x/2"},
		},
		{
			name:   "one name whited out",
			layers: []Layer{layerOf(regE("a", 0o644, 0), linkE("b", "a")), layerOf(regE(".wh.a", 0, 0))},
			want:   map[string]string{"/b": "x/1"},
		},
		{
			name:   "one name replaced",
			layers: []Layer{layerOf(regE("a", 0o644, 0), linkE("b", "a")), layerOf(regE("a", 0o600, 0))},
			want:   map[string]string{"/a": "y/1", "/b": "x/1"},
		},
		{
			name:   "link replaced later in its layer",
			layers: []Layer{layerOf(regE("a", 0o644, 0), linkE("b", "a"), regE("b", 0o600, 0))},
			want:   map[string]string{"/a": "x/1", "/b": "y/1"},
		},
		{
			name:   "link over a directory",
			layers: []Layer{layerOf(regE("f", 0o644, 0), dirE("d", 0o755), regE("d/x", 0o644, 0)), layerOf(linkE("d", "f"))},
			want:   map[string]string{"/f": "x/2", "/d": "x/2"},
		},
		{
			name:   "to a symlink and a device",
			layers: []Layer{layerOf(symE("s", "t"), linkE("h", "s"), &estargz.TOCEntry{Name: "c", Type: "char", DevMajor: 1, DevMinor: 5}, linkE("c2", "c"))},
			want:   map[string]string{"/s": "x/2", "/h": "x/2", "/c": "y/2", "/c2": "y/2"},
		},
		{
			name:   "to itself, over a lower file",
			layers: []Layer{layerOf(regE("a", 0o644, 0)), layerOf(linkE("a", "a"))},
			want:   map[string]string{"/a": "x/1"},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tr, err := Build(tc.layers, Options{})
			if err != nil {
				t.Fatalf("Build: %v", err)
			}
			paths := walk(t, tr)
			groups := map[string]uint64{}
			inos := map[uint64]string{}
			for p, want := range tc.want {
				ino, ok := paths[p]
				if !ok {
					t.Fatalf("%s missing; tree %v", p, paths)
				}
				group, nlink, _ := strings.Cut(want, "/")
				if g, ok := groups[group]; ok && g != ino {
					t.Errorf("%s: inode %d, want the same as group %s's %d", p, ino, group, g)
				}
				if g, ok := inos[ino]; ok && g != group {
					t.Errorf("%s: inode %d is shared with group %s", p, ino, g)
				}
				groups[group], inos[ino] = ino, group
				a, _ := tr.Getattr(ino)
				if itoa(uint64(a.Nlink)) != nlink {
					t.Errorf("%s: nlink %d, want %s", p, a.Nlink, nlink)
				}
			}
			for p, ino := range paths {
				if a, _ := tr.Getattr(ino); p != "/" && a.Mode&syscall.S_IFMT != syscall.S_IFDIR && tc.want[p] == "" {
					t.Errorf("unexpected %s", p)
				}
			}
		})
	}
}

func TestBuildDirNlink(t *testing.T) {
	tr, err := Build([]Layer{layerOf(dirE("a", 0o755), dirE("a/b", 0o755), dirE("a/c", 0o755), regE("a/f", 0o644, 0), regE("x/y/z", 0o644, 0))}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	for p, want := range map[string]uint32{"/": 4, "/a": 4, "/a/b": 2, "/x": 3, "/x/y": 2, "/a/f": 1} {
		ino, err := tr.Resolve(p)
		if err != nil {
			t.Fatal(err)
		}
		if a, _ := tr.Getattr(ino); a.Nlink != want {
			t.Errorf("%s: nlink %d, want %d", p, a.Nlink, want)
		}
	}
}

func TestBuildErrorType(t *testing.T) {
	_, err := Build([]Layer{layerOf(regE("ok", 0o644, 0)), layerOf(regE("fine", 0o644, 0), linkE("bad", "nowhere"))}, Options{Name: "img@sha256:1"})
	var be *BuildError
	if !errors.As(err, &be) {
		t.Fatalf("Build: %v, want a *BuildError", err)
	}
	if be.Layer != 1 || be.Entry != 1 || be.Name != "bad" || be.Tree != "img@sha256:1" {
		t.Errorf("BuildError %+v, want layer 1 entry 1 %q", be, "bad")
	}
	for _, s := range []string{"img@sha256:1", "layer 1", "entry 1", `"bad"`, `"nowhere"`} {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("error %q does not mention %s", err, s)
		}
	}
}

// TestBuildLinkChain builds a long chain of hardlinks listed against their
// order (each names the next, the last a file): linear work, one inode.
func TestBuildLinkChain(t *testing.T) {
	const n = 20000
	es := make([]*estargz.TOCEntry, 0, n+1)
	for i := range n {
		es = append(es, linkE("l/"+strconv.Itoa(i), "l/"+strconv.Itoa(i+1)))
	}
	es = append(es, regE("l/"+strconv.Itoa(n), 0o644, 0))
	start := time.Now()
	tr, err := Build([]Layer{layerOf(es...)}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("Build took %s for %d links", d, n)
	}
	ino := resolve(t, tr, "/l/0")
	if a, _ := tr.Getattr(ino); a.Nlink != n+1 || tr.Len() != 3 {
		t.Errorf("nlink %d, %d inodes; want %d, 3", a.Nlink, tr.Len(), n+1)
	}
}

func TestBuildErrorUnwraps(t *testing.T) {
	e := regE("a", 0o644, 0)
	e.ModTime3339 = "2024-13-01T00:00:00Z"
	_, err := Build([]Layer{layerOf(e)}, Options{})
	var pe *time.ParseError
	if !errors.As(err, &pe) {
		t.Fatalf("Build: %v, want it to wrap the *time.ParseError", err)
	}
}
