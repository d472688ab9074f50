package hostfs_test

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/hugelgupf/p9/linux"
	"github.com/hugelgupf/p9/p9"
	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/hostfs"
	"github.com/kilnvm/kiln/ninep"
)

// serve answers the 9P stream on conn with s, one message at a time, as a
// transport would.
func serve(t *testing.T, s *ninep.Server, conn net.Conn) {
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			var hdr [4]byte
			if _, err := io.ReadFull(conn, hdr[:]); err != nil {
				return
			}
			size := binary.LittleEndian.Uint32(hdr[:])
			if size < 7 || size > s.MaxMsize() {
				conn.Close()
				return
			}
			req := make([]byte, size)
			copy(req, hdr[:])
			if _, err := io.ReadFull(conn, req[4:]); err != nil {
				return
			}
			if _, err := conn.Write(s.Handle(context.Background(), req)); err != nil {
				return
			}
		}
	}()
	t.Cleanup(func() { conn.Close(); wg.Wait() })
}

// TestNinep: a host directory served through the 9P server, read with a
// 9P client as the guest's kernel would: walk, read, readlink, readdir,
// and no way out through a link or "..".
func TestNinep(t *testing.T) {
	top := t.TempDir()
	dir := filepath.Join(top, "rootfs")
	if err := os.MkdirAll(filepath.Join(dir, "etc"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "etc", "os-release"), []byte("ID=kiln\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(top, "secret"), []byte("host"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("../secret", filepath.Join(dir, "out")); err != nil {
		t.Fatal(err)
	}
	fs, err := hostfs.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer fs.Close()
	cc, sc := net.Pipe()
	serve(t, ninep.NewServer(fs, ninep.Options{}), sc)
	c, err := p9.NewClient(cc, p9.WithMessageSize(64<<10))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	root, err := c.Attach("/")
	if err != nil {
		t.Fatal(err)
	}
	_, f, err := root.Walk([]string{"etc", "os-release"})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := f.Open(p9.ReadOnly); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64)
	n, err := f.ReadAt(buf, 0)
	if err != nil && !errors.Is(err, io.EOF) {
		t.Fatal(err)
	}
	if string(buf[:n]) != "ID=kiln\n" {
		t.Errorf("read %q", buf[:n])
	}
	_, link, err := root.Walk([]string{"out"})
	if err != nil {
		t.Fatal(err)
	}
	if target, err := link.Readlink(); err != nil || target != "../secret" {
		t.Errorf("Readlink(out) = %q, %v", target, err)
	}
	// A walk stops at the link (a partial walk: one qid, or an error).
	if qids, _, err := root.Walk([]string{"out", "x"}); err == nil && len(qids) == 2 {
		t.Error("walked through a symbolic link")
	}
	// ".." at the root stays at the root (the server's rule).
	qids, up, err := root.Walk([]string{".."})
	if err != nil {
		t.Fatal(err)
	}
	_, _, attr, err := up.GetAttr(p9.AttrMaskAll)
	if err != nil {
		t.Fatal(err)
	}
	if len(qids) != 1 || attr.Mode.IsDir() == false {
		t.Errorf("walk .. from the root: %v, %+v", qids, attr)
	}
	if _, _, err := up.Walk([]string{"secret"}); !isErrno(err, unix.ENOENT) {
		t.Errorf("walk ../secret: %v, want ENOENT", err)
	}
	_, d, err := root.Walk(nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := d.Open(p9.ReadOnly); err != nil {
		t.Fatal(err)
	}
	ents, err := d.Readdir(0, 4096)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name)
	}
	if len(names) < 2 || !containsAll(names, "etc", "out") {
		t.Errorf("readdir of the root: %v", names)
	}
}

func isErrno(err error, want unix.Errno) bool {
	var got linux.Errno
	return errors.As(err, &got) && uintptr(got) == uintptr(want)
}

func containsAll(have []string, want ...string) bool {
	set := map[string]bool{}
	for _, h := range have {
		set[h] = true
	}
	for _, w := range want {
		if !set[w] {
			return false
		}
	}
	return true
}
