package snapshot

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/kvm"
	"github.com/kilnvm/kiln/memory"
	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmm"
)

const testMemMiB = 16

// testState returns a valid state of a one-vCPU VM of testMemMiB with one
// virtio-rng device, as vmm.SaveState shapes it, without KVM.
func testState() *vmm.State {
	st := &vmm.State{
		Version:       vmm.StateVersion,
		VirtioVersion: virtio.StateVersion,
		CPUs:          1,
		MemoryMiB:     testMemMiB,
		Memory:        []vmm.MemoryRegion{{GuestAddr: 0, Size: testMemMiB << 20, Offset: 0}},
		Devices:       []vmm.DeviceState{{Spec: rngSpec, Transport: virtio.MMIOState{DeviceID: virtio.IDRNG, Queues: []virtio.QueueState{{Size: 64}}}}},
		Machine: vmm.MachineState{
			PICMaster: make([]byte, 512), PICSlave: make([]byte, 512), IOAPIC: make([]byte, 512),
			Clock: kvm.ClockData{Clock: 42},
		},
		VCPUs: []vmm.VCPUState{{
			ID:    0,
			Regs:  kvm.Regs{RIP: 0x1000, RFLAGS: 2},
			XSave: make([]byte, 4096),
			LAPIC: make([]byte, 1024),
			MSRs:  []vmm.MSR{{Index: 0x10, Data: 99}},
		}},
	}
	st.VCPUs[0].XSave[512] = 1
	return st
}

// testMemory returns guest memory of the test state's layout with a few
// pages written, and the pages' offsets.
func testMemory(t *testing.T) (*memory.Memory, []int) {
	t.Helper()
	mem, err := memory.New("snapshot-test", memory.Layout{{GuestAddr: 0, Size: testMemMiB << 20}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mem.Close() })
	pages := []int{0, 7, 8, 9, 1000, testMemMiB<<8 - 1}
	for _, p := range pages {
		b := bytes.Repeat([]byte{byte(p), 0xa5}, 128)
		if err := mem.WriteAt(b, uint64(p)*pageSize+100); err != nil {
			t.Fatal(err)
		}
	}
	return mem, pages
}

var rngSpec = virtio.DeviceSpec{ID: "rng", Kind: virtio.KindRNG, RNG: &virtio.RNGSpec{}}

func testConfig() vmm.RestoreConfig { return vmm.RestoreConfig{} }

// testKey is the host key the tests' snapshots are authenticated with.
var testKey = bytes.Repeat([]byte{0x5a}, KeySize)

// openTest opens the snapshot in dir as Load does, without KVM.
func openTest(dir string, cfg *vmm.RestoreConfig, opts ...Option) (*vmm.State, *memory.Memory, error) {
	return newConfig(append([]Option{WithKey(testKey)}, opts...)).open(context.Background(), dir, cfg)
}

func quietSaver(opts ...Option) *saver {
	s := newSaver(append([]Option{WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil)))}, opts...))
	s.now = func() time.Time { return time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC) }
	return s
}

// saveTest writes a snapshot of the test state and memory into a new
// directory and returns its path.
func saveTest(t *testing.T) (string, *vmm.State, *memory.Memory) {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "snap")
	mem, _ := testMemory(t)
	st := testState()
	if err := quietSaver(WithKey(testKey)).write(context.Background(), dir, st, mem); err != nil {
		t.Fatal(err)
	}
	return dir, st, mem
}

// onlyEntries checks that parent holds exactly the names given: no
// temporary or half-written directory is left.
func onlyEntries(t *testing.T, parent string, names ...string) {
	t.Helper()
	ents, err := os.ReadDir(parent)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range ents {
		got = append(got, e.Name())
	}
	if strings.Join(got, ",") != strings.Join(names, ",") {
		t.Fatalf("%s holds %q, want %q", parent, got, names)
	}
}

