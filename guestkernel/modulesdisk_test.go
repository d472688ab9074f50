package guestkernel

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// modulesTree writes a small lib/modules/<release> tree: modules.dep, two
// modules in subfolders, a big file and a symbolic link.
func modulesTree(t *testing.T) string {
	t.Helper()
	src := filepath.Join(t.TempDir(), "modules")
	files := map[string]string{
		"modules.dep":                        "kernel/net/bridge/br_netfilter.ko: kernel/net/bridge/bridge.ko\nkernel/net/bridge/bridge.ko:\n",
		"modules.builtin":                    "kernel/fs/ext4/ext4.ko\n",
		"kernel/net/bridge/bridge.ko":        "bridge module bytes",
		"kernel/net/bridge/br_netfilter.ko":  "br_netfilter module bytes",
		"kernel/fs/overlayfs/overlay.ko":     strings.Repeat("overlay ", 100000),
		"kernel/drivers/empty/placeholder.x": "",
	}
	for name, data := range files {
		p := filepath.Join(src, name)
		must(t, os.MkdirAll(filepath.Dir(p), 0o755))
		must(t, os.WriteFile(p, []byte(data), 0o644))
	}
	must(t, os.Symlink("kernel/net", filepath.Join(src, "net")))
	return src
}

func needE2fsprogs(t *testing.T) {
	t.Helper()
	for _, tool := range []string{mke2fsTool, debugfsTool} {
		if _, err := lookTool(tool); err != nil {
			t.Fatalf("%v", err) // make deps installs e2fsprogs
		}
	}
}

// debugfsCat reads a file of an ext4 image.
func debugfsCat(t *testing.T, img, path string) string {
	t.Helper()
	debugfs, _ := lookTool(debugfsTool)
	out, err := exec.Command(debugfs, "-R", "cat "+path, img).Output()
	if err != nil {
		t.Fatalf("debugfs cat %s: %v", path, err)
	}
	return string(out)
}

func TestBuildModulesDiskDeterministic(t *testing.T) {
	needE2fsprogs(t)
	const release = "6.1.0-99-test"
	src := modulesTree(t)
	dir := t.TempDir()
	a, b := filepath.Join(dir, "a.ext4"), filepath.Join(dir, "b.ext4")
	must(t, BuildModulesDisk(context.Background(), src, release, a))
	// What mke2fs -d copies and what a later build must not see: other
	// access, change and modification times of the tree.
	later := time.Now().Add(time.Hour)
	must(t, os.Chtimes(filepath.Join(src, "modules.dep"), later, later))
	must(t, os.Chtimes(filepath.Join(src, "kernel", "net"), later, later))
	must(t, BuildModulesDisk(context.Background(), src, release, b))
	da, err := os.ReadFile(a)
	must(t, err)
	db, err := os.ReadFile(b)
	must(t, err)
	if !bytes.Equal(da, db) {
		t.Fatalf("two builds of one tree differ (%d and %d bytes)", len(da), len(db))
	}
	rel, err := ReadModulesDisk(a)
	if err != nil || rel != release {
		t.Fatalf("ReadModulesDisk = %q, %v; want %q", rel, err, release)
	}
	if got := debugfsCat(t, a, "/kernel/net/bridge/br_netfilter.ko"); got != "br_netfilter module bytes" {
		t.Errorf("br_netfilter.ko in the disk = %q", got)
	}
	if got, _ := os.ReadFile(filepath.Join(src, "modules.dep")); debugfsCat(t, a, "/modules.dep") != string(got) {
		t.Error("modules.dep in the disk differs from the tree's")
	}
	if got := debugfsCat(t, a, "/kernel/fs/overlayfs/overlay.ko"); got != strings.Repeat("overlay ", 100000) {
		t.Errorf("overlay.ko in the disk has %d bytes, want %d", len(got), 800000)
	}
	debugfs, _ := lookTool(debugfsTool)
	out, err := exec.Command(debugfs, "-R", "stat /modules.dep", a).Output()
	must(t, err)
	for _, want := range []string{"User:     0", "Group:     0", "mtime: 0x386d4380"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("stat /modules.dep lacks %q:\n%s", want, out)
		}
	}
	if fi, err := os.Stat(a); err != nil || fi.Mode().Perm() != 0o444 {
		t.Errorf("the disk's mode is %v, %v; want read-only", fi.Mode(), err)
	}
	if left, _ := filepath.Glob(filepath.Join(dir, ".*")); len(left) > 0 {
		t.Errorf("temporary files left behind: %v", left)
	}
}

