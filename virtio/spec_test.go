package virtio

import (
	"encoding/json"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kilnvm/kiln/image/tree"
	"github.com/kilnvm/kiln/rofs"
	"golang.org/x/sys/unix"
)

func TestDeviceSpecValidate(t *testing.T) {
	blk := func(b BlockSpec) DeviceSpec { return DeviceSpec{ID: "disk", Kind: KindBlock, Block: &b} }
	fsd := func(f FSSpec) DeviceSpec { return DeviceSpec{ID: "image", Kind: KindFS, FS: &f} }
	dig := "sha256:" + strings.Repeat("0f", 32)
	tests := []struct {
		name    string
		spec    DeviceSpec
		wantErr string
	}{
		{"disk", blk(BlockSpec{Path: "/a.img"}), ""},
		{"disk by fd", blk(BlockSpec{FD: 7}), ""},
		{"net", DeviceSpec{ID: "net0", Kind: KindNet, Net: &NetSpec{Tap: "tap0", MAC: "02:00:00:00:00:01"}}, ""},
		{"vsock", DeviceSpec{ID: "vsock", Kind: KindVsock, Vsock: &VsockSpec{CID: 3, Path: "/v.sock"}}, ""},
		{"rng", DeviceSpec{ID: "rng", Kind: KindRNG, RNG: &RNGSpec{}}, ""},
		{"no ID", DeviceSpec{Kind: KindRNG, RNG: &RNGSpec{}}, `device "": ID: want 1 to 32`},
		{"bad ID", DeviceSpec{ID: "Disk/1", Kind: KindRNG, RNG: &RNGSpec{}}, "ID: want"},
		{"long ID", DeviceSpec{ID: strings.Repeat("a", 33), Kind: KindRNG, RNG: &RNGSpec{}}, "ID: want"},
		{"unknown kind", DeviceSpec{ID: "x", Kind: "floppy", RNG: &RNGSpec{}}, `unknown kind "floppy"`},
		{"no settings", DeviceSpec{ID: "x", Kind: KindBlock}, "with 0 device settings"},
		{"two settings", DeviceSpec{ID: "x", Kind: KindBlock, Block: &BlockSpec{Path: "/a"}, RNG: &RNGSpec{}}, "with 2 device settings"},
		{"kind and settings differ", DeviceSpec{ID: "x", Kind: KindBlock, RNG: &RNGSpec{}}, "kind blk without blk settings"},
		{"disk without image", blk(BlockSpec{}), "no image path or fd"},
		{"long serial", blk(BlockSpec{Path: "/a", Serial: strings.Repeat("s", BlockIDBytes+1)}), "serial"},
		{"too many queues", blk(BlockSpec{Path: "/a", Queues: BlockMaxQueues + 1}), "17 queues"},
		{"negative queues", blk(BlockSpec{Path: "/a", Queues: -2}), "-2 queues"},
		{"bad MAC", DeviceSpec{ID: "n", Kind: KindNet, Net: &NetSpec{MAC: "zz"}}, `MAC "zz"`},
		{"multicast MAC", DeviceSpec{ID: "n", Kind: KindNet, Net: &NetSpec{MAC: "01:00:00:00:00:01"}}, "multicast"},
		{"low CID", DeviceSpec{ID: "v", Kind: KindVsock, Vsock: &VsockSpec{CID: 2, Path: "/v"}}, "guest CID 2"},
		{"no socket", DeviceSpec{ID: "v", Kind: KindVsock, Vsock: &VsockSpec{CID: 3}}, "no host socket path"},
		{"fs", fsd(FSSpec{Tag: "kilnroot", Image: dig, Images: "/i"}), ""},
		{"fs without tag", fsd(FSSpec{Image: dig, Images: "/i"}), "mount tag"},
		{"fs tag with a space", fsd(FSSpec{Tag: "a b", Image: dig, Images: "/i"}), "mount tag"},
		{"fs long tag", fsd(FSSpec{Tag: strings.Repeat("t", MaxTagLen+1), Image: dig, Images: "/i"}), "mount tag"},
		{"fs image not a digest", fsd(FSSpec{Tag: "t", Image: "debian:12", Images: "/i"}), "not a manifest digest"},
		{"fs relative images", fsd(FSSpec{Tag: "t", Image: dig, Images: "images"}), "not an absolute path"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.spec.Validate()
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("Validate: %v", err)
				}
				return
			}
			var se *SpecError
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) || !errors.As(err, &se) {
				t.Fatalf("Validate = %v, want a *SpecError saying %q", err, tt.wantErr)
			}
		})
	}
}

