package pid1

import (
	"io/fs"
	"reflect"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// freshBoot is MountBase's calls on a bare initramfs whose kernel has the
// memory and pids cgroup controllers.
var freshBoot = []string{
	"mkdir /proc -rwxr-xr-x",
	"mount proc /proc proc nosuid|nodev|noexec ",
	"mkdir /sys -rwxr-xr-x",
	"mount sysfs /sys sysfs nosuid|nodev|noexec ",
	"mkdir /dev -rwxr-xr-x",
	"mount devtmpfs /dev devtmpfs nosuid mode=0755",
	"mkdir /dev/pts -rwxr-xr-x",
	"mount devpts /dev/pts devpts nosuid|noexec mode=0620,ptmxmode=0666",
	"mkdir /dev/shm -rwxr-xr-x",
	"mount shm /dev/shm tmpfs nosuid|nodev mode=1777",
	"mkdir /tmp -rwxr-xr-x",
	"mount tmpfs /tmp tmpfs nosuid|nodev mode=1777",
	"mkdir /run -rwxr-xr-x",
	"mount tmpfs /run tmpfs nosuid|nodev mode=0755",
	"mkdir /sys/fs/cgroup -rwxr-xr-x",
	"mount cgroup2 /sys/fs/cgroup cgroup2 nosuid|nodev|noexec ",
	"symlink /dev/fd -> /proc/self/fd",
	"symlink /dev/stdin -> /proc/self/fd/0",
	"symlink /dev/stdout -> /proc/self/fd/1",
	"symlink /dev/stderr -> /proc/self/fd/2",
	"write /sys/fs/cgroup/cgroup.subtree_control +memory",
	"write /sys/fs/cgroup/cgroup.subtree_control +pids",
}

func TestMountBase(t *testing.T) {
	const controllers = "/sys/fs/cgroup/cgroup.controllers"
	tests := []struct {
		name    string
		setup   func(f *fakeSys)
		want    []string
		wantErr string
	}{
		{
			name:  "fresh boot",
			setup: func(f *fakeSys) { f.files[controllers] = "cpuset cpu io memory hugetlb pids rdma misc\n" },
			want:  freshBoot,
		},
		{
			name: "proc, sys and dev mounted already, links there",
			setup: func(f *fakeSys) {
				f.mounted["/proc"], f.mounted["/sys"], f.mounted["/dev"] = true, true, true
				f.files[controllers] = "memory pids"
				for _, l := range devLinks() {
					f.errs["symlink "+l[0]+" -> "+l[1]] = errExist(l[0])
				}
			},
			want: append(freshBoot[6:16:16], freshBoot[16:]...),
		},
		{
			name: "EBUSY tolerated",
			setup: func(f *fakeSys) {
				f.errs["mount tmpfs /run tmpfs nosuid|nodev mode=0755"] = unix.EBUSY
				f.files[controllers] = "memory pids"
			},
			want: freshBoot,
		},
		{
			name:  "no pids controller",
			setup: func(f *fakeSys) { f.files[controllers] = "cpu memory\n" },
			want:  freshBoot[:len(freshBoot)-1],
		},
		{
			name:  "no controllers",
			setup: func(f *fakeSys) { f.files[controllers] = "\n" },
			want:  freshBoot[:len(freshBoot)-2],
		},
		{
			name: "no cgroup.controllers",
			want: freshBoot[:len(freshBoot)-2],
		},
		{
			name: "mount fails",
			setup: func(f *fakeSys) {
				f.errs["mount devtmpfs /dev devtmpfs nosuid mode=0755"] = unix.ENODEV
			},
			want:    freshBoot[:6],
			wantErr: "mounting devtmpfs on /dev: no such device",
		},
		{
			name:    "mkdir fails",
			setup:   func(f *fakeSys) { f.errs["mkdir /tmp -rwxr-xr-x"] = unix.EROFS },
			want:    freshBoot[:11],
			wantErr: "creating mount point /tmp: read-only file system",
		},
		{
			name:    "symlink fails",
			setup:   func(f *fakeSys) { f.errs["symlink /dev/fd -> /proc/self/fd"] = unix.EACCES },
			want:    freshBoot[:17],
			wantErr: "linking /dev/fd to /proc/self/fd: permission denied",
		},
		{
			name:    "controllers unreadable",
			setup:   func(f *fakeSys) { f.errs["read "+controllers] = unix.EIO },
			want:    freshBoot[:20],
			wantErr: "reading the cgroup controllers: input/output error",
		},
		{
			name: "enabling fails",
			setup: func(f *fakeSys) {
				f.files[controllers] = "memory pids"
				f.errs["write /sys/fs/cgroup/cgroup.subtree_control +memory"] = unix.EBUSY
			},
			want:    freshBoot[:21],
			wantErr: "enabling the memory cgroup controller: device or resource busy",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFake()
			if tt.setup != nil {
				tt.setup(f)
			}
			err := f.sys().MountBase()
			if tt.wantErr == "" && err != nil {
				t.Fatalf("MountBase: %v", err)
			}
			if tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)) {
				t.Fatalf("MountBase error = %v, want %q", err, tt.wantErr)
			}
			diffCalls(t, f.calls, tt.want)
		})
	}
}

func errExist(path string) error {
	return &fs.PathError{Op: "symlink", Path: path, Err: unix.EEXIST}
}

func TestMountPoints(t *testing.T) {
	const mountinfo = `22 1 0:21 / /proc rw,nosuid,nodev,noexec - proc proc rw
23 1 0:22 / /sys rw - sysfs sysfs rw
36 35 98:0 /mnt1 /mnt\040with\040space rw,noatime master:1 - ext3 /dev/root rw,errors=continue
37 35 98:0 / /back\134slash rw - ext3 /dev/root rw
short line

38 35 98:0 / /bad\04escape rw - ext3 /dev/root rw
`
	want := []string{"/proc", "/sys", "/mnt with space", `/back\slash`, `/bad\04escape`}
	if got := MountPoints([]byte(mountinfo)); !reflect.DeepEqual(got, want) {
		t.Fatalf("mountPoints = %q, want %q", got, want)
	}
}

func TestUnescapeOctal(t *testing.T) {
	tests := []struct{ in, want string }{
		{"/plain", "/plain"},
		{`/a\040b`, "/a b"},
		{`/tab\011nl\012`, "/tab\tnl\n"},
		{`\134`, `\`},
		{`/end\04`, `/end\04`},
		{`/x\999`, `/x\999`},
		{`/x\`, `/x\`},
		{`/x\400`, `/x\400`}, // does not fit a byte
	}
	for _, tt := range tests {
		if got := unescapeOctal(tt.in); got != tt.want {
			t.Errorf("unescapeOctal(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}

func TestIsMountPointWithoutProc(t *testing.T) {
	f := newFake()
	if f.sys().isMountPoint("/proc") {
		t.Fatal("isMountPoint(/proc) with no mountinfo = true")
	}
	f.mounted["/proc"] = true
	if !f.sys().isMountPoint("/proc") {
		t.Fatal("isMountPoint(/proc) = false with /proc listed")
	}
}
