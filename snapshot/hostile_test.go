package snapshot

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/memory"
	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmm"
)

// diskState is the test state with a disk whose saved path is target.
func diskState(target string) *vmm.State {
	st := testState()
	st.Devices = append(st.Devices, vmm.DeviceState{
		Spec:      virtio.DeviceSpec{ID: "root", Kind: virtio.KindBlock, Block: &virtio.BlockSpec{Path: target}},
		Transport: virtio.MMIOState{DeviceID: virtio.IDBlock, Queues: []virtio.QueueState{{Size: 64}}, Device: json.RawMessage(`{"capacity_sectors":8}`)},
	})
	return st
}

// watchOpens watches path for opens (inotify IN_OPEN) and returns a
// function that reports how many there were since.
func watchOpens(t *testing.T, path string) func() int {
	t.Helper()
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	if _, err := unix.InotifyAddWatch(fd, path, unix.IN_OPEN); err != nil {
		t.Fatal(err)
	}
	return func() int {
		n := 0
		buf := make([]byte, 4096)
		for {
			m, err := unix.Read(fd, buf)
			if err != nil || m <= 0 {
				return n
			}
			for off := 0; off+unix.SizeofInotifyEvent <= m; {
				mask := binary.NativeEndian.Uint32(buf[off+4:])
				nameLen := int(binary.NativeEndian.Uint32(buf[off+12:]))
				if mask&unix.IN_OPEN != 0 {
					n++
				}
				off += unix.SizeofInotifyEvent + nameLen
			}
		}
	}
}

// TestLoadNeverOpensSnapshotDisks: a disk path in a snapshot, even an
// authenticated one, is never opened: the restore must name each disk.
func TestLoadNeverOpensSnapshotDisks(t *testing.T) {
	target := filepath.Join(t.TempDir(), "host-secret")
	if err := os.WriteFile(target, make([]byte, 4096), 0o600); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "snap")
	mem, _ := testMemory(t)
	if err := quietSaver(WithKey(testKey)).write(context.Background(), dir, diskState(target), mem); err != nil {
		t.Fatal(err)
	}
	opens := watchOpens(t, target)
	cfg := testConfig()
	cfg.KVMPath = "/nonexistent/kvm"
	vm, err := Load(dir, cfg, WithKey(testKey))
	if vm != nil {
		vm.Close()
	}
	if !errors.Is(err, ErrMismatch) || !strings.Contains(err.Error(), `disk "root": the restore must name its image`) {
		t.Fatalf("err = %v, want the unnamed disk refused", err)
	}
	if n := opens(); n != 0 {
		t.Fatalf("the snapshot's disk path was opened %d times", n)
	}
	// Named by the caller, the disk gets past the check (to KVM, absent).
	other := filepath.Join(t.TempDir(), "disk.img")
	if err := os.WriteFile(other, make([]byte, 4096), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg.Devices = []virtio.DeviceSpec{{ID: "root", Kind: virtio.KindBlock, Block: &virtio.BlockSpec{Path: other}}}
	if _, err := Load(dir, cfg, WithKey(testKey)); err == nil || !strings.Contains(err.Error(), "/nonexistent/kvm") {
		t.Fatalf("err = %v, want Restore's failure to open KVM", err)
	}
	if n := opens(); n != 0 {
		t.Fatalf("the snapshot's disk path was opened %d times", n)
	}
	// The watch sees an open: the zeros above are not for want of one.
	f, err := os.Open(target)
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	if n := opens(); n != 1 {
		t.Fatalf("an open of the disk path counted %d times", n)
	}
}

