package kvmtest

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// writeToken returns a build that writes token into dir/product.
func writeToken(token string, builds *atomic.Int32) func(string) error {
	return func(dir string) error {
		builds.Add(1)
		return os.WriteFile(filepath.Join(dir, "product"), []byte(token), 0o644)
	}
}

// leftovers lists what root holds besides the given names.
func leftovers(t *testing.T, root string, names ...string) []string {
	t.Helper()
	entries, err := os.ReadDir(root)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range entries {
		if !strings.Contains(" "+strings.Join(names, " ")+" ", " "+e.Name()+" ") {
			out = append(out, e.Name())
		}
	}
	return out
}

func TestSharedDirBuildsOnce(t *testing.T) {
	root := t.TempDir()
	var builds atomic.Int32
	first, err := sharedDir(root, "snap", writeToken("one", &builds))
	if err != nil || first != filepath.Join(root, "snap") {
		t.Fatalf("sharedDir = %q, %v", first, err)
	}
	second, err := sharedDir(root, "snap", writeToken("two", &builds))
	if err != nil || second != first {
		t.Fatalf("second sharedDir = %q, %v; want %q", second, err, first)
	}
	if n := builds.Load(); n != 1 {
		t.Errorf("built %d times, want once", n)
	}
	if data, _ := os.ReadFile(filepath.Join(first, "product")); string(data) != "one" {
		t.Errorf("product %q, want the first build's", data)
	}
	if l := leftovers(t, root, "snap"); len(l) > 0 {
		t.Errorf("left behind %q", l)
	}
}

func TestSharedDirErrors(t *testing.T) {
	root := t.TempDir()
	if err := os.WriteFile(filepath.Join(root, "file"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	boom := errors.New("boom")
	tests := []struct {
		name    string
		build   func(string) error
		wantErr string
	}{
		{"failing", func(dir string) error {
			os.WriteFile(filepath.Join(dir, "half"), []byte("x"), 0o644)
			return boom
		}, "building failing: boom"},
		{"file", func(string) error { return nil }, "not a folder"},
		{"", func(string) error { return nil }, "want one path element"},
		{".hidden", func(string) error { return nil }, "want one path element"},
		{"a/b", func(string) error { return nil }, "want one path element"},
		{"..", func(string) error { return nil }, "want one path element"},
	}
	for _, tt := range tests {
		_, err := sharedDir(root, tt.name, tt.build)
		if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
			t.Errorf("sharedDir(%q) error %v, want one with %q", tt.name, err, tt.wantErr)
		}
	}
	if _, err := sharedDir(root, "failing", func(string) error { return boom }); !errors.Is(err, boom) {
		t.Errorf("the build's error is not wrapped: %v", err)
	}
	if l := leftovers(t, root, "file"); len(l) > 0 {
		t.Errorf("failed builds left %q behind", l)
	}
}

// TestSharedDirRace builds one name from many goroutines at once: every
// caller gets the same folder, holding one whole build, and the losers'
// folders are gone.
func TestSharedDirRace(t *testing.T) {
	root := t.TempDir()
	const n = 8
	var builds atomic.Int32
	var start, wg sync.WaitGroup
	start.Add(1)
	paths := make([]string, n)
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() {
			start.Wait()
			paths[i], errs[i] = sharedDir(root, "snap", func(dir string) error {
				builds.Add(1)
				// Several files, so a mix of two builds would show.
				for _, f := range []string{"a", "b", "c"} {
					if err := os.WriteFile(filepath.Join(dir, f), []byte(fmt.Sprint(i)), 0o644); err != nil {
						return err
					}
				}
				return nil
			})
		})
	}
	start.Done()
	wg.Wait()
	for i := range n {
		if errs[i] != nil || paths[i] != filepath.Join(root, "snap") {
			t.Errorf("caller %d: %q, %v", i, paths[i], errs[i])
		}
	}
	var got []string
	for _, f := range []string{"a", "b", "c"} {
		data, err := os.ReadFile(filepath.Join(root, "snap", f))
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, string(data))
	}
	if got[0] != got[1] || got[1] != got[2] {
		t.Errorf("the product mixes builds: %q", got)
	}
	if l := leftovers(t, root, "snap"); len(l) > 0 {
		t.Errorf("the losers left %q behind", l)
	}
	t.Logf("%d of %d callers built", builds.Load(), n)
}