func TestModulesDiskCache(t *testing.T) {
	needE2fsprogs(t)
	const release = "6.1.0-98-test"
	t.Setenv("TMPDIR", t.TempDir())
	root := t.TempDir()
	k := &Kernel{Version: release, ModulesDir: modulesTree(t), Cache: root}
	ctx := context.Background()
	want := filepath.Join(root, "modules", ModulesDiskName(release))
	p, err := k.ModulesDisk(ctx, "")
	if err != nil || p != want {
		t.Fatalf("ModulesDisk = %q, %v; want %q", p, err, want)
	}
	good, err := os.ReadFile(p)
	must(t, err)
	stamp := time.Now().Add(time.Minute).Truncate(time.Second)
	must(t, os.Chtimes(p, stamp, stamp))

	tests := []struct {
		name    string
		damage  func(t *testing.T, p string)
		rebuilt bool
	}{
		{name: "cached", damage: func(*testing.T, string) {}},
		{name: "truncated", rebuilt: true, damage: func(t *testing.T, p string) {
			must(t, os.Truncate(p, int64(len(good))/2))
		}},
		{name: "corrupt superblock", rebuilt: true, damage: func(t *testing.T, p string) {
			b := bytes.Clone(good)
			copy(b[superblockOffset:superblockOffset+superblockSize], make([]byte, superblockSize))
			must(t, os.WriteFile(p, b, 0o644))
		}},
		{name: "empty", rebuilt: true, damage: func(t *testing.T, p string) { must(t, os.WriteFile(p, nil, 0o644)) }},
		{name: "another kernel's disk", rebuilt: true, damage: func(t *testing.T, p string) {
			must(t, BuildModulesDisk(ctx, k.ModulesDir, "6.1.0-1-other", p))
		}},
		{name: "older than modules.dep", rebuilt: true, damage: func(t *testing.T, p string) {
			old := time.Now().Add(-time.Hour)
			must(t, os.Chtimes(p, old, old))
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			must(t, os.Chmod(p, 0o644))
			tt.damage(t, p)
			if !tt.rebuilt {
				must(t, os.Chtimes(p, stamp, stamp))
			}
			got, err := k.ModulesDisk(ctx, "")
			if err != nil || got != want {
				t.Fatalf("ModulesDisk = %q, %v; want %q", got, err, want)
			}
			b, err := os.ReadFile(got)
			must(t, err)
			if !bytes.Equal(b, good) {
				t.Fatalf("the disk (%d bytes) is not the good one (%d)", len(b), len(good))
			}
			fi, err := os.Stat(got)
			must(t, err)
			if rebuilt := !fi.ModTime().Equal(stamp); rebuilt != tt.rebuilt {
				t.Errorf("rebuilt = %v, want %v", rebuilt, tt.rebuilt)
			}
			must(t, os.Chtimes(got, stamp, stamp))
		})
	}

	// A kernel that is not from a cache keeps its disk in dir, else under
	// the temporary directory.
	k2 := &Kernel{Version: release, ModulesDir: k.ModulesDir}
	other := t.TempDir()
	if got, err := k2.ModulesDisk(ctx, other); err != nil || got != filepath.Join(other, ModulesDiskName(release)) {
		t.Errorf("ModulesDisk(%s) = %q, %v", other, got, err)
	}
	if got, err := k2.ModulesDisk(ctx, ""); err != nil || got != filepath.Join(os.TempDir(), "kiln-modules", ModulesDiskName(release)) {
		t.Errorf("ModulesDisk without a cache = %q, %v", got, err)
	}
}