// TestLoadRefusesHostileFiles: links, other kinds of files and snapshots
// without the host's MAC are refused before anything is mapped.
func TestLoadRefusesHostileFiles(t *testing.T) {
	outside := filepath.Join(t.TempDir(), "host-file")
	if err := os.WriteFile(outside, make([]byte, testMemMiB<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	replace := func(name string, with func(p string) error) func(*testing.T, string) {
		return func(t *testing.T, dir string) {
			p := filepath.Join(dir, name)
			if err := os.Remove(p); err != nil {
				t.Fatal(err)
			}
			if err := with(p); err != nil {
				t.Fatal(err)
			}
		}
	}
	symlinkTo := func(target string) func(string) error {
		return func(p string) error { return os.Symlink(target, p) }
	}
	tests := []struct {
		name    string
		damage  func(*testing.T, string)
		opts    []Option
		is      error
		wantErr string
	}{
		{"memory symlink outside", replace(MemoryFile, symlinkTo(outside)), nil, ErrCorrupt, "memory is a symbolic link"},
		{"memory symlink inside", replace(MemoryFile, symlinkTo(StateFile)), nil, ErrCorrupt, "memory is a symbolic link"},
		{"state symlink", replace(StateFile, symlinkTo(outside)), nil, ErrCorrupt, "state.json is a symbolic link"},
		{"manifest symlink", replace(ManifestFile, symlinkTo(outside)), nil, ErrCorrupt, "manifest.json is a symbolic link"},
		{"mac symlink", replace(MACFile, symlinkTo(outside)), nil, ErrAuth, "manifest.mac is a symbolic link"},
		{"memory fifo", replace(MemoryFile, func(p string) error { return unix.Mkfifo(p, 0o600) }), nil, ErrCorrupt, "memory is not a regular file"},
		{"memory directory", replace(MemoryFile, func(p string) error { return os.Mkdir(p, 0o700) }), nil, ErrCorrupt, "memory is not a regular file"},
		{"memory hard link elsewhere", replace(MemoryFile, func(p string) error { return os.Link(outside, p) }), nil, ErrChecksum, "memory file: checksum mismatch"},
		{"no mac", func(t *testing.T, dir string) { os.Remove(filepath.Join(dir, MACFile)) }, nil, ErrAuth, "no manifest.mac"},
		{"other key", nil, []Option{WithKey(bytes.Repeat([]byte{1}, KeySize))}, ErrAuth, "manifest.mac does not match the manifest"},
		{"no key", nil, []Option{WithKey(nil)}, ErrAuth, "no host key given"},
		{"pinned other manifest", nil, []Option{WithKey(nil), WithManifestDigest(sha256.Sum256([]byte("x")))}, ErrAuth, "not the one verified before"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir, _, _ := saveTest(t)
			if tt.damage != nil {
				tt.damage(t, dir)
			}
			opens := watchOpens(t, outside)
			cfg := testConfig()
			_, mem, err := openTest(dir, &cfg, tt.opts...)
			if mem != nil {
				mem.Close()
				t.Fatal("opened")
			}
			if !errors.Is(err, tt.is) || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("err = %v, want %v saying %q", err, tt.is, tt.wantErr)
			}
			if n := opens(); n != 0 && tt.name != "memory hard link elsewhere" {
				t.Fatalf("the file outside was opened %d times", n)
			}
		})
	}
}

