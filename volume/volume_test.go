package volume

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

func TestMake(t *testing.T) {
	p := filepath.Join(t.TempDir(), "v.ext4")
	if err := Make(context.Background(), p, 32); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Size() != 32<<20 {
		t.Errorf("size %d, want %d", fi.Size(), 32<<20)
	}
	debugfs, err := look("debugfs")
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(debugfs, "-R", "stat /", p).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "Mode:  01777") {
		t.Errorf("root directory: %v\n%s", err, out)
	}
	out, err = exec.Command(debugfs, "-R", "features", p).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "has_journal") || !strings.Contains(string(out), "extent") {
		t.Errorf("features: %v\n%s", err, out)
	}
	if err := Make(context.Background(), p, 32); err == nil {
		t.Error("Make over an existing image: no error")
	}
}

func TestMakeBadSize(t *testing.T) {
	for _, mib := range []uint32{0, MinMiB - 1, MaxMiB + 1} {
		p := filepath.Join(t.TempDir(), "v.ext4")
		err := Make(context.Background(), p, mib)
		if err == nil || !strings.Contains(err.Error(), "MiB") {
			t.Errorf("Make(%d MiB): %v, want an error naming the size", mib, err)
		}
		if _, serr := os.Stat(p); serr == nil {
			t.Errorf("Make(%d MiB) left a file", mib)
		}
	}
}

func TestNeedsRecovery(t *testing.T) {
	p := filepath.Join(t.TempDir(), "v.ext4")
	if err := Make(context.Background(), p, 16); err != nil {
		t.Fatal(err)
	}
	if dirty, err := NeedsRecovery(p); err != nil || dirty {
		t.Fatalf("a new image: %v, %v", dirty, err)
	}
	// As a guest killed with it mounted read-write leaves it.
	f, err := os.OpenFile(p, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	var b [4]byte
	f.ReadAt(b[:], superblock+sbFeatureIncompat)
	b[0] |= incompatRecover
	f.WriteAt(b[:], superblock+sbFeatureIncompat)
	f.Close()
	if dirty, err := NeedsRecovery(p); err != nil || !dirty {
		t.Errorf("an image left to recover: %v, %v", dirty, err)
	}
	junk := filepath.Join(t.TempDir(), "junk")
	os.WriteFile(junk, make([]byte, 4096), 0o600)
	if _, err := NeedsRecovery(junk); err == nil || !strings.Contains(err.Error(), "not an ext4") {
		t.Errorf("not ext4: %v", err)
	}
	short := filepath.Join(t.TempDir(), "short")
	os.WriteFile(short, make([]byte, 100), 0o600)
	if _, err := NeedsRecovery(short); err == nil || !strings.Contains(err.Error(), "superblock") {
		t.Errorf("too short: %v", err)
	}
}
