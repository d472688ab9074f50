package agent_test

import (
	"bytes"
	"debug/elf"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

	"github.com/kilnvm/kiln/guest/agent"
	"github.com/kilnvm/kiln/guest/client"
)

func TestRootNames(t *testing.T) {
	for _, tc := range []struct {
		name string
		ok   bool
	}{
		{"web", true},
		{"0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef", true},
		{"a.b_c-d", true},
		{"", false},
		{".", false},
		{"..", false},
		{"a/b", false},
		{"a b", false},
		{"a,aname=x", false},
		{strings.Repeat("a", 129), false},
	} {
		if err := agent.CheckRootName(tc.name); (err == nil) != tc.ok {
			t.Errorf("CheckRootName(%q) = %v, want ok %v", tc.name, err, tc.ok)
		}
	}
}

func TestIsZombieStat(t *testing.T) {
	for _, tc := range []struct {
		stat string
		want bool
	}{
		{"12 (sleep) S 1 12 12 0", false},
		{"12 (a) Z) Z 1 12", true}, // the command may hold ") "
		{"12 (x) X 1", true},
		{"12 (x)", false},
		{"", false},
	} {
		if got := agent.IsZombieStat([]byte(tc.stat)); got != tc.want {
			t.Errorf("IsZombieStat(%q) = %v, want %v", tc.stat, got, tc.want)
		}
	}
}