// TestLoadRefusesFlippedBytes flips one byte in each file of a snapshot
// (and a disk's identity in the state): each is refused, and no error
// says what a digest or the MAC should have been.
func TestLoadRefusesFlippedBytes(t *testing.T) {
	flip := func(name string, at func(size int) int) func(*testing.T, string) {
		return func(t *testing.T, dir string) {
			p := filepath.Join(dir, name)
			f, err := os.OpenFile(p, os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			fi, _ := f.Stat()
			off := int64(at(int(fi.Size())))
			b := make([]byte, 1)
			if _, err := f.ReadAt(b, off); err != nil {
				t.Fatal(err)
			}
			b[0] ^= 0x01
			if _, err := f.WriteAt(b, off); err != nil {
				t.Fatal(err)
			}
		}
	}
	mid := func(n int) int { return n / 2 }
	tests := []struct {
		name   string
		damage func(*testing.T, string)
		is     error
	}{
		{"manifest", flip(ManifestFile, mid), ErrAuth},
		{"manifest first byte", flip(ManifestFile, func(int) int { return 0 }), ErrCorrupt}, // '{' becomes 'z': not JSON
		{"mac", flip(MACFile, func(int) int { return 3 }), ErrAuth},
		{"state", flip(StateFile, mid), ErrChecksum},
		{"state disk capacity", func(t *testing.T, dir string) {
			p := filepath.Join(dir, StateFile)
			b, _ := os.ReadFile(p)
			i := bytes.Index(b, []byte(`"capacity_sectors":8`))
			if i < 0 {
				t.Fatal("no disk capacity in the state")
			}
			b[i+len(`"capacity_sectors":`)] = '9'
			os.WriteFile(p, b, 0o600)
		}, ErrChecksum},
		{"memory data page", flip(MemoryFile, func(int) int { return 7*pageSize + 100 }), ErrChecksum},
		{"memory hole", flip(MemoryFile, func(int) int { return 500 * pageSize }), ErrChecksum},
		{"memory last byte", flip(MemoryFile, func(n int) int { return n - 1 }), ErrChecksum},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "snap")
			mem, _ := testMemory(t)
			if err := quietSaver(WithKey(testKey)).write(context.Background(), dir, diskState("/dev/null"), mem); err != nil {
				t.Fatal(err)
			}
			m, err := Info(dir, WithKey(testKey))
			if err != nil {
				t.Fatal(err)
			}
			mb, _ := os.ReadFile(filepath.Join(dir, ManifestFile))
			secrets := []string{m.StateSHA256, m.MemorySHA256, manifestMAC(testKey, mb)}
			tt.damage(t, dir)
			cfg := testConfig()
			cfg.Devices = []virtio.DeviceSpec{{ID: "root", Kind: virtio.KindBlock, Block: &virtio.BlockSpec{Path: "/dev/null"}}}
			_, got, err := openTest(dir, &cfg)
			if got != nil {
				got.Close()
				t.Fatal("a damaged snapshot opened")
			}
			if !errors.Is(err, tt.is) {
				t.Fatalf("err = %v, want %v", err, tt.is)
			}
			for _, s := range secrets {
				if strings.Contains(err.Error(), s) || strings.Contains(err.Error(), s[:16]) {
					t.Fatalf("err = %v gives away a digest", err)
				}
			}
			if _, err := Verify(context.Background(), dir, WithKey(testKey)); !errors.Is(err, tt.is) {
				t.Fatalf("Verify: err = %v, want %v", err, tt.is)
			}
		})
	}
}

// TestRestoredMemoryImmutable maps a snapshot's memory as a restore does,
// then truncates and overwrites the memory file: the mapped memory does
// not change and reading it all does not fault (no SIGBUS).
func TestRestoredMemoryImmutable(t *testing.T) {
	dir, _, want := saveTest(t)
	cache := NewCache(0)
	defer cache.Close()
	cfg := testConfig()
	var clones []*memory.Memory
	for range 3 {
		_, m, err := openTest(dir, &cfg, WithCache(cache))
		if err != nil {
			t.Fatal(err)
		}
		defer m.Close()
		clones = append(clones, m)
	}
	if cache.Len() != 1 {
		t.Fatalf("cache holds %d copies for one snapshot", cache.Len())
	}
	clones[0].Host(0)[0] ^= 0xff // a clone's own write stays its own
	p := filepath.Join(dir, MemoryFile)
	if err := os.WriteFile(p, bytes.Repeat([]byte{0xee}, 2<<20), 0o600); err != nil { // truncates, then writes
		t.Fatal(err)
	}
	if err := os.Truncate(p, 4096); err != nil {
		t.Fatal(err)
	}
	for i, m := range clones {
		got := bytes.Clone(m.Host(0)) // reads every page
		if i == 0 {
			got[0] ^= 0xff
		}
		if !bytes.Equal(got, want.Host(0)) {
			t.Fatalf("clone %d's memory changed with the file", i)
		}
	}
	// The changed file is not the snapshot's any more.
	if _, m, err := openTest(dir, &cfg, WithCache(cache)); err == nil {
		m.Close()
		t.Fatal("opened a snapshot whose memory file was truncated")
	}
}

