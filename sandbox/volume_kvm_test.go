package sandbox

import (
	"context"
	"errors"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/kilnvm/kiln/internal/kvmtest"
)

// mkfsVolume makes an ext4 image of 64 MiB whose root is root's, 0755.
func mkfsVolume(t *testing.T, path string) {
	t.Helper()
	if out, err := exec.Command("mke2fs", "-q", "-t", "ext4", "-E", "root_owner=0:0", "-F", path, "64M").CombinedOutput(); err != nil {
		t.Fatalf("mke2fs: %v\n%s", err, out)
	}
}

// TestKVMVolume attaches an ext4 volume to a running sandbox (restored
// from the warm snapshot: its slots come from Start), writes it, refuses
// a second volume in the same slot, saves, restores with the volume
// named, reads the file back, and refuses writes to a read-only volume.
func TestKVMVolume(t *testing.T) {
	kvmtest.Require(t)
	kvmtest.Kernel(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	dir := t.TempDir()
	data, ro := filepath.Join(dir, "data.img"), filepath.Join(dir, "ro.img")
	mkfsVolume(t, data)
	mkfsVolume(t, ro)

	var console kvmtest.Console
	sb, err := Restore(ctx, warmSnapshot(t), RestoreOptions{Hostname: "vol", Console: &console})
	if err != nil {
		t.Fatalf("Restore: %v", err)
	}
	defer func() {
		sb.Close(context.Background())
		if t.Failed() {
			t.Logf("guest console:\n%s", console.String())
		}
	}()
	if err := sb.AttachVolume(ctx, Volume{Slot: 0, Path: data, MountPath: "/data"}); err != nil {
		t.Fatalf("AttachVolume: %v", err)
	}
	sh(t, ctx, sb, "echo hi > /data/hello && sync")
	if got := sh(t, ctx, sb, "cat /data/hello"); got != "hi" {
		t.Fatalf("/data/hello: %q", got)
	}
	if err := sb.AttachVolume(ctx, Volume{Slot: 0, Path: ro, MountPath: "/other"}); err == nil {
		t.Fatal("a second volume in a filled slot: no error")
	} else if errors.Is(err, ErrNoVolumeSlot) {
		t.Fatalf("a second volume in a filled slot: %v (the slot is there)", err)
	}
	snap := filepath.Join(dir, "snap")
	if err := sb.Save(ctx, snap); err != nil {
		t.Fatalf("Save: %v", err)
	}
	// The volume is locked while a VM holds it: the restore takes it over.
	if err := sb.Close(ctx); err != nil {
		t.Fatalf("Close: %v", err)
	}

	var rconsole kvmtest.Console
	r, err := Restore(ctx, snap, RestoreOptions{Disks: map[string]string{VolumeDevice(0): data}, Console: &rconsole})
	if err != nil {
		t.Fatalf("Restore with the volume: %v", err)
	}
	defer func() {
		r.Close(context.Background())
		if t.Failed() {
			t.Logf("restored guest console:\n%s", rconsole.String())
		}
	}()
	if got := sh(t, ctx, r, "cat /data/hello"); got != "hi" {
		t.Fatalf("/data/hello after restore: %q", got)
	}
	if err := r.AttachVolume(ctx, Volume{Slot: 1, Path: ro, ReadOnly: true, MountPath: "/ro"}); err != nil {
		t.Fatalf("AttachVolume read-only: %v", err)
	}
	if out, errOut, st, err := shTry(ctx, r, "touch /ro/x"); err != nil || st.Success() {
		t.Fatalf("touch /ro/x: %v %v; stdout %q stderr %q; want it refused", st, err, out, errOut)
	}
	sh(t, ctx, r, "test -d /ro/lost+found")
}
