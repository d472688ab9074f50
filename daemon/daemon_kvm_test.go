package daemon_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"

	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/daemon/kilnpb"
	"github.com/kilnvm/kiln/daemon/vmmbackend"
	"github.com/kilnvm/kiln/image"
	"github.com/kilnvm/kiln/image/imagetest"
	"github.com/kilnvm/kiln/internal/kvmtest"
	"github.com/kilnvm/kiln/sandbox"
	"github.com/kilnvm/kiln/vmmproc"
)

// TestMain lets the test binary serve as a VMM process (the real
// backend's Command in TestKVMDaemon).
func TestMain(m *testing.M) {
	if os.Getenv(vmmproc.SocketEnv) != "" {
		os.Exit(vmmproc.Main(context.Background(), nil))
	}
	os.Exit(m.Run())
}

// kvmEnv is a server over the real backend: sandboxes in VMM processes
// (this test binary), rooted on the busybox test image.
type kvmEnv struct {
	env
	image string
	// backend is what startKVM makes each server's backend of (its
	// StateDir and Logger are e.cfg's at the start).
	backend vmmbackend.Options
}

func newKVMEnv(t *testing.T) *kvmEnv {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	_, refs := imagetest.ServeLayout(t, kvmtest.TestImages(t), "kiln/test")
	images := t.TempDir()
	roots := image.NewRoots(image.Options{})
	im, err := roots.Images(images)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := im.Pull(ctx, refs["busybox"], image.PullOptions{}); err != nil {
		t.Fatalf("pull busybox: %v", err)
	}
	rt, err := sandbox.NewRuntime(sandbox.RuntimeConfig{Kernel: kvmtest.Kernel(t), Agent: kvmtest.AgentBinary(t)})
	if err != nil {
		t.Fatal(err)
	}
	// A short state folder: the sandboxes' Unix sockets live in it.
	state, err := os.MkdirTemp("", "kd-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(state) })
	e := &kvmEnv{image: refs["busybox"]}
	e.t, e.state = t, state
	e.backend = vmmbackend.Options{Runtime: rt, Images: images, Command: []string{os.Args[0], "-test.run=^$"}}
	e.cfg = daemon.Config{StateDir: state, BootTimeout: 8 * time.Minute,
		// The tests' guests touch a fraction of their memory: up to 7
		// sandboxes of 512 + 128 MiB at once on L1's 4 GiB.
		MemoryOvercommit: 2,
		Logger:           slog.New(slog.NewTextHandler(io.Discard, nil))}
	e.startKVM()
	t.Cleanup(e.stop)
	return e
}

func (e *kvmEnv) startKVM() {
	e.t.Helper()
	// A server's backend, as kilnd's: VMM processes over its state folder.
	opts := e.backend
	opts.StateDir, opts.Logger = e.cfg.StateDir, e.cfg.Logger
	be, err := vmmbackend.New(opts)
	if err != nil {
		e.t.Fatal(err)
	}
	e.cfg.Backend = be
	srv, err := daemon.New(e.cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	e.srv = srv
	lis := bufconn.Listen(1 << 20)
	e.gs = grpc.NewServer()
	srv.Register(e.gs)
	go e.gs.Serve(lis)
	conn, err := grpc.NewClient("passthrough:///bufnet",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { conn.Close() })
	e.c = kilnpb.NewKilnClient(conn)
}

func (e *kvmEnv) createImage(idleMS int64, volumes ...*kilnpb.VolumeMount) *kilnpb.Sandbox {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	sb, err := e.c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{RequestId: nextReq(),
		Source: &kilnpb.CreateSandboxRequest_Image{Image: e.image}, IdleTimeoutMs: idleMS, Volumes: volumes})
	if err != nil {
		e.t.Fatalf("create: %v", err)
	}
	return sb
}

func (e *kvmEnv) shOut(id, script string) string {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	r := e.exec(ctx, &kilnpb.ExecStart{SandboxId: id, Argv: []string{"sh", "-c", script}})
	if r.err != nil || r.exit.GetExitCode() != 0 {
		e.t.Fatalf("sandbox %s: %q: %+v", id, script, r)
	}
	return strings.TrimSpace(r.stdout)
}

// TestKVMDaemon drives the daemon over its real backend: image-rooted
// sandboxes in VMM processes, concurrent creates and execs, a VMM process
// killed, checkpoint, rollback, forks two levels deep, a restart that
// takes every sandbox over, an idle timeout, and destroy leaving nothing;
// a volume written in one sandbox, kept across the restart and read in
// the next, read-write in one sandbox only.
func TestKVMDaemon(t *testing.T) {
	kvmtest.Require(t)
	e := newKVMEnv(t)
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Minute)
	defer cancel()

	// Concurrent creates, one exec each (three cold boots share the one
	// emulated vCPU; TestKVMDaemonTemplates makes 100 at once from a
	// template).
	// The third mounts a volume read-write.
	vol, err := e.c.CreateVolume(ctx, &kilnpb.CreateVolumeRequest{Name: "data", SizeMib: 64})
	if err != nil {
		t.Fatalf("create volume: %v", err)
	}
	const n = 3
	sbs := make([]*kilnpb.Sandbox, n)
	var wg sync.WaitGroup
	for i := range sbs {
		var vs []*kilnpb.VolumeMount
		if i == 2 {
			vs = append(vs, &kilnpb.VolumeMount{Volume: "data", Path: "/mnt/data"})
		}
		wg.Add(1)
		go func() { defer wg.Done(); sbs[i] = e.createImage(0, vs...) }()
	}
	wg.Wait()
	withVol := sbs[2]
	if got := e.shOut(withVol.Id, "echo written > /mnt/data/f && sync && grep ' /mnt/data ' /proc/mounts | cut -d' ' -f3,4 | cut -d, -f1"); got != "ext4 rw" {
		t.Errorf("the volume in sandbox %s: %q", withVol.Id, got)
	}
	_, errBusy := e.c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{RequestId: nextReq(), Source: &kilnpb.CreateSandboxRequest_Image{Image: e.image},
		Volumes: []*kilnpb.VolumeMount{{Volume: "data", Path: "/d", ReadOnly: true}}})
	if status.Code(errBusy) != codes.FailedPrecondition || !strings.Contains(status.Convert(errBusy).Message(), withVol.Id) {
		t.Errorf("a second sandbox with the volume: %v", errBusy)
	}
	for _, sb := range sbs {
		if got := e.shOut(sb.Id, "echo $((6*7))"); got != "42" {
			t.Errorf("sandbox %s: %q", sb.Id, got)
		}
		t.Logf("sandbox %s ready in %d ms (pid %d)", sb.Id, sb.ReadyMs, sb.Pid)
	}

	// kill -9 of one VMM process fails that sandbox only.
	syscall.Kill(int(sbs[0].Pid), syscall.SIGKILL)
	failed := e.waitState(sbs[0].Id, kilnpb.SandboxState_SANDBOX_STATE_FAILED)
	t.Logf("killed: %s", failed.Reason)
	if got := e.shOut(sbs[1].Id, "echo alive"); got != "alive" {
		t.Errorf("sibling: %q", got)
	}

	// Rollback in place.
	sb := sbs[1]
	e.shOut(sb.Id, "echo v1 > /f")
	ck1, err := e.c.Checkpoint(ctx, &kilnpb.CheckpointRequest{SandboxId: sb.Id})
	if err != nil {
		t.Fatal(err)
	}
	pid := e.shOut(sb.Id, "rm /f; setsid sleep 1000 </dev/null >/dev/null 2>&1 & echo $!")
	if got := e.shOut(sb.Id, "sleep 0.5; kill -0 "+pid+" && test ! -e /f && echo running"); got != "running" {
		t.Errorf("background sleep %s before the rollback: %q", pid, got)
	}
	if _, err := e.c.Rollback(ctx, &kilnpb.RollbackRequest{SandboxId: sb.Id, CheckpointId: ck1.Id}); err != nil {
		t.Fatal(err)
	}
	if got := e.shOut(sb.Id, "cat /f; kill -0 "+pid+" 2>/dev/null && echo running || echo gone"); got != "v1\ngone" {
		t.Errorf("after rollback: %q", got)
	}
	ck2, err := e.c.Checkpoint(ctx, &kilnpb.CheckpointRequest{SandboxId: sb.Id})
	if err != nil || ck2.ParentId != ck1.Id {
		t.Fatalf("second checkpoint: %v %v", ck2, err)
	}

	// Forks from a checkpoint two levels deep: entropy differs.
	kids, err := e.forkCtx(ctx, &kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_CheckpointId{CheckpointId: ck2.Id}, Count: 2})
	if err != nil || len(kids) != 2 {
		t.Fatalf("fork: %v %v", kids, err)
	}
	r0 := e.shOut(kids[0].Id, "cat /f; od -An -tx1 -N16 /dev/urandom")
	r1 := e.shOut(kids[1].Id, "cat /f; od -An -tx1 -N16 /dev/urandom")
	if !strings.HasPrefix(r0, "v1") || r0 == r1 {
		t.Errorf("fork children: %q, %q", r0, r1)
	}

	// Bad requests: each a clear status code, and the sandbox runs on.
	_, errGet := e.c.GetSandbox(ctx, &kilnpb.GetSandboxRequest{Id: "sb-nope"})
	_, errTemplate := e.c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{RequestId: nextReq(), Source: &kilnpb.CreateSandboxRequest_Template{Template: "nope"}})
	_, errCk := e.c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{RequestId: nextReq(), Source: &kilnpb.CreateSandboxRequest_Checkpoint{Checkpoint: "ck-nope"}})
	_, errFork := e.forkCtx(ctx, &kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_CheckpointId{CheckpointId: "ck-nope"}, Count: 1})
	_, errCPUs := e.c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{RequestId: nextReq(), Source: &kilnpb.CreateSandboxRequest_Image{Image: e.image}, Resources: &kilnpb.Resources{Cpus: 4096}})
	_, errMem := e.c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{RequestId: nextReq(), Source: &kilnpb.CreateSandboxRequest_Image{Image: e.image}, Resources: &kilnpb.Resources{MemoryMib: 1 << 30}})
	_, errNoReq := e.c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{Source: &kilnpb.CreateSandboxRequest_Image{Image: e.image}})
	_, errHugeReq := e.c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{RequestId: strings.Repeat("r", 4096), Source: &kilnpb.CreateSandboxRequest_Image{Image: e.image}})
	_, errPath := e.c.Stat(ctx, &kilnpb.StatRequest{SandboxId: sb.Id, Path: "/tmp/../../etc/passwd"})
	_, errRelPath := e.c.ListDir(ctx, &kilnpb.ListDirRequest{SandboxId: sb.Id, Path: "etc"})
	_, errMissing := e.c.Stat(ctx, &kilnpb.StatRequest{SandboxId: sb.Id, Path: "/no/such/file"})
	for _, bad := range []struct {
		name string
		err  error
		code codes.Code
		msg  string
	}{
		{"unknown sandbox", errGet, codes.NotFound, "sb-nope"},
		{"unknown template", errTemplate, codes.NotFound, "nope"},
		{"unknown checkpoint", errCk, codes.NotFound, "ck-nope"},
		{"fork of an unknown checkpoint", errFork, codes.NotFound, "ck-nope"},
		{"too many CPUs", errCPUs, codes.InvalidArgument, "cpus"},
		{"more memory than the host", errMem, codes.InvalidArgument, "more than the host has"},
		{"no request ID", errNoReq, codes.InvalidArgument, "request_id is empty"},
		{"huge request ID", errHugeReq, codes.InvalidArgument, "4096 bytes"},
		{"a path escaping", errPath, codes.InvalidArgument, "path"},
		{"a relative path", errRelPath, codes.InvalidArgument, "path"},
		{"a missing file", errMissing, codes.NotFound, ""},
	} {
		if status.Code(bad.err) != bad.code || !strings.Contains(status.Convert(bad.err).Message(), bad.msg) {
			t.Errorf("%s: %v, want %v naming %q", bad.name, bad.err, bad.code, bad.msg)
		}
	}
	t.Run("terminals users files watch attach", func(t *testing.T) { kvmTerminalsAndFiles(t, e, sb.Id) })

	// A client that disconnects mid-exec: a foreground exec is killed, a
	// background one runs on, listed, until killed.
	fg, cancelFg := e.startExec(&kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"sleep", "1000"}})
	bg, cancelBg := e.startExec(&kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"sleep", "1001"}, Background: true})
	cancelFg()
	cancelBg()
	probe := fmt.Sprintf("for i in $(seq 100); do kill -0 %d 2>/dev/null || break; sleep 0.1; done; kill -0 %d 2>/dev/null && echo fg-alive || echo fg-gone; kill -0 %d 2>/dev/null && echo bg-alive || echo bg-gone", fg.Pid, fg.Pid, bg.Pid)
	if got := e.shOut(sb.Id, probe); got != "fg-gone\nbg-alive" {
		t.Errorf("after the client went: %q", got)
	}
	execs, err := e.c.ListExecs(ctx, &kilnpb.ListExecsRequest{SandboxId: sb.Id})
	if err != nil || !slices.ContainsFunc(execs.GetExecs(), func(x *kilnpb.ExecInfo) bool { return x.ExecId == bg.ExecId }) {
		t.Errorf("background exec %s not listed: %v %v", bg.ExecId, execs, err)
	}
	if _, err := e.c.KillExec(ctx, &kilnpb.KillExecRequest{SandboxId: sb.Id, ExecId: bg.ExecId}); err != nil {
		t.Errorf("kill the background exec: %v", err)
	}
	if got := e.shOut(sb.Id, fmt.Sprintf("for i in $(seq 100); do kill -0 %d 2>/dev/null || break; sleep 0.1; done; kill -0 %d 2>/dev/null && echo alive || echo gone", bg.Pid, bg.Pid)); got != "gone" {
		t.Errorf("background exec after KillExec: %q", got)
	}

	// A background exec outlives the restart below: the agent keeps it.
	survivor, cancelSurvivor := e.startExec(&kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"sleep", "1000"}, Background: true})
	cancelSurvivor()

	// A restart takes every sandbox over.
	before, _ := e.c.ListSandboxes(ctx, &kilnpb.ListSandboxesRequest{})
	e.stop()
	e.startKVM()
	after, err := e.c.ListSandboxes(ctx, &kilnpb.ListSandboxesRequest{})
	if err != nil || len(after.Sandboxes) != len(before.Sandboxes) {
		t.Fatalf("after the restart: %v %v, before %v", after, err, before)
	}
	for _, s := range after.Sandboxes {
		if got := e.shOut(s.Id, "echo back"); got != "back" {
			t.Errorf("sandbox %s after the restart: %q", s.Id, got)
		}
	}
	// The background exec is listed again, alive, and KillExec ends it.
	execs, err = e.c.ListExecs(ctx, &kilnpb.ListExecsRequest{SandboxId: sb.Id})
	if i := slices.IndexFunc(execs.GetExecs(), func(x *kilnpb.ExecInfo) bool { return x.ExecId == survivor.ExecId }); err != nil || i < 0 ||
		execs.Execs[i].Exit != nil || execs.Execs[i].Pid != survivor.Pid || !execs.Execs[i].Background {
		t.Errorf("background exec %s (pid %d) after the restart: %v %v", survivor.ExecId, survivor.Pid, execs, err)
	}
	if got := e.shOut(sb.Id, fmt.Sprintf("kill -0 %d && echo alive", survivor.Pid)); got != "alive" {
		t.Errorf("background exec after the restart: %q", got)
	}
	if _, err := e.c.KillExec(ctx, &kilnpb.KillExecRequest{SandboxId: sb.Id, ExecId: survivor.ExecId}); err != nil {
		t.Errorf("kill the background exec after the restart: %v", err)
	}
	if got := e.shOut(sb.Id, fmt.Sprintf("for i in $(seq 100); do kill -0 %d 2>/dev/null || break; sleep 0.1; done; kill -0 %d 2>/dev/null && echo alive || echo gone", survivor.Pid, survivor.Pid)); got != "gone" {
		t.Errorf("background exec after KillExec after the restart: %q", got)
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		execs, err = e.c.ListExecs(ctx, &kilnpb.ListExecsRequest{SandboxId: sb.Id})
		i := slices.IndexFunc(execs.GetExecs(), func(x *kilnpb.ExecInfo) bool { return x.ExecId == survivor.ExecId })
		if err == nil && i >= 0 && execs.Execs[i].Exit != nil {
			if x := execs.Execs[i].Exit; x.Signal != int32(syscall.SIGKILL) {
				t.Errorf("background exec killed after the restart: exit %v", x)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("background exec killed after the restart not listed as exited: %v %v", execs, err)
			break
		}
	}
	if more, err := e.forkCtx(ctx, &kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_CheckpointId{CheckpointId: ck1.Id}, Count: 1}); err != nil || len(more) != 1 {
		t.Errorf("fork of a checkpoint from before the restart: %v %v", more, err)
	}
	// The volume across the restart: still the sandbox's, then, once it
	// is destroyed, the next one's (read-only), with what it wrote.
	if got, err := e.c.GetVolume(ctx, &kilnpb.GetVolumeRequest{Id: vol.Id}); err != nil || len(got.Users) != 1 || got.Users[0].Sandbox != withVol.Id {
		t.Errorf("the volume after the restart: %v, %v", got, err)
	}
	if _, err := e.c.DestroySandbox(ctx, &kilnpb.DestroySandboxRequest{Id: withVol.Id}); err != nil {
		t.Fatal(err)
	}

	// Idle timeout on the real clock (the sandbox reads the volume first).
	idle := e.createImage(10_000, &kilnpb.VolumeMount{Volume: vol.Id, Path: "/vol", ReadOnly: true})
	if got := e.shOut(idle.Id, "cat /vol/f; touch /vol/g 2>/dev/null && echo wrote || echo refused"); got != "written\nrefused" {
		t.Errorf("the volume in the next sandbox: %q", got)
	}
	time.Sleep(12 * time.Second)
	e.waitState(idle.Id, kilnpb.SandboxState_SANDBOX_STATE_TIMED_OUT)

	// Destroy leaves no VMM process and no folder.
	all, _ := e.c.ListSandboxes(ctx, &kilnpb.ListSandboxesRequest{})
	for _, s := range all.Sandboxes {
		if _, err := e.c.DestroySandbox(ctx, &kilnpb.DestroySandboxRequest{Id: s.Id}); err != nil {
			t.Errorf("destroy %s: %v", s.Id, err)
		}
		if alive(s.Pid) {
			t.Errorf("sandbox %s: VMM process %d left", s.Id, s.Pid)
		}
	}
	left, _ := filepath.Glob(filepath.Join(e.state, "sandboxes", "*", "*.sock"))
	if len(left) > 0 {
		t.Errorf("sockets left: %v", left)
	}
	if _, err := e.c.DeleteVolume(ctx, &kilnpb.DeleteVolumeRequest{Id: vol.Id}); err != nil {
		t.Errorf("delete the volume: %v", err)
	}
}

