package jail

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// childEnv makes the test binary a child that enters the jail its value
// (a Config in JSON) describes and reports what it sees (childMain).
const childEnv = "KILN_JAIL_TEST_CHILD"

func TestMain(m *testing.M) {
	if cfg := os.Getenv(childEnv); cfg != "" {
		os.Exit(childMain(cfg))
	}
	os.Exit(m.Run())
}

// childMain starts threads, enters the jail, prints one JSON report and
// waits for its stdin to close (the test reads /proc/PID meanwhile).
func childMain(js string) int {
	var c Config
	if err := json.Unmarshal([]byte(js), &c); err != nil {
		fmt.Fprintln(os.Stderr, "config:", err)
		return 3
	}
	// Threads born before Enter: it must reach them all.
	release := make(chan struct{})
	for range 4 {
		go func() {
			runtime.LockOSThread()
			<-release
		}()
	}
	time.Sleep(20 * time.Millisecond)
	if err := Enter(c); err != nil {
		fmt.Fprintln(os.Stderr, "enter:", err)
		return 4
	}
	// And one born after.
	go func() {
		runtime.LockOSThread()
		<-release
	}()
	var r childReport
	ents, err := os.ReadDir("/")
	if err != nil {
		r.Err = err.Error()
	}
	for _, e := range ents {
		r.Root = append(r.Root, e.Name())
	}
	for _, p := range []string{"/etc/passwd", "/proc/self", "/usr", "/dev/null", os.Args[0]} {
		if _, err := os.Lstat(p); err == nil {
			r.Visible = append(r.Visible, p)
		}
	}
	for _, l := range []struct {
		name string
		res  int
	}{{"NOFILE", unix.RLIMIT_NOFILE}, {"MEMLOCK", unix.RLIMIT_MEMLOCK}, {"CORE", unix.RLIMIT_CORE}, {"NPROC", unix.RLIMIT_NPROC}} {
		var lim unix.Rlimit
		unix.Getrlimit(l.res, &lim)
		r.Limits = append(r.Limits, fmt.Sprintf("%s=%d/%d", l.name, lim.Cur, lim.Max))
	}
	r.UID, r.GID = os.Getuid(), os.Getgid()
	if err := os.WriteFile("/newfile", []byte("x"), 0o600); err == nil {
		r.Wrote = append(r.Wrote, "/newfile")
	}
	for _, b := range c.Binds {
		if err := os.WriteFile(filepath.Join(b.Path, "probe"), []byte("x"), 0o600); err == nil {
			r.Wrote = append(r.Wrote, b.Path)
		}
	}
	if err := unix.Mount("tmpfs", "/", "tmpfs", 0, ""); err == nil {
		r.Wrote = append(r.Wrote, "mount")
	}
	if err := unix.Chroot("/"); err == nil {
		r.Wrote = append(r.Wrote, "chroot")
	}
	b, _ := json.Marshal(r)
	fmt.Println(string(b))
	bufio.NewReader(os.Stdin).ReadString('\n')
	close(release)
	return 0
}

type childReport struct {
	Root    []string
	Visible []string
	Limits  []string
	UID     int
	GID     int
	Wrote   []string // what it could change (nothing, in a jail)
	Err     string
}

// startChild runs the test binary as a child in new namespaces (as
// vmmproc starts a jailed VMM) that enters c.
func startChild(t *testing.T, c Config) (*exec.Cmd, childReport, func()) {
	t.Helper()
	js, err := json.Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(childBinary(t), "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+string(js))
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: unix.CLONE_NEWNS | unix.CLONE_NEWPID | unix.CLONE_NEWIPC | unix.CLONE_NEWUTS | unix.CLONE_NEWNET}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatalf("start the child: %v", err)
	}
	done := func() {
		stdin.Close()
		cmd.Wait()
	}
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		done()
		t.Fatalf("child: %v; stderr: %s", err, stderr.String())
	}
	var r childReport
	if err := json.Unmarshal([]byte(line), &r); err != nil {
		done()
		t.Fatalf("child said %q: %v", line, err)
	}
	return cmd, r, done
}

