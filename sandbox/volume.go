package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"

	"github.com/kilnvm/kiln/guest/client"
	"github.com/kilnvm/kiln/snapshot"
	"github.com/kilnvm/kiln/virtio"
)

// VolumeSlots is how many volume slots every sandbox Start boots has:
// empty virtio disks (devices and serials VolumeDevice(0) to
// VolumeDevice(VolumeSlots-1), after every other disk, so that those keep
// their /dev/vdX names) into which AttachVolume inserts an ext4 image
// while the guest runs. A sandbox restored or forked keeps its
// snapshot's or parent's slots: one from a snapshot that predates them
// has none.
const VolumeSlots = 4

// ErrNoVolumeSlot is what AttachVolume's error is (errors.Is) when the
// sandbox has no such slot: its snapshot predates volume slots.
var ErrNoVolumeSlot = errors.New("the sandbox has no such volume slot (its snapshot predates volume slots: boot a new one)")

// VolumeDevice is the device ID, and the disk serial, of volume slot
// slot: "vol0" to "vol3".
func VolumeDevice(slot int) string { return fmt.Sprintf("vol%d", slot) }

// volumeSpecs are the empty volume slots of a new sandbox.
func volumeSpecs() []virtio.DeviceSpec {
	out := make([]virtio.DeviceSpec, VolumeSlots)
	for i := range out {
		id := VolumeDevice(i)
		out[i] = virtio.DeviceSpec{ID: id, Kind: virtio.KindBlock, Block: &virtio.BlockSpec{Slot: true, Serial: id}}
	}
	return out
}

// Volume is an ext4 image AttachVolume puts into a sandbox.
type Volume struct {
	// Slot is the volume slot, 0 to VolumeSlots-1; it must be empty.
	Slot int
	// Path is the image on the host: an ext4 filesystem (mke2fs), in one
	// sandbox at a time (it is locked while attached).
	Path string
	// ReadOnly opens the image read-only: the guest mounts it read-only
	// and its writes fail.
	ReadOnly bool
	// MountPath is where the guest mounts it (an absolute path, made if
	// missing, not under /proc, /sys, /dev or /run/kiln); "" inserts
	// the image without mounting it.
	MountPath string
}

// AttachVolume inserts the image v.Path into the sandbox's empty volume
// slot v.Slot while it runs (the guest sees the disk's capacity change)
// and has the agent mount it at v.MountPath, nosuid and nodev. The
// volume stays in the slot for the sandbox's life: its snapshots need it
// to restore (RestoreOptions.Disks[VolumeDevice(slot)], or the path it
// has now), and a fork refuses a writable one. A sandbox without the
// slot gets an error that is ErrNoVolumeSlot.
func (s *Sandbox) AttachVolume(ctx context.Context, v Volume) error {
	s.life.Lock()
	defer s.life.Unlock()
	if v.Slot < 0 || v.Slot >= VolumeSlots {
		return fmt.Errorf("sandbox: attach volume: slot %d: want 0 to %d", v.Slot, VolumeSlots-1)
	}
	if v.Path == "" {
		return fmt.Errorf("sandbox: attach volume: slot %d: no image path", v.Slot)
	}
	if v.MountPath != "" && !filepath.IsAbs(v.MountPath) {
		return fmt.Errorf("sandbox: attach volume: slot %d: mount path %q is not absolute", v.Slot, v.MountPath)
	}
	id := VolumeDevice(v.Slot)
	specs := s.m.devices()
	i := slices.IndexFunc(specs, func(d virtio.DeviceSpec) bool { return d.ID == id })
	if i < 0 || specs[i].Kind != virtio.KindBlock || specs[i].Block == nil || !specs[i].Block.Slot {
		return fmt.Errorf("sandbox: attach volume: slot %d (%s): %w", v.Slot, id, ErrNoVolumeSlot)
	}
	if !specs[i].Block.EmptySlot() {
		return fmt.Errorf("sandbox: attach volume: slot %d (%s) already holds %s", v.Slot, id, specs[i].Block.Path)
	}
	path, err := filepath.Abs(v.Path)
	if err != nil {
		return fmt.Errorf("sandbox: attach volume: %w", err)
	}
	flag := os.O_RDWR
	if v.ReadOnly {
		flag = os.O_RDONLY
	}
	// Named by its absolute path: the VM's spec, its snapshots and
	// s.disks (ExpectDisks) name the image by it.
	f, err := os.OpenFile(path, flag, 0)
	if err != nil {
		return fmt.Errorf("sandbox: attach volume: slot %d: %w", v.Slot, err)
	}
	if err := s.m.insertDisk(ctx, id, f, v.ReadOnly); err != nil {
		return fmt.Errorf("sandbox: attach volume: slot %d: %w", v.Slot, err)
	}
	if s.disks == nil {
		s.disks = map[string]string{}
	}
	s.disks[id] = path
	if v.MountPath == "" {
		return nil
	}
	m := client.Mount{Destination: v.MountPath, Kind: client.MountDisk, Name: id, ReadOnly: v.ReadOnly}
	if err := s.client.AddMounts(ctx, "", []client.Mount{m}); err != nil {
		return fmt.Errorf("sandbox: attach volume: slot %d: the image is in the slot, the guest did not mount it: %w", v.Slot, err)
	}
	return nil
}

// FilledVolumes returns the volume slots among specs (a sandbox's, a
// Frozen's) that hold an image, and the image each holds.
func FilledVolumes(specs []virtio.DeviceSpec) map[int]string {
	out := map[int]string{}
	for i := range VolumeSlots {
		id := VolumeDevice(i)
		for _, d := range specs {
			if d.ID == id && d.Kind == virtio.KindBlock && d.Block != nil && d.Block.Slot && !d.Block.EmptySlot() {
				out[i] = d.Block.Path
			}
		}
	}
	return out
}

// SnapshotVolumes returns the volume slots of the sandbox snapshot in dir
// that hold an image (FilledVolumes), once its manifest is authenticated
// by key (nil: SnapshotKeyFile's): a restore needs each named
// (RestoreOptions.Disks), and the slots it lacks take AttachVolume after.
func SnapshotVolumes(dir string, key []byte) (map[int]string, error) {
	k, err := snapshotKey(key)
	if err != nil {
		return nil, err
	}
	info, err := snapshot.Info(dir, snapshot.WithKey(k))
	if err != nil {
		return nil, fmt.Errorf("sandbox: %w", err)
	}
	return FilledVolumes(info.Devices), nil
}

// FreezeVolumes has the guest freeze the file systems of its writable
// volumes (client.FreezeVolumes): their journals flushed and their
// images left clean, as an unmount leaves them, so that a read-only
// mount elsewhere needs no journal replay (which a read-only slot
// refuses). For a sandbox about to be closed for good, never one that is
// saved to run on; a sandbox without writable volumes asks nothing.
func (s *Sandbox) FreezeVolumes(ctx context.Context) error {
	s.life.Lock()
	defer s.life.Unlock()
	writable := false
	for _, d := range s.m.devices() {
		if d.Kind == virtio.KindBlock && d.Block != nil && d.Block.Slot && !d.Block.EmptySlot() && !d.Block.ReadOnly {
			writable = true
		}
	}
	if !writable {
		return nil
	}
	if err := s.client.FreezeVolumes(ctx); err != nil {
		return fmt.Errorf("sandbox: freeze volumes: %w", err)
	}
	return nil
}
