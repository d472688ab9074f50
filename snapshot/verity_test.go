package snapshot

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kilnvm/kiln/fsverity"
)

// TestVerityFallback checks the restore's choice where the memory file
// has no fs-verity (a file system without it, or a snapshot copied off
// one): the caller copies and checks the file (verityMemory says not ok),
// and memory handed to a VMM process must then be a sealed memfd.
func TestVerityFallback(t *testing.T) {
	p := filepath.Join(t.TempDir(), MemoryFile)
	if err := os.WriteFile(p, make([]byte, 8192), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := fsverity.Measure(f); err == nil {
		t.Skip("this file system has fs-verity and the file has it: the KVM tests check that path")
	}
	for _, c := range []struct {
		name   string
		verity string
		size   uint64
		given  string // checkGiven's error
		bad    bool   // verityMemory says ErrCorrupt (else: copy)
	}{
		{"no digest", "", 8192, "not a sealable memfd", false},
		{"digest, file without fs-verity", strings.Repeat("ab", 32), 8192, "neither a sealed memfd", false},
		{"digest, wrong size", strings.Repeat("ab", 32), 4096, "neither a sealed memfd", true},
	} {
		t.Run(c.name, func(t *testing.T) {
			m := &Manifest{MemorySize: c.size, MemoryVerity: c.verity}
			fd, ok, err := verityMemory(f, m)
			if ok || fd != -1 || (err != nil) != c.bad || (c.bad && !errors.Is(err, ErrCorrupt)) {
				t.Errorf("verityMemory: fd %d, ok %v, err %v; want -1, false and ErrCorrupt %v", fd, ok, err, c.bad)
			}
			err = checkGiven(int(f.Fd()), m)
			if err == nil || !strings.Contains(err.Error(), c.given) {
				t.Errorf("checkGiven: %v, want %q", err, c.given)
			}
		})
	}
	// A digest that is not one is a corrupt manifest, not a fallback.
	err = checkVerity(f, &Manifest{MemorySize: 8192, MemoryVerity: "zz"})
	if !errors.Is(err, ErrCorrupt) {
		t.Errorf("checkVerity with a bad digest: %v, want ErrCorrupt", err)
	}
}
