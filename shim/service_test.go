package shim

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	eventstypes "github.com/containerd/containerd/api/events"
	taskAPI "github.com/containerd/containerd/api/runtime/task/v2"
	"github.com/containerd/containerd/api/types/task"
	"github.com/containerd/containerd/errdefs"
	"github.com/containerd/containerd/events"
	"github.com/containerd/containerd/pkg/shutdown"
	"github.com/containerd/fifo"
	"github.com/containerd/ttrpc"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/kilnvm/kiln/guest/client"
)

// hostBooter is a Booter whose "VMs" run processes on the host: the Task
// service's plumbing (FIFOs, exits, events, signals) tested without KVM.
type hostBooter struct {
	mu    sync.Mutex
	boots []BootSpec
	vms   []*hostVM
	// gate, when set, holds every boot until it is closed (a slow boot).
	gate chan struct{}
}

func (b *hostBooter) Boot(ctx context.Context, spec BootSpec) (VM, error) {
	if b.gate != nil {
		select {
		case <-b.gate:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.boots = append(b.boots, spec)
	vm := &hostVM{}
	b.vms = append(b.vms, vm)
	return vm, nil
}

// hostVM runs host processes; its Pause, Resume and Save are recorded
// (Save writes a marker file where the snapshot would be).
type hostVM struct {
	mu     sync.Mutex
	calls  []string
	closed bool
	roots  map[string]string // container roots: name → host directory
	// saveGate, when set, holds Save until it is closed (a slow save).
	saveGate chan struct{}
}

func (v *hostVM) record(call string) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.calls = append(v.calls, call)
}

func (v *hostVM) Start(ctx context.Context, opts client.ExecOptions) (GuestProcess, error) {
	cmd := exec.CommandContext(ctx, opts.Argv[0], opts.Argv[1:]...)
	cmd.Env, cmd.Dir = opts.Env, "/"
	if opts.Root != "" { // a host process cannot chroot here: it runs in the root's folder
		v.mu.Lock()
		dir, ok := v.roots[opts.Root]
		v.mu.Unlock()
		if !ok {
			return nil, fmt.Errorf("root %s is not mounted", opts.Root)
		}
		cmd.Dir = dir
	}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = opts.Stdin, opts.Stdout, opts.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	return &hostProc{cmd: cmd}, nil
}

func (v *hostVM) ReadFile(ctx context.Context, path string, w io.Writer) (int64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	n, err := w.Write(b)
	return int64(n), err
}
func (v *hostVM) Pause(context.Context) error  { v.record("pause"); return nil }
func (v *hostVM) Resume(context.Context) error { v.record("resume"); return nil }
func (v *hostVM) Save(_ context.Context, dir string) error {
	if v.saveGate != nil {
		<-v.saveGate
	}
	v.record("save")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "state"), []byte("host processes have no snapshot"), 0o600)
}
func (v *hostVM) Close(context.Context) error { v.record("close"); v.closed = true; return nil }

func (v *hostVM) MountRoot(_ context.Context, name, dir string) error {
	v.record("mountroot " + name)
	v.mu.Lock()
	defer v.mu.Unlock()
	if _, ok := v.roots[name]; ok {
		return fmt.Errorf("root %s is mounted", name)
	}
	if v.roots == nil {
		v.roots = map[string]string{}
	}
	v.roots[name] = dir
	return nil
}

func (v *hostVM) UnmountRoot(_ context.Context, name string) error {
	v.record("unmountroot " + name)
	v.mu.Lock()
	defer v.mu.Unlock()
	if _, ok := v.roots[name]; !ok {
		return fmt.Errorf("root %s is not mounted", name)
	}
	delete(v.roots, name)
	return nil
}

func (v *hostVM) ServeDir(name, dir string) error {
	v.record("serve " + name + " " + dir)
	return nil
}

func (v *hostVM) StopServingDir(name string) error {
	v.record("stopserving " + name)
	return nil
}

func (v *hostVM) AddMounts(_ context.Context, root string, ms []client.Mount) error {
	var parts []string
	for _, m := range ms {
		parts = append(parts, fmt.Sprintf("%d:%s:%s", m.Kind, m.Destination, m.Name))
	}
	v.record("mounts " + root + " " + strings.Join(parts, ","))
	return nil
}

// Adopt stands a fresh host process in for the restored VM's copy of the
// checkpointed one (host processes cannot be restored).
func (v *hostVM) Adopt(ctx context.Context, id string, stdout, stderr io.Writer) (GuestProcess, error) {
	v.record("adopt " + id)
	return v.Start(ctx, client.ExecOptions{Argv: []string{"sleep", "600"}, Stdout: stdout, Stderr: stderr})
}

