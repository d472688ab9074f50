package vmm

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/kilnvm/kiln/virtio"
)

// slotVM is a VM that never touched KVM with the devices specs, opened
// and behind transports (interrupts dropped).
func slotVM(t *testing.T, specs []virtio.DeviceSpec) *VM {
	t.Helper()
	v := newVM(Config{Spec: Spec{CPUs: 1, MemoryMiB: 16, Devices: specs}, Logger: discardLogger()})
	if err := v.openDevices(); err != nil {
		t.Fatal(err)
	}
	for i, dev := range v.opened {
		m := virtio.NewMMIO(dev, nil, func(bool) {})
		v.devices = append(v.devices, &vdev{spec: specs[i], dev: dev, mmio: m, irq: &virtioIRQ{efd: -1}})
	}
	v.opened = nil
	t.Cleanup(func() {
		for _, d := range v.devices {
			closeDevice(d.dev)
		}
	})
	return v
}

func TestInsertDisk(t *testing.T) {
	dir := t.TempDir()
	img := filepath.Join(dir, "vol.img")
	root := filepath.Join(dir, "root.img")
	for _, p := range []string{img, root} {
		if err := os.WriteFile(p, make([]byte, 8*virtio.BlockSectorSize), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	specs := []virtio.DeviceSpec{
		{ID: "root", Kind: virtio.KindBlock, Block: &virtio.BlockSpec{Path: root}},
		{ID: "vol0", Kind: virtio.KindBlock, Block: &virtio.BlockSpec{Slot: true, Serial: "vol0"}},
		{ID: "rng", Kind: virtio.KindRNG, RNG: &virtio.RNGSpec{}},
	}
	v := slotVM(t, specs)
	open := func(flag int) *os.File {
		f, err := os.OpenFile(img, flag, 0)
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	tests := []struct {
		name     string
		id       string
		flag     int
		readOnly bool
		wantErr  string
	}{
		{"unknown device", "vol9", os.O_RDONLY, true, `"vol9": the VM has no such device`},
		{"not a slot", "root", os.O_RDWR, false, "not a volume slot"},
		{"not a disk", "rng", os.O_RDWR, false, "not a volume slot"},
		{"read-only file, writable volume", "vol0", os.O_RDONLY, false, "open read-only"},
		{"into the slot", "vol0", os.O_RDONLY, true, ""},
		{"into the filled slot", "vol0", os.O_RDONLY, true, "already holds"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := open(tt.flag)
			err := v.InsertDisk(tt.id, f, tt.readOnly)
			checkErr(t, err, tt.wantErr)
			if err != nil {
				f.Close()
			}
		})
	}
	d := v.Devices()[1]
	if d.Block == nil || !d.Block.Slot || d.Block.Path != img || !d.Block.ReadOnly {
		t.Errorf("the filled slot's spec: %+v", d.Block)
	}
	if specs[1].Block.Path != "" {
		t.Error("InsertDisk changed the caller's spec")
	}
	if c := v.Device("vol0").(*virtio.Block).Capacity(); c != 8 {
		t.Errorf("capacity %d sectors, want 8", c)
	}

	v.stop(ReasonCancelled, "test")
	v.lc.ended()
	f := open(os.O_RDONLY)
	defer f.Close()
	checkErr(t, v.InsertDisk("vol0", f, true), "insert disk: the VM has stopped")
}
