package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kilnvm/kiln/daemon/client"
	"github.com/kilnvm/kiln/daemon/kilnpb"
	"github.com/kilnvm/kiln/image"
	"github.com/kilnvm/kiln/image/imagetest"
	"github.com/kilnvm/kiln/internal/kvmtest"
)

// kilndProc is kilnd run as a process of its own over the real backend:
// this test binary as kilnd (TestMain, testKilndEnv=real), whose sandboxes
// run in VMM processes of this same binary (TestMain, vmmproc.SocketEnv).
type kilndProc struct {
	t    *testing.T
	sock string
	args []string
	logs string   // the folder of the daemons' logs, one file a start
	env  []string // added to the next start's environment

	cmd  *exec.Cmd
	done chan struct{} // closed once cmd has been waited for
	err  error         // cmd.Wait's, once done is closed
	n    int           // starts so far

	mu   sync.Mutex
	pids map[int32]bool // every VMM process seen, killed at the end
}

// start runs kilnd and returns once its socket serves, with a client.
func (k *kilndProc) start(ctx context.Context) *client.Client {
	k.t.Helper()
	k.n++
	logPath := filepath.Join(k.logs, fmt.Sprintf("kilnd-%d.log", k.n))
	logf, err := os.Create(logPath)
	if err != nil {
		k.t.Fatal(err)
	}
	defer logf.Close() // the child has its own descriptor
	self, err := os.Executable()
	if err != nil {
		k.t.Fatal(err)
	}
	k.cmd = exec.Command(self, k.args...)
	k.cmd.Env = append(append(os.Environ(), testKilndEnv+"="+testKilndReal), k.env...)
	k.cmd.Stdout, k.cmd.Stderr = logf, logf
	if err := k.cmd.Start(); err != nil {
		k.t.Fatalf("starting kilnd: %v", err)
	}
	k.done = make(chan struct{})
	go func(cmd *exec.Cmd, done chan struct{}) {
		k.err = cmd.Wait()
		close(done)
	}(k.cmd, k.done)
	for {
		c, err := client.Dial(ctx, "unix:"+k.sock)
		if err == nil {
			return c
		}
		select {
		case <-k.done:
			k.t.Fatalf("kilnd exited before serving: %v\n%s", k.err, readTail(logPath))
		case <-ctx.Done():
			k.t.Fatalf("kilnd never served on %s: %v\n%s", k.sock, err, readTail(logPath))
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// wait waits for the running kilnd to exit and returns how it did.
func (k *kilndProc) wait(timeout time.Duration) error {
	k.t.Helper()
	select {
	case <-k.done:
		return k.err
	case <-time.After(timeout):
		k.t.Fatalf("kilnd %d still runs after %v", k.cmd.Process.Pid, timeout)
		return nil
	}
}

// track notes sandboxes' VMM processes, for the cleanup of a failed test.
func (k *kilndProc) track(sbs ...*kilnpb.Sandbox) {
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, sb := range sbs {
		if sb.GetPid() > 0 {
			k.pids[sb.GetPid()] = true
		}
	}
}

// cleanup kills what a failed test left: kilnd and every VMM process,
// and shows the daemons' logs.
func (k *kilndProc) cleanup() {
	if k.cmd != nil {
		select {
		case <-k.done:
		default:
			k.cmd.Process.Kill()
			<-k.done
		}
	}
	k.mu.Lock()
	for pid := range k.pids {
		syscall.Kill(int(pid), syscall.SIGKILL)
	}
	k.mu.Unlock()
	if k.t.Failed() {
		for i := 1; i <= k.n; i++ {
			p := filepath.Join(k.logs, fmt.Sprintf("kilnd-%d.log", i))
			k.t.Logf("%s:\n%s", filepath.Base(p), readTail(p))
		}
	}
}

// readTail returns the last lines of a log file.
func readTail(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(lines) > 40 {
		lines = lines[len(lines)-40:]
	}
	return strings.Join(lines, "\n")
}

// vmmAlive reports whether a VMM process runs: it exists and is not a
// zombie (which no kilnd reaps once the one that started it is dead).
func vmmAlive(pid int32) bool {
	if syscall.Kill(int(pid), 0) != nil {
		return false
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	i := bytes.LastIndexByte(b, ')')
	return i >= 0 && i+2 < len(b) && b[i+2] != 'Z'
}

// leftovers lists what destroyed sandboxes may not leave in kilnd's state
// folder: a sandbox's folder (its sockets, its VMM log) or a checkpoint
// (its record or its folder). The records of ended sandboxes stay.
func leftovers(t *testing.T, state string) []string {
	t.Helper()
	var left []string
	for _, d := range []string{"sandboxes", "checkpoints"} {
		ents, err := os.ReadDir(filepath.Join(state, d))
		if err != nil {
			t.Fatalf("reading kilnd's state folder: %v", err)
		}
		for _, e := range ents {
			if d == "checkpoints" || e.IsDir() {
				left = append(left, filepath.Join(d, e.Name()))
			}
		}
	}
	return left
}

// sh runs script in a sandbox and returns its output, trimmed.
func sh(t *testing.T, ctx context.Context, c *client.Client, id, script string) string {
	t.Helper()
	var stdout, stderr bytes.Buffer
	res, err := c.Exec(ctx, id, client.ExecOptions{Argv: []string{"sh", "-c", script}, Stdout: &stdout, Stderr: &stderr})
	if err != nil {
		t.Fatalf("sandbox %s: %q: %v", id, script, err)
	}
	if res.ExitCode != 0 {
		t.Fatalf("sandbox %s: %q exited %d: %s", id, script, res.ExitCode, stderr.String())
	}
	return strings.TrimSpace(stdout.String())
}

// kvmWatchdogUsec is TestKVMKilnd's WATCHDOG_USEC: a ping every second.
const kvmWatchdogUsec = 2000000

// TestKVMKilnd is issue 11's must-show on (emulated) KVM, with kilnd a
// real process: kill -9 of kilnd leaves its sandboxes' VMM processes
// running, and the next kilnd over the same state folder and socket lists
// every sandbox with the same ID, state and process, runs execs in them,
// resumes the paused one, and forks a checkpoint taken before the kill;
// a kilnd under systemd's notify protocol says READY=1 with its count of
// sandboxes, and once wedged is killed by its watchdog (SIGABRT) without
// them, and the next kilnd adopts them again; destroying them all leaves
// no VMM process and no folder, and kilnd stopped with SIGTERM exits 0 and
// removes its socket.
func TestKVMKilnd(t *testing.T) {
	kvmtest.Require(t)
	began := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	kvmtest.Kernel(t) // kilnd finds the same cached kernel itself
	agent := kvmtest.AgentBinary(t)

	// busybox, pulled from an in-process registry into kilnd's images
	// folder; the VMM processes fetch its chunks from the registry too.
	_, refs := imagetest.ServeLayout(t, kvmtest.TestImages(t), "kiln/test")
	images := t.TempDir()
	im, err := image.NewRoots(image.Options{}).Images(images)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := im.Pull(ctx, refs["busybox"], image.PullOptions{}); err != nil {
		t.Fatalf("pull busybox: %v", err)
	}

	// A short folder: the sandboxes' Unix sockets live under it.
	dir, err := os.MkdirTemp("", "kd-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	state := filepath.Join(dir, "state")
	// kilnd jails every VMM process (as its default does for a root kilnd
	// with a cgo-free kiln; --jail=true makes it certain): kiln built
	// without cgo, an id folder of the test's own.
	vmmBin := kvmtest.VMMBinary(t)
	// kilnd's delegated cgroup, as systemd's Delegate=yes would make it:
	// every sandbox's VMM process gets a cgroup below it.
	if err := os.WriteFile("/sys/fs/cgroup/cgroup.subtree_control", []byte("+cpu +memory +pids +io"), 0); err != nil {
		t.Fatalf("enabling L1's cgroup controllers: %v", err)
	}
	cgRoot, err := os.MkdirTemp("/sys/fs/cgroup", "kilnd-test-")
	if err != nil {
		t.Fatalf("a cgroup for kilnd (L1 mounts cgroup2 at /sys/fs/cgroup): %v", err)
	}
	t.Cleanup(func() { removeCgroupTree(t, cgRoot) })
	k := &kilndProc{t: t, sock: filepath.Join(dir, "kilnd.sock"), logs: t.TempDir(), pids: map[int32]bool{},
		args: []string{"--listen", "unix:" + filepath.Join(dir, "kilnd.sock"), "--state-dir", state,
			"--images", images, "--agent", agent, "--vmm", vmmBin, "--jail=true", "--jail-ids", t.TempDir(), "--cgroup-root", cgRoot}}
	t.Cleanup(k.cleanup)

	startAt := time.Now()
	c := k.start(ctx)
	defer func() { c.Close() }()
	t.Logf("kilnd %d serving after %v (its own start: %v)", k.cmd.Process.Pid, time.Since(began).Round(time.Millisecond), time.Since(startAt).Round(time.Millisecond))

	// Three image-rooted sandboxes, made at once.
	sbs := make([]*kilnpb.Sandbox, 3)
	errs := make([]error, len(sbs))
	var wg sync.WaitGroup
	for i := range sbs {
		wg.Go(func() {
			sbs[i], errs[i] = c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{
				Source: &kilnpb.CreateSandboxRequest_Image{Image: refs["busybox"]}})
		})
	}
	wg.Wait()
	k.track(sbs...)
	if err := errors.Join(errs...); err != nil {
		t.Fatalf("create: %v", err)
	}
	for _, sb := range sbs {
		t.Logf("sandbox %s ready in %d ms (VMM process %d)", sb.GetId(), sb.GetReadyMs(), sb.GetPid())
		// Its VMM process was born in a cgroup of its own, under kilnd's.
		cg := sb.GetCgroup()
		if !strings.HasPrefix(cg, cgRoot+"/") {
			t.Errorf("sandbox %s: cgroup %q, want one under %s", sb.GetId(), cg, cgRoot)
		}
		if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", sb.GetPid())); err != nil || strings.TrimSpace(string(b)) != "0::"+strings.TrimPrefix(cg, "/sys/fs/cgroup") {
			t.Errorf("sandbox %s: VMM process %d is in %q (%v), want %s", sb.GetId(), sb.GetPid(), b, err, cg)
		}
		// Jailed: no privileges, a uid of its own.
		if st, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", sb.GetPid())); err != nil ||
			!strings.Contains(string(st), "\nNoNewPrivs:\t1\n") || !strings.Contains(string(st), "\nCapEff:\t0000000000000000\n") || strings.Contains(string(st), "\nUid:\t0\t") {
			t.Errorf("sandbox %s: VMM process %d is not jailed (%v):\n%s", sb.GetId(), sb.GetPid(), err, st)
		}
	}
	t.Logf("3 sandboxes after %v", time.Since(began).Round(time.Millisecond))
	paused, written, plain := sbs[0], sbs[1], sbs[2]

	if _, err := c.PauseSandbox(ctx, paused.GetId()); err != nil {
		t.Fatal(err)
	}
	sh(t, ctx, c, written.GetId(), "echo before-kill > /kd")
	ck, err := c.Checkpoint(ctx, written.GetId(), client.CheckpointOptions{})
	if err != nil {
		t.Fatal(err)
	}
	sh(t, ctx, c, written.GetId(), "echo after-checkpoint > /kd2")
	before, err := c.ListSandboxes(ctx, client.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	c.Close()

	// kill -9: nothing of kilnd's shutdown runs, its socket stays behind,
	// and the VMM processes, each in a process group of its own, run on.
	killed := k.cmd.Process.Pid
	if err := k.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	var exit *exec.ExitError
	if err := k.wait(time.Minute); !errors.As(err, &exit) || exit.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Fatalf("kilnd after kill -9: %v; want killed by SIGKILL", err)
	}
	for _, sb := range sbs {
		if !vmmAlive(sb.GetPid()) {
			t.Fatalf("sandbox %s: its VMM process %d died with kilnd", sb.GetId(), sb.GetPid())
		}
	}
	if fi, err := os.Stat(k.sock); err != nil || fi.Mode()&os.ModeSocket == 0 {
		t.Fatalf("kilnd's socket after kill -9: %v, %v; want it left behind, for the next kilnd to replace", fi, err)
	}

	// The next kilnd, on the same state folder and socket, as systemd
	// runs it (Type=notify, WatchdogSec=2s): READY=1 once it serves.
	ns := newNotifySocket(t, dir)
	k.env = []string{"NOTIFY_SOCKET=" + ns.path, fmt.Sprintf("WATCHDOG_USEC=%d", kvmWatchdogUsec)}
	restarted := time.Now()
	c = k.start(ctx)
	if ready, _ := ns.until("READY=1", 2*time.Minute); !slices.Contains(ready, "STATUS=serving: 3 sandboxes") {
		t.Errorf("READY=1 of the kilnd that adopted 3 sandboxes came with %q; want STATUS=serving: 3 sandboxes", ready)
	}
	t.Logf("kilnd %d (after kill -9 of %d) serving after %v", k.cmd.Process.Pid, killed, time.Since(restarted).Round(time.Millisecond))
	after, err := c.ListSandboxes(ctx, client.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(after) != len(before) {
		t.Fatalf("after the restart %d sandboxes %v; before %d %v", len(after), after, len(before), before)
	}
	for _, b := range before {
		i := slices.IndexFunc(after, func(a *kilnpb.Sandbox) bool { return a.GetId() == b.GetId() })
		if i < 0 {
			t.Fatalf("sandbox %s is not listed after the restart: %v", b.GetId(), after)
		}
		a := after[i]
		if a.GetState() != b.GetState() || a.GetPid() != b.GetPid() {
			t.Errorf("sandbox %s: %s, VMM process %d after the restart; %s, %d before", a.GetId(), a.GetState(), a.GetPid(), b.GetState(), b.GetPid())
		}
		want := kilnpb.SandboxState_SANDBOX_STATE_RUNNING
		if a.GetId() == paused.GetId() {
			want = kilnpb.SandboxState_SANDBOX_STATE_PAUSED
		}
		if a.GetState() != want {
			t.Errorf("sandbox %s is %s after the restart; want %s", a.GetId(), a.GetState(), want)
		}
	}
	if got := sh(t, ctx, c, written.GetId(), "cat /kd /kd2"); got != "before-kill\nafter-checkpoint" {
		t.Errorf("sandbox %s after the restart: %q; want its files", written.GetId(), got)
	}
	if got := sh(t, ctx, c, plain.GetId(), "echo $((6*7))"); got != "42" {
		t.Errorf("sandbox %s after the restart: %q", plain.GetId(), got)
	}
	// Files of the image it never read: their chunks are fetched by this
	// kilnd for the jailed VMM process (the last kilnd served its chunk
	// socket until the kill).
	if got := sh(t, ctx, c, plain.GetId(), "cat $(find / -xdev -type f ! -path '/proc/*' ! -path '/sys/*' 2>/dev/null) >/dev/null && echo read"); got != "read" {
		t.Errorf("sandbox %s: reading the image's files after the restart: %q", plain.GetId(), got)
	}
	if sb, err := c.ResumeSandbox(ctx, paused.GetId()); err != nil || sb.GetState() != kilnpb.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("resume %s after the restart: %v, %v", paused.GetId(), sb, err)
	}
	if got := sh(t, ctx, c, paused.GetId(), "echo resumed"); got != "resumed" {
		t.Errorf("sandbox %s resumed after the restart: %q", paused.GetId(), got)
	}

	// The checkpoint from before the kill forks: the child has the file
	// written before it, not the one after.
	var kids []*kilnpb.Sandbox
	for sb, err := range c.Fork(ctx, &kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_CheckpointId{CheckpointId: ck.GetId()}, Count: 1}) {
		if err != nil {
			t.Fatalf("fork of checkpoint %s from before the kill: %v", ck.GetId(), err)
		}
		kids = append(kids, sb)
	}
	k.track(kids...)
	if len(kids) != 1 {
		t.Fatalf("fork of checkpoint %s: %d children; want 1", ck.GetId(), len(kids))
	}
	if got := sh(t, ctx, c, kids[0].GetId(), "cat /kd; test -e /kd2 && echo kd2 || echo no-kd2"); got != "before-kill\nno-kd2" {
		t.Errorf("fork child %s of checkpoint %s: %q; want before-kill, no-kd2", kids[0].GetId(), ck.GetId(), got)
	}
	t.Logf("after the restart, execs, resume and fork (child ready in %d ms) took %v", kids[0].GetReadyMs(), time.Since(restarted).Round(time.Millisecond))

	// systemd's watchdog: a wedged kilnd (SIGSTOP) stops pinging and gets
	// WatchdogSignal=SIGABRT (then SIGCONT); the sandboxes run on, and the
	// kilnd systemd restarts adopts them.
	c.Close()
	ns.until("WATCHDOG=1", time.Minute)
	wedged := k.cmd.Process.Pid
	if err := syscall.Kill(wedged, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(time.Minute); processState(wedged) != 'T'; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("kilnd %d is not stopped: state %c", wedged, processState(wedged))
		}
	}
	for ns.next(50*time.Millisecond) != nil {
	}
	for end := time.Now().Add(2 * kvmWatchdogUsec * time.Microsecond); time.Now().Before(end); {
		if m := ns.next(time.Until(end)); m != nil {
			t.Fatalf("a stopped kilnd sent %q", m)
		}
	}
	syscall.Kill(wedged, syscall.SIGABRT)
	syscall.Kill(wedged, syscall.SIGCONT)
	if err := k.wait(time.Minute); !errors.As(err, &exit) || exit.Success() {
		t.Fatalf("kilnd after the watchdog's SIGABRT: %v; want it dead", err)
	}
	all := append(slices.Clone(kids), sbs...)
	for _, sb := range all {
		if !vmmAlive(sb.GetPid()) {
			t.Fatalf("sandbox %s: its VMM process %d died with the wedged kilnd", sb.GetId(), sb.GetPid())
		}
	}
	k.env = nil
	aborted := time.Now()
	c = k.start(ctx)
	if live, err := c.ListSandboxes(ctx, client.ListOptions{}); err != nil || len(live) != len(all) {
		t.Fatalf("after the watchdog's SIGABRT the next kilnd lists %v, %v; want %d sandboxes", live, err, len(all))
	}
	if got := sh(t, ctx, c, kids[0].GetId(), "cat /kd"); got != "before-kill" {
		t.Errorf("fork child %s after the watchdog restart: %q", kids[0].GetId(), got)
	}
	t.Logf("watchdog kill of kilnd %d, restart, list and exec took %v", wedged, time.Since(aborted).Round(time.Millisecond))

	// Destroy them all, the fork child first: no VMM process, socket or
	// folder is left, nor the checkpoint, which was its sandbox's.
	destroying := time.Now()
	for _, sb := range append(kids, sbs...) {
		if err := c.DestroySandbox(ctx, sb.GetId()); err != nil {
			t.Errorf("destroy %s: %v", sb.GetId(), err)
		}
	}
	for _, sb := range append(kids, sbs...) {
		deadline := time.Now().Add(10 * time.Second)
		for vmmAlive(sb.GetPid()) && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		if vmmAlive(sb.GetPid()) {
			t.Errorf("sandbox %s: VMM process %d runs after its destroy", sb.GetId(), sb.GetPid())
		}
	}
	t.Logf("4 destroys took %v", time.Since(destroying).Round(time.Millisecond))
	if live, err := c.ListSandboxes(ctx, client.ListOptions{}); err != nil || len(live) != 0 {
		t.Errorf("live sandboxes after destroying all: %v, %v", live, err)
	}
	if left := leftovers(t, state); len(left) > 0 {
		t.Errorf("left after destroying all: %v", left)
	}
	c.Close()

	// SIGTERM, as systemd stops it: exit 0, the socket gone.
	if err := k.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := k.wait(time.Minute); err != nil {
		t.Errorf("kilnd after SIGTERM: %v; want exit 0", err)
	}
	if _, err := os.Stat(k.sock); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("kilnd's socket after SIGTERM: %v; want it removed", err)
	}
	t.Logf("TestKVMKilnd took %v", time.Since(began).Round(time.Millisecond))
}

// removeCgroupTree removes a cgroup folder and those below it, deepest
// first, killing what still runs in them.
func removeCgroupTree(t *testing.T, root string) {
	var dirs []string
	filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			dirs = append(dirs, p)
		}
		return nil
	})
	slices.Reverse(dirs)
	for _, d := range dirs {
		os.WriteFile(filepath.Join(d, "cgroup.kill"), []byte("1"), 0)
		deadline := time.Now().Add(10 * time.Second)
		for {
			err := os.Remove(d)
			if err == nil || errors.Is(err, os.ErrNotExist) {
				break
			}
			if time.Now().After(deadline) {
				t.Errorf("removing cgroup %s: %v", d, err)
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
}