func (v *hostVM) callList() []string {
	v.mu.Lock()
	defer v.mu.Unlock()
	return slices.Clone(v.calls)
}

type hostProc struct{ cmd *exec.Cmd }

func (p *hostProc) Pid() int                        { return p.cmd.Process.Pid }
func (p *hostProc) Signal(sig syscall.Signal) error { return p.cmd.Process.Signal(sig) }
func (p *hostProc) SignalGroup(sig syscall.Signal) error {
	return syscall.Kill(-p.cmd.Process.Pid, sig)
}
func (p *hostProc) Resize(client.PtySize) error { return nil }
func (p *hostProc) Wait() (client.ExitStatus, error) {
	err := p.cmd.Wait()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			return client.ExitStatus{Code: -1, Signal: int(ws.Signal())}, nil
		}
		return client.ExitStatus{Code: ee.ExitCode()}, nil
	}
	return client.ExitStatus{}, err
}

// recorder is a shim.Publisher that keeps the events' topics.
type recorder struct {
	mu     sync.Mutex
	topics []string
	exits  []*eventstypes.TaskExit
}

func (r *recorder) Close() error { return nil }

func (r *recorder) Publish(ctx context.Context, topic string, ev events.Event) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.topics = append(r.topics, topic)
	if e, ok := ev.(*eventstypes.TaskExit); ok {
		r.exits = append(r.exits, e)
	}
	return nil
}

func (r *recorder) got() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.topics...)
}

// bundle writes a bundle with spec (its rootfs a plain folder) and returns
// its path.
func bundle(t *testing.T, s *specs.Spec) string {
	t.Helper()
	dir := t.TempDir()
	if err := os.Mkdir(filepath.Join(dir, "rootfs"), 0o755); err != nil {
		t.Fatal(err)
	}
	b, err := json.Marshal(s)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "config.json"), b, 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

func testSpec(args ...string) *specs.Spec {
	return &specs.Spec{
		Process: &specs.Process{Args: args, Env: []string{"PATH=/usr/bin:/bin"}, Cwd: "/"},
		Root:    &specs.Root{Path: "rootfs"},
		Linux: &specs.Linux{Namespaces: []specs.LinuxNamespace{
			{Type: specs.PIDNamespace}, {Type: specs.IPCNamespace}, {Type: specs.NetworkNamespace}, {Type: specs.MountNamespace},
		}},
	}
}

// fifos makes stdin/stdout/stderr FIFOs, opens containerd's ends, and
// collects the outputs.
type testIO struct {
	stdin, stdout, stderr string
	in                    io.WriteCloser
	out, err              *bytes.Buffer
	wg                    sync.WaitGroup
}