func TestValidateSpecs(t *testing.T) {
	rng := DeviceSpec{ID: "rng", Kind: KindRNG, RNG: &RNGSpec{}}
	vsock := func(id string) DeviceSpec {
		return DeviceSpec{ID: id, Kind: KindVsock, Vsock: &VsockSpec{CID: 3, Path: "/" + id}}
	}
	if err := ValidateSpecs([]DeviceSpec{rng, vsock("v")}); err != nil {
		t.Fatal(err)
	}
	if err := ValidateSpecs([]DeviceSpec{rng, rng}); err == nil || !strings.Contains(err.Error(), `device "rng": ID used by two devices`) {
		t.Fatalf("duplicate IDs: %v", err)
	}
	if err := ValidateSpecs([]DeviceSpec{vsock("a"), vsock("b")}); err == nil || !strings.Contains(err.Error(), "2 vsock devices") {
		t.Fatalf("two vsock devices: %v", err)
	}
}

func TestDeviceSpecSaved(t *testing.T) {
	s := DeviceSpec{ID: "disk", Kind: KindBlock, Block: &BlockSpec{Path: "/a.img", FD: 9, ReadOnly: true}}
	saved := s.Saved()
	if saved.Block.FD != 0 || saved.Block.Path != "/a.img" || !saved.Block.ReadOnly {
		t.Fatalf("saved %+v", saved.Block)
	}
	if s.Block.FD != 9 {
		t.Fatal("Saved changed the original")
	}
	n := DeviceSpec{ID: "n", Kind: KindNet, Net: &NetSpec{Tap: "t", FD: 4}}.Saved()
	if n.Net.FD != 0 || n.Net.Tap != "t" {
		t.Fatalf("saved %+v", n.Net)
	}
}