// TestKVMDaemonTemplates: one template (busybox, set up once), N
// concurrent creates from it with one exec each (KILN_TEMPLATE_STORM,
// default 12: more than kilnd starts at once on L1's one CPU, so the
// queue is exercised; make soak runs 100), a warm pool's hand-out under a
// new identity, and every sandbox gone after destroy.
func TestKVMDaemonTemplates(t *testing.T) {
	kvmtest.Require(t)
	n := 12
	if s := os.Getenv("KILN_TEMPLATE_STORM"); s != "" {
		var err error
		if n, err = strconv.Atoi(s); err != nil || n < 1 || n > 1000 {
			t.Fatalf("KILN_TEMPLATE_STORM=%q: want 1 to 1000 concurrent creates", s)
		}
	}
	e := newKVMEnv(t)
	// Restored sandboxes share the template's pages: 100 of 128 MiB each
	// are more guest memory than L1 has, and fit.
	e.stop()
	e.cfg.MaxMemoryMiB = uint64(max(n, 100)) * 128 * 2
	e.cfg.MemoryOvercommit = 16 // 100 × (128 + 128 MiB of VMM overhead) committed on L1's 4 GiB
	e.startKVM()
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Minute)
	defer cancel()

	began := time.Now()
	// With a warm pool of 2 (checked after the storm): one template
	// build, not two.
	tp, err := e.c.CreateTemplate(ctx, &kilnpb.CreateTemplateRequest{Name: "bb", Image: e.image, RequestId: nextReq(),
		Setup:     []string{"sh", "-c", "echo ready > /setup"},
		Resources: &kilnpb.Resources{MemoryMib: 128}, PoolSize: 2})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("template %s ready in %v", tp.Id, time.Since(began).Round(time.Millisecond))

	// n creates at once, each followed by an exec and a destroy (an RL
	// step's life); kilnd starts Config.MaxStarting at a time (4 per
	// CPU) and queues the rest.
	began = time.Now()
	sbs := make([]*kilnpb.Sandbox, n)
	outs := make([]string, n)
	errs := make([]error, n)
	var done atomic.Int32
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() {
				if d := done.Add(1); d%20 == 0 || int(d) == n {
					t.Logf("%d of %d done after %v", d, n, time.Since(began).Round(time.Second))
				}
			}()
			sb, err := e.c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{RequestId: nextReq(),
				Source: &kilnpb.CreateSandboxRequest_Template{Template: "bb"}})
			if err != nil {
				errs[i] = err
				return
			}
			sbs[i] = sb
			r := e.exec(ctx, &kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"sh", "-c", "cat /setup; hostname"}})
			if r.err != nil || r.exit.GetExitCode() != 0 {
				errs[i] = fmt.Errorf("exec: %+v", r)
			}
			outs[i] = r.stdout
			if _, err := e.c.DestroySandbox(ctx, &kilnpb.DestroySandboxRequest{Id: sb.Id}); err != nil {
				errs[i] = errors.Join(errs[i], fmt.Errorf("destroy: %w", err))
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(began)
	var ready []int64
	failures := 0
	for i, sb := range sbs {
		if errs[i] != nil {
			failures++
			t.Errorf("sandbox %d: %v", i, errs[i])
			continue
		}
		if want := "ready\n" + sb.Id + "\n"; outs[i] != want {
			t.Errorf("sandbox %s printed %q, want %q", sb.Id, outs[i], want)
		}
		ready = append(ready, sb.ReadyMs)
	}
	slices.Sort(ready)
	if len(ready) > 0 {
		t.Logf("%d concurrent creates from a template, an exec and a destroy each: %v in all, %d errors; create to ready p50 %d ms, p95 %d ms, max %d ms (emulated KVM, queued %d at a time)",
			n, elapsed.Round(time.Millisecond), failures, ready[len(ready)/2], ready[len(ready)*95/100], ready[len(ready)-1], 4*runtime.NumCPU())
	}
	// Destroyed: no VMM process, socket, folder or memory file left.
	for _, sb := range sbs {
		if sb == nil {
			continue
		}
		if got, err := e.c.GetSandbox(ctx, &kilnpb.GetSandboxRequest{Id: sb.Id}); err != nil || got.State != kilnpb.SandboxState_SANDBOX_STATE_DESTROYED {
			t.Errorf("sandbox %s after destroy: %v %v", sb.Id, got, err)
		}
		if alive(sb.Pid) {
			t.Errorf("sandbox %s: VMM process %d left", sb.Id, sb.Pid)
		}
	}
	// Only the template's warm pool (2, pl-*) has folders now: the
	// destroyed sandboxes, pooled ones handed out included, left none.
	held := map[string]bool{}
	for _, p := range globAll(e.state, "sandboxes/*/*") {
		held[filepath.Base(filepath.Dir(p))] = true
	}
	for d := range held {
		if !strings.HasPrefix(d, "pl-") {
			t.Errorf("left in sandbox folder %s: %v", d, globAll(e.state, "sandboxes/"+d+"/*"))
		}
	}
	if len(held) > 2 {
		t.Errorf("%d sandbox folders hold files after the storm, more than the pool's 2: %v", len(held), held)
	}

	// The warm pool, refilled after the storm: a sandbox handed out
	// answers at once, under its own name and with entropy of its own.
	wp := tp
	deadline := time.Now().Add(10 * time.Minute)
	for wp.PoolReady < 2 && time.Now().Before(deadline) {
		time.Sleep(time.Second)
		if wp, err = e.c.GetTemplate(ctx, &kilnpb.GetTemplateRequest{Id: wp.Id}); err != nil {
			t.Fatal(err)
		}
	}
	var pooled []string
	for range 2 {
		sb, err := e.c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{RequestId: nextReq(),
			Source: &kilnpb.CreateSandboxRequest_Template{Template: "bb"}})
		if err != nil {
			t.Fatal(err)
		}
		if !sb.FromPool {
			t.Errorf("sandbox %s not from the pool (%d ready)", sb.Id, wp.PoolReady)
		}
		out := e.shOut(sb.Id, "cat /setup; hostname; od -An -tx1 -N16 /dev/urandom")
		if !strings.HasPrefix(out, "ready\n"+sb.Id+"\n") {
			t.Errorf("pool sandbox %s: %q", sb.Id, out)
		}
		t.Logf("from the pool: %s ready in %d ms", sb.Id, sb.ReadyMs)
		pooled = append(pooled, strings.SplitN(out, "\n", 3)[2])
		defer e.c.DestroySandbox(context.Background(), &kilnpb.DestroySandboxRequest{Id: sb.Id})
	}
	if pooled[0] == pooled[1] {
		t.Errorf("two pool sandboxes read the same entropy: %q", pooled[0])
	}
}

