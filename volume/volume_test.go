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
