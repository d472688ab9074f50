package daemontest

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/daemon"
)

// A volume of the double is not an ext4 image mounted in a guest: its
// files are in the host folder beside the image (dataDir), copied into
// the sandbox's root at the mount path when attached and back (when
// writable) when the sandbox is closed, so that a test sees a volume's
// files outlive the sandbox that wrote them.

// dataDir is where the double keeps the files of the volume whose image
// is path.
func dataDir(path string) string { return path + ".daemontest" }

// restoreVolumes checks want against the volumes m (a checkpoint's, or
// nothing) already holds: one in the same slot must be the same volume,
// mounted as it was. It returns those of want to attach anew.
func restoreVolumes(m *meta, want []daemon.VolumeAttach) ([]daemon.VolumeAttach, error) {
	var attach []daemon.VolumeAttach
	for _, v := range want {
		i := slices.IndexFunc(m.Volumes, func(h daemon.VolumeAttach) bool { return h.Slot == v.Slot })
		switch {
		case i < 0:
			if err := checkVolume(v, m.Volumes); err != nil {
				return nil, err
			}
			attach = append(attach, v)
		case m.Volumes[i] != v:
			return nil, fmt.Errorf("daemontest: volume slot %d holds %+v, the restore names %+v", v.Slot, m.Volumes[i], v)
		}
	}
	return attach, nil
}

// checkVolume checks v against the volumes held as a VMM and agent
// would: a slot in range and free, an image that exists.
func checkVolume(v daemon.VolumeAttach, held []daemon.VolumeAttach) error {
	if v.Slot < 0 || v.Slot >= daemon.MaxVolumes {
		return status.Errorf(codes.FailedPrecondition, "daemontest: no volume slot %d", v.Slot)
	}
	if slices.ContainsFunc(held, func(h daemon.VolumeAttach) bool { return h.Slot == v.Slot }) {
		return status.Errorf(codes.FailedPrecondition, "daemontest: volume slot %d is taken", v.Slot)
	}
	if _, err := os.Stat(v.Path); err != nil {
		return fmt.Errorf("daemontest: volume: %w", err)
	}
	return nil
}

// mountVolume copies v's files into root at its mount path.
func mountVolume(root string, v daemon.VolumeAttach) error {
	target := filepath.Join(root, v.MountPath)
	if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
		return fmt.Errorf("daemontest: mount volume: %w", err)
	}
	os.RemoveAll(target)
	if _, err := os.Stat(dataDir(v.Path)); os.IsNotExist(err) {
		return os.Mkdir(target, 0o777)
	}
	return copyTree(dataDir(v.Path), target)
}

// AttachVolume implements daemon.Instance.
func (in *Instance) AttachVolume(ctx context.Context, v daemon.VolumeAttach) error {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.closed || in.ended() {
		return status.Error(codes.Unavailable, "daemontest: attach volume: the sandbox has stopped")
	}
	if err := checkVolume(v, in.meta.Volumes); err != nil {
		return err
	}
	if err := mountVolume(in.rootPath(), v); err != nil {
		return err
	}
	in.meta.Volumes = append(in.meta.Volumes, v)
	return writeJSON(filepath.Join(in.dir, metaFile), in.meta)
}

// unmountVolumes copies the files of the sandbox's writable volumes back
// to where the double keeps them.
func (in *Instance) unmountVolumes() error {
	in.mu.Lock()
	vs := in.meta.Volumes
	in.mu.Unlock()
	for _, v := range vs {
		if v.ReadOnly {
			continue
		}
		tmp := dataDir(v.Path) + ".tmp-" + randHex()
		if err := copyTree(filepath.Join(in.rootPath(), v.MountPath), tmp); err != nil {
			return err
		}
		os.RemoveAll(dataDir(v.Path))
		if err := os.Rename(tmp, dataDir(v.Path)); err != nil {
			return fmt.Errorf("daemontest: unmount volume: %w", err)
		}
	}
	return nil
}

// FreezeVolumes implements daemon.Instance: the double's volumes are
// written back when the sandbox is closed, frozen or not; it counts the
// calls (Frozen).
func (in *Instance) FreezeVolumes(ctx context.Context) error {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.closed || in.ended() {
		return status.Error(codes.Unavailable, "daemontest: freeze volumes: the sandbox has stopped")
	}
	in.freezes++
	return nil
}

// Freezes is how many times FreezeVolumes was called.
func (in *Instance) Freezes() int {
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.freezes
}
