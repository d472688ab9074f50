package hostcheck

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/kilnvm/kiln/fsverity"
)

// CheckSnapshotVerity: the state folder's file system has fs-verity, so
// that a snapshot's first restore (a checkpoint, a hibernated sandbox, a
// template) maps its memory file instead of copying and hashing it whole
// (package snapshot). Never fatal: without it restores copy.
func CheckSnapshotVerity(_ context.Context, h *Host) Result {
	dir, err := existingParent(h.StateDir)
	if err != nil {
		return Result{Status: Warn, Detail: err.Error()}
	}
	where := h.StateDir
	if dir != h.StateDir {
		where = fmt.Sprintf("%s (not made yet; %s)", h.StateDir, dir)
	}
	probe := h.ProbeVerity
	if probe == nil {
		probe = probeVerity
	}
	err = probe(dir)
	switch {
	case err == nil:
		return Result{Detail: where + ": fs-verity: snapshots' first restores map their memory files"}
	case errors.Is(err, fsverity.ErrUnsupported):
		return Result{Status: Warn, Detail: where + ": no fs-verity: every first restore of a snapshot copies and hashes its memory file",
			Hint: "put the state folder on ext4 with the verity feature (tune2fs -O verity DEVICE), btrfs or f2fs"}
	}
	return Result{Status: Warn, Detail: fmt.Sprintf("%s: fs-verity probe: %v", where, err)}
}

// probeVerity seals a new empty file in dir with fs-verity, then removes it.
func probeVerity(dir string) error {
	f, err := os.CreateTemp(dir, ".kiln-verity-probe-")
	if err != nil {
		return err
	}
	name := f.Name()
	defer os.Remove(name)
	f.Close()
	if f, err = os.Open(name); err != nil {
		return err
	}
	defer f.Close()
	return fsverity.Enable(f)
}
