package sandbox

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/guest/client"
	"github.com/kilnvm/kiln/internal/kvmtest"
)

// Docker inside a sandbox is slow under emulation (L2 under TCG): every
// docker command forks a large Go binary and talks to dockerd, containerd
// and runc. The timeouts are generous; none is asserted as a speed.
const (
	dockerdStartTimeout = 6 * time.Minute
	dockerCmdTimeout    = 4 * time.Minute
	dockerdLog          = "/var/log/dockerd.log"
)

// dockerArchive is a one-layer busybox image, "busybox:latest", in docker
// save's form (docker load reads it).
func dockerArchive(t testing.TB) []byte {
	t.Helper()
	return kvmtest.BusyboxArchive(t, "busybox:latest")
}

// dockerSh runs script in sb under timeout and returns its stdout; on a
// failure it fails the test with the script's output, the tail of
// dockerd's log and the kernel's last messages.
func dockerSh(t testing.TB, ctx context.Context, sb *Sandbox, timeout time.Duration, script string) string {
	t.Helper()
	out, errOut, err := dockerTry(ctx, sb, timeout, script)
	if err != nil {
		logs, _, _ := dockerTry(ctx, sb, time.Minute, "tail -n 60 "+dockerdLog+"; echo '--- containerd'; tail -n 20 /var/log/containerd.log; echo '--- dmesg'; dmesg | tail -n 20")
		t.Fatalf("%q: %v\nstdout %q\nstderr %q\n--- dockerd's log\n%s", script, err, out, errOut, logs)
	}
	return out
}

// dockerTry is dockerSh returning what went wrong instead.
func dockerTry(ctx context.Context, sb *Sandbox, timeout time.Duration, script string) (string, string, error) {
	var out, errOut bytes.Buffer
	st, err := sb.Client().Exec(ctx, client.ExecOptions{Argv: []string{"sh", "-c", script}, Stdout: &out, Stderr: &errOut, Timeout: timeout})
	if err == nil && !st.Success() {
		err = fmt.Errorf("exit status %v", st)
	}
	return strings.TrimSpace(out.String()), strings.TrimSpace(errOut.String()), err
}

// startDockerd starts containerd, then dockerd on it, in sb with
// Debian's defaults (no other flags: the storage driver and cgroup setup
// are what dockerd picks in the sandbox), and waits for it to answer.
// containerd is started first, as Debian's containerd.service does: the
// one dockerd would start itself must answer within dockerd's own
// timeout, which under emulation it does not. Its socket is there once it
// serves (no ctr probe: loading ctr, a binary nothing else uses, through
// the lazy image root took tens of emulated seconds). A daemon that exits
// fails at once.
func startDockerd(t testing.TB, ctx context.Context, sb *Sandbox) {
	t.Helper()
	wait := int(dockerdStartTimeout/time.Second) - 30
	dockerSh(t, ctx, sb, dockerdStartTimeout, fmt.Sprintf(`mkdir -p /var/log
setsid containerd >/var/log/containerd.log 2>&1 </dev/null &
c=$!
for i in $(seq %[2]d); do
	test -S /run/containerd/containerd.sock && break
	kill -0 $c 2>/dev/null || { echo containerd exited >&2; tail -n 40 /var/log/containerd.log >&2; exit 1; }
	sleep 1
done
setsid dockerd --containerd=/run/containerd/containerd.sock >%[1]s 2>&1 </dev/null &
d=$!
for i in $(seq %[2]d); do
	test -S /var/run/docker.sock && docker info >/dev/null 2>&1 && exit 0
	kill -0 $d 2>/dev/null || { echo dockerd exited >&2; exit 1; }
	sleep 1
done
echo "dockerd did not answer in %[2]d s" >&2; exit 1`, dockerdLog, wait))
}