// TestCacheEvicts: a Cache keeps the copies of the files used last only.
func TestCacheEvicts(t *testing.T) {
	cache := NewCache(1)
	defer cache.Close()
	cfg := testConfig()
	a, _, _ := saveTest(t)
	b, _, _ := saveTest(t)
	for _, dir := range []string{a, b, a} {
		_, m, err := openTest(dir, &cfg, WithCache(cache))
		if err != nil {
			t.Fatal(err)
		}
		m.Close()
		if cache.Len() != 1 {
			t.Fatalf("a cache of 1 keeps %d copies", cache.Len())
		}
	}
}

// TestCacheRefusesChangedFile: the cache never hands out a copy for a
// file whose contents changed in place (same size): its identity (mtime,
// ctime) changes, and the new contents fail the digest.
func TestCacheRefusesChangedFile(t *testing.T) {
	dir, _, _ := saveTest(t)
	cache := NewCache(0)
	defer cache.Close()
	cfg := testConfig()
	_, m, err := openTest(dir, &cfg, WithCache(cache))
	if err != nil {
		t.Fatal(err)
	}
	m.Close()
	f, err := os.OpenFile(filepath.Join(dir, MemoryFile), os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte{0x42}, 3*pageSize); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if _, m, err := openTest(dir, &cfg, WithCache(cache)); !errors.Is(err, ErrChecksum) {
		if m != nil {
			m.Close()
		}
		t.Fatalf("err = %v, want %v", err, ErrChecksum)
	}
}

// TestSignVerifyHandOff: a snapshot saved without the key (by a VMM
// process) loads only once signed; Verify hands a pinned digest and the
// sealed memory to a Load without the key.
func TestSignVerifyHandOff(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "snap")
	mem, _ := testMemory(t)
	if err := quietSaver().write(context.Background(), dir, testState(), mem); err != nil {
		t.Fatal(err)
	}
	cfg := testConfig()
	if _, m, err := openTest(dir, &cfg); !errors.Is(err, ErrAuth) {
		if m != nil {
			m.Close()
		}
		t.Fatalf("unsigned snapshot: err = %v, want %v", err, ErrAuth)
	}
	if err := Sign(context.Background(), dir); err == nil {
		t.Fatal("signed without a key")
	}
	if err := Sign(context.Background(), dir, WithKey(testKey)); err != nil {
		t.Fatal(err)
	}
	v, err := Verify(context.Background(), dir, WithKey(testKey))
	if err != nil {
		t.Fatal(err)
	}
	defer v.Memory.Close()
	fd, err := unix.Dup(int(v.Memory.Fd()))
	if err != nil {
		t.Fatal(err)
	}
	_, got, err := newConfig([]Option{WithManifestDigest(v.ManifestSHA256), WithSealedMemory(fd)}).open(context.Background(), dir, &cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer got.Close()
	if !bytes.Equal(got.Host(0), mem.Host(0)) {
		t.Fatal("memory handed off differs")
	}
	// An unsealed memfd is refused.
	raw, err := unix.MemfdCreate("raw", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	unix.Ftruncate(raw, testMemMiB<<20)
	if _, m, err := newConfig([]Option{WithManifestDigest(v.ManifestSHA256), WithSealedMemory(raw)}).open(context.Background(), dir, &cfg); err == nil {
		m.Close()
		t.Fatal("mapped an unsealed memory image")
	}
	// A memory file changed before signing is not signed.
	dir2 := filepath.Join(t.TempDir(), "snap")
	if err := quietSaver().write(context.Background(), dir2, testState(), mem); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(dir2, MemoryFile), make([]byte, testMemMiB<<20), 0o600)
	if err := Sign(context.Background(), dir2, WithKey(testKey)); !errors.Is(err, ErrChecksum) {
		t.Fatalf("Sign of a changed memory file: err = %v, want %v", err, ErrChecksum)
	}
}

