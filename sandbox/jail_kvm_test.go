package sandbox

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kilnvm/kiln/image/imagetest"
	"github.com/kilnvm/kiln/internal/kvmtest"
	"github.com/kilnvm/kiln/jail"
	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmmproc"
)

// TestKVMJail restores the warm snapshot into two jailed VMM processes
// and forks one of them into a third, then checks each from the host:
// every thread has its seccomp filter, NO_NEW_PRIVS, no capability and a
// non-root uid of its own (distinct between sandboxes); /proc/PID/root
// holds only the jail's binds; its mount, PID, IPC, UTS and network
// namespaces are not this process's; execs work; a jailed sandbox saves
// (through a folder passed as a descriptor) and the save restores; and
// after Close no id is held, no jail mount is left and no socket stays.
// The VMM processes run kiln-vmm (kvmtest.VMMBinary: without cgo).
func TestKVMJail(t *testing.T) {
	kvmtest.Require(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	warm := warmSnapshot(t)
	ids, err := jail.NewIDs(t.TempDir(), jail.FirstID, 64)
	if err != nil {
		t.Fatal(err)
	}
	// The VMM is kiln-vmm built without cgo (a test binary may have it,
	// and a cgo binary cannot enter a jail).
	proc := &ProcessOptions{Command: []string{kvmtest.VMMBinary(t)}, Jail: &JailOptions{IDs: ids}}
	run := func(sb *Sandbox, script string) string {
		t.Helper()
		return shOut(t, ctx, sb, script)
	}
	var dirs []string
	uids := map[int]string{}
	check := func(name string, sb *Sandbox, snap string) {
		t.Helper()
		uid := checkJailed(t, name, sb.PID())
		if other, ok := uids[uid]; ok {
			t.Fatalf("%s and %s share uid %d", name, other, uid)
		}
		uids[uid] = name
		binds := []string{"/dev/kvm", sb.Dir()}
		if snap != "" {
			binds = append(binds, snap)
		}
		for _, d := range sb.Devices() {
			// An empty volume slot has no image to bind.
			if d.Kind == virtio.KindBlock && d.Block != nil && !d.Block.EmptySlot() {
				binds = append(binds, d.Block.Path)
			}
		}
		checkJailRoot(t, name, sb.PID(), binds)
		dirs = append(dirs, sb.Dir())
	}

	begin := time.Now()
	a, err := Restore(ctx, warm, RestoreOptions{Hostname: "jailed-a", Process: proc})
	if err != nil {
		t.Fatalf("Restore into a jailed VMM process: %v", err)
	}
	defer a.Close(context.Background())
	t.Logf("a: restored into jailed VMM process %d in %v", a.PID(), time.Since(begin).Round(time.Millisecond))
	b, err := Restore(ctx, warm, RestoreOptions{Hostname: "jailed-b", Process: proc})
	if err != nil {
		t.Fatalf("Restore b: %v", err)
	}
	defer b.Close(context.Background())
	check("a", a, warm)
	check("b", b, warm)
	if got := run(a, "hostname; echo $((6*7))"); got != "jailed-a\n42" {
		t.Fatalf("a's exec: %q", got)
	}
	if got := run(b, "hostname"); got != "jailed-b" {
		t.Fatalf("b's exec: %q", got)
	}

	kids, err := a.Fork(ctx, 1, ForkOptions{})
	if err != nil {
		t.Fatalf("Fork of a jailed sandbox: %v", err)
	}
	defer kids[0].Close(context.Background())
	check("a's child", kids[0], "")
	if got := run(kids[0], "hostname"); got != "jailed-a-0" {
		t.Fatalf("child's exec: %q", got)
	}

	snap := filepath.Join(t.TempDir(), "snap")
	if got := run(b, "echo saved-in-jail > /tmp/mark; sync"); got != "" {
		t.Fatalf("mark: %q", got)
	}
	if err := b.Save(ctx, snap); err != nil {
		t.Fatalf("Save of a jailed sandbox: %v", err)
	}
	ents, err := os.ReadDir(filepath.Dir(snap))
	if err != nil || len(ents) != 1 {
		t.Fatalf("beside the snapshot: %v %v (want only it: no staged folder left)", ents, err)
	}
	if err := filepath.Walk(snap, func(path string, fi os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		if uid := fileUID(fi); uid != 0 {
			return fmt.Errorf("%s is owned by uid %d, not root", path, uid)
		}
		return nil
	}); err != nil {
		t.Fatalf("the saved snapshot: %v", err)
	}
	c, err := Restore(ctx, snap, RestoreOptions{Hostname: "jailed-c", Process: proc})
	if err != nil {
		t.Fatalf("Restore of the jailed save: %v", err)
	}
	defer c.Close(context.Background())
	check("c", c, snap)
	if got := run(c, "hostname; cat /tmp/mark"); got != "jailed-c\nsaved-in-jail" {
		t.Fatalf("c's exec: %q", got)
	}
	if got := run(b, "echo after save"); got != "after save" {
		t.Fatalf("b after its save: %q", got)
	}

	// An image-rooted sandbox in a jail: the images folder is bound in
	// read-only and the VMM process is in a network namespace of its own,
	// so this process fetches the chunks its guest reads (serveChunks).
	reg, refs := imagetest.ServeLayout(t, kvmtest.TestImages(t), "kiln/test")
	ie := newImageEnv(t, reg, refs)
	ie.pull(t, ctx, "debian")
	reg.Reset()
	begin = time.Now()
	is := ie.startWith(t, ctx, Options{Image: ie.refs["debian"], Process: proc})
	t.Logf("image: booted in jailed VMM process %d in %v", is.PID(), time.Since(begin).Round(time.Millisecond))
	iuid := checkJailed(t, "image", is.PID())
	uids[iuid] = "image"
	dirs = append(dirs, is.Dir())
	checkReadOnlyBind(t, "image", is.PID(), ie.dir)
	chunkSock := vmmproc.ChunkSocket(filepath.Join(is.Dir(), vmmproc.SocketFile))
	if fi, err := os.Stat(chunkSock); err != nil || fileUID(fi) != iuid || fi.Mode().Perm() != 0o600 {
		t.Errorf("image: chunk socket %s: %v (uid %d), want mode 0600 owned by the jail's uid %d", chunkSock, err, fileUIDOf(fi), iuid)
	}
	// The folder is searchable (0711) so that the jail reaches its
	// socket; nothing in it is open to others.
	ents, err = os.ReadDir(is.Dir())
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		fi, err := os.Lstat(filepath.Join(is.Dir(), e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		m := fi.Mode()
		switch {
		case m&os.ModeSocket != 0 && m.Perm()&0o002 != 0:
			t.Errorf("image: socket %s is mode %v: others may connect", e.Name(), m)
		case m&os.ModeSocket == 0 && m.IsRegular() && m.Perm()&0o006 != 0:
			t.Errorf("image: %s in the sandbox folder is mode %v: open to others", e.Name(), m)
		case m.IsDir() && m.Perm()&0o007 != 0:
			t.Errorf("image: folder %s in the sandbox folder is mode %v: open to others", e.Name(), m)
		}
	}
	if got := run(is, `python3 -c 'import json, sqlite3; print(1)'; git --version | cut -c1-11; hostname`); got != "1\ngit version\nimg" {
		t.Fatalf("image: python3 and git in the jail: %q", got)
	}
	if st := reg.Stats(); st.Requests == 0 || st.Bytes == 0 {
		t.Errorf("image: the registry served %+v: the guest's reads fetched nothing", st)
	}
	t.Logf("image: the parent fetched %d bytes in %d requests for the jailed guest", reg.Stats().Bytes, reg.Stats().Requests)
	checkGuestDial(t, ctx, is, iuid)
	// Its child, jailed too, reads what the parent never read.
	ikids, err := is.Fork(ctx, 1, ForkOptions{})
	if err != nil {
		t.Fatalf("Fork of a jailed image-rooted sandbox: %v", err)
	}
	uids[checkJailed(t, "image's child", ikids[0].PID())] = "image's child"
	dirs = append(dirs, ikids[0].Dir())
	if got := run(ikids[0], "base32 --version | head -1"); !strings.Contains(got, "base32") {
		t.Errorf("image's child: base32 --version: %q", got)
	}

	for _, sb := range []*Sandbox{ikids[0], is} {
		api := filepath.Join(sb.Dir(), vmmproc.SocketFile)
		if err := sb.Close(ctx); err != nil {
			t.Fatalf("Close: %v", err)
		}
		for _, sock := range []string{vmmproc.ChunkSocket(api), vmmproc.DialSocket(api)} {
			if _, err := os.Lstat(sock); !os.IsNotExist(err) {
				t.Errorf("socket %s after Close: %v", sock, err)
			}
		}
	}
	for _, sb := range []*Sandbox{kids[0], a, b, c} {
		if err := sb.Close(ctx); err != nil {
			t.Fatalf("Close: %v", err)
		}
	}
	for uid, name := range uids {
		if held, err := ids.Held(uid); err != nil || held {
			t.Errorf("%s's id %d after Close: held %v, %v", name, uid, held, err)
		}
	}
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range dirs {
		if strings.Contains(string(mi), d) {
			t.Errorf("a mount under %s is left:\n%s", d, mi)
		}
		if _, err := os.Stat(d); err == nil {
			t.Errorf("sandbox folder %s is left", d)
		}
	}
	t.Logf("%d jailed VMM processes (uids %v), closed: no id held, no mount, no folder left", len(uids), sortedKeys(uids))
}

// checkGuestDial has sb's guest (python3 in an image root) connect to the
// host's vsock port 5005, where a listener waits on the sandbox's
// vsock.sock_5005 (Firecracker's convention), and to port 5006, where
// none does. The jailed VMM process (uid) cannot reach the root-owned
// sandbox folder's listener itself: its parent dials it
// (vmmproc.DialSocket, the jail uid's alone).
func checkGuestDial(t *testing.T, ctx context.Context, sb *Sandbox, uid int) {
	t.Helper()
	dial := vmmproc.DialSocket(filepath.Join(sb.Dir(), vmmproc.SocketFile))
	if fi, err := os.Stat(dial); err != nil || fileUID(fi) != uid || fi.Mode().Perm() != 0o600 {
		t.Errorf("vsock dial socket %s: %v (uid %d), want mode 0600 owned by the jail's uid %d", dial, err, fileUIDOf(fi), uid)
	}
	ln, err := net.Listen("unix", sb.VsockPath()+"_5005")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	heard := make(chan string, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			heard <- err.Error()
			return
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(2 * time.Minute))
		line, err := bufio.NewReader(c).ReadString('\n')
		if err != nil {
			heard <- err.Error()
			return
		}
		io.WriteString(c, "hello, guest\n")
		heard <- strings.TrimSpace(line)
	}()
	got := shOut(t, ctx, sb, `python3 - <<'EOF'
import socket
s = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
s.settimeout(60)
s.connect((socket.VMADDR_CID_HOST, 5005))
s.sendall(b"from the jail\n")
print(s.makefile().readline().strip())
u = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
u.settimeout(60)
try:
    u.connect((socket.VMADDR_CID_HOST, 5006))
    print("5006: connected")
except OSError as e:
    print("5006:", type(e).__name__)
EOF`)
	lines := strings.Split(got, "\n")
	if len(lines) != 2 || lines[0] != "hello, guest" || !strings.HasPrefix(lines[1], "5006: ") || lines[1] == "5006: connected" || lines[1] == "5006: TimeoutError" {
		t.Errorf("guest-initiated vsock from the jail: the guest printed %q, want the host's answer, then port 5006 refused", got)
	}
	select {
	case h := <-heard:
		if h != "from the jail" {
			t.Errorf("guest-initiated vsock from the jail: the host listener read %q", h)
		}
	case <-time.After(time.Minute):
		t.Error("guest-initiated vsock from the jail: the host listener heard nothing")
	}
	t.Logf("image: the jailed guest connected to the host's vsock port 5005 through its parent (%s); port 5006: %s", lines[0], strings.TrimPrefix(lines[len(lines)-1], "5006: "))
}

// checkJailed checks every thread of the VMM process pid: its seccomp
// filter, NO_NEW_PRIVS, no capability, one non-root uid; and that its
// namespaces are not this process's. It returns the uid.
func checkJailed(t *testing.T, name string, pid int) int {
	t.Helper()
	if pid == os.Getpid() || pid <= 1 {
		t.Fatalf("%s: VMM PID %d", name, pid)
	}
	tasks, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/status", pid))
	if err != nil || len(tasks) == 0 {
		t.Fatalf("%s: tasks of %d: %v", name, pid, err)
	}
	uid := -1
	for _, f := range tasks {
		st, err := os.ReadFile(f)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		for _, w := range []string{"Seccomp:\t2", "NoNewPrivs:\t1", "CapEff:\t0000000000000000", "CapPrm:\t0000000000000000", "CapBnd:\t0000000000000000", "CapAmb:\t0000000000000000"} {
			if !bytes.Contains(st, []byte("\n"+w+"\n")) {
				t.Fatalf("%s: %s has no %q:\n%s", name, f, w, st)
			}
		}
		u := statusUID(t, string(st))
		if u == 0 || (uid >= 0 && u != uid) {
			t.Fatalf("%s: %s has uid %d (others %d)", name, f, u, uid)
		}
		uid = u
	}
	for _, ns := range []string{"mnt", "pid", "ipc", "uts", "net"} {
		mine, _ := os.Readlink("/proc/self/ns/" + ns)
		its, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/%s", pid, ns))
		if err != nil || its == mine {
			t.Fatalf("%s: %s namespace %q (%v) is this process's %q", name, ns, its, err, mine)
		}
	}
	t.Logf("%s: VMM process %d: %d threads, all Seccomp 2, NoNewPrivs 1, no capabilities, uid %d; own mnt/pid/ipc/uts/net namespaces", name, pid, len(tasks), uid)
	return uid
}

// statusUID is the real uid of a /proc/PID/status, all four equal.
func statusUID(t *testing.T, st string) int {
	t.Helper()
	for _, l := range strings.Split(st, "\n") {
		if f := strings.Fields(l); len(f) == 5 && f[0] == "Uid:" {
			if f[1] != f[2] || f[1] != f[3] || f[1] != f[4] {
				t.Fatalf("uids differ: %s", l)
			}
			u, _ := strconv.Atoi(f[1])
			return u
		}
	}
	t.Fatalf("no Uid line in\n%s", st)
	return -1
}

// checkJailRoot checks that the root of process pid holds the binds and
// nothing else: every entry is a bind or a folder on the way to one.
func checkJailRoot(t *testing.T, name string, pid int, binds []string) {
	t.Helper()
	root := fmt.Sprintf("/proc/%d/root", pid)
	isBind := map[string]bool{}
	onWay := map[string]bool{"/": true}
	for _, b := range binds {
		b = filepath.Clean(b)
		isBind[b] = true
		for d := filepath.Dir(b); d != "/"; d = filepath.Dir(d) {
			onWay[d] = true
		}
	}
	var walk func(dir string)
	n := 0
	walk = func(dir string) {
		ents, err := os.ReadDir(filepath.Join(root, dir))
		if err != nil {
			t.Fatalf("%s: %s in its root: %v", name, dir, err)
		}
		for _, e := range ents {
			p := filepath.Join(dir, e.Name())
			switch {
			case isBind[p]:
				n++
			case onWay[p]:
				walk(p)
			default:
				t.Errorf("%s: its root holds %s, which is no bind (binds %v)", name, p, binds)
			}
		}
	}
	walk("/")
	if n != len(isBind) {
		t.Errorf("%s: %d of the %d binds in its root (%v)", name, n, len(isBind), binds)
	}
	for _, p := range []string{"/etc/passwd", "/proc/self", "/usr", os.Args[0]} {
		if _, err := os.Lstat(filepath.Join(root, p)); err == nil {
			t.Errorf("%s: %s is in its jail", name, p)
		}
	}
}

func sortedKeys(m map[int]string) []int {
	var ks []int
	for k := range m {
		ks = append(ks, k)
	}
	sort.Ints(ks)
	return ks
}

// fileUID is a file's owner.
func fileUID(fi os.FileInfo) int {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return int(st.Uid)
	}
	return -1
}

// checkReadOnlyBind checks that path is mounted read-only in the mount
// namespace of process pid (its jail).
func checkReadOnlyBind(t *testing.T, name string, pid int, path string) {
	t.Helper()
	mi, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", pid))
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	for _, l := range strings.Split(string(mi), "\n") {
		f := strings.Fields(l)
		if len(f) > 5 && f[4] == filepath.Clean(path) {
			if !strings.HasPrefix(f[5], "ro") {
				t.Errorf("%s: %s is mounted %s in its jail, want ro", name, path, f[5])
			}
			return
		}
	}
	t.Errorf("%s: %s is not mounted in its jail:\n%s", name, path, mi)
}

// fileUIDOf is fileUID of fi, -1 when there is none.
func fileUIDOf(fi os.FileInfo) int {
	if fi == nil {
		return -1
	}
	return fileUID(fi)
}