func TestSaveOpenRoundTrip(t *testing.T) {
	dir, st, mem := saveTest(t)
	onlyEntries(t, filepath.Dir(dir), "snap")
	onlyEntries(t, dir, ManifestFile, MACFile, MemoryFile, StateFile)

	m, err := Info(dir)
	if err != nil {
		t.Fatal(err)
	}
	if m.Format != FormatVersion || m.CPUs != 1 || m.MemoryMiB != testMemMiB || m.MemorySize != testMemMiB<<20 ||
		!reflect.DeepEqual(m.Devices, []virtio.DeviceSpec{rngSpec}) || !m.Created.Equal(time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)) {
		t.Fatalf("manifest %+v", m)
	}

	cfg := testConfig()
	got, cow, err := openTest(dir, &cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer cow.Close()
	if !reflect.DeepEqual(got, st) {
		t.Fatalf("state read back differs:\n%+v\n%+v", got, st)
	}
	if !bytes.Equal(cow.Host(0), mem.Host(0)) {
		t.Fatal("memory read back differs")
	}

	// Only the written pages take space (sparse file).
	var s unix.Stat_t
	if err := unix.Stat(filepath.Join(dir, MemoryFile), &s); err != nil {
		t.Fatal(err)
	}
	if s.Size != testMemMiB<<20 {
		t.Fatalf("memory file is %d bytes", s.Size)
	}
	if used := s.Blocks * 512; used > 1<<20 {
		t.Errorf("memory file of 6 non-zero pages takes %d bytes on disk", used)
	}

	// The mapping is copy-on-write: the file never changes.
	cow.Host(0)[0] ^= 0xff
	f, err := os.ReadFile(filepath.Join(dir, MemoryFile))
	if err != nil {
		t.Fatal(err)
	}
	if f[0] != mem.Host(0)[0] {
		t.Fatal("a write to the restored memory reached the snapshot's file")
	}
}