func TestLoadKey(t *testing.T) {
	p := filepath.Join(t.TempDir(), "state", "snapshot.key")
	k1, err := LoadKey(p)
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 || len(k1) != KeySize {
		t.Fatalf("key file mode %v, key of %d bytes", fi.Mode(), len(k1))
	}
	k2, err := LoadKey(p)
	if err != nil || !bytes.Equal(k1, k2) {
		t.Fatalf("second LoadKey: %v, same key %v", err, bytes.Equal(k1, k2))
	}
	tests := []struct {
		name    string
		setup   func(p string)
		wantErr string
	}{
		{"readable by others", func(p string) { os.WriteFile(p, []byte(strings.Repeat("ab", 32)), 0o644); os.Chmod(p, 0o644) }, "others than its owner"},
		{"symlink", func(p string) { os.Symlink("/etc/hostname", p) }, "symbolic link"},
		{"short", func(p string) { os.WriteFile(p, []byte("abcd"), 0o600) }, "not 32 hex-encoded bytes"},
		{"directory", func(p string) { os.Mkdir(p, 0o700) }, "not a regular file"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := filepath.Join(t.TempDir(), "snapshot.key")
			tt.setup(p)
			if _, err := LoadKey(p); err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("err = %v, want %q", err, tt.wantErr)
			}
		})
	}
}

// TestExpectDisks: Save and Sign refuse a snapshot that names a disk the
// caller did not give its VM (a VMM process taken over by its guest could
// write one naming any host file, for its parent to sign).
func TestExpectDisks(t *testing.T) {
	mem, _ := testMemory(t)
	given := map[string]string{"root": "/images/root.img"}
	tests := []struct {
		name    string
		disks   map[string]string
		wantErr string
	}{
		{"the VM's own", given, ""},
		{"another path", map[string]string{"root": "/etc/shadow"}, `disk "root" is not the image the VM was given`},
		{"not the VM's", map[string]string{"other": "/images/root.img"}, `disk "root" is not one of the VM's`},
		{"one missing", map[string]string{"root": "/images/root.img", "data": "/images/data.img"}, "1 disks, the VM was given 2"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// What the VMM wrote (unsigned) names /images/root.img.
			dir := filepath.Join(t.TempDir(), "snap")
			if err := quietSaver().write(context.Background(), dir, diskState("/images/root.img"), mem); err != nil {
				t.Fatal(err)
			}
			err := Sign(context.Background(), dir, WithKey(testKey), ExpectDisks(tt.disks))
			err2 := quietSaver(WithKey(testKey), ExpectDisks(tt.disks)).write(context.Background(), filepath.Join(t.TempDir(), "s"), diskState("/images/root.img"), mem)
			for _, e := range []error{err, err2} {
				if tt.wantErr == "" && e != nil {
					t.Fatal(e)
				}
				if tt.wantErr != "" && (e == nil || !strings.Contains(e.Error(), tt.wantErr)) {
					t.Fatalf("err = %v, want %q", e, tt.wantErr)
				}
			}
			if _, err := os.Stat(filepath.Join(dir, MACFile)); (err == nil) != (tt.wantErr == "") {
				t.Fatalf("MAC file present: %v, want %v", err == nil, tt.wantErr == "")
			}
		})
	}
}

