package pid1

import (
	"encoding/binary"
	"encoding/hex"
	"log/slog"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/guestkernel"
)

// modulesDiskHead is the first 2 KiB of a modules disk of release: its
// superblock at 1024.
func modulesDiskHead(t *testing.T, release string) string {
	t.Helper()
	b := make([]byte, 2048)
	sb := b[1024:]
	le := binary.LittleEndian
	le.PutUint16(sb[0x38:], 0xEF53)
	copy(sb[0x78:], guestkernel.ModulesDiskLabel)
	copy(sb[0x88:], guestkernel.ModulesMountPoint(release))
	u, err := hex.DecodeString(strings.ReplaceAll(guestkernel.ModulesDiskUUID(release), "-", ""))
	if err != nil {
		t.Fatal(err)
	}
	copy(sb[0x68:], u)
	le.PutUint32(sb[0x18:], 2)
	le.PutUint32(sb[0x04:], 1000)
	return string(b)
}

func TestMountModulesDisk(t *testing.T) {
	const rel = "6.1.0-57-amd64"
	target := "/lib/modules/" + rel
	mount := "mount /dev/vdb " + target + " ext4 ro|nosuid|nodev "
	disks := func(f *fakeSys) {
		f.files["/proc/sys/kernel/osrelease"] = rel + "\n"
		f.files["/sys/block/vda/serial"] = "root"
		f.files["/sys/block/vdb/serial"] = "modules\n"
		f.files["/dev/vdb"] = modulesDiskHead(t, rel)
		f.exist["/dev/vdb"] = true
	}
	tests := []struct {
		name    string
		setup   func(f *fakeSys)
		want    []string
		wantErr string
	}{
		{name: "mounted", setup: disks, want: []string{"readat /dev/vdb 1024 1024", "mkdir " + target + " -rwxr-xr-x", mount}},
		{name: "device node appears late", setup: func(f *fakeSys) {
			disks(f)
			delete(f.exist, "/dev/vdb")
			f.appear["/dev/vdb"], f.appearAfter = true, 3
		}, want: []string{"readat /dev/vdb 1024 1024", "mkdir " + target + " -rwxr-xr-x", mount}},
		{name: "no such disk", setup: func(f *fakeSys) {
			disks(f)
			delete(f.files, "/sys/block/vdb/serial")
		}, wantErr: `no virtio disk with serial "modules" appeared within 5s`},
		{name: "another kernel's disk", setup: func(f *fakeSys) {
			disks(f)
			f.files["/dev/vdb"] = modulesDiskHead(t, "6.1.0-58-amd64")
		}, want: []string{"readat /dev/vdb 1024 1024"}, wantErr: "holds kernel 6.1.0-58-amd64's modules; this guest runs 6.1.0-57-amd64"},
		{name: "not a modules disk", setup: func(f *fakeSys) {
			disks(f)
			f.files["/dev/vdb"] = strings.Repeat("\x00", 2048)
		}, want: []string{"readat /dev/vdb 1024 1024"}, wantErr: "not a Kiln modules disk"},
		{name: "read-only root without the folder", setup: func(f *fakeSys) {
			disks(f)
			f.errs["mkdir "+target+" -rwxr-xr-x"] = unix.EROFS
		}, want: []string{"readat /dev/vdb 1024 1024", "mkdir " + target + " -rwxr-xr-x", "mkdir /run/kiln/modules -rwxr-xr-x",
			"mount /dev/vdb /run/kiln/modules ext4 ro|nosuid|nodev "}},
		{name: "read-only root without the folder nor /run", setup: func(f *fakeSys) {
			disks(f)
			f.errs["mkdir "+target+" -rwxr-xr-x"] = unix.EROFS
			f.errs["mkdir /run/kiln/modules -rwxr-xr-x"] = unix.EROFS
		}, want: []string{"readat /dev/vdb 1024 1024", "mkdir " + target + " -rwxr-xr-x", "mkdir /run/kiln/modules -rwxr-xr-x"}},
		{name: "mount fails", setup: func(f *fakeSys) {
			disks(f)
			f.errs[mount] = unix.EINVAL
		}, want: []string{"readat /dev/vdb 1024 1024", "mkdir " + target + " -rwxr-xr-x", mount}, wantErr: "mounting /dev/vdb (ext4, read-only) on " + target},
		{name: "no release", setup: func(f *fakeSys) {}, wantErr: "reading the kernel release"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFake()
			tt.setup(f)
			err := f.sys().MountModulesDisk("modules", slog.New(slog.DiscardHandler))
			if tt.wantErr == "" && err != nil {
				t.Fatalf("MountModulesDisk: %v", err)
			}
			if tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)) {
				t.Fatalf("MountModulesDisk error = %v, want %q", err, tt.wantErr)
			}
			diffCalls(t, f.calls, tt.want)
		})
	}
}

// TestSetupModulesDisk: the modules disk is mounted in the final root,
// after the switch to it, and the kernel's modprobe helper installed
// there; a helper that cannot be installed does not fail the setup.
func TestSetupModulesDisk(t *testing.T) {
	const rel = "6.1.0-57-amd64"
	f := newFake()
	f.files["/proc/cmdline"] = "kiln.root=/dev/vda kiln.modules=modules\n"
	f.files["/proc/sys/kernel/osrelease"] = rel
	f.files["/sys/block/vda/serial"] = "root"
	f.files["/sys/block/vdb/serial"] = "modules"
	f.files["/dev/vdb"] = modulesDiskHead(t, rel)
	f.exist["/dev/vda"], f.exist["/dev/vdb"] = true, true
	opts, err := f.sys().setup(nil, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if opts.Modules != "modules" {
		t.Errorf("Options.Modules = %q", opts.Modules)
	}
	n := len(f.calls)
	want := concat(switchCalls[len(switchCalls)-3:], []string{"readat /dev/vdb 1024 1024", "mkdir /lib/modules/" + rel + " -rwxr-xr-x", "mount /dev/vdb /lib/modules/" + rel + " ext4 ro|nosuid|nodev "},
		helperCalls)
	if n < len(want) {
		t.Fatalf("calls %q", f.calls)
	}
	diffCalls(t, f.calls[n-len(want):], want)

	f.calls = nil
	f.errs[helperCalls[2]] = unix.EPERM
	if _, err := f.sys().setup(nil, t.TempDir()); err != nil {
		t.Fatalf("setup with a helper that cannot be bound: %v", err)
	}
	if got := f.calls[len(f.calls)-1]; got != helperCalls[2] {
		t.Errorf("last call %q, want the failed bind %q", got, helperCalls[2])
	}
}

func TestVirtioDiskName(t *testing.T) {
	for i, want := range map[int]string{0: "vda", 1: "vdb", 25: "vdz", 26: "vdaa", 27: "vdab", 51: "vdaz", 52: "vdba", 701: "vdzz"} {
		if got := virtioDiskName(i); got != want {
			t.Errorf("virtioDiskName(%d) = %q, want %q", i, got, want)
		}
	}
}
