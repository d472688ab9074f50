package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmm"
	"github.com/kilnvm/kiln/vmmproc"
)

// testFrozen returns a Frozen of a state with the devices given, over a
// small memfd that starts with id, with no KVM.
func testFrozen(t *testing.T, id string, devs ...virtio.DeviceSpec) *Frozen {
	t.Helper()
	fd, err := unix.MemfdCreate("sandbox-test", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	base := os.NewFile(uintptr(fd), "memfd")
	if _, err := base.WriteAt([]byte(id), 0); err != nil {
		t.Fatal(err)
	}
	st := &vmm.State{CPUs: 2, MemoryMiB: 64}
	for _, d := range devs {
		st.Devices = append(st.Devices, vmm.DeviceState{Spec: d})
	}
	f, err := newFrozen(id, st, base, map[string]string{LabelHostname: "box"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

// baseText reads the start of f's base through a descriptor of its own.
func baseText(t *testing.T, f *Frozen, n int) string {
	t.Helper()
	d, err := f.dupBase()
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	b := make([]byte, n)
	if _, err := d.ReadAt(b, 0); err != nil {
		t.Fatal(err)
	}
	return string(b)
}

var testVsock = virtio.DeviceSpec{ID: VsockDevice, Kind: virtio.KindVsock, Vsock: &virtio.VsockSpec{CID: GuestCID, Path: "/nonexistent/vsock.sock"}}

func TestFrozen(t *testing.T) {
	img := virtio.DeviceSpec{ID: ImageDevice, Kind: virtio.KindFS, FS: &virtio.FSSpec{Image: "sha256:abc"}}
	f := testFrozen(t, "ck-1", img, testVsock)
	if f.ID() != "ck-1" || f.Hostname() != "box" || f.Image() != "sha256:abc" || f.CPUs() != 2 || f.MemoryMiB() != 64 || len(f.Devices()) != 2 {
		t.Fatalf("Frozen: id %q host %q image %q cpus %d mem %d devices %v", f.ID(), f.Hostname(), f.Image(), f.CPUs(), f.MemoryMiB(), f.Devices())
	}
	if g := testFrozen(t, "plain", testVsock); g.Image() != "" {
		t.Fatalf("Image of a frozen sandbox without an image root: %q", g.Image())
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, err := f.dupBase(); err == nil {
		t.Fatal("a closed Frozen's base duplicated")
	}

	for _, c := range []struct {
		name   string
		labels map[string]string
		want   string
	}{
		{"no hostname", map[string]string{"x": "y"}, "not a sandbox's"},
		{"bad hostname", map[string]string{LabelHostname: "a b"}, "hostname"},
	} {
		fd, err := unix.MemfdCreate("sandbox-test", unix.MFD_CLOEXEC)
		if err != nil {
			t.Fatal(err)
		}
		base := os.NewFile(uintptr(fd), "memfd")
		if _, err := newFrozen("x", &vmm.State{}, base, c.labels); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want %q", c.name, err, c.want)
		}
		if _, err := base.Stat(); !errors.Is(err, os.ErrClosed) {
			t.Errorf("%s: the refused base is open", c.name)
		}
	}
}

func TestLocalHolds(t *testing.T) {
	var h localHolds
	a := testFrozen(t, "a", testVsock)
	if err := h.adopt(a); err != nil {
		t.Fatalf("adopt: %v", err)
	}
	// The table keeps its own descriptor: closing a leaves the hold.
	a.Close()
	if err := h.adopt(testFrozen(t, "a", testVsock)); !errors.Is(err, ErrHoldExists) {
		t.Fatalf("adopt of a held ID: %v", err)
	}
	if err := h.adopt(testFrozen(t, "c", testVsock)); err != nil {
		t.Fatal(err)
	}
	if got := h.ids(); !slices.Equal(got, []string{"a", "c"}) {
		t.Fatalf("ids %v", got)
	}
	f, err := h.frozen("a")
	if err != nil {
		t.Fatalf("frozen: %v", err)
	}
	if got := baseText(t, f, 1); got != "a" || f.Hostname() != "box" {
		t.Fatalf("frozen a: base %q, host %q", got, f.Hostname())
	}
	f.Close()
	if _, err := h.frozen("zz"); !errors.Is(err, ErrNotHeld) {
		t.Fatalf("frozen of an unknown ID: %v", err)
	}
	if _, err := h.frozen("../a"); err == nil || errors.Is(err, ErrNotHeld) || !strings.Contains(err.Error(), "byte 2") {
		t.Fatalf("frozen of a bad ID: %v", err)
	}
	if err := h.release("a"); err != nil {
		t.Fatal(err)
	}
	if err := h.release("a"); !errors.Is(err, ErrNotHeld) {
		t.Fatalf("second release: %v", err)
	}
	for i := len(h.ids()); i < vmmproc.MaxHolds; i++ {
		if err := h.reserve(fmt.Sprint("r", i)); err != nil {
			t.Fatal(err)
		}
	}
	if err := h.reserve("over"); err == nil || !strings.Contains(err.Error(), "at most") {
		t.Fatalf("reserve past the limit: %v", err)
	}
	c, err := h.frozen("c")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	h.closeAll()
	if got := h.ids(); len(got) != 0 {
		t.Fatalf("ids after closeAll: %v", got)
	}
	if err := h.adopt(c); err == nil || !strings.Contains(err.Error(), "closed") {
		t.Fatalf("adopt after closeAll: %v", err)
	}
	// A Frozen handed out outlives the table.
	if got := baseText(t, c, 1); got != "c" {
		t.Fatalf("frozen c after closeAll reads %q", got)
	}
}

// TestRestoreFrozenRefuses: what RestoreFrozen refuses before it starts
// a VM.
func TestRestoreFrozenRefuses(t *testing.T) {
	ctx := context.Background()
	disk := virtio.DeviceSpec{ID: "data", Kind: virtio.KindBlock, Block: &virtio.BlockSpec{Path: "/nonexistent/data.img"}}
	closed := testFrozen(t, "closed", testVsock)
	closed.Close()
	for _, c := range []struct {
		name string
		f    *Frozen
		opts RestoreOptions
		want string
	}{
		{"nil", nil, RestoreOptions{}, "no frozen checkpoint"},
		{"bad hostname", testFrozen(t, "h", testVsock), RestoreOptions{Hostname: "a=b"}, "hostname"},
		{"no vsock", testFrozen(t, "nov", disk), RestoreOptions{}, `hold "nov" is not a sandbox's`},
		{"net for none", testFrozen(t, "n", testVsock), RestoreOptions{Net: &virtio.NetSpec{Tap: "kilntest0"}}, "has no network card"},
		{"disk not there", testFrozen(t, "d", disk, testVsock), RestoreOptions{Disks: map[string]string{"other": "/x.img"}}, `names "other", which is not a disk of hold "d"`},
		{"image for none", testFrozen(t, "i", testVsock), RestoreOptions{Image: "debian"}, "has no image root"},
		{"closed", closed, RestoreOptions{}, "closed already"},
	} {
		t.Run(c.name, func(t *testing.T) {
			sb, err := RestoreFrozen(ctx, c.f, c.opts)
			if err == nil {
				sb.Close(ctx)
			}
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("RestoreFrozen: %v, want %q", err, c.want)
			}
		})
	}
}

func TestHoldsWithoutVM(t *testing.T) {
	ctx := context.Background()
	var s Sandbox
	if err := s.Hold(ctx, "a"); err == nil || !strings.Contains(err.Error(), "no VM") {
		t.Fatalf("Hold: %v", err)
	}
	if _, err := s.Held(ctx); err == nil {
		t.Fatal("Held of a sandbox without a VM")
	}
	if err := s.Adopt(ctx, nil); err == nil || !strings.Contains(err.Error(), "no frozen checkpoint") {
		t.Fatalf("Adopt of nil: %v", err)
	}
	if err := s.Refresh(ctx, "a b"); err == nil || !strings.Contains(err.Error(), "hostname") {
		t.Fatalf("Refresh to a bad hostname: %v", err)
	}
}