func TestSaveRefusesExisting(t *testing.T) {
	dir, _, mem := saveTest(t)
	s := quietSaver()
	err := s.write(context.Background(), dir, testState(), mem)
	if !errors.Is(err, ErrExists) {
		t.Fatalf("second save: %v, want ErrExists", err)
	}
	// An empty directory is refused too (a plain rename would replace it).
	empty := filepath.Join(t.TempDir(), "empty")
	if err := os.Mkdir(empty, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := s.write(context.Background(), empty, testState(), mem); !errors.Is(err, ErrExists) {
		t.Fatalf("save over an empty directory: %v, want ErrExists", err)
	}
	onlyEntries(t, filepath.Dir(empty), "empty")
	onlyEntries(t, filepath.Dir(dir), "snap")
}

func TestSaveOverwrite(t *testing.T) {
	dir, _, mem := saveTest(t)
	st := testState()
	st.VCPUs[0].Regs.RIP = 0x2000
	if err := quietSaver(Overwrite(), WithKey(testKey)).write(context.Background(), dir, st, mem); err != nil {
		t.Fatal(err)
	}
	onlyEntries(t, filepath.Dir(dir), "snap")
	cfg := testConfig()
	got, cow, err := openTest(dir, &cfg)
	if err != nil {
		t.Fatal(err)
	}
	cow.Close()
	if got.VCPUs[0].Regs.RIP != 0x2000 {
		t.Fatalf("overwritten snapshot has RIP %#x", got.VCPUs[0].Regs.RIP)
	}

	// Never over something that is not a snapshot.
	other := filepath.Join(t.TempDir(), "data")
	if err := os.Mkdir(other, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(other, "precious"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	err = quietSaver(Overwrite(), WithKey(testKey)).write(context.Background(), other, st, mem)
	if err == nil || !strings.Contains(err.Error(), "is not a snapshot") {
		t.Fatalf("overwrite of a non-snapshot directory: %v", err)
	}
	onlyEntries(t, other, "precious")
}

func TestSaveReplaceFallback(t *testing.T) {
	// replace's fallback (no RENAME_EXCHANGE) moves the old one aside.
	dir, _, _ := saveTest(t)
	tmp := dir + ".tmp-new"
	if err := os.Mkdir(tmp, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(tmp, "marker"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := quietSaver(Overwrite()).replace(tmp, dir); err != nil {
		t.Fatal(err)
	}
	onlyEntries(t, filepath.Dir(dir), "snap")
	onlyEntries(t, dir, "marker")
}

// failingFile fails every write with ENOSPC once budget bytes are spent,
// as a full filesystem does.
type failingFile struct {
	*os.File
	budget *int64
}

func (f failingFile) spend(n int) (int, error) {
	if int64(n) > *f.budget {
		ok := int(max(*f.budget, 0))
		*f.budget = 0
		return ok, &os.PathError{Op: "write", Path: f.Name(), Err: syscall.ENOSPC}
	}
	*f.budget -= int64(n)
	return n, nil
}

func (f failingFile) Write(b []byte) (int, error) {
	n, err := f.spend(len(b))
	if n > 0 {
		f.File.Write(b[:n])
	}
	return n, err
}

func (f failingFile) WriteAt(b []byte, off int64) (int, error) {
	n, err := f.spend(len(b))
	if n > 0 {
		f.File.WriteAt(b[:n], off)
	}
	return n, err
}

func TestSaveDiskFullLeavesNothing(t *testing.T) {
	mem, _ := testMemory(t)
	stateSize := func() int64 {
		b, err := json.Marshal(testState())
		if err != nil {
			t.Fatal(err)
		}
		return int64(len(b))
	}()
	for _, tt := range []struct {
		name   string
		budget int64
	}{
		{"state file", 10},
		{"memory file", stateSize + 3*pageSize},
		{"manifest", stateSize + 6*pageSize + 20},
	} {
		t.Run(tt.name, func(t *testing.T) {
			parent := t.TempDir()
			dir := filepath.Join(parent, "snap")
			s := quietSaver()
			budget := tt.budget
			s.create = func(path string) (file, error) {
				f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
				if err != nil {
					return nil, err
				}
				return failingFile{File: f, budget: &budget}, nil
			}
			err := s.write(context.Background(), dir, testState(), mem)
			if !errors.Is(err, syscall.ENOSPC) {
				t.Fatalf("err = %v, want ENOSPC", err)
			}
			onlyEntries(t, parent)
		})
	}
}

// TestSaveFullTmpfs saves into a real 1 MiB tmpfs: the memory does not fit.
func TestSaveFullTmpfs(t *testing.T) {
	parent := t.TempDir()
	if err := unix.Mount("tmpfs", parent, "tmpfs", 0, "size=1m"); err != nil {
		t.Skipf("cannot mount a tmpfs here (%v): the ENOSPC seam test covers this", err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(parent, 0); err != nil {
			t.Errorf("unmount %s: %v", parent, err)
		}
	})
	mem, err := memory.New("full", memory.Layout{{GuestAddr: 0, Size: testMemMiB << 20}})
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	for i := range mem.Host(0)[:4<<20] {
		mem.Host(0)[i] = byte(i%251 + 1)
	}
	err = quietSaver().write(context.Background(), filepath.Join(parent, "snap"), testState(), mem)
	if !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("err = %v, want ENOSPC", err)
	}
	onlyEntries(t, parent)
	// The space is back: a small file fits.
	if err := os.WriteFile(filepath.Join(parent, "after"), make([]byte, 512<<10), 0o600); err != nil {
		t.Fatalf("the failed snapshot's space was not freed: %v", err)
	}
}

func TestSaveCancelled(t *testing.T) {
	mem, _ := testMemory(t)
	parent := t.TempDir()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	err := quietSaver().write(ctx, filepath.Join(parent, "snap"), testState(), mem)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
	onlyEntries(t, parent)
}

func TestSaveRefusesBadInput(t *testing.T) {
	mem, _ := testMemory(t)
	parent := t.TempDir()
	bad := testState()
	bad.VCPUs[0].LAPIC = nil
	if err := quietSaver().write(context.Background(), filepath.Join(parent, "a"), bad, mem); err == nil || !strings.Contains(err.Error(), "LAPIC") {
		t.Fatalf("invalid state saved: %v", err)
	}
	small, err := memory.NewAnonymous(memory.Layout{{GuestAddr: 0, Size: 1 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	defer small.Close()
	if err := quietSaver().write(context.Background(), filepath.Join(parent, "b"), testState(), small); err == nil {
		t.Fatal("memory of the wrong size saved")
	}
	if err := quietSaver().write(context.Background(), filepath.Join(parent, "no", "such", "dir"), testState(), mem); err == nil {
		t.Fatal("saved under a missing parent")
	}
	onlyEntries(t, parent)
}

// rewriteManifest changes the saved manifest through f.
func rewriteManifest(t *testing.T, dir string, f func(map[string]any)) {
	t.Helper()
	p := filepath.Join(dir, ManifestFile)
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	f(m)
	if b, err = json.Marshal(m); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	// Signed again: what is tested is past the MAC.
	if err := os.WriteFile(filepath.Join(dir, MACFile), []byte(manifestMAC(testKey, b)), 0o600); err != nil {
		t.Fatal(err)
	}
}

func TestLoadRefusesBadSnapshots(t *testing.T) {
	tests := []struct {
		name    string
		damage  func(t *testing.T, dir string)
		cfg     func(*vmm.RestoreConfig)
		is      error
		wantErr string
	}{
		{
			name: "other format version",
			damage: func(t *testing.T, dir string) {
				rewriteManifest(t, dir, func(m map[string]any) { m["format"] = 7; m["new_field"] = true })
			},
			is:      ErrFormatVersion,
			wantErr: "snapshot format version 7, this kiln reads format version 3",
		},
		{
			name: "flipped state byte",
			damage: func(t *testing.T, dir string) {
				p := filepath.Join(dir, StateFile)
				b, err := os.ReadFile(p)
				if err != nil {
					t.Fatal(err)
				}
				b[len(b)/2] ^= 0x01
				if err := os.WriteFile(p, b, 0o600); err != nil {
					t.Fatal(err)
				}
			},
			is:      ErrChecksum,
			wantErr: "checksum mismatch",
		},
		{
			name: "truncated state",
			damage: func(t *testing.T, dir string) {
				if err := os.Truncate(filepath.Join(dir, StateFile), 100); err != nil {
					t.Fatal(err)
				}
			},
			is:      ErrCorrupt,
			wantErr: "state file is 100 bytes, the manifest says",
		},
		{
			name: "truncated memory",
			damage: func(t *testing.T, dir string) {
				if err := os.Truncate(filepath.Join(dir, MemoryFile), 1<<20); err != nil {
					t.Fatal(err)
				}
			},
			is:      ErrCorrupt,
			wantErr: "memory file is 1048576 bytes, the manifest says 16777216",
		},
		{
			name: "missing memory",
			damage: func(t *testing.T, dir string) {
				if err := os.Remove(filepath.Join(dir, MemoryFile)); err != nil {
					t.Fatal(err)
				}
			},
			is:      ErrCorrupt,
			wantErr: "memory file: no memory",
		},
		{
			name: "missing manifest",
			damage: func(t *testing.T, dir string) {
				if err := os.Remove(filepath.Join(dir, ManifestFile)); err != nil {
					t.Fatal(err)
				}
			},
			is:      ErrCorrupt,
			wantErr: "no manifest.json",
		},
		{
			name: "manifest and state disagree",
			damage: func(t *testing.T, dir string) {
				rewriteManifest(t, dir, func(m map[string]any) {
					m["devices"] = []map[string]any{{"id": "rng2", "kind": "rng", "rng": map[string]any{}}}
				})
			},
			is:      ErrCorrupt,
			wantErr: "state and manifest disagree on virtio device 0",
		},
		{
			name: "override of another kind",
			cfg: func(c *vmm.RestoreConfig) {
				c.Devices = []virtio.DeviceSpec{{ID: "rng", Kind: virtio.KindBlock, Block: &virtio.BlockSpec{Path: "/x.img"}}}
			},
			is:      ErrMismatch,
			wantErr: `override of device "rng": the snapshot's is a rng device, the override a blk one`,
		},
		{
			name: "override of no device",
			cfg: func(c *vmm.RestoreConfig) {
				c.Devices = []virtio.DeviceSpec{{ID: "disk", Kind: virtio.KindRNG, RNG: &virtio.RNGSpec{}}}
			},
			is:      ErrMismatch,
			wantErr: `override of device "disk": the snapshot has no such device (it has "rng")`,
		},
		{
			name: "too many labels",
			damage: func(t *testing.T, dir string) {
				labels := map[string]any{}
				for i := range MaxLabels + 1 {
					labels[fmt.Sprint("k", i)] = "v"
				}
				rewriteManifest(t, dir, func(m map[string]any) { m["labels"] = labels })
			},
			is:      ErrCorrupt,
			wantErr: "65 labels: at most 64",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir, _, _ := saveTest(t)
			if tt.damage != nil {
				tt.damage(t, dir)
			}
			cfg := testConfig()
			cfg.KVMPath = "/nonexistent/kvm" // nothing here may reach KVM
			if tt.cfg != nil {
				tt.cfg(&cfg)
			}
			vm, err := Load(dir, cfg, WithKey(testKey))
			if vm != nil {
				vm.Close()
				t.Fatal("Load returned a VM")
			}
			if !errors.Is(err, tt.is) {
				t.Errorf("err = %v, want %v", err, tt.is)
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("err = %v, want it to say %q", err, tt.wantErr)
			}
		})
	}
}

func TestLoadReachesRestore(t *testing.T) {
	// With every check passed, Load hands over to vmm.Restore (which
	// here fails to open KVM) and the memory mapping is released.
	dir, _, _ := saveTest(t)
	cfg := testConfig()
	cfg.KVMPath = "/nonexistent/kvm"
	_, err := Load(dir, cfg, WithKey(testKey))
	if err == nil || !strings.Contains(err.Error(), "restore: open /nonexistent/kvm") {
		t.Fatalf("err = %v, want Restore's failure to open KVM", err)
	}
}

func TestFileExtents(t *testing.T) {
	mem, pages := testMemory(t)
	ext, err := fileExtents(mem.FD(), 0, int64(mem.Size()))
	if err != nil {
		t.Fatal(err)
	}
	// Every written page lies in an extent, and the extents are far
	// smaller than the memory (tmpfs has holes where nothing was written).
	var total int64
	for _, e := range ext {
		if e.start%pageSize != 0 || e.end%pageSize != 0 || e.end <= e.start {
			t.Fatalf("extent %+v", e)
		}
		total += e.end - e.start
	}
	for _, p := range pages {
		off := int64(p) * pageSize
		found := false
		for _, e := range ext {
			if off >= e.start && off < e.end {
				found = true
			}
		}
		if !found {
			t.Errorf("written page %d is in no extent %+v", p, ext)
		}
	}
	if total > int64(mem.Size())/2 {
		t.Errorf("extents cover %d of %d bytes", total, mem.Size())
	}
	if mem.Private() {
		t.Error("a memfd mapped shared reads as private")
	}
	anon, err := memory.NewAnonymous(memory.Layout{{GuestAddr: 0, Size: 1 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	defer anon.Close()
	if !anon.Private() {
		t.Error("anonymous memory reads as shared")
	}
}

func TestWriteNonZeroRuns(t *testing.T) {
	b := make([]byte, 8*pageSize)
	for _, p := range []int{1, 2, 5} {
		b[p*pageSize+pageSize-1] = 1
	}
	f, err := os.Create(filepath.Join(t.TempDir(), "m"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	rec := &recordingFile{File: f}
	n, err := writeNonZero(context.Background(), rec, b, 1<<20, make([]byte, pageSize), nil)
	if err != nil {
		t.Fatal(err)
	}
	want := []extent{{1<<20 + pageSize, 1<<20 + 3*pageSize}, {1<<20 + 5*pageSize, 1<<20 + 6*pageSize}}
	if !reflect.DeepEqual(rec.writes, want) || n != 3*pageSize {
		t.Fatalf("writes %+v (%d bytes), want %+v", rec.writes, n, want)
	}
}

type recordingFile struct {
	*os.File
	writes []extent
}

func (r *recordingFile) WriteAt(b []byte, off int64) (int, error) {
	r.writes = append(r.writes, extent{off, off + int64(len(b))})
	return len(b), nil
}
