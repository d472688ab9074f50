package shim_test

import (
	"archive/tar"
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/kilnvm/kiln/guest/client"
	"github.com/kilnvm/kiln/internal/kvmtest"
	"github.com/kilnvm/kiln/sandbox"
	"github.com/kilnvm/kiln/shim"
)

// Under emulated KVM a VM boots in tens of seconds; none of these bounds
// is a speed asserted.
const (
	ctrTimeout  = 4 * time.Minute
	testImage   = "docker.io/library/busybox:latest"
	testNS      = "kilntest"
	shimBinName = "containerd-shim-kiln-v2"
)

// ctrd is a containerd started by a test, with its own config, root,
// state and socket.
type ctrd struct {
	t    testing.TB
	dir  string
	sock string
	cmd  *exec.Cmd
	log  *bytes.Buffer
	logM *sync.Mutex
	// runBefore is what shim.DefaultRunDir held before the test: VM
	// folders the test leaves are the others.
	runBefore map[string]bool
}

func runDirEntries() map[string]bool {
	ents, _ := os.ReadDir(shim.DefaultRunDir)
	m := map[string]bool{}
	for _, e := range ents {
		m[e.Name()] = true
	}
	return m
}

// syncBuffer is a bytes.Buffer safe for the process's writes and the
// test's reads.
type syncBuffer struct {
	mu *sync.Mutex
	b  *bytes.Buffer
}

func (s syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func (c *ctrd) logs() string {
	c.logM.Lock()
	defer c.logM.Unlock()
	return c.log.String()
}

// startContainerd starts containerd (Debian's package) with the shim on
// its PATH and the shim's config in its environment, and waits for it.
// With private, containerd runs in mount and network namespaces of its
// own: a tmpfs on /var/lib (the CNI plugins and libcni keep their state
// under /var/lib/cni, which no config moves, and in the harness's L1 the
// host's / is read-only), and the CNI bridge, its addresses and the
// pods' namespaces in a network the test made (run crictl there with
// c.inNetns).
func startContainerd(t testing.TB, shimCfg string, extra string, private bool, disable ...string) *ctrd {
	t.Helper()
	bin, err := exec.LookPath("containerd")
	if err != nil {
		t.Fatalf("containerd: %v (make deps installs Debian's containerd)", err)
	}
	dir := t.TempDir()
	binDir := filepath.Join(dir, "bin")
	if err := os.MkdirAll(binDir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(kvmtest.ShimBinary(t), filepath.Join(binDir, shimBinName)); err != nil {
		t.Fatal(err)
	}
	c := &ctrd{t: t, dir: dir, sock: filepath.Join(dir, "containerd.sock"), log: &bytes.Buffer{}, logM: &sync.Mutex{}, runBefore: runDirEntries()}
	var disabled string
	for _, p := range append([]string{"io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
		"io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs", "io.containerd.tracing.processor.v1.otlp"}, disable...) {
		if disabled != "" {
			disabled += ", "
		}
		disabled += strconv.Quote(p)
	}
	cfg := fmt.Sprintf(`version = 2
root = %q
state = %q
disabled_plugins = [%s]
[grpc]
  address = %q
[ttrpc]
  address = %q
[debug]
  level = "info"
%s
`, filepath.Join(dir, "root"), filepath.Join(dir, "state"), disabled, c.sock, c.sock+".ttrpc", extra)
	cfgPath := filepath.Join(dir, "config.toml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	c.cmd = exec.Command(bin, "--config", cfgPath)
	if private {
		unshare, err := exec.LookPath("unshare")
		if err != nil {
			t.Fatalf("unshare (util-linux): %v", err)
		}
		c.cmd = exec.Command(unshare, "--mount", "--net", "--propagation", "private", "--", "sh", "-c",
			`mount -t tmpfs -o size=64m,mode=0755 kiln-test-varlib /var/lib && ip link set lo up && exec "$0" "$@"`, bin, "--config", cfgPath)
	}
	c.cmd.Env = append(os.Environ(), "PATH="+binDir+":"+os.Getenv("PATH"), shim.ConfigEnv+"="+shimCfg)
	w := syncBuffer{c.logM, c.log}
	c.cmd.Stdout, c.cmd.Stderr = w, w
	c.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := c.cmd.Start(); err != nil {
		t.Fatalf("starting containerd: %v", err)
	}
	exited := make(chan struct{})
	go func() { c.cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		c.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(30 * time.Second):
			c.cmd.Process.Kill()
			<-exited
		}
		if t.Failed() {
			t.Logf("containerd's log:\n%s", tail(c.logs(), 8000))
		}
		// Shims outlive containerd by design: a failed test's leave its
		// VMs running, which would fail the harness's retry in the same
		// L1. Kill them (a passing test has none: checkClean).
		for _, p := range shimProcs() {
			if strings.Contains(p, " -address "+c.sock+" ") || strings.HasSuffix(p, " -address "+c.sock) {
				pid, _, _ := strings.Cut(p, " ")
				if n, err := strconv.Atoi(pid); err == nil {
					syscall.Kill(n, syscall.SIGKILL)
					t.Logf("killed a shim left running: %s", p)
				}
			}
		}
		// containerd's root holds snapshots mounted read-only by the
		// snapshotter: unmount what is left before TempDir's removal.
		for _, m := range c.mountsUnder(dir) {
			syscall.Unmount(m, syscall.MNT_DETACH)
		}
	})
	start := time.Now()
	for {
		if _, err := os.Stat(c.sock); err == nil {
			if _, err := c.ctr(context.Background(), nil, "version"); err == nil {
				break
			}
		}
		select {
		case <-exited:
			t.Fatalf("containerd exited at start; its log:\n%s", tail(c.logs(), 8000))
		default:
		}
		if time.Since(start) > 2*time.Minute {
			t.Fatalf("containerd did not answer within 2 minutes; its log:\n%s", tail(c.logs(), 8000))
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Logf("containerd up after %v", time.Since(start).Round(time.Millisecond))
	return c
}

// stdinFlag is what ctr run needs to pass its stdin on: -i where this
// ctr has it (1.7 and later), nothing where stdin is always passed (1.6).
func (c *ctrd) stdinFlag() []string {
	out, _ := exec.Command("ctr", "run", "--help").CombinedOutput()
	if strings.Contains(string(out), "--stdin") || strings.Contains(string(out), " -i ") || strings.Contains(string(out), ", -i") {
		return []string{"-i"}
	}
	return nil
}

// ctrResult is one ctr command's outcome.
type ctrResult struct {
	stdout, stderr string
	code           int
}

// ctr runs ctr against c in the test namespace; a non-zero exit is not an
// error (code says it), a failure to run it is.
func (c *ctrd) ctr(ctx context.Context, stdin []byte, args ...string) (ctrResult, error) {
	ctx, cancel := context.WithTimeout(ctx, ctrTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, "ctr", append([]string{"--address", c.sock, "--namespace", testNS}, args...)...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	err := cmd.Run()
	r := ctrResult{stdout: out.String(), stderr: errb.String()}
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee) && ctx.Err() == nil:
		r.code = ee.ExitCode()
	case err != nil:
		return r, fmt.Errorf("ctr %s: %w (stderr: %s)", strings.Join(args, " "), err, r.stderr)
	}
	return r, nil
}

// must runs ctr and fails the test unless it exits 0.
func (c *ctrd) must(args ...string) string {
	c.t.Helper()
	r, err := c.ctr(context.Background(), nil, args...)
	if err == nil && r.code != 0 {
		err = fmt.Errorf("ctr %s: exit %d: %s%s", strings.Join(args, " "), r.code, r.stdout, r.stderr)
	}
	if err != nil {
		c.t.Fatalf("%v\ncontainerd's log:\n%s", err, tail(c.logs(), 4000))
	}
	return r.stdout
}

func tail(s string, n int) string {
	if len(s) > n {
		return "..." + s[len(s)-n:]
	}
	return s
}

// mountsUnder lists the mount points under dir, deepest first, as
// containerd (and so its shims) sees them: its mount namespace may be its
// own.
func (c *ctrd) mountsUnder(dir string) []string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", c.cmd.Process.Pid))
	if err != nil {
		b, err = os.ReadFile("/proc/self/mountinfo")
	}
	if err != nil {
		return nil
	}
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) > 4 && (f[4] == dir || strings.HasPrefix(f[4], dir+"/")) {
			out = append([]string{f[4]}, out...)
		}
	}
	return out
}