func TestModulesDiskErrors(t *testing.T) {
	needE2fsprogs(t)
	ctx := context.Background()
	src := modulesTree(t)
	spaced := modulesTree(t)
	must(t, os.WriteFile(filepath.Join(spaced, "a b.ko"), nil, 0o644))
	noDep := t.TempDir()
	tests := []struct {
		name    string
		k       Kernel
		wantErr string
	}{
		{name: "bad release", k: Kernel{Version: "../x", ModulesDir: src}, wantErr: "invalid kernel version"},
		{name: "release with a space", k: Kernel{Version: "6.1 x", ModulesDir: src}, wantErr: "without spaces"},
		{name: "long release", k: Kernel{Version: strings.Repeat("6", 60), ModulesDir: src}, wantErr: "too long"},
		{name: "no modules.dep", k: Kernel{Version: "6.1.0-1", ModulesDir: noDep}, wantErr: "no modules.dep"},
		{name: "missing tree", k: Kernel{Version: "6.1.0-1", ModulesDir: filepath.Join(noDep, "none")}, wantErr: "no modules.dep"},
		{name: "a space in a name", k: Kernel{Version: "6.1.0-1", ModulesDir: spaced}, wantErr: "a space, quote or backslash"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			p, err := tt.k.ModulesDisk(ctx, dir)
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("ModulesDisk = %q, %v; want an error containing %q", p, err, tt.wantErr)
			}
			if left, _ := os.ReadDir(dir); len(left) > 0 {
				t.Errorf("left in the folder: %v", left)
			}
		})
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if err := BuildModulesDisk(cctx, src, "6.1.0-1", filepath.Join(t.TempDir(), "d.ext4")); err == nil || !errors.Is(err, context.Canceled) {
		t.Errorf("BuildModulesDisk with a cancelled context = %v, want context.Canceled", err)
	}
	if _, err := ReadModulesDisk(filepath.Join(noDep, "missing.ext4")); err == nil || errors.Is(err, ErrNotModulesDisk) {
		t.Errorf("ReadModulesDisk of a missing file = %v, want a not-exist error", err)
	}
}

// superblock returns a modules disk's superblock for release; edit changes
// it.
func superblock(release string, edit func(sb []byte)) []byte {
	sb := make([]byte, superblockSize)
	le := binary.LittleEndian
	le.PutUint16(sb[sbMagic:], ext4Magic)
	copy(sb[sbVolumeName:], ModulesDiskLabel)
	copy(sb[sbLastMounted:], ModulesMountPoint(release))
	u := derivedUUID("kiln modules disk uuid", release)
	copy(sb[sbUUID:], u[:])
	le.PutUint32(sb[sbLogBlockSize:], 2)
	le.PutUint32(sb[sbBlocksCountLo:], 1000)
	le.PutUint32(sb[sbFeatureIncompt:], incompat64bit)
	le.PutUint32(sb[sbBlocksCountHi:], 1)
	if edit != nil {
		edit(sb)
	}
	return sb
}

