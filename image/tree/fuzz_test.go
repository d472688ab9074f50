package tree

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"syscall"
	"testing"

	"github.com/containerd/stargz-snapshotter/estargz"
)

// FuzzBuild builds a tree from two JSON TOCs (a lower and an upper layer):
// Build must not panic and must explain a refusal with a *BuildError; a
// tree it builds must hold together when walked, and reads must land on
// the right chunks.
func FuzzBuild(f *testing.F) {
	seed := func(lower, upper *estargz.JTOC) {
		a, err := json.Marshal(lower)
		if err != nil {
			f.Fatal(err)
		}
		b, err := json.Marshal(upper)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(a, b)
	}
	layers, _, _ := imageLayers(f)
	seed(layers[0].TOC, layers[1].TOC)
	toc := func(es ...*estargz.TOCEntry) *estargz.JTOC { return &estargz.JTOC{Version: 1, Entries: es} }
	big := regE("big", 0o644, 10)
	big.ChunkSize = 4
	seed(toc(dirE("d", 0o755), regE("d/a", 0o644, 0), big, chunkE("big", 4, 4), chunkE("big", 8, 0), linkE("l", "big")),
		toc(regE("d/.wh..wh..opq", 0, 0), regE(".wh.big", 0, 0), linkE("m", "l"), symE("d", "x")))
	seed(toc(linkE("a", "b"), linkE("b", "a")), toc())
	seed(toc(regE("../x", 0, 0)), toc(chunkE("x", 0, 1)))
	f.Add([]byte(`{"entries":[{"name":"a","type":"reg","size":3,"chunkDigest":"sha256:`+
		"0000000000000000000000000000000000000000000000000000000000000000"+`"}]}`), []byte(`{}`))

	f.Fuzz(func(t *testing.T, lower, upper []byte) {
		var layers []Layer
		for _, js := range [][]byte{lower, upper} {
			var toc estargz.JTOC
			if err := json.Unmarshal(js, &toc); err != nil {
				return
			}
			layers = append(layers, Layer{TOC: &toc, Chunks: patternChunks{}})
		}
		tr, err := Build(layers, Options{})
		if err != nil {
			var be *BuildError
			if !errors.As(err, &be) {
				t.Fatalf("Build: %v (%T), not a *BuildError", err, err)
			}
			if be.Error() == "" {
				t.Fatal("empty error")
			}
			return
		}
		exercise(t, tr)
	})
}

// exercise calls every method on every inode and checks what they answer.
func exercise(t *testing.T, tr *Tree) {
	walk(t, tr)
	ctx := context.Background()
	for ino := uint64(1); ino <= uint64(tr.Len()); ino++ {
		a, err := tr.Getattr(ino)
		if err != nil || a.Ino != ino {
			t.Fatalf("Getattr(%d) = %+v, %v", ino, a, err)
		}
		if _, err := tr.Readlink(ino); (err == nil) != (a.Mode&syscall.S_IFMT == syscall.S_IFLNK) {
			t.Fatalf("Readlink(%d, mode %o): %v", ino, a.Mode, err)
		}
		names, err := tr.Listxattr(ino)
		if err != nil {
			t.Fatal(err)
		}
		for _, n := range names {
			if _, err := tr.Getxattr(ino, n); err != nil {
				t.Fatalf("Getxattr(%d, %q): %v", ino, n, err)
			}
		}
		buf := make([]byte, 17)
		for _, off := range []int64{0, a.Size / 2, a.Size - 1, a.Size} {
			n, err := tr.ReadAt(ctx, ino, buf, off)
			if a.Mode&syscall.S_IFMT != syscall.S_IFREG {
				if err == nil {
					t.Fatalf("ReadAt(%d, mode %o) succeeded", ino, a.Mode)
				}
				break
			}
			if off < 0 {
				continue
			}
			if err != nil && err != io.EOF {
				t.Fatalf("ReadAt(%d at %d): %v", ino, off, err)
			}
			want := make([]byte, n)
			for i := range want {
				want[i] = pattern(off + int64(i))
			}
			if !bytes.Equal(buf[:n], want) {
				t.Fatalf("ReadAt(%d at %d): read the wrong chunk", ino, off)
			}
		}
	}
	if st := tr.StatFS(); st.Files != uint64(tr.Len()) {
		t.Fatalf("StatFS %+v, Len %d", st, tr.Len())
	}
}