// shimConfig writes the shim's config: this tree's agent and the cached
// kernel, a small VM.
func shimConfig(t testing.TB) (string, sandbox.Runtime) {
	t.Helper()
	rt, err := sandbox.NewRuntime(sandbox.RuntimeConfig{Kernel: kvmtest.Kernel(t), Agent: kvmtest.AgentBinary(t), CacheDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(t.TempDir(), "shim.toml")
	cfg := fmt.Sprintf("kernel = %q\ninitrd = %q\ncpus = 1\nmemory_mib = 256\nboot_timeout = \"4m\"\n", rt.Kernel, rt.Initrd)
	if err := os.WriteFile(p, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	return p, rt
}

// shimProcs lists the running shim processes.
func shimProcs() []string {
	ents, _ := os.ReadDir("/proc")
	var out []string
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		// containerd starts shimBinName from PATH; the shim's server is
		// its os.Executable, the build's own name (ShimBinary's).
		if argv0, _, _ := strings.Cut(string(b), "\x00"); strings.HasPrefix(filepath.Base(argv0), shimBinName) {
			out = append(out, e.Name()+" "+strings.ReplaceAll(string(b), "\x00", " "))
		}
	}
	return out
}

// checkClean fails t if a shim process, a mount of a bundle or a bundle
// folder of the test namespace is left (a VM lives in its shim process).
func (c *ctrd) checkClean(t testing.TB, what string) {
	t.Helper()
	checkCleanNS(t, c, testNS, what)
}

func checkCleanNS(t testing.TB, c *ctrd, ns, what string) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		procs := shimProcs()
		bundles, _ := filepath.Glob(filepath.Join(c.dir, "state", "io.containerd.runtime.v2.task", ns, "*"))
		var mounts []string
		for _, m := range c.mountsUnder(filepath.Join(c.dir, "state")) {
			mounts = append(mounts, m)
		}
		var vmDirs []string
		for name := range runDirEntries() {
			if !c.runBefore[name] {
				vmDirs = append(vmDirs, name)
			}
		}
		if len(procs) == 0 && len(bundles) == 0 && len(mounts) == 0 && len(vmDirs) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("after %s, in namespace %s: left behind: shim processes %q, bundles %q, mounts %q, VM folders in %s %q",
				what, ns, procs, bundles, mounts, shim.DefaultRunDir, vmDirs)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// TestKVMShimCtr drives the shim through a real containerd with ctr: the
// issue's must-shows for stdio, exit codes, the guest kernel, stdin,
// exec, kill and events, refused specs, and that nothing is left after
// each.
func TestKVMShimCtr(t *testing.T) {
	kvmtest.Require(t)
	if _, err := exec.LookPath("ctr"); err != nil {
		t.Fatalf("ctr: %v (make deps installs Debian's containerd)", err)
	}
	cfgPath, _ := shimConfig(t)
	c := startContainerd(t, cfgPath, "", false, "io.containerd.grpc.v1.cri")
	archive := filepath.Join(t.TempDir(), "busybox.tar")
	if err := os.WriteFile(archive, kvmtest.BusyboxArchive(t, testImage), 0o644); err != nil {
		t.Fatal(err)
	}
	c.must("images", "import", archive)
	run := func(stdin []byte, args ...string) ctrResult {
		t.Helper()
		start := time.Now()
		r, err := c.ctr(context.Background(), stdin, append([]string{"run", "--rm", "--runtime", shim.RuntimeName}, args...)...)
		if err != nil {
			t.Fatalf("%v\ncontainerd's log:\n%s", err, tail(c.logs(), 4000))
		}
		t.Logf("ctr run %s: exit %d after %v", strings.Join(args, " "), r.code, time.Since(start).Round(time.Millisecond))
		return r
	}

	t.Run("stdio and exit code", func(t *testing.T) {
		r := run(nil, testImage, "t1", "sh", "-c", "echo out; echo err >&2; exit 3")
		if r.stdout != "out\n" || r.stderr != "err\n" || r.code != 3 {
			t.Fatalf("ctr run: stdout %q, stderr %q, exit %d; want \"out\\n\", \"err\\n\", 3\ncontainerd's log:\n%s", r.stdout, r.stderr, r.code, tail(c.logs(), 4000))
		}
		c.checkClean(t, "t1")
	})

	t.Run("stdin and the guest kernel", func(t *testing.T) {
		hostCmdline, err := os.ReadFile("/proc/cmdline")
		if err != nil {
			t.Fatal(err)
		}
		// ctr 1.6 (Debian 12's) connects stdin to every ctr run that is
		// not detached and has no -i; later ones ask for it with -i.
		r := run([]byte("hi\n"), append(c.stdinFlag(), testImage, "t2", "sh", "-c", "cat; uname -r; cat /proc/cmdline")...)
		lines := strings.Split(strings.TrimRight(r.stdout, "\n"), "\n")
		if r.code != 0 || len(lines) != 3 {
			t.Fatalf("ctr run -i: exit %d, stdout %q, stderr %q; want 3 lines", r.code, r.stdout, r.stderr)
		}
		if lines[0] != "hi" {
			t.Errorf("stdin: cat printed %q, want hi", lines[0])
		}
		if want := kvmtest.Kernel(t).Version; lines[1] != want {
			t.Errorf("uname -r in the container: %q, want the guest kernel's %q", lines[1], want)
		}
		// The guest kernel may be the same build as the host's (both
		// Debian's): its command line is Kiln's, not the host's.
		if !strings.Contains(lines[2], "kiln.root=9p:") || lines[2] == strings.TrimSpace(string(hostCmdline)) {
			t.Errorf("/proc/cmdline in the container: %q; want the Kiln guest's (kiln.root=9p:...), not the host's %q", lines[2], hostCmdline)
		}
		c.checkClean(t, "t2")
	})

	t.Run("exec, kill and events", func(t *testing.T) {
		evCtx, stopEvents := context.WithCancel(context.Background())
		defer stopEvents()
		ev := exec.CommandContext(evCtx, "ctr", "--address", c.sock, "events")
		evOut := syncBuffer{&sync.Mutex{}, &bytes.Buffer{}}
		ev.Stdout = evOut
		if err := ev.Start(); err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Second) // subscribed before the container is made
		c.must("run", "-d", "--runtime", shim.RuntimeName, testImage, "t4", "sleep", "600")
		r, err := c.ctr(context.Background(), nil, "task", "exec", "--exec-id", "e1", "t4", "sh", "-c", "echo from-exec; exit 5")
		if err != nil || r.stdout != "from-exec\n" || r.code != 5 {
			t.Fatalf("ctr task exec: %v, stdout %q, stderr %q, exit %d; want from-exec and exit 5", err, r.stdout, r.stderr, r.code)
		}
		if logShimRSS(t) == 0 {
			t.Errorf("no shim process found while t4 runs: %q", shimProcs())
		}
		ps := c.must("task", "ps", "t4")
		if !strings.Contains(ps, "PID") {
			t.Errorf("ctr task ps: %q", ps)
		}
		c.must("task", "kill", "-s", "KILL", "t4")
		deadline := time.Now().Add(time.Minute)
		for {
			ls := c.must("task", "ls")
			if strings.Contains(ls, "STOPPED") {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("t4 not stopped a minute after SIGKILL: %s", ls)
			}
			time.Sleep(200 * time.Millisecond)
		}
		c.must("task", "rm", "t4")
		c.must("container", "rm", "t4")
		c.checkClean(t, "t4")
		time.Sleep(time.Second)
		stopEvents()
		ev.Wait()
		got := map[string]bool{}
		var exit137 bool
		sc := bufio.NewScanner(strings.NewReader(evOut.String()))
		for sc.Scan() {
			l := sc.Text()
			if !strings.Contains(l, `"t4"`) {
				continue
			}
			for _, topic := range []string{"/tasks/create", "/tasks/start", "/tasks/exit", "/tasks/delete", "/tasks/exec-added", "/tasks/exec-started"} {
				if strings.Contains(l, " "+topic+" ") {
					got[topic] = true
					if topic == "/tasks/exit" && strings.Contains(l, `"id":"t4"`) && strings.Contains(l, `"exit_status":137`) {
						exit137 = true
					}
				}
			}
		}
		for _, topic := range []string{"/tasks/create", "/tasks/start", "/tasks/exec-added", "/tasks/exec-started", "/tasks/exit", "/tasks/delete"} {
			if !got[topic] {
				t.Errorf("ctr events: no %s event for t4", topic)
			}
		}
		if !exit137 {
			t.Errorf("ctr events: no exit of t4 with status 137 (128+SIGKILL)")
		}
		if t.Failed() {
			t.Logf("ctr events:\n%s", evOut.String())
		}
	})

	// Checkpoint and restore, the shim's path to fork: ctr checkpoints a
	// running container (its task paused around it) into a checkpoint
	// image, the original goes on, and a container restored from the
	// checkpoint has the VM as it was then, its init process included:
	// the restored task takes over the checkpointed process (the same
	// guest PID, not started again: /tmp/boots, a line per start, holds
	// the one line) and does not see the original's change after the
	// checkpoint.
	t.Run("checkpoint and restore", func(t *testing.T) {
		const ref = "kiln.test/checkpoint:tc"
		t.Cleanup(func() {
			if t.Failed() { // what a failure left: the retry must find none
				for _, id := range []string{"tc", "tr"} {
					c.ctr(context.Background(), nil, "task", "kill", "-s", "KILL", id)
					time.Sleep(time.Second)
					c.ctr(context.Background(), nil, "task", "rm", "-f", id)
					c.ctr(context.Background(), nil, "container", "rm", id)
				}
			}
		})
		c.must("run", "-d", "--runtime", shim.RuntimeName, testImage, "tc", "sh", "-c", "echo boot >> /tmp/boots; exec sleep 600")
		read := func(id, execID string) string {
			t.Helper()
			r, err := c.ctr(context.Background(), nil, "task", "exec", "--exec-id", execID, id, "cat", "/tmp/boots")
			if err != nil {
				t.Fatal(err)
			}
			return strings.Join(strings.Fields(r.stdout), " ")
		}
		deadline := time.Now().Add(time.Minute)
		for read("tc", fmt.Sprintf("w%d", time.Now().UnixNano())) != "boot" {
			if time.Now().After(deadline) {
				t.Fatal("tc never wrote /tmp/boots")
			}
			time.Sleep(500 * time.Millisecond)
		}
		start := time.Now()
		c.must("container", "checkpoint", "--task", "tc", ref)
		t.Logf("bench: ctr container checkpoint --task: %v", time.Since(start).Round(time.Millisecond))
		if ls := c.must("task", "ls"); !strings.Contains(ls, "RUNNING") {
			t.Errorf("tc after its checkpoint: %s; want it running", ls)
		}
		c.must("task", "exec", "--exec-id", "change", "tc", "sh", "-c", "echo after >> /tmp/boots")
		start = time.Now()
		c.must("container", "restore", "--live", "tr", ref)
		t.Logf("bench: ctr container restore --live: %v", time.Since(start).Round(time.Millisecond))
		if got := read("tr", "r1"); got != "boot" {
			t.Errorf("/tmp/boots in the restored container: %q, want \"boot\" (the checkpoint's line; its init not started again)", got)
		}
		pids := map[string]string{}
		for _, line := range strings.Split(c.must("task", "ls"), "\n") {
			if f := strings.Fields(line); len(f) >= 3 {
				pids[f[0]] = f[1]
			}
		}
		if pids["tr"] == "" || pids["tr"] != pids["tc"] {
			t.Errorf("task PIDs %v: want tr's init to be tc's, taken over (the same guest PID)", pids)
		}
		if got := read("tc", "r2"); got != "boot after" {
			t.Errorf("/tmp/boots in the original: %q, want \"boot after\"", got)
		}
		for _, id := range []string{"tc", "tr"} {
			c.must("task", "kill", "-s", "KILL", id)
		}
		// The adopted process's exit is the restored task's.
		deadline = time.Now().Add(time.Minute)
		for !strings.Contains(c.must("task", "ls"), "STOPPED") || strings.Count(c.must("task", "ls"), "STOPPED") < 2 {
			if time.Now().After(deadline) {
				t.Fatalf("the tasks never stopped after their kill:\n%s", c.must("task", "ls"))
			}
			time.Sleep(200 * time.Millisecond)
		}
		for _, id := range []string{"tc", "tr"} {
			deadline := time.Now().Add(time.Minute)
			for {
				r, _ := c.ctr(context.Background(), nil, "task", "rm", id)
				if r.code == 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("task rm %s: %s", id, r.stderr)
				}
				time.Sleep(200 * time.Millisecond)
			}
			c.must("container", "rm", id)
		}
		c.must("images", "rm", ref)
		c.checkClean(t, "the checkpoint and its restore")
	})

	t.Run("refused specs", func(t *testing.T) {
		// A spec without a PID namespace asks for the host's.
		r, err := c.ctr(context.Background(), nil, "oci", "spec")
		if err != nil || r.code != 0 {
			t.Fatalf("ctr oci spec: %v %s", err, r.stderr)
		}
		var s specs.Spec
		if err := json.Unmarshal([]byte(r.stdout), &s); err != nil {
			t.Fatal(err)
		}
		var ns []specs.LinuxNamespace
		for _, n := range s.Linux.Namespaces {
			if n.Type != specs.PIDNamespace {
				ns = append(ns, n)
			}
		}
		s.Linux.Namespaces = ns
		s.Process.Args = []string{"true"}
		hostPID := filepath.Join(t.TempDir(), "hostpid.json")
		b, _ := json.Marshal(&s)
		if err := os.WriteFile(hostPID, b, 0o644); err != nil {
			t.Fatal(err)
		}
		for _, tt := range []struct {
			name string
			args []string
			want string
		}{
			{"host PID namespace", []string{"--config", hostPID, "t5"}, "PID namespace"},
			{"device", []string{"--device", "/dev/kvm", testImage, "t6", "true"}, "host device"},
			{"host network", []string{"--net-host", testImage, "t7", "true"}, "network namespace"},
		} {
			start := time.Now()
			r := run(nil, tt.args...)
			if r.code == 0 || !strings.Contains(r.stderr, tt.want) {
				t.Errorf("%s: exit %d, stderr %q; want a failure naming %q", tt.name, r.code, r.stderr, tt.want)
			}
			if d := time.Since(start); d > time.Minute {
				t.Logf("%s: refused only after %v", tt.name, d)
			}
			id := tt.args[len(tt.args)-1]
			if tt.name != "host PID namespace" {
				id = tt.args[len(tt.args)-2]
			}
			c.ctr(context.Background(), nil, "container", "rm", id)
		}
		c.checkClean(t, "refused specs")
	})
}