func TestShared(t *testing.T) {
	root := t.TempDir()
	var builds atomic.Int32
	t.Run("with the shared folder", func(t *testing.T) {
		t.Setenv(SharedEnvVar, root)
		for range 2 {
			if got := Shared(t, "warm", writeToken("x", &builds)); got != filepath.Join(root, "warm") {
				t.Errorf("Shared = %q, want it in %s", got, root)
			}
		}
		if builds.Load() != 1 {
			t.Errorf("built %d times, want once", builds.Load())
		}
	})
	t.Run("without", func(t *testing.T) {
		t.Setenv(SharedEnvVar, "")
		got := Shared(t, "warm", writeToken("y", &builds))
		if strings.HasPrefix(got, root) || filepath.Base(got) != "warm" {
			t.Errorf("Shared = %q, want a test-private folder", got)
		}
		if data, err := os.ReadFile(filepath.Join(got, "product")); err != nil || string(data) != "y" {
			t.Errorf("product %q, %v", data, err)
		}
	})
}

// Sizes of the file TestSharedMappable shares: sparse, with data at the
// start and at the end.
const (
	mappableSize = 1 << 30
	mappableData = 16 << 20
)

// mappableByte is the content of the data regions at offset off.
func mappableByte(off int64) byte { return byte(off/4096) ^ byte(off) }

// TestSharedMappable shares a big sparse file the way a warm snapshot's
// memory file is shared, and maps it MAP_PRIVATE as snapshot.Load does:
// the data reads back, the holes read as zeros, and writes to the mapping
// stay private. Run by two L1 VMs with one shared folder (kvmharness
// -exec -shared DIR), the second checks the first's file through 9p.
func TestSharedMappable(t *testing.T) {
	built := false
	dir := Shared(t, "mappable", func(dir string) error {
		built = true
		return writeMappable(filepath.Join(dir, "mem"))
	})
	t.Logf("shared file in %s (built here: %v)", dir, built)
	f, err := os.Open(filepath.Join(dir, "mem"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	start := time.Now()
	m, err := unix.Mmap(int(f.Fd()), 0, mappableSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE)
	if err != nil {
		t.Fatalf("mmap MAP_PRIVATE: %v", err)
	}
	defer unix.Munmap(m)
	for _, region := range [][2]int64{{0, mappableData}, {mappableSize - mappableData, mappableSize}} {
		for off := region[0]; off < region[1]; off += 512 {
			if m[off] != mappableByte(off) {
				t.Fatalf("byte %#x of the mapping is %#x, want %#x", off, m[off], mappableByte(off))
			}
		}
	}
	readTime := time.Since(start)
	for off := int64(mappableData); off < mappableSize-mappableData; off += 16 << 20 {
		if m[off] != 0 {
			t.Fatalf("hole byte %#x of the mapping is %#x", off, m[off])
		}
	}
	m[0], m[mappableData+4096] = ^mappableByte(0), 0xAA // copy-on-write
	b := make([]byte, 1)
	for _, off := range []int64{0, mappableData + 4096} {
		if _, err := f.ReadAt(b, off); err != nil {
			t.Fatal(err)
		}
		if want := map[int64]byte{0: mappableByte(0)}[off]; b[0] != want {
			t.Errorf("a private write reached the file at %#x: %#x", off, b[0])
		}
	}
	t.Logf("mapped %d MiB of data through MAP_PRIVATE in %v", 2*mappableData>>20, readTime.Round(time.Millisecond))
}

// writeMappable writes the sparse file TestSharedMappable maps.
func writeMappable(path string) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	buf := make([]byte, 1<<20)
	for _, base := range []int64{0, mappableSize - mappableData} {
		for off := base; off < base+mappableData; off += int64(len(buf)) {
			for i := range buf {
				buf[i] = mappableByte(off + int64(i))
			}
			if _, err := f.WriteAt(buf, off); err != nil {
				f.Close()
				return err
			}
		}
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