func globAll(dir, pattern string) []string {
	m, _ := filepath.Glob(filepath.Join(dir, pattern))
	return m
}

// kvmTerminalsAndFiles checks in a running sandbox: an exec on a pty
// (tty, stty size, a resize), an exec and a file as a user added to the
// guest's /etc/passwd, a move, a watch seeing what a command does, and an
// attach to a background exec.
func kvmTerminalsAndFiles(t *testing.T, e *kvmEnv, id string) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	const slow = 2 * time.Minute // TCG

	// A pty: tty names /dev/pts/N, stty sees the size and the resize.
	x := e.liveExec(ctx, &kilnpb.ExecStart{SandboxId: id, Argv: []string{"sh", "-c", `tty; stty size; echo ready; read l; stty size; echo "got $l"`},
		Pty: &kilnpb.PtySize{Rows: 24, Cols: 80}})
	waitUntilFor(t, "ready", slow, func() bool { return strings.Contains(x.output(), "ready\n") })
	x.stream.Send(&kilnpb.ExecRequest{Kind: &kilnpb.ExecRequest_Resize{Resize: &kilnpb.PtySize{Rows: 50, Cols: 132}}})
	x.stream.Send(&kilnpb.ExecRequest{Kind: &kilnpb.ExecRequest_Stdin{Stdin: []byte("hi\n")}})
	if exit := <-x.exit; exit.GetExitCode() != 0 {
		t.Errorf("pty exec: %v: %q", exit, x.output())
	}
	for _, want := range []string{"/dev/pts/", "\n24 80\n", "\n50 132\n", "got hi\n"} {
		if !strings.Contains(x.output(), want) {
			t.Errorf("pty output %q lacks %q", x.output(), want)
		}
	}

	// A user the image lacks, added by hand (no useradd in busybox).
	e.shOut(id, `echo 'kuser:x:1234:1234::/home/kuser:/bin/sh' >> /etc/passwd; echo 'kgroup:x:1234:' >> /etc/group; echo 'kextra:x:2345:kuser' >> /etc/group; mkdir -p /home/kuser`)
	r := e.exec(ctx, &kilnpb.ExecStart{SandboxId: id, Argv: []string{"sh", "-c", `echo "$(id -u) $(id -g) $(id -G) $HOME $USER"`}, User: "kuser"})
	if r.err != nil || r.stdout != "1234 1234 1234 2345 /home/kuser kuser\n" {
		t.Errorf("exec as kuser: %+v (%v)", r, r.err)
	}
	fi, err := e.writeFile(ctx, &kilnpb.WriteFileHeader{SandboxId: id, Path: "/home/kuser/d/f", MakeParents: true, User: "kuser"}, []byte("k"))
	if err != nil || fi.Owner != "kuser" || fi.Group != "kgroup" || fi.Uid != 1234 {
		t.Errorf("write as kuser: %v %v", fi, err)
	}
	l, err := e.c.ListDir(ctx, &kilnpb.ListDirRequest{SandboxId: id, Path: "/home/kuser", Depth: 2})
	if err != nil || len(l.Entries) != 2 || l.Entries[1].Path != "/home/kuser/d/f" || l.Entries[0].Owner != "kuser" {
		t.Errorf("list to depth 2: %v %v", l, err)
	}

	// Move.
	mv, err := e.c.Move(ctx, &kilnpb.MoveRequest{SandboxId: id, Source: "/home/kuser/d/f", Destination: "/home/kuser/g"})
	if err != nil || mv.Path != "/home/kuser/g" || mv.Size != 1 {
		t.Errorf("move: %v %v", mv, err)
	}
	if got := e.shOut(id, "cat /home/kuser/g; echo; test -e /home/kuser/d/f || echo gone"); got != "k\ngone" {
		t.Errorf("after the move: %q", got)
	}

	// A watch sees a file a command creates.
	e.shOut(id, "mkdir -p /tmp/watched")
	wctx, wcancel := context.WithCancel(ctx)
	w, err := e.c.WatchDir(wctx, &kilnpb.WatchDirRequest{SandboxId: id, Path: "/tmp/watched", Recursive: true})
	if err != nil {
		t.Fatal(err)
	}
	if ev, err := w.Recv(); err != nil || !ev.Started {
		t.Fatalf("watch: first event %v %v", ev, err)
	}
	e.shOut(id, "echo x > /tmp/watched/by-cmd")
	for {
		ev, err := w.Recv()
		if err != nil {
			t.Fatalf("watch: %v before the command's file", err)
		}
		if ev.Op == kilnpb.WatchEvent_OP_CREATE && ev.Name == "by-cmd" {
			break
		}
	}
	wcancel()

	// Attach to a background exec: its output from now on, then its exit.
	bg := e.liveExec(ctx, &kilnpb.ExecStart{SandboxId: id, Argv: []string{"sh", "-c", "while :; do echo tick; sleep 0.2; done"}, Background: true})
	at, err := e.c.AttachExec(ctx, &kilnpb.AttachExecRequest{SandboxId: id, ExecId: bg.id})
	if err != nil {
		t.Fatal(err)
	}
	var seen strings.Builder
	killed := false
	for {
		r, err := at.Recv()
		if err != nil {
			t.Fatalf("attach: %v after %q", err, seen.String())
		}
		seen.Write(r.GetStdout())
		if !killed && strings.Contains(seen.String(), "tick") {
			killed = true
			if _, err := e.c.KillExec(ctx, &kilnpb.KillExecRequest{SandboxId: id, ExecId: bg.id}); err != nil {
				t.Fatal(err)
			}
		}
		if x := r.GetExit(); x != nil {
			if !killed || x.Signal != int32(syscall.SIGKILL) {
				t.Errorf("attach: exit %v after %q", x, seen.String())
			}
			break
		}
	}
}