// TestKVMShimCRI runs a pod on the shim through containerd's CRI plugin
// with crictl, as a kubelet would: runp with the kiln handler, create and
// start a container, exec in it, its network (CNI's bridge), stopp and
// rmp.
func TestKVMShimCRI(t *testing.T) {
	kvmtest.Require(t)
	crictl := crictlPath(t)
	dir := t.TempDir()
	cni := filepath.Join(dir, "cni")
	if err := os.MkdirAll(cni, 0o755); err != nil {
		t.Fatal(err)
	}
	// A bridge with the gateway's address, in containerd's own network
	// namespace (startContainerd's private): the pod's VM takes over the
	// veth CNI gives the pod, and reaches the gateway.
	conf := `{"cniVersion": "0.4.0", "name": "kilntest", "plugins": [{"type": "bridge", "bridge": "kilntest0", "isGateway": true, "ipMasq": false,
  "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.213.77.0/24"}]]}}, {"type": "loopback"}]}`
	if err := os.WriteFile(filepath.Join(cni, "10-kilntest.conflist"), []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	extra := fmt.Sprintf(`[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  stream_server_address = "127.0.0.1"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    # Naming a runtime replaces containerd's default table: runc too.
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.kiln]
      runtime_type = %q
      pod_annotations = ["io.kiln.*"]
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = %q
`, testImage, shim.RuntimeName, cni)
	cfgPath, _ := shimConfig(t)
	c := startContainerd(t, cfgPath, extra, true)
	archive := filepath.Join(dir, "busybox.tar")
	if err := os.WriteFile(archive, kvmtest.BusyboxArchive(t, testImage), 0o644); err != nil {
		t.Fatal(err)
	}
	c.must("--namespace", "k8s.io", "images", "import", archive)
	cri := func(args ...string) string {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), ctrTimeout)
		defer cancel()
		start := time.Now()
		// In containerd's network namespace: CRI's streaming server
		// (exec) listens on its loopback.
		cmd := exec.CommandContext(ctx, "nsenter", append([]string{fmt.Sprintf("--net=/proc/%d/ns/net", c.cmd.Process.Pid), "--", crictl,
			"--runtime-endpoint", "unix://" + c.sock, "--image-endpoint", "unix://" + c.sock, "--timeout", "4m"}, args...)...)
		var out, errb bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errb
		if err := cmd.Run(); err != nil {
			t.Fatalf("crictl %s: %v: %s%s\ncontainerd's log:\n%s", strings.Join(args, " "), err, out.String(), errb.String(), tail(c.logs(), 6000))
		}
		t.Logf("crictl %s: %v", args[0], time.Since(start).Round(time.Millisecond))
		return strings.TrimSpace(out.String())
	}
	// Wait until CRI has seen the imported image.
	deadline := time.Now().Add(time.Minute)
	for !strings.Contains(cri("images"), "busybox") {
		if time.Now().After(deadline) {
			t.Fatal("crictl images: the imported busybox never showed")
		}
		time.Sleep(time.Second)
	}
	podJSON := filepath.Join(dir, "pod.json")
	writeJSON(t, podJSON, map[string]any{
		"metadata":      map[string]any{"name": "kiln-pod", "namespace": "default", "uid": "kiln-pod-uid", "attempt": 0},
		"log_directory": filepath.Join(dir, "logs"),
		"annotations":   map[string]string{shim.AnnotationMemoryMiB: "256"},
		"dns_config":    map[string]any{"servers": []string{"10.213.77.53"}},
		"linux":         map[string]any{},
	})
	// Volumes as the kubelet gives them: a read-only folder (a
	// ConfigMap's) and an emptyDir both containers mount.
	cfgDir := filepath.Join(dir, "pods/kiln-pod-uid/volumes/kubernetes.io~configmap/cfg")
	cacheDir := filepath.Join(dir, "pods/kiln-pod-uid/volumes/kubernetes.io~empty-dir/cache")
	for _, d := range []string{cfgDir, cacheDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(cfgDir, "key"), []byte("value\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	volumes := []map[string]any{
		{"container_path": "/etc/cfg", "host_path": cfgDir, "readonly": true},
		{"container_path": "/cache", "host_path": cacheDir},
	}
	ctrJSON := filepath.Join(dir, "container.json")
	writeJSON(t, ctrJSON, map[string]any{
		"metadata": map[string]any{"name": "app"},
		"image":    map[string]any{"image": testImage},
		"command":  []string{"sleep", "600"},
		"log_path": "app.log",
		"mounts":   volumes,
		"linux":    map[string]any{},
	})
	pod := cri("runp", "--runtime", "kiln", podJSON)
	cid := cri("create", pod, ctrJSON, podJSON)
	cri("start", cid)
	if out := cri("exec", cid, "echo", "ok"); out != "ok" {
		t.Errorf("crictl exec: %q, want ok", out)
	}
	if out := cri("exec", "--sync", cid, "uname", "-r"); out != kvmtest.Kernel(t).Version {
		t.Errorf("crictl exec uname -r: %q, want the guest kernel's %q", out, kvmtest.Kernel(t).Version)
	}
	// The pod's network: the guest has the address CNI gave the pod,
	// and reaches the bridge's gateway through the veth.
	podIP := cri("inspectp", "-o", "go-template", "--template", "{{.status.network.ip}}", pod)
	if !strings.HasPrefix(podIP, "10.213.77.") {
		t.Fatalf("crictl inspectp: pod IP %q, want one of 10.213.77.0/24", podIP)
	}
	if out := cri("exec", cid, "ip", "-4", "-o", "addr", "show"); !strings.Contains(out, " "+podIP+"/24 ") {
		t.Errorf("the guest's addresses:\n%s\nwant %s/24 (the pod's)", out, podIP)
	}
	if out := cri("exec", cid, "ping", "-c", "2", "-W", "20", "10.213.77.1"); !strings.Contains(out, "2 packets received") {
		t.Errorf("ping of the pod's gateway from the guest:\n%s", out)
	}
	// A second container in the pod: the same VM (its kernel, its
	// network), its own root (the first's files are not in it), its own
	// processes; it goes while the first runs on.
	if out := cri("exec", cid, "sh", "-c", "echo first > /tmp/mine; hostname"); out == "" {
		t.Errorf("crictl exec hostname in the first container: nothing")
	}
	side := filepath.Join(dir, "side.json")
	writeJSON(t, side, map[string]any{
		"metadata": map[string]any{"name": "side"},
		"image":    map[string]any{"image": testImage},
		"command":  []string{"sh", "-c", "echo side-started > /tmp/side; exec sleep 600"},
		"log_path": "side.log",
		"mounts":   volumes,
		"linux":    map[string]any{},
	})
	cid2 := cri("create", pod, side, podJSON)
	cri("start", cid2)
	if out := cri("exec", "--sync", cid2, "uname", "-r"); out != kvmtest.Kernel(t).Version {
		t.Errorf("second container: uname -r %q, want the guest kernel's %q", out, kvmtest.Kernel(t).Version)
	}
	for deadline := time.Now().Add(time.Minute); cri("exec", cid2, "sh", "-c", "cat /tmp/side || true") != "side-started"; time.Sleep(time.Second) {
		if time.Now().After(deadline) {
			t.Fatal("the second container's process never wrote /tmp/side in its root")
		}
	}
	if out := cri("exec", cid2, "sh", "-c", "test -e /tmp/mine && echo shared || echo own"); out != "own" {
		t.Errorf("the first container's /tmp/mine in the second's root: %q, want own", out)
	}
	if out := cri("exec", cid, "sh", "-c", "test -e /tmp/side && echo shared || echo own"); out != "own" {
		t.Errorf("the second container's /tmp/side in the first's root: %q, want own", out)
	}
	if out := cri("exec", cid2, "ip", "-4", "-o", "addr", "show"); !strings.Contains(out, " "+podIP+"/24 ") {
		t.Errorf("the second container's addresses:\n%s\nwant the pod's %s/24", out, podIP)
	}
	if out := cri("exec", cid2, "cat", "/etc/resolv.conf"); !strings.Contains(out, "nameserver 10.213.77.53") {
		t.Errorf("the second container's /etc/resolv.conf: %q, want the pod's nameserver 10.213.77.53", out)
	}
	// The volumes: the read-only folder in both, read-only; the emptyDir
	// shared (in guest RAM: the host's folder stays empty).
	for _, id := range []string{cid, cid2} {
		if out := cri("exec", id, "cat", "/etc/cfg/key"); out != "value" {
			t.Errorf("/etc/cfg/key in %.12s: %q, want value", id, out)
		}
		if out := cri("exec", id, "sh", "-c", "touch /etc/cfg/new 2>/dev/null && echo wrote || echo refused"); out != "refused" {
			t.Errorf("writing the read-only volume in %.12s: %q", id, out)
		}
	}
	cri("exec", cid, "sh", "-c", "echo from-app > /cache/note")
	if out := cri("exec", cid2, "cat", "/cache/note"); out != "from-app" {
		t.Errorf("the emptyDir in the second container: %q, want the first's from-app", out)
	}
	if out := cri("exec", cid, "cat", "/etc/resolv.conf"); !strings.Contains(out, "nameserver 10.213.77.53") {
		t.Errorf("the first container's /etc/resolv.conf (CRI's file): %q", out)
	}
	cri("stop", "--timeout", "5", cid2)
	cri("rm", cid2)
	if out := cri("exec", cid, "cat", "/tmp/mine"); out != "first" {
		t.Errorf("the first container after the second's removal: %q, want first", out)
	}
	cri("stopp", pod)
	cri("rmp", pod)
	if out := cri("pods", "-q"); out != "" {
		t.Errorf("crictl pods after rmp: %q", out)
	}
	checkCleanNS(t, c, "k8s.io", "the pod")
}