// TestEnter: a child that entered its jail has, on every thread, no
// capability (effective, permitted, bounding, ambient), NO_NEW_PRIVS and
// the jail's ids; its root holds only the binds (a host file outside them
// is absent), read-only where asked; its rlimits are the jail's; it
// cannot write its root, mount or chroot.
func TestEnter(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	// The jailed uid must be able to walk down to its binds.
	for d := dir; d != "/"; d = filepath.Dir(d) {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
		if filepath.Dir(d) == os.TempDir() {
			break
		}
	}
	sock := filepath.Join(dir, "sock")
	ro := filepath.Join(dir, "ro")
	for _, d := range []string{sock, ro} {
		if err := os.Mkdir(d, 0o777); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(d, 0o777); err != nil { // past the umask
			t.Fatal(err)
		}
	}
	file := filepath.Join(dir, "kernel")
	if err := os.WriteFile(file, []byte("vmlinux"), 0o644); err != nil {
		t.Fatal(err)
	}
	c := Config{Dir: filepath.Join(dir, "jail"), UID: FirstID + 7, GID: FirstID + 7, Binds: []Bind{
		{Path: "/dev/null"}, {Path: sock}, {Path: ro, ReadOnly: true}, {Path: file, ReadOnly: true},
	}}
	ns, err := MountNS()
	if err != nil {
		t.Fatal(err)
	}
	c.ParentMountNS = ns
	cmd, r, done := startChild(t, c)
	defer done()
	pid := cmd.Process.Pid
	if r.Err != "" {
		t.Fatalf("child: %s", r.Err)
	}
	// Every thread, seen from the host.
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		t.Fatal(err)
	}
	if len(tasks) < 6 {
		t.Fatalf("child has %d threads, want the ones it started (6 or more)", len(tasks))
	}
	want := []string{
		"CapInh:\t0000000000000000", "CapPrm:\t0000000000000000", "CapEff:\t0000000000000000",
		"CapBnd:\t0000000000000000", "CapAmb:\t0000000000000000", "NoNewPrivs:\t1",
		fmt.Sprintf("Uid:\t%d\t%d\t%d\t%d", c.UID, c.UID, c.UID, c.UID),
		fmt.Sprintf("Gid:\t%d\t%d\t%d\t%d", c.GID, c.GID, c.GID, c.GID),
	}
	for _, task := range tasks {
		st, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/status", pid, task.Name()))
		if err != nil {
			t.Fatal(err)
		}
		for _, w := range want {
			if !strings.Contains(string(st), "\n"+w) {
				t.Errorf("thread %s: no %q in its status:\n%s", task.Name(), w, st)
			}
		}
		if g := statusField(string(st), "Groups"); g != "" {
			t.Errorf("thread %s: supplementary groups %q, want none", task.Name(), g)
		}
	}
	// Its root, from the host and from inside.
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/root", pid))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	top := strings.Split(strings.TrimPrefix(dir, "/"), "/")[0]
	wantRoot := []string{"dev", top}
	sort.Strings(wantRoot)
	if strings.Join(names, " ") != strings.Join(wantRoot, " ") {
		t.Errorf("/proc/PID/root holds %v, want %v", names, wantRoot)
	}
	if strings.Join(r.Root, " ") != strings.Join(wantRoot, " ") {
		t.Errorf("the child's / holds %v, want %v", r.Root, wantRoot)
	}
	if strings.Join(r.Visible, " ") != "/dev/null" {
		t.Errorf("the child sees %v of /etc/passwd, /proc/self, /usr, /dev/null, its own binary; want only /dev/null", r.Visible)
	}
	wantLimits := fmt.Sprintf("NOFILE=%d/%d MEMLOCK=0/0 CORE=0/0 NPROC=%d/%d", MaxFiles, MaxFiles, MaxProcs, MaxProcs)
	if got := strings.Join(r.Limits, " "); got != wantLimits {
		t.Errorf("rlimits %s, want %s", got, wantLimits)
	}
	if r.UID != c.UID || r.GID != c.GID {
		t.Errorf("child ids %d/%d, want %d/%d", r.UID, r.GID, c.UID, c.GID)
	}
	// The socket folder is 0777 here, so the jailed uid may write it;
	// the read-only bind it may not, nor the root, nor mount or chroot.
	if got := strings.Join(r.Wrote, " "); got != sock {
		t.Errorf("child could write %q, want only %s", got, sock)
	}
	// Namespaces differ from the test's.
	for _, ns := range []string{"mnt", "pid", "ipc", "uts", "net"} {
		mine, _ := os.Readlink("/proc/self/ns/" + ns)
		its, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/%s", pid, ns))
		if err != nil || its == mine {
			t.Errorf("ns %s: child's %q (%v), mine %q", ns, its, err, mine)
		}
	}
	// The jail's mounts are the child's: the host sees an empty folder.
	if ents, err := os.ReadDir(filepath.Join(c.Dir, RootDir)); err != nil || len(ents) != 0 {
		t.Errorf("host's view of the jail root: %v, %v; want an empty folder", ents, err)
	}
	if mi, _ := os.ReadFile("/proc/self/mountinfo"); strings.Contains(string(mi), c.Dir) {
		t.Errorf("the host's mounts name the jail:\n%s", mi)
	}
}

