package pid1

import (
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// switchCalls is SwitchRoot's calls for /dev/vda, ext4, read-write, no
// options.
var switchCalls = []string{
	"mkdir /newroot -rwxr-xr-x",
	"mount /dev/vda /newroot ext4 0 ",
	"mkdir /newroot/dev -rwxr-xr-x",
	"mount /dev /newroot/dev  move ",
	"mkdir /newroot/proc -rwxr-xr-x",
	"mount /proc /newroot/proc  move ",
	"mkdir /newroot/sys -rwxr-xr-x",
	"mount /sys /newroot/sys  move ",
	"mkdir /newroot/run -rwxr-xr-x",
	"mount /run /newroot/run  move ",
	"umount /tmp 0x2",
	"mkdir /newroot/tmp -rwxr-xr-x",
	"mount tmpfs /newroot/tmp tmpfs nosuid|nodev mode=1777",
	"chdir /newroot",
	"mount . /  move ",
	"chroot .",
	"chdir /",
}

// replaced returns calls with call i replaced by with (none: removed).
func replaced(calls []string, i int, with ...string) []string {
	out := append([]string(nil), calls[:i]...)
	out = append(out, with...)
	return append(out, calls[i+1:]...)
}

func TestSwitchRoot(t *testing.T) {
	tests := []struct {
		name           string
		dev, fs, flags string
		ro             bool
		setup          func(f *fakeSys)
		want           []string
		wantSleeps     int
		wantErr        string
	}{
		{name: "present at once", dev: "/dev/vda", fs: "ext4", want: switchCalls},
		{
			name: "default fstype, appears later", dev: "/dev/vda",
			setup: func(f *fakeSys) {
				delete(f.exist, "/dev/vda")
				f.appear["/dev/vda"], f.appearAfter = true, 7
			},
			want: switchCalls, wantSleeps: 7,
		},
		{
			name: "read-only with options", dev: "/dev/vda", fs: "ext4", flags: "noatime,data=ordered,nodev,errors=remount-ro", ro: true,
			want: replaced(switchCalls, 1, "mount /dev/vda /newroot ext4 ro|nodev|noatime data=ordered,errors=remount-ro"),
		},
		{
			name: "ro in the options", dev: "/dev/vdb", fs: "xfs", flags: "ro",
			setup: func(f *fakeSys) { f.exist["/dev/vdb"] = true },
			want:  replaced(switchCalls, 1, "mount /dev/vdb /newroot xfs ro "),
		},
		{
			name: "read-only root without /run and /tmp", dev: "/dev/vda", fs: "ext4", ro: true,
			setup: func(f *fakeSys) {
				f.errs["mkdir /newroot/run -rwxr-xr-x"] = unix.EROFS
				f.errs["mkdir /newroot/tmp -rwxr-xr-x"] = unix.EROFS
			},
			want: replaced(replaced(replaced(switchCalls, 12), 9), 1, "mount /dev/vda /newroot ext4 ro "),
		},
		{
			name: "/tmp not a mount", dev: "/dev/vda", fs: "ext4",
			setup: func(f *fakeSys) { f.errs["umount /tmp 0x2"] = unix.EINVAL },
			want:  switchCalls,
		},
		{
			name: "never appears", dev: "/dev/vdz", fs: "ext4",
			wantSleeps: 250, wantErr: "/dev/vdz did not appear within 5s: stat /dev/vdz: no such file or directory",
		},
		{name: "no device", wantErr: "no root device"},
		{
			name: "mount fails", dev: "/dev/vda", fs: "ext4", flags: "bogus",
			setup:   func(f *fakeSys) { f.errs["mount /dev/vda /newroot ext4 0 bogus"] = unix.EINVAL },
			want:    []string{switchCalls[0], "mount /dev/vda /newroot ext4 0 bogus"},
			wantErr: `mounting /dev/vda (ext4, options "bogus") on /newroot: invalid argument`,
		},
		{
			name: "read-only root without /proc", dev: "/dev/vda", fs: "ext4",
			setup:   func(f *fakeSys) { f.errs["mkdir /newroot/proc -rwxr-xr-x"] = unix.EROFS },
			want:    switchCalls[:5],
			wantErr: "creating /newroot/proc: read-only file system",
		},
		{
			name: "move fails", dev: "/dev/vda", fs: "ext4",
			setup:   func(f *fakeSys) { f.errs["mount /sys /newroot/sys  move "] = unix.EINVAL },
			want:    switchCalls[:8],
			wantErr: "moving /sys to /newroot/sys: invalid argument",
		},
		{
			name: "umount fails", dev: "/dev/vda", fs: "ext4",
			setup:   func(f *fakeSys) { f.errs["umount /tmp 0x2"] = unix.EPERM },
			want:    switchCalls[:11],
			wantErr: "unmounting /tmp: operation not permitted",
		},
		{
			name: "chroot fails", dev: "/dev/vda", fs: "ext4",
			setup:   func(f *fakeSys) { f.errs["chroot ."] = unix.EPERM },
			want:    switchCalls[:16],
			wantErr: "chroot: operation not permitted",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFake()
			f.exist["/dev/vda"] = true
			if tt.setup != nil {
				tt.setup(f)
			}
			err := f.sys().SwitchRoot(tt.dev, tt.fs, tt.flags, tt.ro)
			if tt.wantErr == "" && err != nil {
				t.Fatalf("SwitchRoot: %v", err)
			}
			if tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)) {
				t.Fatalf("SwitchRoot error = %v, want %q", err, tt.wantErr)
			}
			diffCalls(t, f.calls, tt.want)
			if f.sleeps != tt.wantSleeps {
				t.Errorf("slept %d times, want %d", f.sleeps, tt.wantSleeps)
			}
		})
	}
}

func TestParseMountOptions(t *testing.T) {
	tests := []struct {
		in       string
		flags    string
		wantData string
	}{
		{"", "0", ""},
		{"defaults", "0", ""},
		{"ro", "ro", ""},
		{"ro,rw", "0", ""},
		{"rw,ro", "ro", ""},
		{"noatime,nodiratime,nosuid,nodev,noexec,sync,dirsync", "nosuid|nodev|noexec|sync|dirsync|noatime|nodiratime", ""},
		{"noexec,exec,suid,dev,async,atime,diratime", "0", ""},
		{"relatime,strictatime,lazytime", "relatime|strictatime|lazytime", ""},
		{"relatime,norelatime,lazytime,nolazytime", "0", ""},
		{"data=ordered,,noatime,errors=remount-ro,discard", "noatime", "data=ordered,errors=remount-ro,discard"},
		{"commit=5", "0", "commit=5"},
	}
	for _, tt := range tests {
		flags, data := parseMountOptions(tt.in)
		if got := flagNames(flags); got != tt.flags || data != tt.wantData {
			t.Errorf("parseMountOptions(%q) = %s, %q; want %s, %q", tt.in, got, data, tt.flags, tt.wantData)
		}
	}
}
