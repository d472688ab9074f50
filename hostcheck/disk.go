package hostcheck

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// Free space of the state folder: below warnBytes is a warning (a few
// sandboxes' disks, checkpoints and templates), below failBytes a failure.
const (
	warnBytes = 10 << 30
	failBytes = 1 << 30
)

// CheckDisk: the state folder's file system (or, before kilnd made it,
// its nearest existing parent's) has room.
func CheckDisk(_ context.Context, h *Host) Result {
	r := Result{Required: true}
	dir, err := existingParent(h.StateDir)
	if err != nil {
		r.Status, r.Detail = Fail, err.Error()
		return r
	}
	var st unix.Statfs_t
	if err := h.statfs(dir, &st); err != nil {
		r.Status, r.Detail = Fail, fmt.Sprintf("statfs %s: %v", dir, err)
		return r
	}
	free := uint64(st.Bavail) * uint64(st.Bsize)
	where := h.StateDir
	if dir != h.StateDir {
		where = fmt.Sprintf("%s (not made yet; %s)", h.StateDir, dir)
	}
	r.Detail = fmt.Sprintf("%s: %s free", where, gib(free))
	switch {
	case free < failBytes:
		r.Status = Fail
		r.Hint = "free space there, or point kilnd's state-dir at a larger file system"
	case free < warnBytes:
		r.Status = Warn
		r.Detail += fmt.Sprintf(", under %s", gib(warnBytes))
		r.Hint = "sandboxes' disks, checkpoints and templates live there: free space or use a larger file system"
	}
	return r
}

// existingParent is dir, or its nearest parent that exists when dir does
// not yet (kilnd makes its state folder).
func existingParent(dir string) (string, error) {
	for {
		_, err := os.Stat(dir)
		if err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if !errors.Is(err, fs.ErrNotExist) || parent == dir {
			return "", err
		}
		dir = parent
	}
}

func gib(n uint64) string { return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30)) }