// TestConfigErrors: bad configurations fail before anything is touched,
// with messages that say what is wrong.
func TestConfigErrors(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		name string
		c    Config
		want string
	}{
		{"relative dir", Config{Dir: "jail", UID: FirstID, GID: FirstID}, `folder "jail" is not an absolute path`},
		{"no dir", Config{UID: FirstID, GID: FirstID}, `folder "" is not an absolute path`},
		{"root uid", Config{Dir: dir, UID: 0, GID: FirstID}, "ids other than root's"},
		{"root gid", Config{Dir: dir, UID: FirstID, GID: 0}, "ids other than root's"},
		{"missing bind", Config{Dir: dir, UID: FirstID, GID: FirstID, Binds: []Bind{{Path: filepath.Join(dir, "nope")}}}, "no such file or directory"},
		{"relative bind", Config{Dir: dir, UID: FirstID, GID: FirstID, Binds: []Bind{{Path: "dev/kvm"}}}, "not a clean absolute path"},
		{"unclean bind", Config{Dir: dir, UID: FirstID, GID: FirstID, Binds: []Bind{{Path: "/dev/../etc"}}}, "not a clean absolute path"},
		{"bind of /", Config{Dir: dir, UID: FirstID, GID: FirstID, Binds: []Bind{{Path: "/"}}}, "not a clean absolute path"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := Enter(tc.c) // fails in Validate: this process is untouched
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Enter: %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

// TestOwnMountNS: Enter refuses a process that shares its parent's mount
// namespace (it would change the host's mounts), and passes one in a
// namespace of its own (TestEnter's child).
func TestOwnMountNS(t *testing.T) {
	ns, err := MountNS()
	if err != nil {
		t.Fatal(err)
	}
	err = checkOwnMountNS(ns)
	if err == nil || !strings.Contains(err.Error(), "CLONE_NEWNS") {
		t.Fatalf("in its parent's mount namespace: %v, want a refusal naming CLONE_NEWNS", err)
	}
	if err := checkOwnMountNS(ns + 1); err != nil {
		t.Fatalf("in another mount namespace: %v", err)
	}
	// Enter itself refuses before it touches a mount.
	err = Enter(Config{Dir: t.TempDir(), UID: FirstID, GID: FirstID, ParentMountNS: ns})
	if err == nil || !strings.Contains(err.Error(), "CLONE_NEWNS") {
		t.Fatalf("Enter in this process: %v, want the refusal", err)
	}
}

// TestIDs: allocations differ; an id held by a process (its inherited
// descriptor) is free again once that process dies; a full range is
// ErrNoIDs.
func TestIDs(t *testing.T) {
	dir := t.TempDir()
	a, err := NewIDs(dir, FirstID, 3)
	if err != nil {
		t.Fatal(err)
	}
	id1, f1, err := a.Allocate()
	if err != nil {
		t.Fatal(err)
	}
	id2, f2, err := a.Allocate()
	if err != nil {
		t.Fatal(err)
	}
	if id1 == id2 || id1 < FirstID || id2 < FirstID || id1 >= FirstID+3 || id2 >= FirstID+3 {
		t.Fatalf("ids %d and %d", id1, id2)
	}
	// id2 goes to a process, and the parent's copy is closed.
	holder := exec.Command("sleep", "60")
	holder.ExtraFiles = []*os.File{f2}
	if err := holder.Start(); err != nil {
		t.Fatal(err)
	}
	defer holder.Process.Kill()
	f2.Close()
	if held, err := a.Held(id2); err != nil || !held {
		t.Fatalf("id %d held by a live process: %v %v", id2, held, err)
	}
	id3, f3, err := a.Allocate()
	if err != nil {
		t.Fatal(err)
	}
	if id3 == id1 || id3 == id2 {
		t.Fatalf("third id %d repeats one of %d, %d", id3, id1, id2)
	}
	_, _, err = a.Allocate()
	if !errors.Is(err, ErrNoIDs) || !strings.Contains(err.Error(), "3 ids from 900000") {
		t.Fatalf("full range: %v, want ErrNoIDs naming the range", err)
	}
	// Another allocator over the same folder (another kilnd) sees them
	// held too.
	b, err := NewIDs(dir, FirstID, 3)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := b.Allocate(); !errors.Is(err, ErrNoIDs) {
		t.Fatalf("second allocator: %v, want ErrNoIDs", err)
	}
	holder.Process.Kill()
	holder.Wait()
	if held, err := a.Held(id2); err != nil || held {
		t.Fatalf("id %d after its holder died: held %v, %v", id2, held, err)
	}
	id4, f4, err := a.Allocate()
	if err != nil || id4 != id2 {
		t.Fatalf("after the holder died: %d, %v; want its id %d", id4, err, id2)
	}
	for _, f := range []*os.File{f1, f3, f4} {
		f.Close()
	}
	if held, err := a.Held(id1); err != nil || held {
		t.Fatalf("id %d after its file closed: held %v, %v", id1, held, err)
	}
}

// TestNewIDsErrors: a bad range or folder is refused.
func TestNewIDsErrors(t *testing.T) {
	for _, tc := range []struct {
		name         string
		dir          string
		first, count int
	}{
		{"root in range", t.TempDir(), 0, 10},
		{"empty range", t.TempDir(), FirstID, 0},
		{"relative dir", "ids", FirstID, 10},
		{"past uid_t", t.TempDir(), 1<<31 - 10, 100},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := NewIDs(tc.dir, tc.first, tc.count); err == nil {
				t.Fatal("no error")
			}
		})
	}
}

// childBinary is the binary startChild runs: this test binary, or under
// the race detector (which links cgo) this package's tests built again
// without cgo, since a cgo binary cannot enter a jail.
func childBinary(t *testing.T) string {
	t.Helper()
	if !raceEnabled {
		return os.Args[0]
	}
	out := filepath.Join(t.TempDir(), "jail-child.test")
	cmd := exec.Command(filepath.Join(runtime.GOROOT(), "bin", "go"), "test", "-c", "-o", out, ".")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build a child without cgo: %v\n%s", err, b)
	}
	return out
}

// statusField returns a /proc/PID/status field's value, trimmed.
func statusField(st, name string) string {
	for _, l := range strings.Split(st, "\n") {
		if v, ok := strings.CutPrefix(l, name+":"); ok {
			return strings.TrimSpace(v)
		}
	}
	return "(none)"
}

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Getuid() != 0 {
		t.Fatal("the jail tests need root (namespaces, mounts, setresuid); run them as root")
	}
}
