package main

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/test/bufconn"

	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/daemon/client"
	"github.com/kilnvm/kiln/daemon/kilnpb"
	"github.com/kilnvm/kiln/daemon/vmmbackend"
	"github.com/kilnvm/kiln/image/imagetest"
	"github.com/kilnvm/kiln/internal/kvmtest"
	"github.com/kilnvm/kiln/sandbox"
)

// The SWE task's project: calc.add subtracts, and test_calc says so.
var (
	sweFiles = map[string]string{
		"calc.py":      "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n",
		"test_calc.py": "from calc import add, mul\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n",
		".gitignore":   "__pycache__/\n.pytest_cache/\n",
	}
	sweFixed = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"
)

// sweEnv is every command's environment, on the host and in the guest
// alike: Debian's python3 (the one python3-pytest is for), git without
// the host's configuration and with a fixed identity and dates (so the
// fix's commit has the same ID everywhere), pytest's width fixed.
var sweEnv = []string{
	"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
	"LANG=C.UTF-8", "COLUMNS=80",
	"GIT_CONFIG_NOSYSTEM=1", "GIT_CONFIG_GLOBAL=/dev/null",
	"GIT_AUTHOR_NAME=Kiln Test", "GIT_AUTHOR_EMAIL=test@kiln.invalid", "GIT_AUTHOR_DATE=2026-01-01T00:00:00Z",
	"GIT_COMMITTER_NAME=Kiln Test", "GIT_COMMITTER_EMAIL=test@kiln.invalid", "GIT_COMMITTER_DATE=2026-01-01T00:00:00Z",
}

// sweStep is one command of the loop, run in a folder relative to the
// task's folder (which holds repo.bundle and fix.patch).
type sweStep struct {
	name string
	dir  string
	argv []string
	code int // what it exits with on the host
}

// The loop before the fix (clone, tests fail) and after it (the patch
// applied, tests pass, the change committed). The daemon's path writes
// calc.py instead of the "apply" step.
var (
	sweBefore = []sweStep{
		{"clone", ".", []string{"git", "clone", "-q", "repo.bundle", "work"}, 0},
		{"pytest before the fix", "work", []string{"python3", "-m", "pytest", "-q"}, 1},
	}
	sweAfter = []sweStep{
		{"apply", "work", []string{"git", "apply", "../fix.patch"}, 0},
		{"pytest after the fix", "work", []string{"python3", "-m", "pytest", "-q"}, 0},
		{"diff", "work", []string{"git", "diff", "--stat"}, 0},
		{"commit", "work", []string{"git", "commit", "-q", "-am", "calc: add adds"}, 0},
		{"log", "work", []string{"git", "log", "--format=%H %s"}, 0},
	}
)

// pytestTime is the one part of pytest's output that differs run to run.
var pytestTime = regexp.MustCompile(` in [0-9.]+s\b`)

func normalize(out string) string { return pytestTime.ReplaceAllString(out, " in Ns") }

// script is steps as one sh command line, from the task's folder: it
// stops at the first step that fails, with its exit code.
func script(steps []sweStep) string {
	var parts []string
	for _, s := range steps {
		q := make([]string, len(s.argv))
		for i, a := range s.argv {
			q[i] = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
		}
		parts = append(parts, "(cd "+s.dir+" && "+strings.Join(q, " ")+")")
	}
	return strings.Join(parts, " && ")
}