// BenchmarkKVMShimRun is the shim's overhead: ctr run --rm of true through
// containerd and the shim (a cold boot of the pod's VM on the image's
// rootfs as containerd mounted it), against kiln run's path for the same
// root (sandbox.Start on the rootfs as a host directory, exec true,
// Close, in this process) with the same kernel and initramfs, the two
// alternating in each iteration. It reports both medians and their
// ratio, and the shim's RSS while a container runs. Not in make test (6
// boots): see docs/bench.md for the command.
func BenchmarkKVMShimRun(b *testing.B) {
	if err := kvmtest.Usable(); err != nil {
		b.Skipf("needs /dev/kvm: %v", err)
	}
	cfgPath, rt := shimConfig(b)
	c := startContainerd(b, cfgPath, "", false, "io.containerd.grpc.v1.cri")
	archive := kvmtest.BusyboxArchive(b, testImage)
	ap := filepath.Join(b.TempDir(), "busybox.tar")
	if err := os.WriteFile(ap, archive, 0o644); err != nil {
		b.Fatal(err)
	}
	c.must("images", "import", ap)
	rootfs := filepath.Join(b.TempDir(), "rootfs")
	extractRootfs(b, archive, rootfs)

	// The shim's memory with one container running (after its boot).
	c.must("run", "-d", "--runtime", shim.RuntimeName, testImage, "rss", "sleep", "600")
	time.Sleep(2 * time.Second)
	if logShimRSS(b) == 0 {
		b.Errorf("no shim process found while a container runs")
	}
	c.must("task", "kill", "-s", "KILL", "rss")
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(200 * time.Millisecond) {
		if r, _ := c.ctr(context.Background(), nil, "task", "rm", "rss"); r.code == 0 || time.Now().After(deadline) {
			break
		}
	}
	c.must("container", "rm", "rss")

	var viaCtr, direct []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		start := time.Now()
		r, err := c.ctr(context.Background(), nil, "run", "--rm", "--runtime", shim.RuntimeName, testImage, fmt.Sprintf("tb%d", i), "true")
		if err != nil || r.code != 0 {
			b.Fatalf("ctr run true: %v, exit %d, %s", err, r.code, r.stderr)
		}
		viaCtr = append(viaCtr, time.Since(start))
		start = time.Now()
		sb, err := sandbox.Start(context.Background(), sandbox.Options{Runtime: rt, RootDir: rootfs, CPUs: 1, MemoryMiB: 256, BootTimeout: 4 * time.Minute})
		if err != nil {
			b.Fatal(err)
		}
		st, err := sb.Client().Exec(context.Background(), client.ExecOptions{Argv: []string{"true"}})
		if err != nil || st.Code != 0 {
			b.Fatalf("exec true: %+v, %v", st, err)
		}
		if err := sb.Close(context.Background()); err != nil {
			b.Fatal(err)
		}
		direct = append(direct, time.Since(start))
	}
	b.StopTimer()
	mc, md := median(viaCtr), median(direct)
	b.Logf("bench: ctr run --rm true: %v (median of %v); kiln run's path: %v (median of %v); ratio %.2f",
		mc.Round(time.Millisecond), viaCtr, md.Round(time.Millisecond), direct, float64(mc)/float64(md))
	b.ReportMetric(mc.Seconds(), "ctr-s")
	b.ReportMetric(md.Seconds(), "kiln-s")
	b.ReportMetric(float64(mc)/float64(md), "ratio")
	c.checkClean(b, "the runs")
}