func newIO(t *testing.T, withStdin bool) *testIO {
	t.Helper()
	dir := t.TempDir()
	tio := &testIO{stdout: filepath.Join(dir, "out"), stderr: filepath.Join(dir, "err"), out: &bytes.Buffer{}, err: &bytes.Buffer{}}
	ctx := context.Background()
	for _, p := range []struct {
		path string
		buf  *bytes.Buffer
	}{{tio.stdout, tio.out}, {tio.stderr, tio.err}} {
		f, err := fifo.OpenFifo(ctx, p.path, syscall.O_RDONLY|syscall.O_CREAT|syscall.O_NONBLOCK, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		tio.wg.Add(1)
		go func(f io.ReadCloser, buf *bytes.Buffer) {
			defer tio.wg.Done()
			io.Copy(buf, f)
			f.Close()
		}(f, p.buf)
	}
	if withStdin {
		tio.stdin = filepath.Join(dir, "in")
		f, err := fifo.OpenFifo(ctx, tio.stdin, syscall.O_WRONLY|syscall.O_CREAT|syscall.O_NONBLOCK, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		tio.in = f
	}
	return tio
}

func newTestService(t *testing.T) (*Service, *recorder, *hostBooter) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	ctx, sd := shutdown.WithShutdown(ctx)
	t.Cleanup(func() { sd.Shutdown(); cancel() })
	rec := &recorder{}
	boot := &hostBooter{}
	cfg, _ := Config{}.withDefaults()
	return NewService(ctx, cfg, boot, rec, sd, slog.New(slog.NewTextHandler(io.Discard, nil))), rec, boot
}

func waitTopics(t *testing.T, rec *recorder, want ...string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		got := rec.got()
		if strings.Join(got, " ") == strings.Join(want, " ") {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("events %q, want %q", got, want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestServiceRunToExit(t *testing.T) {
	s, rec, boot := newTestService(t)
	ctx := context.Background()
	tio := newIO(t, true)
	b := bundle(t, testSpec("sh", "-c", "cat; echo err >&2; exit 3"))
	if _, err := s.Create(ctx, &taskAPI.CreateTaskRequest{ID: "c1", Bundle: b, Stdin: tio.stdin, Stdout: tio.stdout, Stderr: tio.stderr}); err != nil {
		t.Fatal(err)
	}
	if len(boot.boots) != 1 || boot.boots[0].RootDir != filepath.Join(b, "rootfs") || boot.boots[0].CPUs != 1 || boot.boots[0].MemoryMiB != 512 {
		t.Fatalf("boots %+v", boot.boots)
	}
	st, err := s.State(ctx, &taskAPI.StateRequest{ID: "c1"})
	if err != nil || st.Status != task.Status_CREATED {
		t.Fatalf("State = %v, %v; want created", st, err)
	}
	if _, err := s.Start(ctx, &taskAPI.StartRequest{ID: "c1"}); err != nil {
		t.Fatal(err)
	}
	// As ctr does: write, then CloseIO at once (before the shim has read
	// what was written: it must still reach the guest), then close.
	tio.in.Write([]byte("hi\n"))
	if _, err := s.CloseIO(ctx, &taskAPI.CloseIORequest{ID: "c1", Stdin: true}); err != nil {
		t.Fatal(err)
	}
	tio.in.Close()
	w, err := s.Wait(ctx, &taskAPI.WaitRequest{ID: "c1"})
	if err != nil || w.ExitStatus != 3 {
		t.Fatalf("Wait = %v, %v; want exit 3", w, err)
	}
	tio.wg.Wait()
	if tio.out.String() != "hi\n" || tio.err.String() != "err\n" {
		t.Fatalf("stdout %q, stderr %q", tio.out, tio.err)
	}
	if _, err := s.Kill(ctx, &taskAPI.KillRequest{ID: "c1", Signal: 9}); !errdefs.IsNotFound(err) {
		t.Errorf("Kill of an exited process = %v, want NotFound", err)
	}
	d, err := s.Delete(ctx, &taskAPI.DeleteRequest{ID: "c1"})
	if err != nil || d.ExitStatus != 3 {
		t.Fatalf("Delete = %v, %v", d, err)
	}
	waitTopics(t, rec, "/tasks/create", "/tasks/start", "/tasks/exit", "/tasks/delete")
	if _, err := s.State(ctx, &taskAPI.StateRequest{ID: "c1"}); !errdefs.IsNotFound(err) {
		t.Errorf("State after Delete = %v, want NotFound", err)
	}
}

func TestServiceExecAndKill(t *testing.T) {
	s, rec, _ := newTestService(t)
	ctx := context.Background()
	tio := newIO(t, false)
	b := bundle(t, testSpec("sleep", "600"))
	if _, err := s.Create(ctx, &taskAPI.CreateTaskRequest{ID: "c2", Bundle: b, Stdout: tio.stdout, Stderr: tio.stderr}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Start(ctx, &taskAPI.StartRequest{ID: "c2"}); err != nil {
		t.Fatal(err)
	}
	eio := newIO(t, false)
	ps, _ := json.Marshal(&specs.Process{Args: []string{"sh", "-c", "echo from-exec; exit 5"}, Cwd: "/", Env: []string{"PATH=/usr/bin:/bin"}})
	if _, err := s.Exec(ctx, &taskAPI.ExecProcessRequest{ID: "c2", ExecID: "e1", Stdout: eio.stdout, Stderr: eio.stderr, Spec: &anypb.Any{Value: ps}}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Exec(ctx, &taskAPI.ExecProcessRequest{ID: "c2", ExecID: "e1", Spec: &anypb.Any{Value: ps}}); !errdefs.IsAlreadyExists(err) {
		t.Errorf("a second exec e1 = %v, want AlreadyExists", err)
	}
	if _, err := s.Start(ctx, &taskAPI.StartRequest{ID: "c2", ExecID: "e1"}); err != nil {
		t.Fatal(err)
	}
	w, err := s.Wait(ctx, &taskAPI.WaitRequest{ID: "c2", ExecID: "e1"})
	if err != nil || w.ExitStatus != 5 {
		t.Fatalf("Wait(e1) = %v, %v", w, err)
	}
	eio.wg.Wait()
	if eio.out.String() != "from-exec\n" {
		t.Errorf("exec stdout %q", eio.out)
	}
	if _, err := s.Delete(ctx, &taskAPI.DeleteRequest{ID: "c2", ExecID: "e1"}); err != nil {
		t.Fatal(err)
	}
	pids, err := s.Pids(ctx, &taskAPI.PidsRequest{ID: "c2"})
	if err != nil || len(pids.Processes) != 1 {
		t.Fatalf("Pids = %v, %v; want the init process", pids, err)
	}
	if _, err := s.Delete(ctx, &taskAPI.DeleteRequest{ID: "c2"}); !errdefs.IsFailedPrecondition(err) {
		t.Errorf("Delete of a running container = %v, want FailedPrecondition", err)
	}
	if _, err := s.Kill(ctx, &taskAPI.KillRequest{ID: "c2", Signal: 0}); !errdefs.IsInvalidArgument(err) {
		t.Errorf("Kill with signal 0 = %v, want InvalidArgument", err)
	}
	if _, err := s.Kill(ctx, &taskAPI.KillRequest{ID: "c2", Signal: uint32(syscall.SIGKILL)}); err != nil {
		t.Fatal(err)
	}
	w, err = s.Wait(ctx, &taskAPI.WaitRequest{ID: "c2"})
	if err != nil || w.ExitStatus != 137 {
		t.Fatalf("Wait after SIGKILL = %v, %v; want 137", w, err)
	}
	if _, err := s.Delete(ctx, &taskAPI.DeleteRequest{ID: "c2"}); err != nil {
		t.Fatal(err)
	}
	waitTopics(t, rec, "/tasks/create", "/tasks/start", "/tasks/exec-added", "/tasks/exec-started", "/tasks/exit", "/tasks/exit", "/tasks/delete")
	rec.mu.Lock()
	last := rec.exits[len(rec.exits)-1]
	rec.mu.Unlock()
	if last.ID != "c2" || last.ExitStatus != 137 {
		t.Errorf("last exit event %+v, want c2 with 137", last)
	}
}

// TestServiceCheckpointPaused: containerd's client pauses a task around
// its checkpoint; the VM runs again just for the save (the agent must
// quiesce the guest) and is paused after it, still paused as containerd
// left it. The checkpoint lands in the path given; a relative path, or a
// pod's sandbox container, is refused.
func TestServiceCheckpointPaused(t *testing.T) {
	s, rec, boot := newTestService(t)
	ctx := context.Background()
	tio := newIO(t, false)
	b := bundle(t, testSpec("sleep", "600"))
	if _, err := s.Create(ctx, &taskAPI.CreateTaskRequest{ID: "c3", Bundle: b, Stdout: tio.stdout, Stderr: tio.stderr}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Start(ctx, &taskAPI.StartRequest{ID: "c3"}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pause(ctx, &taskAPI.PauseRequest{ID: "c3"}); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if _, err := s.Checkpoint(ctx, &taskAPI.CheckpointTaskRequest{ID: "c3", Path: dir}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, checkpointDir, "state")); err != nil {
		t.Errorf("the checkpoint is not in its path: %v", err)
	}
	vm := boot.vms[0]
	vm.mu.Lock()
	calls := strings.Join(vm.calls, " ")
	vm.mu.Unlock()
	if m, err := readCheckpointMeta(dir); err != nil || m.Init != "init:c3" {
		t.Errorf("the checkpoint's %s: %+v, %v; want init init:c3", checkpointMetaFile, m, err)
	}
	if calls != "pause resume save pause" {
		t.Errorf("VM calls %q, want pause resume save pause", calls)
	}
	if st, err := s.State(ctx, &taskAPI.StateRequest{ID: "c3"}); err != nil || st.Status != task.Status_PAUSED {
		t.Errorf("State after the checkpoint = %v, %v; want paused", st, err)
	}
	if _, err := s.Checkpoint(ctx, &taskAPI.CheckpointTaskRequest{ID: "c3", Path: "relative"}); !errdefs.IsInvalidArgument(err) {
		t.Errorf("Checkpoint to a relative path = %v, want InvalidArgument", err)
	}
	if _, err := s.Resume(ctx, &taskAPI.ResumeRequest{ID: "c3"}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Kill(ctx, &taskAPI.KillRequest{ID: "c3", Signal: uint32(syscall.SIGKILL)}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Wait(ctx, &taskAPI.WaitRequest{ID: "c3"}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Delete(ctx, &taskAPI.DeleteRequest{ID: "c3"}); err != nil {
		t.Fatal(err)
	}
	waitTopics(t, rec, "/tasks/create", "/tasks/start", "/tasks/paused", "/tasks/checkpointed", "/tasks/resumed", "/tasks/exit", "/tasks/delete")
}

// TestServiceRestoreAdopts: a task created from a checkpoint takes over
// the checkpointed init process (detached in the guest, so the restored
// VM still runs it) rather than running its spec's process anew; a
// checkpoint whose metadata is not valid is refused at Create.
func TestServiceRestoreAdopts(t *testing.T) {
	s, _, boot := newTestService(t)
	ctx := context.Background()
	dir := t.TempDir()
	if err := writeCheckpointMeta(dir, checkpointMeta{Init: "init:orig"}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Create(ctx, &taskAPI.CreateTaskRequest{ID: "r", Bundle: bundle(t, testSpec("false")), Checkpoint: dir}); err != nil {
		t.Fatal(err)
	}
	if boot.boots[0].Checkpoint != dir {
		t.Errorf("boot %+v, want a restore of %s", boot.boots[0], dir)
	}
	if _, err := s.Start(ctx, &taskAPI.StartRequest{ID: "r"}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Kill(ctx, &taskAPI.KillRequest{ID: "r", Signal: uint32(syscall.SIGKILL)}); err != nil {
		t.Fatal(err)
	}
	// The spec's process (false) would exit 1 at once: the adopted one
	// ran until killed.
	if w, err := s.Wait(ctx, &taskAPI.WaitRequest{ID: "r"}); err != nil || w.ExitStatus != 137 {
		t.Errorf("Wait = %v, %v; want the adopted process killed (137)", w, err)
	}
	if got := boot.vms[0].callList(); !slices.Equal(got, []string{"adopt init:orig"}) {
		t.Errorf("VM calls %q, want the adoption of init:orig", got)
	}
	if _, err := s.Delete(ctx, &taskAPI.DeleteRequest{ID: "r"}); err != nil {
		t.Fatal(err)
	}

	for name, meta := range map[string]string{
		"not json":  "{",
		"bad id":    `{"init":"../x y"}`,
		"too large": `{"init":"` + strings.Repeat("a", 5000) + `"}`,
	} {
		d := t.TempDir()
		os.WriteFile(filepath.Join(d, checkpointMetaFile), []byte(meta), 0o600)
		if _, err := s.Create(ctx, &taskAPI.CreateTaskRequest{ID: "bad", Bundle: bundle(t, testSpec("true")), Checkpoint: d}); !errdefs.IsInvalidArgument(err) {
			t.Errorf("%s: Create = %v, want InvalidArgument", name, err)
		}
	}
}

func TestServiceRefusesSpecs(t *testing.T) {
	devSpec := testSpec("true")
	devSpec.Linux.Devices = []specs.LinuxDevice{{Path: "/dev/kvm", Type: "c", Major: 10, Minor: 232}}
	hostPID := testSpec("true")
	hostPID.Linux.Namespaces = hostPID.Linux.Namespaces[1:]
	noArgs := testSpec()
	bigCPU := testSpec("true")
	bigCPU.Annotations = map[string]string{AnnotationVCPUs: "1000"}
	badMem := testSpec("true")
	badMem.Annotations = map[string]string{AnnotationMemoryMiB: "lots"}
	for _, tt := range []struct {
		name string
		spec *specs.Spec
		want string
		is   func(error) bool
	}{
		{"device", devSpec, "host device", errdefs.IsNotImplemented},
		{"host PID namespace", hostPID, "PID namespace", errdefs.IsNotImplemented},
		{"no args", noArgs, "no process", errdefs.IsInvalidArgument},
		{"too many vCPUs", bigCPU, "vCPUs", errdefs.IsInvalidArgument},
		{"bad memory annotation", badMem, AnnotationMemoryMiB, errdefs.IsInvalidArgument},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s, rec, boot := newTestService(t)
			_, err := s.Create(context.Background(), &taskAPI.CreateTaskRequest{ID: "x", Bundle: bundle(t, tt.spec)})
			if err == nil || !strings.Contains(err.Error(), tt.want) || !tt.is(err) {
				t.Fatalf("Create = %v; want an error naming %q of the right kind", err, tt.want)
			}
			if len(boot.boots) != 0 || len(rec.got()) != 0 {
				t.Errorf("a refused spec booted %d VMs and sent %q", len(boot.boots), rec.got())
			}
		})
	}
}

func TestServicePod(t *testing.T) {
	s, rec, boot := newTestService(t)
	ctx := context.Background()
	pause := testSpec("/pause")
	pause.Annotations = map[string]string{criContainerType: criTypeSandbox, criSandboxID: "pod1"}
	if _, err := s.Create(ctx, &taskAPI.CreateTaskRequest{ID: "pod1", Bundle: bundle(t, pause)}); err != nil {
		t.Fatal(err)
	}
	if len(boot.boots) != 0 {
		t.Fatalf("the pod's sandbox container booted a VM")
	}
	st, err := s.Start(ctx, &taskAPI.StartRequest{ID: "pod1"})
	if err != nil || st.Pid != uint32(os.Getpid()) {
		t.Fatalf("Start(pod1) = %v, %v", st, err)
	}
	app := testSpec("sleep", "600")
	app.Annotations = map[string]string{"io.kubernetes.cri.container-type": "container", criSandboxID: "pod1", AnnotationVCPUs: "2", AnnotationMemoryMiB: "1024"}
	if _, err := s.Create(ctx, &taskAPI.CreateTaskRequest{ID: "app", Bundle: bundle(t, app)}); err != nil {
		t.Fatal(err)
	}
	if len(boot.boots) != 1 || boot.boots[0].CPUs != 2 || boot.boots[0].MemoryMiB != 1024 {
		t.Fatalf("boots %+v; want one of 2 vCPUs and 1024 MiB", boot.boots)
	}
	if _, err := s.Create(ctx, &taskAPI.CreateTaskRequest{ID: "app2", Bundle: bundle(t, app)}); err != nil {
		t.Fatalf("a second application container: %v", err)
	}
	if len(boot.boots) != 1 {
		t.Fatalf("the second container booted a VM of its own: %+v", boot.boots)
	}
	if _, err := s.Delete(ctx, &taskAPI.DeleteRequest{ID: "app2"}); err != nil { // created, never started
		t.Fatal(err)
	}
	if _, err := s.Kill(ctx, &taskAPI.KillRequest{ID: "pod1", Signal: 15}); err != nil {
		t.Fatal(err)
	}
	w, err := s.Wait(ctx, &taskAPI.WaitRequest{ID: "pod1"})
	if err != nil || w.ExitStatus != 128+15 {
		t.Fatalf("Wait(pod1) = %v, %v", w, err)
	}
	if _, err := s.Delete(ctx, &taskAPI.DeleteRequest{ID: "app"}); err != nil { // created, never started
		t.Fatal(err)
	}
	if _, err := s.Delete(ctx, &taskAPI.DeleteRequest{ID: "pod1"}); err != nil {
		t.Fatal(err)
	}
	waitTopics(t, rec, "/tasks/create", "/tasks/start", "/tasks/create", "/tasks/create", "/tasks/exit", "/tasks/delete", "/tasks/exit", "/tasks/exit", "/tasks/delete", "/tasks/delete")
	if got := boot.vms[0].callList(); !slices.Equal(got, []string{"mountroot app2", "unmountroot app2", "close"}) {
		t.Errorf("VM calls %q", got)
	}
}

// TestServicePodContainers: a pod's application containers share one VM:
// the first's rootfs is its root, each other's a container root its
// processes run in; the VM outlives the first while others run, stops
// with the last, and what would stop or save them all is refused while
// they share it.
func TestServicePodContainers(t *testing.T) {
	s, _, boot := newTestService(t)
	ctx := context.Background()
	pause := testSpec("/pause")
	pause.Annotations = map[string]string{criContainerType: criTypeSandbox, criSandboxID: "pod1"}
	if _, err := s.Create(ctx, &taskAPI.CreateTaskRequest{ID: "pod1", Bundle: bundle(t, pause)}); err != nil {
		t.Fatal(err)
	}
	appSpec := func(args ...string) *specs.Spec {
		sp := testSpec(args...)
		sp.Annotations = map[string]string{criContainerType: "container", criSandboxID: "pod1"}
		return sp
	}
	// The second container's Create waits for the first's boot.
	boot.gate = make(chan struct{})
	errs := make(chan error, 1)
	go func() {
		_, err := s.Create(ctx, &taskAPI.CreateTaskRequest{ID: "web", Bundle: bundle(t, appSpec("sleep", "600"))})
		errs <- err
	}()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		s.mu.Lock()
		booting := s.pod != nil
		s.mu.Unlock()
		if booting {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("web's Create never began its boot")
		}
	}
	side := bundle(t, appSpec("sh", "-c", "cat marker; exit 7"))
	if err := os.WriteFile(filepath.Join(side, "rootfs", "marker"), []byte("side's own root\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	sideIO := newIO(t, false)
	go func() {
		time.Sleep(50 * time.Millisecond)
		close(boot.gate)
	}()
	if _, err := s.Create(ctx, &taskAPI.CreateTaskRequest{ID: "side", Bundle: side, Stdout: sideIO.stdout, Stderr: sideIO.stderr}); err != nil {
		t.Fatalf("Create(side): %v", err)
	}
	if err := <-errs; err != nil {
		t.Fatalf("Create(web): %v", err)
	}
	if len(boot.boots) != 1 {
		t.Fatalf("%d boots, want the pod's one", len(boot.boots))
	}
	vm := boot.vms[0]
	for _, id := range []string{"web", "side"} {
		if _, err := s.Start(ctx, &taskAPI.StartRequest{ID: id}); err != nil {
			t.Fatalf("Start(%s): %v", id, err)
		}
	}
	w, err := s.Wait(ctx, &taskAPI.WaitRequest{ID: "side"})
	if err != nil || w.ExitStatus != 7 {
		t.Fatalf("Wait(side) = %v, %v", w, err)
	}
	sideIO.wg.Wait()
	if out := sideIO.out.String(); out != "side's own root\n" {
		t.Errorf("side's output %q: it did not run in its own root", out)
	}
	// Stopping or saving the VM would stop or save the others too.
	if _, err := s.Pause(ctx, &taskAPI.PauseRequest{ID: "web"}); !errdefs.IsFailedPrecondition(err) || !strings.Contains(err.Error(), "side") {
		t.Errorf("Pause(web) beside side = %v, want FailedPrecondition naming side", err)
	}
	if _, err := s.Checkpoint(ctx, &taskAPI.CheckpointTaskRequest{ID: "web", Path: t.TempDir()}); !errdefs.IsFailedPrecondition(err) {
		t.Errorf("Checkpoint(web) beside side = %v, want FailedPrecondition", err)
	}
	// A checkpoint cannot be restored into a running pod's VM.
	if _, err := s.Create(ctx, &taskAPI.CreateTaskRequest{ID: "restored", Bundle: bundle(t, appSpec("true")), Checkpoint: t.TempDir()}); !errdefs.IsNotImplemented(err) {
		t.Errorf("Create from a checkpoint into the pod = %v, want NotImplemented", err)
	}
	// The VM's root container goes first: the VM stays for side.
	if _, err := s.Kill(ctx, &taskAPI.KillRequest{ID: "web", Signal: 9}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Wait(ctx, &taskAPI.WaitRequest{ID: "web"}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Delete(ctx, &taskAPI.DeleteRequest{ID: "web"}); err != nil {
		t.Fatal(err)
	}
	if slices.Contains(vm.callList(), "close") {
		t.Fatalf("the VM stopped with its first container while side remains: %q", vm.callList())
	}
	if _, err := s.Delete(ctx, &taskAPI.DeleteRequest{ID: "side"}); err != nil {
		t.Fatal(err)
	}
	if got := vm.callList(); !slices.Equal(got, []string{"mountroot side", "unmountroot side", "close"}) {
		t.Errorf("VM calls %q", got)
	}
	// The pod's next application container boots a VM anew.
	if _, err := s.Create(ctx, &taskAPI.CreateTaskRequest{ID: "again", Bundle: bundle(t, appSpec("true"))}); err != nil {
		t.Fatal(err)
	}
	if len(boot.boots) != 2 {
		t.Errorf("%d boots, want a second once the pod had no VM", len(boot.boots))
	}
}

func TestServiceStats(t *testing.T) {
	s, _, _ := newTestService(t)
	ctx := context.Background()
	if _, err := s.Create(ctx, &taskAPI.CreateTaskRequest{ID: "c", Bundle: bundle(t, testSpec("true"))}); err != nil {
		t.Fatal(err)
	}
	r, err := s.Stats(ctx, &taskAPI.StatsRequest{ID: "c"})
	if err != nil || r.Stats == nil || !strings.HasSuffix(r.Stats.TypeUrl, "cgroups.v2.Metrics") {
		t.Fatalf("Stats = %v, %v", r, err)
	}
}

// TestServiceErrorCodes: errors cross ttrpc with their status codes
// (through the interceptor the shim package installs), so containerd can
// tell a process already gone (NotFound) from a failure.
func TestServiceErrorCodes(t *testing.T) {
	s, _, _ := newTestService(t)
	icpt := s.UnaryInterceptor()
	call := func(err error) error {
		_, got := icpt(context.Background(), func(any) error { return nil }, &ttrpc.UnaryServerInfo{FullMethod: "/containerd.task.v2.Task/Kill"},
			func(context.Context, func(any) error) (any, error) { return nil, err })
		return got
	}
	_, err := s.Kill(context.Background(), &taskAPI.KillRequest{ID: "nope", Signal: 9})
	for _, tt := range []struct {
		err  error
		want codes.Code
	}{
		{err, codes.NotFound},
		{fmt.Errorf("x: %w", errdefs.ErrFailedPrecondition), codes.FailedPrecondition},
		{fmt.Errorf("x: %w", errdefs.ErrNotImplemented), codes.Unimplemented},
		{errors.New("plain"), codes.Unknown},
	} {
		got := call(tt.err)
		if st, _ := status.FromError(got); st.Code() != tt.want {
			t.Errorf("%v crossed as %v, want %v", tt.err, st.Code(), tt.want)
		}
		if back := errdefs.FromGRPC(got); tt.want == codes.NotFound && !errdefs.IsNotFound(back) {
			t.Errorf("containerd's side reads %v as %v, not NotFound", got, back)
		}
	}
	if call(nil) != nil {
		t.Error("a nil error crossed as non-nil")
	}
}

// TestServiceCreateUnlocked: while an app container's VM boots, the pod's
// other calls answer (its sandbox container's State), the booting one is
// refused as not ready yet, and a second app container waits to join it.
func TestServiceCreateUnlocked(t *testing.T) {
	s, _, boot := newTestService(t)
	boot.gate = make(chan struct{})
	ctx := context.Background()
	sb := testSpec("pause")
	sb.Annotations = map[string]string{criContainerType: criTypeSandbox}
	if _, err := s.Create(ctx, &taskAPI.CreateTaskRequest{ID: "pod", Bundle: bundle(t, sb)}); err != nil {
		t.Fatal(err)
	}
	tio := newIO(t, false)
	done := make(chan error, 1)
	go func() {
		_, err := s.Create(ctx, &taskAPI.CreateTaskRequest{ID: "app", Bundle: bundle(t, testSpec("true")), Stdout: tio.stdout, Stderr: tio.stderr})
		done <- err
	}()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if _, err := s.State(ctx, &taskAPI.StateRequest{ID: "app"}); errdefs.IsFailedPrecondition(err) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the booting container never showed as being created")
		}
	}
	if st, err := s.State(ctx, &taskAPI.StateRequest{ID: "pod"}); err != nil || st.Status != task.Status_CREATED {
		t.Errorf("State of the sandbox during the boot = %v, %v", st, err)
	}
	// A second app container waits for the pod's VM, then joins it.
	done2 := make(chan error, 1)
	go func() {
		_, err := s.Create(ctx, &taskAPI.CreateTaskRequest{ID: "app2", Bundle: bundle(t, testSpec("true"))})
		done2 <- err
	}()
	select {
	case err := <-done2:
		t.Fatalf("a second app container's Create returned during the boot: %v", err)
	case <-time.After(100 * time.Millisecond):
	}
	close(boot.gate)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if err := <-done2; err != nil {
		t.Fatalf("a second app container after the boot: %v", err)
	}
	if len(boot.boots) != 1 {
		t.Errorf("%d boots, want the pod's one", len(boot.boots))
	}
	if st, err := s.State(ctx, &taskAPI.StateRequest{ID: "app"}); err != nil || st.Status != task.Status_CREATED {
		t.Errorf("State after the boot = %v, %v", st, err)
	}
}

// TestServiceCheckpointUnlocked: while a checkpoint saves, the service
// answers (State), and what would change the VM under it (Pause, Delete,
// a second Checkpoint) is refused.
func TestServiceCheckpointUnlocked(t *testing.T) {
	s, _, boot := newTestService(t)
	ctx := context.Background()
	if _, err := s.Create(ctx, &taskAPI.CreateTaskRequest{ID: "c", Bundle: bundle(t, testSpec("sleep", "600"))}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Start(ctx, &taskAPI.StartRequest{ID: "c"}); err != nil {
		t.Fatal(err)
	}
	vm := boot.vms[0]
	vm.saveGate = make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, err := s.Checkpoint(ctx, &taskAPI.CheckpointTaskRequest{ID: "c", Path: t.TempDir()})
		done <- err
	}()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		s.mu.Lock()
		saving := s.containers["c"].life.state == ctrCheckpointing
		s.mu.Unlock()
		if saving {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the checkpoint never began")
		}
	}
	if _, err := s.Pause(ctx, &taskAPI.PauseRequest{ID: "c"}); !errdefs.IsFailedPrecondition(err) {
		t.Errorf("Pause during the checkpoint = %v, want FailedPrecondition", err)
	}
	if _, err := s.Delete(ctx, &taskAPI.DeleteRequest{ID: "c"}); !errdefs.IsFailedPrecondition(err) {
		t.Errorf("Delete during the checkpoint = %v, want FailedPrecondition", err)
	}
	if st, err := s.State(ctx, &taskAPI.StateRequest{ID: "c"}); err != nil || st.Status != task.Status_RUNNING {
		t.Errorf("State during the checkpoint = %v, %v", st, err)
	}
	if _, err := s.Checkpoint(ctx, &taskAPI.CheckpointTaskRequest{ID: "c", Path: t.TempDir()}); !errdefs.IsFailedPrecondition(err) {
		t.Errorf("a second Checkpoint = %v, want FailedPrecondition", err)
	}
	close(vm.saveGate)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if _, err := s.Pause(ctx, &taskAPI.PauseRequest{ID: "c"}); err != nil {
		t.Errorf("Pause after the checkpoint: %v", err)
	}
}