// TestExecInRoot: a process Exec starts in a container root runs chrooted
// in a mount namespace of its own, with its executable, working
// directory and user resolved in the root (an absolute symbolic link
// included), and the rest of the guest out of its sight.
func TestExecInRoot(t *testing.T) {
	busybox, err := os.ReadFile("/usr/bin/busybox")
	if err != nil {
		t.Skip("no /usr/bin/busybox to make a root of")
	}
	base := t.TempDir()
	root := filepath.Join(base, "root")
	for _, d := range []string{"", "bin", "proc", "etc", "work"} {
		if err := os.Mkdir(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(root, "bin", "busybox"), busybox, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/bin/busybox", filepath.Join(root, "bin", "sh")); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(root, "etc", "passwd"), []byte("root:x:0:0::/root:/bin/sh\napp:x:1234:1234::/work:/bin/sh\n"), 0o644)
	os.WriteFile(filepath.Join(root, "etc", "group"), []byte("root:x:0:\n"), 0o644)
	os.WriteFile(filepath.Join(root, "work", "marker"), []byte("in the root\n"), 0o644)
	// The trampoline is /proc/self/exe, found through the root's /proc: a
	// test binary built with cgo needs its loader and libraries there
	// (the guest's agent is static).
	copyLibraries(t, root)
	if err := unix.Mount("proc", filepath.Join(root, "proc"), "proc", 0, ""); err != nil {
		t.Skipf("cannot mount proc in a test root: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(filepath.Join(root, "proc"), unix.MNT_DETACH) })

	a := startAgent(t, agent.Config{})
	a.srv.AddTestRoot("c1", base)
	ctx := testContext(t, 30*time.Second)
	var out, errb bytes.Buffer
	st, err := a.Exec(ctx, client.ExecOptions{
		Argv: []string{"sh", "-c", "cat marker; id -u; pwd; test -e /var && echo host-visible; exit 0"},
		Env:  []string{"PATH=/bin"}, Dir: "/work", User: "app", Root: "c1",
		Stdout: &out, Stderr: &errb,
	})
	if err != nil || st.Code != 0 {
		t.Fatalf("Run in root = %+v, %v (stderr %q)", st, err, errb.String())
	}
	want := "in the root\n1234\n/work\n"
	if out.String() != want {
		t.Errorf("output %q, want %q", out.String(), want)
	}

	// What is not in the root is not found, even if the guest has it.
	_, err = a.Exec(ctx, client.ExecOptions{Argv: []string{"busybox-not-here"}, Env: []string{"PATH=/bin:/usr/bin"}, Root: "c1"})
	wantCode(t, err, codes.NotFound, "busybox-not-here")
	_, err = a.Exec(ctx, client.ExecOptions{Argv: []string{"sh"}, Env: []string{"PATH=/bin"}, Dir: "/nowhere", Root: "c1"})
	wantCode(t, err, codes.InvalidArgument, "/nowhere")
	_, err = a.Exec(ctx, client.ExecOptions{Argv: []string{"sh"}, Root: "c2"})
	wantCode(t, err, codes.NotFound, "c2")
	_, err = a.Exec(ctx, client.ExecOptions{Argv: []string{"sh"}, Root: "../c1"})
	wantCode(t, err, codes.InvalidArgument)

	// UnmountRoot kills what runs in it, a process that left its group too.
	p, err := a.Start(ctx, client.ExecOptions{Argv: []string{"sh", "-c", "setsid sleep 600 & sleep 600"}, Env: []string{"PATH=/bin"}, Root: "c1"})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	// (Before UnmountRoot removes the folder: a real root's proc goes
	// with its overlay.)
	if err := unix.Unmount(filepath.Join(root, "proc"), unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	if err := a.UnmountRoot(ctx, "c1"); err != nil {
		t.Fatalf("UnmountRoot: %v", err)
	}
	if _, err := os.Stat(base); !os.IsNotExist(err) {
		t.Errorf("the root's folder after UnmountRoot: %v", err)
	}
	if st, err := p.Wait(); err != nil || st.Signal != 9 {
		t.Errorf("the root's process after UnmountRoot: %+v, %v; want killed", st, err)
	}
	if err := a.UnmountRoot(ctx, "c1"); err == nil {
		t.Error("a second UnmountRoot succeeded")
	}
}

// copyLibraries copies the dynamic loader and libraries of this test
// binary, if it has any, into root at their paths.
func copyLibraries(t *testing.T, root string) {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	f, err := elf.Open(exe)
	if err != nil {
		t.Fatal(err)
	}
	dynamic := false
	for _, p := range f.Progs {
		dynamic = dynamic || p.Type == elf.PT_INTERP
	}
	f.Close()
	if !dynamic {
		return
	}
	out, err := exec.Command("ldd", exe).Output()
	if err != nil {
		t.Fatalf("ldd %s: %v", exe, err)
	}
	for _, line := range strings.Split(string(out), "\n") {
		for _, field := range strings.Fields(line) {
			if !strings.HasPrefix(field, "/") {
				continue
			}
			b, err := os.ReadFile(field)
			if err != nil {
				t.Fatal(err)
			}
			dst := filepath.Join(root, field)
			if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(dst, b, 0o755); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// TestAddMounts: volumes go into a container root at destinations
// resolved in it (an absolute link included), made where missing: a tree
// read-only, a guest volume shared by the roots that name it, a tmpfs, a
// file; bad requests name what is wrong.
func TestAddMounts(t *testing.T) {
	base := t.TempDir()
	root := filepath.Join(base, "root")
	trees, volumes := t.TempDir(), t.TempDir()
	for _, d := range []string{filepath.Join(root, "etc"), filepath.Join(trees, "cfg")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	os.WriteFile(filepath.Join(trees, "cfg", "key"), []byte("value\n"), 0o644)
	// An absolute link in the root: resolved in it, not in the guest.
	if err := os.Symlink("/etc", filepath.Join(root, "conf")); err != nil {
		t.Fatal(err)
	}
	a := startAgent(t, agent.Config{})
	a.srv.SetTestDirs(trees, volumes)
	a.srv.AddTestRoot("c1", base)
	ctx := testContext(t, 30*time.Second)
	err := a.AddMounts(ctx, "c1", []client.Mount{
		{Destination: "/conf/cfg", Kind: client.MountTree, Name: "cfg"},
		{Destination: "/data/shared", Kind: client.MountVolume, Name: "scratch"},
		{Destination: "/scratch-ro", Kind: client.MountVolume, Name: "scratch", ReadOnly: true},
		{Destination: "/mem", Kind: client.MountTmpfs, Size: 1 << 20},
		{Destination: "/etc/hosts", Kind: client.MountFile, Data: []byte("10.0.0.9 pod\n"), Mode: 0o640},
	})
	if err != nil {
		t.Fatalf("AddMounts: %v", err)
	}
	t.Cleanup(func() {
		for _, m := range []string{"etc/cfg", "data/shared", "scratch-ro", "mem"} {
			unix.Unmount(filepath.Join(root, m), unix.MNT_DETACH)
		}
	})
	if b, err := os.ReadFile(filepath.Join(root, "etc", "cfg", "key")); err != nil || string(b) != "value\n" {
		t.Errorf("the tree at /conf/cfg (= the root's /etc/cfg): %q, %v", b, err)
	}
	if err := os.WriteFile(filepath.Join(root, "etc", "cfg", "new"), nil, 0o644); !errors.Is(err, unix.EROFS) {
		t.Errorf("writing into a tree: %v, want EROFS (trees are read-only)", err)
	}
	if err := os.WriteFile(filepath.Join(root, "data", "shared", "f"), []byte("x"), 0o644); err != nil {
		t.Fatalf("writing the volume: %v", err)
	}
	if b, err := os.ReadFile(filepath.Join(root, "scratch-ro", "f")); err != nil || string(b) != "x" {
		t.Errorf("the volume's second mount: %q, %v; want the first's file", b, err)
	}
	if err := os.WriteFile(filepath.Join(root, "scratch-ro", "g"), nil, 0o644); !errors.Is(err, unix.EROFS) {
		t.Errorf("writing the read-only mount: %v, want EROFS", err)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(filepath.Join(root, "mem"), &st); err != nil || st.Type != unix.TMPFS_MAGIC {
		t.Errorf("/mem: statfs %+v, %v; want a tmpfs", st.Type, err)
	}
	if fi, err := os.Lstat(filepath.Join(root, "etc", "hosts")); err != nil || fi.Mode().Perm() != 0o640 {
		t.Errorf("/etc/hosts: %v, %v; want a 0640 file", fi, err)
	} else if b, _ := os.ReadFile(filepath.Join(root, "etc", "hosts")); string(b) != "10.0.0.9 pod\n" {
		t.Errorf("/etc/hosts: %q", b)
	}
	if _, err := os.Stat(filepath.Join("/", "cfg")); err == nil {
		t.Errorf("a mount landed outside the root")
	}

	for _, tc := range []struct {
		name string
		root string
		m    client.Mount
		code codes.Code
		want string
	}{
		{"relative", "c1", client.Mount{Destination: "x", Kind: client.MountTmpfs}, codes.InvalidArgument, "absolute"},
		{"the root", "c1", client.Mount{Destination: "/", Kind: client.MountTmpfs}, codes.InvalidArgument, "root"},
		{"proc", "c1", client.Mount{Destination: "/proc/x", Kind: client.MountTmpfs}, codes.InvalidArgument, "/proc"},
		{"dev", "c1", client.Mount{Destination: "/dev/termination-log", Kind: client.MountFile}, codes.InvalidArgument, "/dev"},
		{"agent state", "", client.Mount{Destination: "/run/kiln/roots", Kind: client.MountTmpfs}, codes.InvalidArgument, "/run/kiln"},
		{"unknown tree", "c1", client.Mount{Destination: "/t", Kind: client.MountTree, Name: "nope"}, codes.NotFound, "nope"},
		{"bad volume", "c1", client.Mount{Destination: "/t", Kind: client.MountVolume, Name: "../x"}, codes.InvalidArgument, "../x"},
		{"big file", "c1", client.Mount{Destination: "/big", Kind: client.MountFile, Data: make([]byte, 1<<20+1)}, codes.InvalidArgument, "at most"},
		{"unknown root", "c2", client.Mount{Destination: "/t", Kind: client.MountTmpfs}, codes.NotFound, "c2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			wantCode(t, a.AddMounts(ctx, tc.root, []client.Mount{tc.m}), tc.code, tc.want)
		})
	}
}

// TestMountRoot: MountRoot makes a tree the host serves a container root:
// the tree under a writable overlay (writes stay out of the tree), with
// proc, sysfs and the guest's /dev, and the guest's /etc files copied in
// (a link the tree puts there is replaced, never followed);
// UnmountRoot takes it all down.
func TestMountRoot(t *testing.T) {
	trees, roots := t.TempDir(), t.TempDir()
	tree := filepath.Join(trees, "web")
	for _, d := range []string{"etc", "bin"} {
		if err := os.MkdirAll(filepath.Join(tree, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	os.WriteFile(filepath.Join(tree, "bin", "app"), []byte("app\n"), 0o755)
	// A hostile tree: its /etc/hosts links to the guest's /etc/passwd,
	// its /proc is a link to the guest's /etc.
	os.Symlink("/etc/passwd", filepath.Join(tree, "etc", "hosts"))
	os.Symlink("/etc", filepath.Join(tree, "proc"))
	a := startAgent(t, agent.Config{})
	a.srv.SetTestDirs(trees, t.TempDir())
	a.srv.SetTestRootsDir(roots)
	ctx := testContext(t, 30*time.Second)
	path, err := a.MountRoot(ctx, "web", 0)
	if err != nil {
		if strings.Contains(err.Error(), "operation not permitted") {
			t.Skipf("this host lets no test mount overlay, proc or sysfs: %v", err)
		}
		t.Fatalf("MountRoot: %v", err)
	}
	if path != filepath.Join(roots, "web", "root") {
		t.Errorf("MountRoot = %s", path)
	}
	if b, err := os.ReadFile(filepath.Join(path, "bin", "app")); err != nil || string(b) != "app\n" {
		t.Errorf("the tree in the root: %q, %v", b, err)
	}
	if err := os.WriteFile(filepath.Join(path, "bin", "new"), []byte("x"), 0o644); err != nil {
		t.Errorf("writing in the root: %v", err)
	}
	if _, err := os.Stat(filepath.Join(tree, "bin", "new")); err == nil {
		t.Error("a write in the root reached the tree")
	}
	var st unix.Statfs_t
	if err := unix.Statfs(filepath.Join(path, "proc"), &st); err != nil || st.Type != unix.PROC_SUPER_MAGIC {
		t.Errorf("the root's /proc: %#x, %v; want proc (the tree's link replaced)", st.Type, err)
	}
	if err := unix.Statfs(filepath.Join(path, "sys"), &st); err != nil || st.Type != unix.SYSFS_MAGIC {
		t.Errorf("the root's /sys: %#x, %v", st.Type, err)
	}
	if _, err := os.Stat(filepath.Join(path, "dev", "null")); err != nil {
		t.Errorf("the root's /dev/null: %v", err)
	}
	if fi, err := os.Lstat(filepath.Join(path, "etc", "hosts")); err == nil && fi.Mode()&os.ModeSymlink != 0 {
		// The guest (this host) has /etc/hosts: the copy replaces the link.
		if _, herr := os.Stat("/etc/hosts"); herr == nil {
			t.Error("the tree's /etc/hosts link was kept, not replaced by the guest's file")
		}
	}
	if b, _ := os.ReadFile("/etc/passwd"); len(b) > 0 {
		if h, _ := os.ReadFile(filepath.Join(path, "etc", "hosts")); string(h) == string(b) {
			t.Error("the guest's /etc/hosts copy went through the tree's link")
		}
	}
	_, err = a.MountRoot(ctx, "web", 0)
	wantCode(t, err, codes.AlreadyExists, "web")
	_, err = a.MountRoot(ctx, "nope", 0)
	wantCode(t, err, codes.NotFound, "nope")
	_, err = a.MountRoot(ctx, "../web", 0)
	wantCode(t, err, codes.InvalidArgument)

	if err := a.UnmountRoot(ctx, "web"); err != nil {
		t.Fatalf("UnmountRoot: %v", err)
	}
	if _, err := os.Stat(filepath.Join(roots, "web")); !os.IsNotExist(err) {
		t.Errorf("the root's folder after UnmountRoot: %v", err)
	}
	if b, _ := os.ReadFile("/proc/self/mountinfo"); strings.Contains(string(b), roots) {
		t.Errorf("mounts left under %s:\n%s", roots, b)
	}
}

// TestAddMountsDisk: a disk mount is refused clearly where it cannot be
// made (another root, an unknown serial, a slot the host left empty, a
// disk without ext4, a bad destination); with a loop device for the
// disk, a real ext4 image mounts, read-only when asked.
func TestAddMountsDisk(t *testing.T) {
	dir := t.TempDir()
	write := func(name, data string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	zeros := write("zeros.img", string(make([]byte, 8192)))
	disks := map[string][2]string{
		"empty": {zeros, write("empty.size", "0\n")},
		"raw":   {zeros, write("raw.size", "16\n")},
	}
	a := startAgent(t, agent.Config{})
	base := t.TempDir()
	if err := os.Mkdir(filepath.Join(base, "root"), 0o755); err != nil {
		t.Fatal(err)
	}
	a.srv.AddTestRoot("c1", base)
	a.srv.SetTestFindDisk(func(serial string) (string, string, error) {
		d, ok := disks[serial]
		if !ok {
			return "", "", errors.New("no such serial")
		}
		return d[0], d[1], nil
	})
	agent.SetTestDiskSizeWait(200 * time.Millisecond)
	t.Cleanup(func() { agent.SetTestDiskSizeWait(5 * time.Second) })
	ctx := testContext(t, 30*time.Second)
	for _, tc := range []struct {
		name string
		root string
		m    client.Mount
		code codes.Code
		want string
	}{
		{"container root", "c1", client.Mount{Destination: "/data", Kind: client.MountDisk, Name: "raw"}, codes.InvalidArgument, "guest's own root"},
		{"bad serial", "", client.Mount{Destination: "/data", Kind: client.MountDisk, Name: "a/b"}, codes.InvalidArgument, "serial"},
		{"no serial", "", client.Mount{Destination: "/data", Kind: client.MountDisk}, codes.InvalidArgument, "serial"},
		{"unknown serial", "", client.Mount{Destination: "/data", Kind: client.MountDisk, Name: "vol3"}, codes.NotFound, "vol3"},
		{"empty slot", "", client.Mount{Destination: "/data", Kind: client.MountDisk, Name: "empty"}, codes.FailedPrecondition, "still empty"},
		{"not ext4", "", client.Mount{Destination: "/data", Kind: client.MountDisk, Name: "raw"}, codes.InvalidArgument, "not an ext4"},
		{"agent state", "", client.Mount{Destination: "/run/kiln/x", Kind: client.MountDisk, Name: "raw"}, codes.InvalidArgument, "/run/kiln"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			wantCode(t, a.AddMounts(ctx, tc.root, []client.Mount{tc.m}), tc.code, tc.want)
		})
	}

	t.Run("ext4 on a loop device", func(t *testing.T) {
		for _, serial := range []string{"vol0", "vol1"} {
			img := filepath.Join(dir, serial+".img")
			if out, err := exec.Command("mke2fs", "-q", "-t", "ext4", "-F", "-E", "root_owner=0:0", img, "8M").CombinedOutput(); err != nil {
				t.Skipf("no mke2fs: %v %s", err, out)
			}
			out, err := exec.Command("losetup", "-f", "--show", img).Output()
			if err != nil {
				t.Skipf("no loop device here: %v", err)
			}
			loop := strings.TrimSpace(string(out))
			t.Cleanup(func() { exec.Command("losetup", "-d", loop).Run() })
			disks[serial] = [2]string{loop, write(serial+".size", "16384\n")}
		}
		mnt := filepath.Join(t.TempDir(), "data")
		ro := filepath.Join(t.TempDir(), "ro")
		err := a.AddMounts(ctx, "", []client.Mount{
			{Destination: mnt, Kind: client.MountDisk, Name: "vol0"},
			{Destination: ro, Kind: client.MountDisk, Name: "vol1", ReadOnly: true},
		})
		if err != nil {
			t.Fatalf("AddMounts: %v", err)
		}
		t.Cleanup(func() {
			unix.Unmount(ro, unix.MNT_DETACH)
			unix.Unmount(mnt, unix.MNT_DETACH)
		})
		if err := os.WriteFile(filepath.Join(mnt, "hello"), []byte("hi\n"), 0o644); err != nil {
			t.Fatalf("writing the volume: %v", err)
		}
		if err := os.WriteFile(filepath.Join(ro, "x"), nil, 0o644); !errors.Is(err, unix.EROFS) {
			t.Errorf("writing the read-only mount: %v, want EROFS", err)
		}
		// Mounted read-write, its image says its journal needs replaying;
		// frozen, it is clean, as unmounted (ext4_freeze).
		recover := func() bool {
			f, err := os.Open(filepath.Join(dir, "vol0.img"))
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			var b [1]byte
			f.ReadAt(b[:], 1024+0x60)
			return b[0]&0x4 != 0
		}
		if !recover() {
			t.Error("a mounted volume's image is clean; want RECOVER set")
		}
		if err := a.FreezeVolumes(ctx); err != nil {
			t.Fatalf("FreezeVolumes: %v", err)
		}
		t.Cleanup(func() {
			if fd, err := unix.Open(mnt, unix.O_RDONLY|unix.O_DIRECTORY, 0); err == nil {
				unix.Syscall(unix.SYS_IOCTL, uintptr(fd), 0xc0045878, 0) // FITHAW
				unix.Close(fd)
			}
		})
		if recover() {
			t.Error("a frozen volume's image still says its journal needs replaying")
		}
		if err := a.FreezeVolumes(ctx); err != nil {
			t.Errorf("FreezeVolumes again (frozen already): %v", err)
		}
		if b, err := os.ReadFile(filepath.Join(dir, "vol0.img")); err != nil || !bytes.Contains(b, []byte("hi\n")) {
			t.Errorf("the written file is not on the image after the freeze: %v", err)
		}
	})
}
