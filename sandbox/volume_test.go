package sandbox

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/virtio"
)

// slotMachine is a machine with specs whose insertDisk records what it
// is given and fills the slot's spec, as a VM does.
type slotMachine struct {
	machine // nil: the tests call nothing else
	specs   []virtio.DeviceSpec
	flags   int // the access mode of the last file inserted
}

func (m *slotMachine) devices() []virtio.DeviceSpec { return m.specs }

func (m *slotMachine) insertDisk(_ context.Context, id string, f *os.File, readOnly bool) error {
	defer f.Close()
	fl, err := unix.FcntlInt(f.Fd(), unix.F_GETFL, 0)
	if err != nil {
		return err
	}
	m.flags = fl & unix.O_ACCMODE
	for i, d := range m.specs {
		if d.ID == id {
			b := *d.Block
			b.Path, b.ReadOnly = f.Name(), readOnly
			m.specs[i].Block = &b
		}
	}
	return nil
}

func TestVolumeSpecs(t *testing.T) {
	specs := volumeSpecs()
	if len(specs) != VolumeSlots {
		t.Fatalf("%d slots, want %d", len(specs), VolumeSlots)
	}
	if err := virtio.ValidateSpecs(specs); err != nil {
		t.Fatal(err)
	}
	for i, d := range specs {
		if d.ID != VolumeDevice(i) || d.Block.Serial != d.ID || !d.Block.EmptySlot() {
			t.Errorf("slot %d: %+v %+v", i, d, d.Block)
		}
	}
}

func TestAttachVolume(t *testing.T) {
	img := filepath.Join(t.TempDir(), "vol.img")
	if err := os.WriteFile(img, make([]byte, 4096), 0o644); err != nil {
		t.Fatal(err)
	}
	filled := volumeSpecs()
	filled[1].Block = &virtio.BlockSpec{Slot: true, Serial: "vol1", Path: "/volumes/other.img"}
	tests := []struct {
		name    string
		specs   []virtio.DeviceSpec
		v       Volume
		wantErr string
		noSlot  bool
	}{
		{"negative slot", volumeSpecs(), Volume{Slot: -1, Path: img}, "want 0 to 3", false},
		{"slot past the last", volumeSpecs(), Volume{Slot: VolumeSlots, Path: img}, "want 0 to 3", false},
		{"no path", volumeSpecs(), Volume{Slot: 0}, "no image path", false},
		{"relative mount path", volumeSpecs(), Volume{Slot: 0, Path: img, MountPath: "data"}, "not absolute", false},
		{"snapshot without slots", nil, Volume{Slot: 0, Path: img}, "predates volume slots", true},
		{"filled slot", filled, Volume{Slot: 1, Path: img}, "already holds /volumes/other.img", false},
		{"missing image", volumeSpecs(), Volume{Slot: 0, Path: img + ".nope"}, "no such file", false},
		{"read-write", volumeSpecs(), Volume{Slot: 0, Path: img}, "", false},
		{"read-only", volumeSpecs(), Volume{Slot: 3, Path: img, ReadOnly: true}, "", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := &slotMachine{specs: tt.specs, flags: -1}
			s := &Sandbox{m: m, disks: blockPaths(nil, tt.specs)}
			err := s.AttachVolume(context.Background(), tt.v)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("AttachVolume: %v, want an error with %q", err, tt.wantErr)
				}
				if errors.Is(err, ErrNoVolumeSlot) != tt.noSlot {
					t.Errorf("errors.Is(%v, ErrNoVolumeSlot) = %v", err, !tt.noSlot)
				}
				return
			}
			if err != nil {
				t.Fatalf("AttachVolume: %v", err)
			}
			want := unix.O_RDWR
			if tt.v.ReadOnly {
				want = unix.O_RDONLY
			}
			if m.flags != want {
				t.Errorf("image opened with access mode %d, want %d", m.flags, want)
			}
			if id := VolumeDevice(tt.v.Slot); s.disks[id] != img {
				t.Errorf("disks[%s] = %q, want %q", id, s.disks[id], img)
			}
		})
	}
}

// TestVolumeOverrides: a restore or fork names no image for an empty
// slot, and one for a filled slot as for any disk.
func TestVolumeOverrides(t *testing.T) {
	specs := volumeSpecs()
	specs[2].Block = &virtio.BlockSpec{Slot: true, Serial: "vol2", Path: "/volumes/v.img"}
	s := &Sandbox{dir: t.TempDir()}
	asked := map[string]bool{}
	out, err := s.overrides(specs, nil, func(id string) (string, bool) {
		asked[id] = true
		return "/copies/" + id + ".img", true
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(asked) != 1 || !asked["vol2"] {
		t.Errorf("images asked for %v, want vol2's only", asked)
	}
	got := out[len(out)-1]
	if got.ID != "vol2" || !got.Block.Slot || got.Block.Path != "/copies/vol2.img" {
		t.Errorf("vol2's override: %+v %+v", got, got.Block)
	}
}

// TestForkRefusesWritableVolume: children cannot share a writable volume;
// a read-only one and empty slots fork.
func TestForkRefusesWritableVolume(t *testing.T) {
	specs := volumeSpecs()
	specs[0].Block = &virtio.BlockSpec{Slot: true, Serial: "vol0", Path: "/volumes/w.img"}
	s := &Sandbox{m: &slotMachine{specs: specs}}
	_, err := s.Fork(context.Background(), 1, ForkOptions{})
	if !errors.Is(err, ErrWritableVolume) || !strings.Contains(err.Error(), "/volumes/w.img") {
		t.Fatalf("Fork: %v, want ErrWritableVolume naming the volume", err)
	}
}