// TestKVMDocker runs Docker (Debian's docker.io) in an image-rooted
// sandbox of the fidelity image, with the agent as init: dockerd starts
// with no flags and picks overlay2 on cgroup v2; docker load of a busybox
// image made here and docker run --rm busybox echo ok; a container on the
// default bridge reaches an address outside the guest's docker networks
// through NAT (a network namespace the test makes in the guest, which has
// no route back to the bridge: the server sees the guest's address); two
// containers on a user-defined bridge reach each other by name (wget
// http://web/ through Docker's embedded DNS; Docker 20.10 refuses
// one-letter names). Then a
// fork of the sandbox with dockerd and a container running: in each child
// the container runs on (docker ps, docker exec) and the children's
// containers do not see each other's files, and its httpd serves on.
// The cold path's figures are logged; BenchmarkKVMDockerReady sets them
// beside a warm template's restore (docs/bench.md).
func TestKVMDocker(t *testing.T) {
	kvmtest.Require(t)
	kvmtest.Kernel(t)
	testStart := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	e := fidelityEnv(t, ctx)
	archive := dockerArchive(t)

	sb, cold := dockerCold(t, ctx, e, archive)
	t.Logf("cold: %s", cold)
	if got := dockerSh(t, ctx, sb, dockerCmdTimeout, `docker info -f '{{.CgroupVersion}} {{.Driver}} {{.CgroupDriver}}'`); got != "2 overlay2 cgroupfs" {
		t.Errorf("docker info: cgroup version, storage driver, cgroup driver %q, want \"2 overlay2 cgroupfs\"", got)
	}
	if got := dockerSh(t, ctx, sb, dockerCmdTimeout, `docker info 2>&1 >/dev/null | grep -i warning || true`); got != "" {
		t.Logf("docker info's warnings:\n%s", got)
	}

	// The default bridge and NAT: the container has its own address on
	// docker0's network and reaches a server in a namespace whose only
	// route is to the guest's side of a veth; the server sees the guest's
	// address, not the container's.
	// Python's start under an emulated CPU has taken over a minute.
	dockerSh(t, ctx, sb, dockerCmdTimeout, `set -e
ip netns add kext
ip link add kx0 type veth peer name kx1
ip link set kx1 netns kext
ip addr add 10.231.0.1/24 dev kx0
ip link set kx0 up
ip netns exec kext ip addr add 10.231.0.2/24 dev kx1
ip netns exec kext ip link set kx1 up
ip netns exec kext ip link set lo up
echo nat-ok > /root/nat
cd /root && setsid ip netns exec kext python3 -u -m http.server 8080 --bind 10.231.0.2 >/root/ext.log 2>&1 </dev/null &
for i in $(seq 2000); do grep -q Serving /root/ext.log 2>/dev/null && exit 0; sleep 0.1; done
cat /root/ext.log; exit 1`)
	got := dockerSh(t, ctx, sb, dockerCmdTimeout, "docker run --rm busybox sh -c 'ip -4 -o addr show eth0; wget -qO- http://10.231.0.2:8080/nat'")
	if lines := strings.Split(got, "\n"); len(lines) != 2 || !strings.Contains(lines[0], " 172.17.") || lines[1] != "nat-ok" {
		t.Errorf("a container on the default bridge (its address, then a fetch from outside): %q", got)
	}
	if got := dockerSh(t, ctx, sb, dockerCmdTimeout, "grep 'GET /nat' /root/ext.log | cut -d' ' -f1"); got != "10.231.0.1" {
		t.Errorf("the server outside saw the request from %q, want the guest's 10.231.0.1 (masqueraded)", got)
	}

	// A user-defined bridge: two containers by name.
	dockerSh(t, ctx, sb, dockerCmdTimeout, `docker network create tnet >/dev/null
docker run -d --name web --network tnet busybox sh -c 'echo hello-a > /www/index.html && exec httpd -f -p 80 -h /www' >/dev/null`)
	if got := dockerSh(t, ctx, sb, dockerCmdTimeout, `for i in $(seq 60); do
	docker run --rm --network tnet busybox wget -qO- http://web/ && exit 0
	sleep 1
done; exit 1`); got != "hello-a" {
		t.Errorf("wget http://web/ from another container on network tnet: %q", got)
	}

	// Fork with dockerd and container web running.
	forkStart := time.Now()
	children, err := sb.Fork(ctx, 2, ForkOptions{})
	if err != nil {
		t.Fatalf("Fork with dockerd and a container running: %v", err)
	}
	t.Logf("fork of the sandbox with dockerd and a container running into 2: %v", time.Since(forkStart).Round(time.Millisecond))
	for i, c := range children {
		t.Cleanup(func() { c.Close(context.Background()) })
		if got := dockerSh(t, ctx, c, dockerCmdTimeout, "docker ps --format '{{.Names}} {{.State}}'"); got != "web running" {
			t.Errorf("child %d: docker ps: %q, want \"web running\"", i, got)
		}
		dockerSh(t, ctx, c, dockerCmdTimeout, fmt.Sprintf("docker exec web sh -c 'echo child-%d > /www/mine-%d'", i, i))
	}
	for i, c := range children {
		want := fmt.Sprintf("index.html mine-%d", i)
		if got := dockerSh(t, ctx, c, dockerCmdTimeout, "docker exec web ls /www | tr '\\n' ' '"); strings.TrimSpace(got) != want {
			t.Errorf("child %d: its container's /www holds %q, want %q (its own file only)", i, got, want)
		}
		if got := dockerSh(t, ctx, c, dockerCmdTimeout, fmt.Sprintf("docker exec web wget -qO- http://localhost/mine-%d", i)); got != fmt.Sprintf("child-%d", i) {
			t.Errorf("child %d: its container's httpd served %q", i, got)
		}
	}
	if got := dockerSh(t, ctx, sb, dockerCmdTimeout, "docker exec web ls /www | tr '\\n' ' '"); strings.TrimSpace(got) != "index.html" {
		t.Errorf("the parent's container sees %q after the children wrote, want index.html only", got)
	}
	for _, c := range children {
		c.Close(ctx)
	}
	sb.Close(ctx)
	t.Logf("TestKVMDocker took %v", time.Since(testStart).Round(time.Second))
}