// FuzzOpen drives a restore's checks (Load short of KVM) with a manifest
// and a state file from the fuzzer, authenticated with the test key so
// that they reach the parsers: nothing may panic, and whatever opens must
// be a whole snapshot of the memory saved.
func FuzzOpen(f *testing.F) {
	dir := filepath.Join(f.TempDir(), "snap")
	mem, err := memory.New("fuzz", memory.Layout{{GuestAddr: 0, Size: testMemMiB << 20}})
	if err != nil {
		f.Fatal(err)
	}
	defer mem.Close()
	if err := quietSaver(WithKey(testKey)).write(context.Background(), dir, testState(), mem); err != nil {
		f.Fatal(err)
	}
	manifest, _ := os.ReadFile(filepath.Join(dir, ManifestFile))
	state, _ := os.ReadFile(filepath.Join(dir, StateFile))
	f.Add(manifest, state)
	f.Add([]byte(`{"format":3}`), []byte(`{}`))
	f.Fuzz(func(t *testing.T, manifest, state []byte) {
		d := filepath.Join(t.TempDir(), "snap")
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.Link(filepath.Join(dir, MemoryFile), filepath.Join(d, MemoryFile)); err != nil {
			t.Fatal(err)
		}
		os.WriteFile(filepath.Join(d, ManifestFile), manifest, 0o600)
		os.WriteFile(filepath.Join(d, StateFile), state, 0o600)
		os.WriteFile(filepath.Join(d, MACFile), []byte(manifestMAC(testKey, manifest)), 0o600)
		cfg := testConfig()
		st, m, err := openTest(d, &cfg)
		if err != nil {
			return
		}
		defer m.Close()
		if st == nil || m.Size() != testMemMiB<<20 {
			t.Fatalf("opened a snapshot of %d bytes of memory", m.Size())
		}
	})
}

// TestLoadVerifiedChecks checks LoadVerified's refusals, which come before
// any VM: a config that does not fit the snapshot's state, a Verified that
// Verify did not make, and a second restore of one.
func TestLoadVerifiedChecks(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "snap")
	mem, _ := testMemory(t)
	if err := quietSaver().write(context.Background(), dir, testState(), mem); err != nil {
		t.Fatal(err)
	}
	if err := Sign(context.Background(), dir, WithKey(testKey)); err != nil {
		t.Fatal(err)
	}
	v, err := Verify(context.Background(), dir, WithKey(testKey))
	if err != nil {
		t.Fatal(err)
	}
	defer v.Memory.Close()
	cfg := testConfig()
	cfg.Devices = append(cfg.Devices, virtio.DeviceSpec{ID: "nosuch", Kind: virtio.KindBlock, Block: &virtio.BlockSpec{Path: "/nonexistent"}})
	if _, err := LoadVerified(v, cfg); !errors.Is(err, ErrMismatch) {
		t.Errorf("LoadVerified with a device the snapshot lacks: %v, want ErrMismatch", err)
	}
	if _, err := LoadVerified(v, testConfig()); err == nil || !strings.Contains(err.Error(), "restored already") {
		t.Errorf("a second LoadVerified: %v", err)
	}
	if _, err := LoadVerified(&Verified{}, testConfig()); err == nil {
		t.Error("LoadVerified of a Verified Verify did not make: no error")
	}
}

// TestCheckDisksSlots: an empty volume slot needs no image named; a
// filled one does, as any disk.
func TestCheckDisksSlots(t *testing.T) {
	slot := func(path string) *vmm.State {
		st := testState()
		st.Devices = append(st.Devices, vmm.DeviceState{
			Spec:      virtio.DeviceSpec{ID: "vol0", Kind: virtio.KindBlock, Block: &virtio.BlockSpec{Slot: true, Serial: "vol0", Path: path}},
			Transport: virtio.MMIOState{DeviceID: virtio.IDBlock, Queues: []virtio.QueueState{{Size: 64}}},
		})
		return st
	}
	named := []virtio.DeviceSpec{{ID: "vol0", Kind: virtio.KindBlock, Block: &virtio.BlockSpec{Slot: true, Path: "/volumes/v.img"}}}
	tests := []struct {
		name    string
		st      *vmm.State
		devices []virtio.DeviceSpec
		wantErr bool
	}{
		{"empty slot, nothing named", slot(""), nil, false},
		{"filled slot, nothing named", slot("/volumes/v.img"), nil, true},
		{"filled slot, named", slot("/volumes/v.img"), named, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := checkDisks(tt.st, &vmm.RestoreConfig{Devices: tt.devices})
			if (err != nil) != tt.wantErr {
				t.Fatalf("checkDisks: %v, want an error: %v", err, tt.wantErr)
			}
		})
	}
}
