package snapshot

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// TestSaveAt: a save through a directory descriptor (as a jailed VMM
// process makes it) writes the same snapshot as Save, loads back, and
// creates only new files: a second save into the folder, or a link
// planted in it, is refused.
func TestSaveAt(t *testing.T) {
	mem, _ := testMemory(t)
	st := testState()
	for _, tc := range []struct {
		name  string
		plant func(dir string) error
		want  string // "" for success
	}{
		{"empty folder", nil, ""},
		{"second save", func(dir string) error { return os.WriteFile(filepath.Join(dir, StateFile), []byte("{}"), 0o600) }, "file exists"},
		{"planted link", func(dir string) error {
			return os.Symlink("/etc/passwd", filepath.Join(dir, StateFile))
		}, "file exists"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "staged")
			if err := os.Mkdir(dir, 0o700); err != nil {
				t.Fatal(err)
			}
			if tc.plant != nil {
				if err := tc.plant(dir); err != nil {
					t.Fatal(err)
				}
			}
			d, err := os.Open(dir)
			if err != nil {
				t.Fatal(err)
			}
			defer d.Close()
			s := quietSaver(WithKey(testKey))
			s.create = createAt(d)
			err = s.writeAt(context.Background(), "fd:staged", d, st, mem)
			if tc.want != "" {
				if err == nil || !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("writeAt: %v, want %q", err, tc.want)
				}
				if b, _ := os.ReadFile("/etc/passwd"); len(b) == 0 {
					t.Fatal("/etc/passwd is empty")
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			onlyEntries(t, dir, ManifestFile, MACFile, MemoryFile, StateFile)
			cfg := testConfig()
			got, cow, err := openTest(dir, &cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer cow.Close()
			if !reflect.DeepEqual(got, st) || !bytes.Equal(cow.Host(0), mem.Host(0)) {
				t.Fatal("the snapshot read back differs")
			}
			// The same bytes as Save's.
			ref, _, _ := saveTest(t)
			for _, f := range []string{ManifestFile, StateFile, MemoryFile} {
				a, _ := os.ReadFile(filepath.Join(dir, f))
				b, _ := os.ReadFile(filepath.Join(ref, f))
				if !bytes.Equal(a, b) {
					t.Errorf("%s differs from Save's", f)
				}
			}
		})
	}
}