func TestOpen(t *testing.T) {
	dir := t.TempDir()
	img := filepath.Join(dir, "disk.img")
	if err := os.WriteFile(img, make([]byte, 8*BlockSectorSize), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Run("disk by path", func(t *testing.T) {
		d, err := Open(DeviceSpec{ID: "data", Kind: KindBlock, Block: &BlockSpec{Path: img, ReadOnly: true}}, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer d.(*Block).Close()
		if d.ID() != IDBlock {
			t.Fatalf("device ID %d", d.ID())
		}
		// The serial defaults to the spec's ID.
		if st, err := d.SaveState(); err != nil || !strings.Contains(string(st), `"id":"data"`) {
			t.Fatalf("state %s, %v", st, err)
		}
	})
	t.Run("disk by descriptor", func(t *testing.T) {
		f, err := os.OpenFile(img, os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		d, err := Open(DeviceSpec{ID: "data", Kind: KindBlock, Block: &BlockSpec{FD: ownFD(t, f), Path: img}}, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := d.(*Block).Close(); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("read-only descriptor for a writable disk", func(t *testing.T) {
		f, err := os.Open(img)
		if err != nil {
			t.Fatal(err)
		}
		_, err = NewBlockFromFile(f, BlockConfig{Path: img})
		if err == nil || !strings.Contains(err.Error(), "open read-only but the disk is read-write") {
			t.Fatalf("NewBlockFromFile = %v", err)
		}
	})
	t.Run("missing image", func(t *testing.T) {
		_, err := Open(DeviceSpec{ID: "data", Kind: KindBlock, Block: &BlockSpec{Path: filepath.Join(dir, "none.img")}}, nil)
		if err == nil || !strings.Contains(err.Error(), "none.img") {
			t.Fatalf("Open = %v", err)
		}
	})
	t.Run("vsock by descriptor", func(t *testing.T) {
		sock := filepath.Join(dir, "v.sock")
		ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
		if err != nil {
			t.Fatal(err)
		}
		f, err := ln.File()
		ln.SetUnlinkOnClose(false)
		ln.Close() // the File holds a duplicate
		if err != nil {
			t.Fatal(err)
		}
		d, err := Open(DeviceSpec{ID: "vsock", Kind: KindVsock, Vsock: &VsockSpec{CID: 3, Path: sock, FD: ownFD(t, f)}}, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer d.(*Vsock).Close()
		c, err := net.Dial("unix", sock)
		if err != nil {
			t.Fatalf("dial the passed listener: %v", err)
		}
		c.Close()
	})
	t.Run("rng", func(t *testing.T) {
		d, err := Open(DeviceSpec{ID: "rng", Kind: KindRNG, RNG: &RNGSpec{}}, nil)
		if err != nil || d.ID() != IDRNG {
			t.Fatalf("Open = %v, %v", d, err)
		}
	})
	t.Run("fs", func(t *testing.T) {
		fsSpec := DeviceSpec{ID: "image", Kind: KindFS, FS: &FSSpec{Tag: "kilnroot", Image: "sha256:" + strings.Repeat("ab", 32), Images: "/var/lib/kiln/images"}}
		if _, err := Open(fsSpec, nil); err == nil || !strings.Contains(err.Error(), "OpenOptions.FS is nil") {
			t.Fatalf("Open without an opener = %v", err)
		}
		_, err := OpenWith(fsSpec, OpenOptions{FS: func(FSSpec) (rofs.FS, io.Closer, error) { return nil, nil, errors.New("no such image") }})
		if err == nil || !strings.Contains(err.Error(), "no such image") || !strings.Contains(err.Error(), fsSpec.FS.Image) {
			t.Fatalf("Open with a failing opener = %v", err)
		}
		tr, err := tree.Build(nil, tree.Options{})
		if err != nil {
			t.Fatal(err)
		}
		var got FSSpec
		closed := 0
		d, err := OpenWith(fsSpec, OpenOptions{FS: func(s FSSpec) (rofs.FS, io.Closer, error) {
			got = s
			return tr, closerFunc(func() error { closed++; return nil }), nil
		}})
		if err != nil || d.ID() != ID9P || got != *fsSpec.FS {
			t.Fatalf("Open = %v, %v (opener got %+v)", d, err, got)
		}
		if err := d.(io.Closer).Close(); err != nil || closed != 1 {
			t.Fatalf("Close = %v, tree released %d times", err, closed)
		}
	})
	t.Run("invalid", func(t *testing.T) {
		if _, err := Open(DeviceSpec{ID: "x", Kind: KindBlock}, nil); err == nil {
			t.Fatal("Open took an invalid spec")
		}
	})
}

// FuzzDeviceSpec feeds device specs as JSON (as snapshots and API requests
// carry them) to Validate and Saved: neither may panic, and a valid spec
// round-trips through JSON unchanged.
func FuzzDeviceSpec(f *testing.F) {
	for _, s := range []string{
		`{"id":"disk","kind":"blk","blk":{"path":"/a.img","read_only":true}}`,
		`{"id":"net0","kind":"net","net":{"tap":"t0","mac":"02:00:00:00:00:01"}}`,
		`{"id":"vsock","kind":"vsock","vsock":{"guest_cid":3,"path":"/v"}}`,
		`{"id":"rng","kind":"rng","rng":{}}`,
		`{"id":"x","kind":"blk","rng":{}}`,
		`{"kind":"fs","fs":{"tag":"t"}}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var s DeviceSpec
		if json.Unmarshal(b, &s) != nil {
			return
		}
		if s.Validate() != nil {
			return
		}
		saved := s.Saved()
		out, err := json.Marshal(saved)
		if err != nil {
			t.Fatal(err)
		}
		var back DeviceSpec
		if err := json.Unmarshal(out, &back); err != nil {
			t.Fatal(err)
		}
		again, _ := json.Marshal(back)
		if string(again) != string(out) {
			t.Fatalf("round trip: %s then %s", out, again)
		}
	})
}

type closerFunc func() error

func (f closerFunc) Close() error { return f() }

// ownFD hands the descriptor of f over to whoever it is passed to, as a
// parent's inherited descriptor would be: a duplicate that nothing else
// closes. Passing f.Fd() itself would leave f's finalizer to close the
// number again later, after another test's socket has been given it.
func ownFD(t *testing.T, f *os.File) int {
	t.Helper()
	fd, err := unix.Dup(int(f.Fd()))
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	return fd
}