// dockerColdFigures is what the cold path to a first docker run took.
type dockerColdFigures struct {
	boot, dockerdUp, load, firstRun time.Duration
}

// ready is boot to docker run ready, without the load.
func (f dockerColdFigures) ready() time.Duration { return f.boot + f.dockerdUp + f.firstRun }

func (f dockerColdFigures) String() string {
	return fmt.Sprintf("boot %v, dockerd up %v, docker load %v, first docker run %v: boot to docker run ready %v (without the load)",
		f.boot.Round(time.Millisecond), f.dockerdUp.Round(time.Millisecond), f.load.Round(time.Millisecond),
		f.firstRun.Round(time.Millisecond), f.ready().Round(time.Millisecond))
}

// dockerCold boots the fidelity image (pulled into e), starts dockerd,
// loads archive and runs docker run --rm busybox echo ok: the cold path,
// timed step by step. The sandbox is closed with the test.
func dockerCold(t testing.TB, ctx context.Context, e *imageEnv, archive []byte) (*Sandbox, dockerColdFigures) {
	t.Helper()
	var f dockerColdFigures
	began := time.Now()
	sb, err := Start(ctx, Options{Runtime: testRuntime(t), Images: e.dir, ImageRoots: e.roots, Image: e.refs[kvmtest.FidelityImage],
		MemoryMiB: 1024, Hostname: "dock", Console: io.Discard})
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(func() { sb.Close(context.Background()) })
	f.boot = time.Since(began)
	began = time.Now()
	startDockerd(t, ctx, sb)
	f.dockerdUp = time.Since(began)
	if err := sb.Client().WriteFile(ctx, "/root/busybox.tar", bytes.NewReader(archive), 0o644); err != nil {
		t.Fatalf("copying the busybox archive in: %v", err)
	}
	began = time.Now()
	if got := dockerSh(t, ctx, sb, dockerCmdTimeout, "docker load -i /root/busybox.tar"); !strings.Contains(got, "busybox:latest") {
		t.Fatalf("docker load: %q", got)
	}
	f.load = time.Since(began)
	began = time.Now()
	if got := dockerSh(t, ctx, sb, dockerCmdTimeout, "docker run --rm busybox echo ok"); got != "ok" {
		t.Fatalf("docker run --rm busybox echo ok printed %q", got)
	}
	f.firstRun = time.Since(began)
	return sb, f
}

// BenchmarkKVMDockerReady measures the time to a first docker run --rm
// busybox echo ok from a cold boot (boot, dockerd, the run; the load
// timed apart) and from a warm template: Restore of a snapshot saved
// right after the cold path's first run (dockerd up, busybox loaded,
// nothing running), then the same run. Each iteration does both and
// logs them; the metrics are the last iteration's. Gated as the other
// KVM benchmarks: run it through the harness where /dev/kvm works
// (docs/bench.md).
func BenchmarkKVMDockerReady(b *testing.B) {
	if err := kvmtest.Usable(); err != nil {
		b.Skipf("needs /dev/kvm: %v", err)
	}
	kvmtest.Kernel(b)
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Minute)
	defer cancel()
	e := fidelityEnv(b, ctx)
	archive := dockerArchive(b)
	var cold dockerColdFigures
	var saved, restored, warmRun time.Duration
	for b.Loop() {
		var sb *Sandbox
		sb, cold = dockerCold(b, ctx, e, archive)
		snap := filepath.Join(b.TempDir(), "docker")
		began := time.Now()
		if err := sb.Save(ctx, snap); err != nil {
			b.Fatalf("Save with dockerd up: %v", err)
		}
		saved = time.Since(began)
		sb.Close(ctx)
		began = time.Now()
		r, err := Restore(ctx, snap, RestoreOptions{ImageRoots: e.roots, Console: io.Discard})
		if err != nil {
			b.Fatalf("Restore with dockerd up: %v", err)
		}
		restored = time.Since(began)
		began = time.Now()
		if got := dockerSh(b, ctx, r, dockerCmdTimeout, "docker run --rm busybox echo ok"); got != "ok" {
			b.Fatalf("restored: docker run --rm busybox echo ok printed %q", got)
		}
		warmRun = time.Since(began)
		r.Close(ctx)
		b.Logf("cold: %s; save with dockerd up %v; warm: restore %v, first docker run %v: restore to docker run ready %v",
			cold, saved.Round(time.Millisecond), restored.Round(time.Millisecond), warmRun.Round(time.Millisecond),
			(restored + warmRun).Round(time.Millisecond))
	}
	b.ReportMetric(cold.ready().Seconds(), "cold-ready-s")
	b.ReportMetric((restored + warmRun).Seconds(), "warm-ready-s")
	b.ReportMetric(float64(cold.ready())/float64(restored+warmRun), "cold/warm")
}