// sweProject makes the project on the host, commits it and returns the
// task's files: the bundle, the fix as a patch, and the fixed calc.py.
func sweProject(t *testing.T, hostDir string) (bundle, patch []byte) {
	t.Helper()
	repo := filepath.Join(hostDir, "origin")
	if err := os.MkdirAll(repo, 0o755); err != nil {
		t.Fatal(err)
	}
	for name, body := range sweFiles {
		if err := os.WriteFile(filepath.Join(repo, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	git := func(args ...string) string {
		t.Helper()
		code, out, errOut := hostRun(t, repo, append([]string{"git"}, args...))
		if code != 0 {
			t.Fatalf("host: git %q: exit %d: %s%s", args, code, out, errOut)
		}
		return out
	}
	git("init", "-q", "-b", "main")
	git("add", ".")
	git("commit", "-q", "-m", "calc: add and mul, with tests")
	git("bundle", "create", "-q", "../repo.bundle", "HEAD", "main")
	if err := os.WriteFile(filepath.Join(repo, "calc.py"), []byte(sweFixed), 0o644); err != nil {
		t.Fatal(err)
	}
	patch = []byte(git("diff"))
	git("checkout", "-q", "calc.py")
	bundle, err := os.ReadFile(filepath.Join(hostDir, "repo.bundle"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(hostDir, "fix.patch"), patch, 0o644); err != nil {
		t.Fatal(err)
	}
	return bundle, patch
}

// hostRun runs argv on the host in dir with sweEnv.
func hostRun(t *testing.T, dir string, argv []string) (int, string, string) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	cmd := exec.Command(sweLookPath(t, argv[0]), argv[1:]...)
	cmd.Dir, cmd.Env, cmd.Stdout, cmd.Stderr = dir, sweEnv, &stdout, &stderr
	err := cmd.Run()
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee):
		return ee.ExitCode(), stdout.String(), stderr.String()
	case err != nil:
		t.Fatalf("host: %q: %v", argv, err)
	}
	return 0, stdout.String(), stderr.String()
}

// sweLookPath finds name in sweEnv's PATH (exec.Command would search
// the test's own, where another python3 may come first).
func sweLookPath(t *testing.T, name string) string {
	t.Helper()
	path := strings.TrimPrefix(sweEnv[0], "PATH=")
	for _, dir := range filepath.SplitList(path) {
		p := filepath.Join(dir, name)
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
			return p
		}
	}
	t.Fatalf("host: no %s in %s (make deps installs git and python3-pytest)", name, path)
	return ""
}

// sweResult is a step's exit code and normalized stdout.
type sweResult struct {
	code int
	out  string
}

// TestKVMSWE runs the loop an RL agent runs on a software task in the
// fidelity image (python3, Debian's pytest, git), end to end: a project
// with a bug is committed and bundled on the host; in the sandbox it is
// cloned from the bundle, its tests fail (exit 1, the failing test
// named), the fix is applied, its tests pass (exit 0), and git diff and
// commit work. Through `kiln run --image` (the failing run saved, the fix
// run restored from it: --save, --from) and through kilnd (the real
// backend: create, WriteFile, Exec; the fix a file write; then a second
// sandbox with init systemd, exec in it, and systemctl poweroff inside, a
// clean STOPPED end). The same
// commands on the host give the same exit codes and the same output,
// pytest's summary and the fix's commit ID included. The kilnd sandbox
// also logs what the guest sees (docs/guest.md).
func TestKVMSWE(t *testing.T) {
	kvmtest.Require(t)
	kvmtest.Kernel(t)
	began := time.Now()
	_, refs := imagetest.ServeLayout(t, kvmtest.FidelityImages(t), "kiln/test")
	ref := refs[kvmtest.FidelityImage]
	images := t.TempDir()
	agent := kvmtest.AgentBinary(t)

	// The host: the project, then the whole loop as the reference.
	hostDir := t.TempDir()
	bundle, patch := sweProject(t, hostDir)
	host := map[string]sweResult{}
	for _, s := range append(append([]sweStep(nil), sweBefore...), sweAfter...) {
		code, out, errOut := hostRun(t, filepath.Join(hostDir, s.dir), s.argv)
		if code != s.code {
			t.Fatalf("host: %s (%q): exit %d, want %d: %s%s", s.name, s.argv, code, s.code, out, errOut)
		}
		host[s.name] = sweResult{code, normalize(out)}
	}
	checkPytest(t, "host", host["pytest before the fix"].out, host["pytest after the fix"].out)
	t.Logf("host: registry up, the project made and its loop run in %v; pytest before the fix:\n%s", time.Since(began).Round(time.Millisecond), host["pytest before the fix"].out)
	joined := func(steps []sweStep) string {
		var b strings.Builder
		for _, s := range steps {
			b.WriteString(host[s.name].out)
		}
		return b.String()
	}

	// kiln run: the task's files on stdin (a tar), cloned and tested in a
	// sandbox that is then saved; the fix in a sandbox restored from it.
	var tarball bytes.Buffer
	tw := tar.NewWriter(&tarball)
	for name, body := range map[string][]byte{"repo.bundle": bundle, "fix.patch": patch} {
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(body)), ModTime: time.Unix(0, 0)}); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(body); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	envFlags := func() []string {
		var f []string
		for _, kv := range sweEnv {
			f = append(f, "-e", kv)
		}
		return f
	}
	snap := filepath.Join(t.TempDir(), "snap")
	began = time.Now()
	args := append([]string{"run", "--agent", agent, "--boot-timeout", "8m", "--images", images, "--image", ref, "-i", "--save", snap}, envFlags()...)
	var stdout, stderr bytes.Buffer
	code := run(append(args, "--", "sh", "-c", "mkdir -p /root/task && cd /root/task && tar xf - && "+script(sweBefore)),
		bytes.NewReader(tarball.Bytes()), &stdout, &stderr)
	if want := host["pytest before the fix"].code; code != want || normalize(stdout.String()) != joined(sweBefore) {
		t.Fatalf("kiln run --image: clone and pytest: exit %d (host %d), stdout %q, want the host's %q; stderr %q",
			code, want, stdout.String(), joined(sweBefore), stderr.String())
	}
	t.Logf("kiln run --image --save: boot, clone, failing pytest and save in %v", time.Since(began).Round(time.Millisecond))

	began = time.Now()
	code, out, errOut := runKiln(t, append(append([]string{"run", "--from", snap, "--boot-timeout", "5m"}, envFlags()...),
		"--", "sh", "-c", "cd /root/task && "+script(sweAfter))...)
	if code != 0 || normalize(out) != joined(sweAfter) {
		t.Fatalf("kiln run --from: apply, pytest, diff, commit: exit %d, stdout %q, want the host's %q; stderr %q", code, out, joined(sweAfter), errOut)
	}
	t.Logf("kiln run --from: restore, fix, passing pytest, diff and commit in %v", time.Since(began).Round(time.Millisecond))

	// kilnd: one sandbox of the image, the files written, each step an
	// exec, the fix a file write.
	t.Run("kilnd", func(t *testing.T) { sweDaemon(t, images, ref, bundle, host) })
}