func TestParseModulesSuperblock(t *testing.T) {
	const rel = "6.1.0-57-amd64"
	tests := []struct {
		name    string
		sb      []byte
		want    ModulesSuperblock
		wantErr string
	}{
		{name: "good", sb: superblock(rel, nil), want: ModulesSuperblock{Release: rel, Size: (1<<32 + 1000) * 4096}},
		{name: "32-bit block count", sb: superblock(rel, func(sb []byte) { sb[sbFeatureIncompt] = 0 }), want: ModulesSuperblock{Release: rel, Size: 1000 * 4096}},
		{name: "short", sb: make([]byte, 100), wantErr: "superblock of 100 bytes"},
		{name: "not ext4", sb: superblock(rel, func(sb []byte) { sb[sbMagic] = 0 }), wantErr: "no ext4 superblock"},
		{name: "other label", sb: superblock(rel, func(sb []byte) { copy(sb[sbVolumeName:], "data") }), wantErr: "volume label"},
		{name: "no release", sb: superblock(rel, func(sb []byte) { copy(sb[sbLastMounted:], "/mnt\x00") }), wantErr: "does not name a kernel release"},
		{name: "bad release", sb: superblock(rel, func(sb []byte) { copy(sb[sbLastMounted:], "/lib/modules/..\x00") }), wantErr: "invalid kernel version"},
		{name: "unterminated", sb: superblock(rel, func(sb []byte) {
			copy(sb[sbLastMounted:], "/lib/modules/"+strings.Repeat("x", 60))
		}), wantErr: "too long"},
		{name: "UUID of another release", sb: superblock(rel, func(sb []byte) { copy(sb[sbLastMounted:], "/lib/modules/6.1.0-58-amd64") }), wantErr: "UUID"},
		{name: "huge blocks", sb: superblock(rel, func(sb []byte) { sb[sbLogBlockSize] = 30 }), wantErr: "block size"},
		{name: "no blocks", sb: superblock(rel, func(sb []byte) {
			copy(sb[sbBlocksCountLo:], make([]byte, 4))
			copy(sb[sbBlocksCountHi:], make([]byte, 4))
		}), wantErr: "0 blocks"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseModulesSuperblock(tt.sb)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) || !errors.Is(err, ErrNotModulesDisk) {
					t.Fatalf("ParseModulesSuperblock = %+v, %v; want ErrNotModulesDisk containing %q", got, err, tt.wantErr)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Fatalf("ParseModulesSuperblock = %+v, %v; want %+v", got, err, tt.want)
			}
		})
	}
}

func TestModulesDiskUUID(t *testing.T) {
	a, b := ModulesDiskUUID("6.1.0-57-amd64"), ModulesDiskUUID("6.1.0-58-amd64")
	if a == b || a != ModulesDiskUUID("6.1.0-57-amd64") || modulesHashSeed("6.1.0-57-amd64") == a {
		t.Fatalf("UUIDs %s %s: want one per release, stable, and a hash seed of its own", a, b)
	}
	if len(a) != 36 || a[14] != '5' || !strings.ContainsRune("89ab", rune(a[19])) {
		t.Errorf("UUID %s: want a version-5 layout", a)
	}
}

func FuzzParseModulesSuperblock(f *testing.F) {
	f.Add(superblock("6.1.0-57-amd64", nil))
	f.Add(superblock("6.1.0-57-amd64", func(sb []byte) { sb[sbLogBlockSize] = 7 }))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, sb []byte) {
		got, err := ParseModulesSuperblock(sb)
		if err != nil {
			if !errors.Is(err, ErrNotModulesDisk) {
				t.Fatalf("error %v does not wrap ErrNotModulesDisk", err)
			}
			return
		}
		if checkModulesRelease(got.Release) != nil || got.Size <= 0 {
			t.Fatalf("accepted %+v", got)
		}
	})
}

// TestModulesDiskRealKernel builds the cached kernel's modules disk, when
// make kernel cached one, into a temporary folder.
func TestModulesDiskRealKernel(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a disk of the whole modules tree (hundreds of MiB)")
	}
	k, err := Find()
	if errors.Is(err, ErrNotCached) {
		t.Skipf("no cached kernel: %v", err)
	}
	must(t, err)
	needE2fsprogs(t)
	start := time.Now()
	p := filepath.Join(t.TempDir(), ModulesDiskName(k.Version))
	must(t, BuildModulesDisk(context.Background(), k.ModulesDir, k.Version, p))
	fi, err := os.Stat(p)
	must(t, err)
	t.Logf("modules disk of %s: %d MiB in %v", k.Version, fi.Size()>>20, time.Since(start).Round(time.Millisecond))
	dep, err := os.ReadFile(filepath.Join(k.ModulesDir, "modules.dep"))
	must(t, err)
	if debugfsCat(t, p, "/modules.dep") != string(dep) {
		t.Error("modules.dep in the disk differs from the kernel's")
	}
}