// median of a few durations.
func median(d []time.Duration) time.Duration {
	s := append([]time.Duration(nil), d...)
	slices.Sort(s)
	return s[len(s)/2]
}

// logShimRSS logs the running shim's resident memory, split: its own
// (anonymous and file pages: the shim, the VMM, the Go runtime) and the
// guest's RAM (shared memory: the memfd the guest has touched).
func logShimRSS(t testing.TB) (n int) {
	t.Helper()
	for _, p := range shimProcs() {
		pid, _, _ := strings.Cut(p, " ")
		b, err := os.ReadFile(filepath.Join("/proc", pid, "status"))
		if err != nil {
			continue
		}
		fields := map[string]string{}
		for _, l := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(l, ":"); ok && strings.HasPrefix(k, "Rss") || k == "VmRSS" {
				fields[k] = strings.TrimSpace(v)
			}
		}
		t.Logf("bench: shim %s RSS: VmRSS %s = RssAnon %s + RssFile %s + RssShmem %s (guest RAM)",
			pid, fields["VmRSS"], fields["RssAnon"], fields["RssFile"], fields["RssShmem"])
		n++
	}
	return n
}

// extractRootfs writes a docker archive's flattened filesystem to dir,
// as a snapshotter would mount it.
func extractRootfs(t testing.TB, archive []byte, dir string) {
	t.Helper()
	img, err := tarball.Image(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(archive)), nil }, nil)
	if err != nil {
		t.Fatal(err)
	}
	rc := mutate.Extract(img)
	defer rc.Close()
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(dir, filepath.Clean("/"+h.Name))
		switch h.Typeflag {
		case tar.TypeDir:
			err = os.MkdirAll(p, os.FileMode(h.Mode)&os.ModePerm|0o700)
		case tar.TypeReg:
			if err = os.MkdirAll(filepath.Dir(p), 0o755); err == nil {
				var f *os.File
				if f, err = os.OpenFile(p, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, os.FileMode(h.Mode)&os.ModePerm); err == nil {
					_, err = io.Copy(f, tr)
					f.Close()
				}
			}
		case tar.TypeSymlink:
			if err = os.MkdirAll(filepath.Dir(p), 0o755); err == nil {
				err = os.Symlink(h.Linkname, p)
			}
		}
		if err != nil {
			t.Fatalf("extracting %s: %v", h.Name, err)
		}
	}
}

// crictlPath is bin/crictl (make deps), else crictl on PATH.
func crictlPath(t *testing.T) string {
	t.Helper()
	if wd, err := os.Getwd(); err == nil {
		p := filepath.Join(filepath.Dir(wd), "bin", "crictl")
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	p, err := exec.LookPath("crictl")
	if err != nil {
		t.Fatalf("crictl: not in bin/ nor on PATH (make deps installs it): %v", err)
	}
	return p
}

func writeJSON(t *testing.T, path string, v any) {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}