// checkPytest checks pytest's output before and after the fix: the
// failing test named, each summary as it should be.
func checkPytest(t *testing.T, where, before, after string) {
	t.Helper()
	if !strings.Contains(before, "FAILED test_calc.py::test_add") || !strings.Contains(before, "1 failed, 1 passed in Ns") {
		t.Errorf("%s: pytest before the fix does not name test_add failing, or its summary is not 1 failed, 1 passed: %q", where, before)
	}
	if !strings.Contains(after, "2 passed in Ns") {
		t.Errorf("%s: pytest after the fix: %q, want 2 passed", where, after)
	}
}

// sweDaemon runs the loop through kilnd's server over the real backend
// (sandboxes in VMM processes: this test binary as `kiln vmm`), in a
// sandbox of the image; then sweSystemd.
func sweDaemon(t *testing.T, images, ref string, bundle []byte, host map[string]sweResult) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	began := time.Now()
	// As kiln run and kilnd resolve it: the agent initramfs cached beside
	// the kernel is found there (building one costs ~25 s in L1).
	rt, err := sandbox.FindRuntime("", kvmtest.AgentBinary(t))
	if err != nil {
		t.Fatal(err)
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	state, err := os.MkdirTemp("", "kswe-") // short: sockets live in it
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(state) })
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	be, err := vmmbackend.New(vmmbackend.Options{StateDir: state, Runtime: rt, Images: images,
		Command: []string{self, "vmm"}, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	srv, err := daemon.New(daemon.Config{StateDir: state, Backend: be, BootTimeout: 8 * time.Minute, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	lis := bufconn.Listen(1 << 20)
	gs := grpc.NewServer()
	srv.Register(gs)
	go gs.Serve(lis)
	defer func() {
		gs.Stop()
		srv.Close(context.Background())
	}()
	conn, err := grpc.NewClient("passthrough:///bufnet",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	c := client.NewFromConn(conn)
	t.Logf("kilnd: runtime and server in %v", time.Since(began).Round(time.Millisecond))

	began = time.Now()
	sb, err := c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{RequestId: client.NewRequestID(),
		Source: &kilnpb.CreateSandboxRequest_Image{Image: ref}})
	if err != nil {
		t.Fatalf("create a sandbox of %s: %v", ref, err)
	}
	destroyed := false
	destroy := func() {
		if destroyed {
			return
		}
		destroyed = true
		began := time.Now()
		if err := c.DestroySandbox(context.Background(), sb.Id); err != nil {
			t.Errorf("kilnd: destroy %s: %v", sb.Id, err)
		}
		t.Logf("kilnd: destroy in %v", time.Since(began).Round(time.Millisecond))
	}
	defer destroy()
	t.Logf("kilnd: sandbox %s of the fidelity image ready in %d ms", sb.Id, sb.ReadyMs)
	const task = "/root/task"
	if _, err := c.WriteFile(ctx, sb.Id, task+"/repo.bundle", bytes.NewReader(bundle), client.WriteFileOptions{MakeParents: true}); err != nil {
		t.Fatalf("write the bundle: %v", err)
	}
	step := func(s sweStep) sweResult {
		t.Helper()
		defer func(began time.Time) { t.Logf("kilnd: %s in %v", s.name, time.Since(began).Round(time.Millisecond)) }(time.Now())
		var stdout, stderr bytes.Buffer
		r, err := c.Exec(ctx, sb.Id, client.ExecOptions{Argv: s.argv, Env: sweEnv, Cwd: filepath.Join(task, s.dir), Stdout: &stdout, Stderr: &stderr})
		if err != nil {
			t.Fatalf("kilnd: %s (%q): %v", s.name, s.argv, err)
		}
		got := sweResult{r.ExitCode, normalize(stdout.String())}
		if want := host[s.name]; got != want {
			t.Errorf("kilnd: %s (%q): exit %d, stdout %q; the host's: exit %d, %q; stderr %q", s.name, s.argv, got.code, got.out, want.code, want.out, stderr.String())
		}
		return got
	}
	var before, after sweResult
	for _, s := range sweBefore {
		before = step(s)
	}
	if _, err := c.WriteFile(ctx, sb.Id, task+"/work/calc.py", strings.NewReader(sweFixed), client.WriteFileOptions{}); err != nil {
		t.Fatalf("write the fix: %v", err)
	}
	for _, s := range sweAfter[1:] {
		r := step(s)
		if s.name == "pytest after the fix" {
			after = r
		}
	}
	checkPytest(t, "kilnd", before.out, after.out)
	t.Logf("kilnd: create, the loop's %d execs and 2 file writes in %v", len(sweBefore)+len(sweAfter)-1, time.Since(began).Round(time.Millisecond))

	// What the guest sees, for docs/guest.md.
	var facts bytes.Buffer
	r, err := c.Exec(ctx, sb.Id, client.ExecOptions{Argv: []string{"sh", "-c", guestFacts}, Stdout: &facts, Stderr: &facts})
	if err != nil || r.ExitCode != 0 {
		t.Fatalf("kilnd: what the guest sees: %v %+v: %s", err, r, facts.String())
	}
	t.Logf("what the guest sees:\n%s", facts.String())
	checkFacts(t, facts.String())
	hostNow := time.Now()
	var date bytes.Buffer
	if _, err := c.Exec(ctx, sb.Id, client.ExecOptions{Argv: []string{"date", "+%s.%N"}, Stdout: &date}); err == nil {
		if f, err := strconv.ParseFloat(strings.TrimSpace(date.String()), 64); err == nil {
			t.Logf("guest clock - host clock: %.3f s", f-float64(hostNow.UnixNano())/1e9)
		}
	}

	destroy()

	// The daemon's --init systemd, in a second sandbox of the image (the
	// loop runs under the agent as init, the default).
	sweSystemd(t, ctx, c, ref)
}

// checkFacts checks what docs/guest.md says of every guest against
// guestFacts' output: kvm-clock, virtio-rng as the kernel's hardware RNG,
// no PCI device, no DMI, and an image-rooted sandbox's eight virtio
// devices (vsock, rng, the image's EROFS disk, the kernel's modules disk
// and four empty volume slots).
func checkFacts(t *testing.T, out string) {
	t.Helper()
	sections := map[string]string{}
	for _, part := range strings.Split(out, "## ")[1:] {
		name, body, _ := strings.Cut(part, "\n")
		sections[name] = body
	}
	busLine := func(bus string) string {
		for _, l := range strings.Split(sections["buses"], "\n") {
			if after, ok := strings.CutPrefix(l, "/sys/bus/"+bus+"/devices:"); ok {
				return strings.TrimSpace(after)
			}
		}
		return "(no such bus)"
	}
	for _, c := range []struct {
		what string
		ok   bool
	}{
		{"the clock source is kvm-clock", strings.HasPrefix(sections["clocksource"], "kvm-clock\n")},
		{"the hardware RNG is virtio-rng", strings.Contains(sections["entropy"], "virtio_rng")},
		{"no PCI device", busLine("pci") == ""},
		{"no DMI", strings.Contains(sections["rtc-dmi-firmware"], "/sys/class/dmi': No such file")},
		{"eight virtio devices", len(strings.Fields(busLine("virtio"))) == 8},
		{"an overlay root", strings.Contains(sections["mounts"], "overlay / overlay ")},
	} {
		if !c.ok {
			t.Errorf("what the guest sees: not %s (docs/guest.md says so)", c.what)
		}
	}
}

// guestFacts prints what a guest sees of its machine.
const guestFacts = `
s() { echo "## $1"; }
s uname; uname -a
s cpu; grep -m1 'model name' /proc/cpuinfo; grep -m1 '^flags' /proc/cpuinfo; echo "cpus: $(nproc)"
s meminfo; head -4 /proc/meminfo
s cmdline; cat /proc/cmdline
s buses; for b in /sys/bus/*/devices; do echo "$b: $(ls $b | tr '\n' ' ')"; done
s clocksource; cat /sys/devices/system/clocksource/clocksource0/current_clocksource /sys/devices/system/clocksource/clocksource0/available_clocksource
s entropy; cat /proc/sys/kernel/random/entropy_avail; cat /sys/devices/virtual/misc/hw_random/rng_available /sys/devices/virtual/misc/hw_random/rng_current 2>&1
s rtc-dmi-firmware; ls /sys/class/rtc /sys/class/dmi /sys/firmware 2>&1
s mounts; cat /proc/mounts
s block; ls /sys/block; lsblk 2>&1 | head
s dev; ls /dev | tr '\n' ' '; echo
s net; ls /sys/class/net
s modules; cut -d' ' -f1 /proc/modules | tr '\n' ' '; echo
s cgroup; cat /proc/self/cgroup; cat /sys/fs/cgroup/cgroup.controllers 2>&1
s dmesg; dmesg 2>&1 | grep -iE 'clocksource|tsc|kvm|virtio|rng|acpi|dmi|pci|rtc' | head -60
`

// sweSystemd creates a sandbox of ref through kilnd with init systemd:
// systemd is process 1 and the agent one of its services, so exec works;
// then systemctl poweroff from inside ends it, which kilnd records as a
// clean STOPPED, not a failure.
func sweSystemd(t *testing.T, ctx context.Context, c *client.Client, ref string) {
	began := time.Now()
	sb, err := c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{RequestId: client.NewRequestID(),
		Source: &kilnpb.CreateSandboxRequest_Image{Image: ref}, Init: "systemd"})
	if err != nil {
		t.Fatalf("kilnd: create a sandbox of %s with init systemd: %v", ref, err)
	}
	poweredOff := false
	defer func() {
		if !poweredOff {
			c.DestroySandbox(context.Background(), sb.Id)
		}
	}()
	t.Logf("kilnd: sandbox %s, init %q, ready in %d ms (%v)", sb.Id, sb.Init, sb.ReadyMs, time.Since(began).Round(time.Millisecond))
	if sb.Init != "systemd" {
		t.Errorf("kilnd: the sandbox's init is %q, want systemd", sb.Init)
	}
	var out bytes.Buffer
	if _, err := c.Exec(ctx, sb.Id, client.ExecOptions{Argv: []string{"sh", "-c", "cat /proc/1/comm; systemctl show -p ActiveState --value kiln-agent.service"}, Stdout: &out}); err != nil {
		t.Fatalf("kilnd: exec under systemd: %v", err)
	} else if got := strings.Fields(out.String()); len(got) != 2 || got[0] != "systemd" || got[1] != "active" {
		t.Errorf("kilnd: process 1 and the agent's unit state: %q, want systemd, active", out.String())
	}

	// Power-off from inside: systemd stops its units and the VM powers
	// off; kilnd records a clean end (STOPPED), not a failure.
	began = time.Now()
	events, err := c.WatchEvents(ctx, sb.Id)
	if err != nil {
		t.Fatal(err)
	}
	defer events.Close()
	if _, err := c.Exec(ctx, sb.Id, client.ExecOptions{Argv: []string{"systemctl", "--no-block", "poweroff"}}); err != nil {
		t.Fatalf("kilnd: systemctl poweroff: %v", err)
	}
	for {
		ev, err := events.Recv()
		if err != nil {
			t.Fatalf("kilnd: waiting for the sandbox's end after systemctl poweroff: %v", err)
		}
		if ev.Kind == kilnpb.Event_KIND_STOPPED {
			poweredOff = true
			t.Logf("kilnd: systemctl poweroff to the sandbox stopped in %v: %s", time.Since(began).Round(time.Millisecond), ev.Reason)
			break
		}
		if ev.Kind == kilnpb.Event_KIND_FAILED || ev.Kind == kilnpb.Event_KIND_EXITED || ev.Kind == kilnpb.Event_KIND_TIMED_OUT {
			poweredOff = true
			t.Fatalf("kilnd: after systemctl poweroff the sandbox ended %v (%s), want KIND_STOPPED", ev.Kind, ev.Reason)
		}
	}
	got, err := c.GetSandbox(ctx, sb.Id)
	if err != nil {
		t.Fatal(err)
	}
	if got.State != kilnpb.SandboxState_SANDBOX_STATE_STOPPED {
		t.Errorf("kilnd: after systemctl poweroff the sandbox is %v, want STOPPED", got.State)
	}
}
