// Package shim is Kiln's containerd runtime shim v2 (runtime type
// io.containerd.kiln.v2, binary containerd-shim-kiln-v2): containerd's
// Task service over ttrpc, one shim process and one microVM per pod (or
// per container outside Kubernetes). A container's rootfs, as containerd
// mounted it from its snapshotter, is the VM's root: served read-only over
// virtio-9p (package hostfs) under a tmpfs overlay in guest RAM. Its
// processes run through the in-guest agent over vsock: stdio from
// containerd's FIFOs, signals, exec, terminal resizes, exit statuses.
// Checkpoint saves the VM as a Kiln snapshot, and a task created from that
// checkpoint restores it.
//
// The shim protocol itself (start/delete, the ttrpc server, event
// publishing) is containerd's own runtime/v2/shim package; Manager and
// Service are what it calls.
package shim

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"
	"sync"
	"syscall"
	"time"

	eventstypes "github.com/containerd/containerd/api/events"
	taskAPI "github.com/containerd/containerd/api/runtime/task/v2"
	"github.com/containerd/containerd/api/types"
	"github.com/containerd/containerd/api/types/task"
	"github.com/containerd/containerd/errdefs"
	"github.com/containerd/containerd/mount"
	"github.com/containerd/containerd/pkg/shutdown"
	"github.com/containerd/containerd/protobuf"
	ptypes "github.com/containerd/containerd/protobuf/types"
	"github.com/containerd/containerd/runtime"
	"github.com/containerd/containerd/runtime/v2/shim"
	"github.com/containerd/ttrpc"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/kilnvm/kiln/guest/client"
)

var _ taskAPI.TaskService = (*Service)(nil)

// Service is the Task service of one shim process: the containers of one
// pod (or one container), each task's processes in its microVM.
type Service struct {
	ctx    context.Context // the shim's life
	pub    shim.Publisher
	sd     shutdown.Service
	cfg    Config
	boot   Booter
	log    *slog.Logger
	events chan event

	mu         sync.Mutex
	containers map[string]*container
	// pod is the pod's VM, shared by its application containers: the
	// first boots it with its rootfs as the VM's root, each other's
	// rootfs is a container root in it (VM.MountRoot). nil until the
	// first, and again once the last is deleted.
	pod *podVM
	// trees counts the containers using each read-only volume served
	// beside the VM's root (VM.ServeDir), by tree name.
	trees map[string]int
}

// podVM is a pod's VM and the application containers that use it.
type podVM struct {
	ready chan struct{} // closed once the boot has ended
	vm    VM            // the booted VM; nil while booting or if it failed
	err   error         // why the boot failed
	users int           // the containers using it (or waiting for it)
}

type event struct {
	topic string
	ev    any
}

// NewService returns the Task service, booting VMs with boot. Events go
// to pub; sd ends the shim (Shutdown, once no container is left).
func NewService(ctx context.Context, cfg Config, boot Booter, pub shim.Publisher, sd shutdown.Service, log *slog.Logger) *Service {
	s := &Service{ctx: ctx, pub: pub, sd: sd, cfg: cfg, boot: boot, log: log,
		events: make(chan event, 128), containers: map[string]*container{}}
	go s.forward()
	sd.RegisterCallback(func(context.Context) error {
		close(s.events)
		return nil
	})
	return s
}

// RegisterTTRPC serves the Task service on server.
func (s *Service) RegisterTTRPC(server *ttrpc.Server) error {
	taskAPI.RegisterTaskService(server, s)
	return nil
}

// UnaryInterceptor gives every RPC's error its status code (NotFound,
// AlreadyExists, FailedPrecondition, ...), as containerd's own shims do
// with errdefs.ToGRPC: containerd tells those apart (a Kill of a process
// already gone is NotFound, which its CRI plugin ignores), and without a
// code every error reaches it as Unknown. The shim package installs it.
func (s *Service) UnaryInterceptor() ttrpc.UnaryServerInterceptor {
	return func(ctx context.Context, unmarshal ttrpc.Unmarshaler, info *ttrpc.UnaryServerInfo, method ttrpc.Method) (any, error) {
		resp, err := method(ctx, unmarshal)
		return resp, errdefs.ToGRPC(err)
	}
}

// forward publishes events in order, off the RPCs' paths.
func (s *Service) forward() {
	for e := range s.events {
		ctx, cancel := context.WithTimeout(s.ctx, 10*time.Second)
		if err := s.pub.Publish(ctx, e.topic, e.ev); err != nil {
			s.log.Warn("publishing an event", "topic", e.topic, "err", err)
		}
		cancel()
	}
	if c, ok := s.pub.(io.Closer); ok {
		c.Close()
	}
}

func (s *Service) send(topic string, ev any) {
	defer func() { recover() }() // the shim is shutting down: events is closed
	s.events <- event{topic, ev}
}

// container is one task: a VM (nil for a pod's sandbox container, which
// Kiln does not run) and its processes.
type container struct {
	id      string
	bundle  string
	spec    *specs.Spec
	rootfs  string // bundle/rootfs, the VM's root or a container root in it
	mounted bool   // Create mounted it (containerd gave mounts)
	vm      VM     // the pod's VM (pod.vm); nil for a pod's sandbox container
	pod     *podVM
	// guestRoot is the container root (VM.MountRoot) its processes run
	// in; "" for the container whose rootfs is the VM's root.
	guestRoot string
	// adopt, for a task restored from a checkpoint, is the detached ID of
	// the checkpointed init process its Start takes over.
	adopt string
	// volumes are its spec's mounts as the VM takes them; trees the
	// read-only volumes it holds served (Service.trees).
	volumes []volume
	trees   []string
	init    *process
	execs   map[string]*process
	// life is its state (creating, ready, paused, checkpointing,
	// deleted), changed only through its gate (containerstate.go).
	life ctrLife
}

// process is a container's init or an exec.
type process struct {
	id     string // "" for the init process
	cid    string
	opts   client.ExecOptions
	stdio  stdio
	status task.Status

	gp    GuestProcess
	pid   uint32
	stdin *io.PipeWriter // the guest's stdin, fed from the FIFO
	// stdinHold is the shim's writer on the stdin FIFO: CloseIO closes
	// it, and the guest's stdin ends once the FIFO is drained.
	stdinHold io.Closer
	exitCode  uint32
	exitedAt  time.Time
	cancel    context.CancelFunc
	done      chan struct{} // closed once it has exited
}

type stdio struct {
	stdin, stdout, stderr string
	terminal              bool
}

func (s *Service) get(id string) (*container, error) {
	c := s.containers[id]
	if c == nil {
		return nil, fmt.Errorf("container %q: %w", id, errdefs.ErrNotFound)
	}
	if err := c.life.check(useOp); err != nil {
		return nil, err
	}
	return c, nil
}

// proc is container id's process execID (its init process when empty);
// s.mu held.
func (s *Service) proc(id, execID string) (*container, *process, error) {
	c, err := s.get(id)
	if err != nil {
		return nil, nil, err
	}
	p, err := c.proc(execID)
	if err != nil {
		return nil, nil, err
	}
	return c, p, nil
}

func (c *container) proc(execID string) (*process, error) {
	if execID == "" {
		return c.init, nil
	}
	p := c.execs[execID]
	if p == nil {
		return nil, fmt.Errorf("exec %q of container %q: %w", execID, c.id, errdefs.ErrNotFound)
	}
	return p, nil
}

// Create mounts the container's rootfs and boots its VM; the init
// process waits for Start. The boot runs without the service's lock, so
// the pod's other calls (State of its sandbox container, a CRI listing)
// do not wait on it; the container is held meanwhile, refused to every
// call (FailedPrecondition) until its Create returns.
func (s *Service) Create(ctx context.Context, r *taskAPI.CreateTaskRequest) (_ *taskAPI.CreateTaskResponse, err error) {
	s.mu.Lock()
	c, boot, err := s.prepare(r)
	s.mu.Unlock()
	if err != nil {
		return nil, err
	}
	if c.pod != nil {
		defer func() {
			if err != nil {
				s.mu.Lock()
				c.life.done(createOp, err)
				delete(s.containers, r.ID)
				s.mu.Unlock()
				if c.mounted {
					unmountRootfs(c.rootfs, s.log)
				}
				s.releaseTrees(c)
				s.release(ctx, c.pod)
			}
		}()
	}
	switch {
	case boot != nil:
		bootCtx, cancel := context.WithTimeout(ctx, s.cfg.bootTimeout())
		vm, berr := s.boot.Boot(bootCtx, *boot)
		cancel()
		s.mu.Lock()
		c.pod.vm, c.pod.err = vm, berr
		if berr != nil && s.pod == c.pod {
			s.pod = nil // the next container boots anew
		}
		close(c.pod.ready)
		s.mu.Unlock()
		if berr != nil {
			return nil, fmt.Errorf("create %s: %w", r.ID, berr)
		}
		s.log.Info("VM up", "container", r.ID, "cpus", boot.CPUs, "memory_mib", boot.MemoryMiB, "from_checkpoint", r.Checkpoint != "")
		// The boot read the kernel and initramfs into the heap (tens of
		// MiB, garbage now): hand them back to the host at once rather
		// than when the scavenger gets to them, since this process
		// lives as long as the pod.
		debug.FreeOSMemory()
	case c.pod != nil:
		// A further container of the pod: its rootfs joins the VM.
		select {
		case <-c.pod.ready:
		case <-ctx.Done():
			return nil, fmt.Errorf("create %s: waiting for the pod's VM: %w", r.ID, ctx.Err())
		}
		if c.pod.err != nil {
			return nil, fmt.Errorf("create %s: the pod's VM did not boot: %w", r.ID, c.pod.err)
		}
		if err := c.pod.vm.MountRoot(ctx, r.ID, c.rootfs); err != nil {
			return nil, fmt.Errorf("create %s: its root in the pod's VM: %w", r.ID, err)
		}
		s.log.Info("container joined the pod's VM", "container", r.ID)
	}
	if c.pod != nil && r.Checkpoint == "" { // a restored VM has its mounts
		if err := s.attachVolumes(ctx, c); err != nil {
			return nil, fmt.Errorf("create %s: its volumes: %w", r.ID, err)
		}
	}
	s.mu.Lock()
	if c.pod != nil {
		c.vm = c.pod.vm
	}
	defer s.mu.Unlock()
	c.life.done(createOp, nil)
	s.send(runtime.TaskCreateEventTopic, &eventstypes.TaskCreate{
		ContainerID: r.ID, Bundle: r.Bundle, Rootfs: r.Rootfs,
		IO:         &eventstypes.TaskIO{Stdin: r.Stdin, Stdout: r.Stdout, Stderr: r.Stderr, Terminal: r.Terminal},
		Checkpoint: r.Checkpoint, Pid: s.pidOf(c.init),
	})
	return &taskAPI.CreateTaskResponse{Pid: s.pidOf(c.init)}, nil
}

// prepare checks a Create, mounts the rootfs of an application
// container and holds its ID (born creating); it returns what to boot (nil for
// a pod's sandbox container, which runs no VM). s.mu held.
func (s *Service) prepare(r *taskAPI.CreateTaskRequest) (_ *container, _ *BootSpec, err error) {
	if _, ok := s.containers[r.ID]; ok {
		return nil, nil, fmt.Errorf("container %q: %w", r.ID, errdefs.ErrAlreadyExists)
	}
	spec, err := readSpec(r.Bundle)
	if err != nil {
		return nil, nil, fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
	}
	if err := checkSpec(spec); err != nil {
		if errors.Is(err, ErrUnsupported) {
			return nil, nil, fmt.Errorf("create %s: %v: %w", r.ID, err, errdefs.ErrNotImplemented)
		}
		return nil, nil, fmt.Errorf("create %s: %v: %w", r.ID, err, errdefs.ErrInvalidArgument)
	}
	if r.ParentCheckpoint != "" {
		return nil, nil, fmt.Errorf("create %s: a parent checkpoint: %w", r.ID, errdefs.ErrNotImplemented)
	}
	io := stdio{stdin: r.Stdin, stdout: r.Stdout, stderr: r.Stderr, terminal: r.Terminal}
	if err := io.check(); err != nil {
		return nil, nil, fmt.Errorf("create %s: %v: %w", r.ID, err, errdefs.ErrInvalidArgument)
	}
	c := &container{id: r.ID, bundle: r.Bundle, spec: spec, execs: map[string]*process{}, life: newCtrLife(r.ID)}
	c.init = &process{cid: r.ID, stdio: io, status: task.Status_CREATED, done: make(chan struct{})}
	if isPodSandbox(spec) {
		s.containers[r.ID] = c
		return c, nil, nil
	}
	if c.init.opts, err = execOptions(spec.Process); err != nil {
		return nil, nil, fmt.Errorf("create %s: %v: %w", r.ID, err, errdefs.ErrInvalidArgument)
	}
	if c.volumes, err = planVolumes(spec); err != nil {
		if errors.Is(err, ErrUnsupported) {
			return nil, nil, fmt.Errorf("create %s: %v: %w", r.ID, err, errdefs.ErrNotImplemented)
		}
		return nil, nil, fmt.Errorf("create %s: %v: %w", r.ID, err, errdefs.ErrInvalidArgument)
	}
	if r.Checkpoint != "" {
		meta, err := readCheckpointMeta(r.Checkpoint)
		if err != nil {
			return nil, nil, fmt.Errorf("create %s: %v: %w", r.ID, err, errdefs.ErrInvalidArgument)
		}
		c.adopt = meta.Init
		for _, v := range c.volumes {
			if v.mount.Kind == client.MountTree {
				return nil, nil, fmt.Errorf("create %s from a checkpoint: the read-only host folder %s (on %s) is not part of a checkpoint: %w", r.ID, v.source, v.mount.Destination, errdefs.ErrNotImplemented)
			}
		}
	}
	if s.pod != nil {
		// The pod's VM is up (or booting): this container joins it.
		if r.Checkpoint != "" {
			return nil, nil, fmt.Errorf("create %s: restoring a checkpoint into a pod whose VM runs already: %w", r.ID, errdefs.ErrNotImplemented)
		}
		for _, o := range s.containers {
			if o.pod != s.pod {
				continue
			}
			if err := o.life.check(joinOp); err != nil {
				return nil, nil, fmt.Errorf("create %s: joining the pod's VM: %w", r.ID, err)
			}
		}
		if err := checkRootName(r.ID); err != nil {
			return nil, nil, fmt.Errorf("create %s: %v: %w", r.ID, err, errdefs.ErrInvalidArgument)
		}
		if c.rootfs, c.mounted, err = mountRootfs(r.Bundle, r.Rootfs); err != nil {
			return nil, nil, fmt.Errorf("create %s: %w", r.ID, err)
		}
		s.pod.users++
		c.pod, c.guestRoot = s.pod, r.ID
		s.containers[r.ID] = c
		return c, nil, nil
	}
	cpus, mem, err := vmSize(spec, s.cfg.CPUs, s.cfg.MemoryMiB)
	if err != nil {
		return nil, nil, fmt.Errorf("create %s: %v: %w", r.ID, err, errdefs.ErrInvalidArgument)
	}
	var network *PodNetwork
	if ns := s.podNetns(spec); ns != "" {
		if network, err = inspectPodNetwork(ns, resolvConf(spec)); err != nil {
			return nil, nil, fmt.Errorf("create %s: %w", r.ID, err)
		}
	}
	if c.rootfs, c.mounted, err = mountRootfs(r.Bundle, r.Rootfs); err != nil {
		return nil, nil, fmt.Errorf("create %s: %w", r.ID, err)
	}
	hostname := spec.Hostname
	if hostname == "" {
		hostname = shortID(r.ID)
	}
	s.containers[r.ID] = c
	s.pod = &podVM{ready: make(chan struct{}), users: 1}
	c.pod = s.pod
	return c, &BootSpec{ID: r.ID, Bundle: r.Bundle, RootDir: c.rootfs, CPUs: cpus, MemoryMiB: mem, Hostname: hostname,
		Checkpoint: r.Checkpoint, Network: network}, nil
}

// podNetns is the network namespace whose network c's VM takes over, or
// "" for none. CRI gives an app container its pod's namespace as
// /proc/<sandbox PID>/ns/net, and a pod sandbox here runs no process:
// its PID is the shim's, so that path is the shim's own namespace (the
// node's, or containerd's). The pod's real one is in its sandbox
// container's spec. The shim's own namespace is never taken over.
// s.mu held.
func (s *Service) podNetns(spec *specs.Spec) string {
	ns := netnsPath(spec)
	if ns == "" {
		return ""
	}
	if sameNetns(ns, "/proc/self/ns/net") {
		ns = ""
		for _, o := range s.containers {
			if isPodSandbox(o.spec) {
				ns = netnsPath(o.spec)
				break
			}
		}
		if ns == "" || sameNetns(ns, "/proc/self/ns/net") {
			return ""
		}
	}
	return ns
}

// pidOf is a process's guest PID; a pod sandbox's (which runs nothing)
// is the shim's own.
func (s *Service) pidOf(p *process) uint32 {
	if p.pid != 0 {
		return p.pid
	}
	if c := s.containers[p.cid]; c != nil && c.vm == nil {
		return uint32(os.Getpid())
	}
	return 0
}

// Start starts the init process or an exec.
func (s *Service) Start(ctx context.Context, r *taskAPI.StartRequest) (*taskAPI.StartResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c, p, err := s.proc(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	if p.status != task.Status_CREATED {
		return nil, fmt.Errorf("start %s: it is %s: %w", describe(c, p), p.status, errdefs.ErrFailedPrecondition)
	}
	if r.ExecID != "" && c.init.status != task.Status_RUNNING {
		return nil, fmt.Errorf("start %s: the container is not running: %w", describe(c, p), errdefs.ErrFailedPrecondition)
	}
	if c.vm == nil { // a pod's sandbox: nothing runs until it is killed
		p.status = task.Status_RUNNING
		s.send(runtime.TaskStartEventTopic, &eventstypes.TaskStart{ContainerID: c.id, Pid: s.pidOf(p)})
		return &taskAPI.StartResponse{Pid: s.pidOf(p)}, nil
	}
	if err := s.startProcess(ctx, c, p); err != nil {
		return nil, fmt.Errorf("start %s: %w", describe(c, p), err)
	}
	if r.ExecID == "" {
		s.send(runtime.TaskStartEventTopic, &eventstypes.TaskStart{ContainerID: c.id, Pid: p.pid})
	} else {
		s.send(runtime.TaskExecStartedEventTopic, &eventstypes.TaskExecStarted{ContainerID: c.id, ExecID: p.id, Pid: p.pid})
	}
	return &taskAPI.StartResponse{Pid: p.pid}, nil
}

func describe(c *container, p *process) string {
	if p.id == "" {
		return "container " + c.id
	}
	return fmt.Sprintf("exec %s of container %s", p.id, c.id)
}

// startProcess opens p's stdio and starts it in c's VM; a goroutine
// records its exit.
func (s *Service) startProcess(ctx context.Context, c *container, p *process) (err error) {
	openCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	streams, err := openStdio(openCtx, p.stdio)
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			streams.Close()
		}
	}()
	if p.id == "" && c.adopt != "" {
		// A restored task: its init is the checkpointed one, still
		// running in the restored VM; it has no stdin any more.
		if streams.stdinHold != nil {
			streams.stdinHold.Close()
		}
		pctx, pcancel := context.WithCancel(s.ctx)
		gp, err := c.vm.Adopt(pctx, c.adopt, streams.stdout, streams.stderr)
		if err != nil {
			pcancel()
			return fmt.Errorf("taking over the checkpointed process: %w", err)
		}
		p.gp, p.pid, p.cancel, p.status = gp, uint32(gp.Pid()), pcancel, task.Status_RUNNING
		go s.waitProcess(c, p, streams)
		return nil
	}
	opts := p.opts
	opts.Root = c.guestRoot
	opts.Stdout, opts.Stderr = streams.stdout, streams.stderr
	if p.id == "" {
		// Detached: it outlives the agent's connection, so a VM restored
		// from a checkpoint still runs it for the new task to adopt.
		opts.DetachID = initDetachID(c.id)
	}
	if streams.stdin != nil {
		pr, pw := io.Pipe()
		p.stdin, p.stdinHold = pw, streams.stdinHold
		opts.Stdin = pr
		go func() {
			_, err := io.Copy(pw, streams.stdin)
			pw.CloseWithError(err) // nil: EOF, the guest's stdin closes
		}()
	}
	pctx, pcancel := context.WithCancel(s.ctx)
	gp, err := c.vm.Start(pctx, opts)
	if err != nil {
		pcancel()
		if p.stdin != nil {
			p.stdin.Close()
		}
		return err
	}
	p.gp, p.pid, p.cancel, p.status = gp, uint32(gp.Pid()), pcancel, task.Status_RUNNING
	go s.waitProcess(c, p, streams)
	return nil
}

// waitProcess records p's exit, publishes it, and after the init
// process kills what is left of the container's execs.
func (s *Service) waitProcess(c *container, p *process, streams *streams) {
	st, err := p.gp.Wait()
	code := uint32(st.ShellCode())
	if err != nil {
		s.log.Warn("process lost", "process", describe(c, p), "err", err)
		code = 255
	}
	streams.Close()
	s.mu.Lock()
	s.exited(c, p, code)
	var others []*process
	if p.id == "" {
		for _, e := range c.execs {
			if e.status == task.Status_RUNNING {
				others = append(others, e)
			}
		}
	}
	s.mu.Unlock()
	for _, e := range others {
		_ = e.gp.SignalGroup(syscall.SIGKILL)
	}
}

// exited marks p stopped with code and publishes its exit; s.mu held.
func (s *Service) exited(c *container, p *process, code uint32) {
	if p.status == task.Status_STOPPED {
		return
	}
	p.status, p.exitCode, p.exitedAt = task.Status_STOPPED, code, time.Now()
	close(p.done)
	id := p.id
	if id == "" {
		id = c.id
	}
	s.send(runtime.TaskExitEventTopic, &eventstypes.TaskExit{ContainerID: c.id, ID: id, Pid: s.pidOf(p),
		ExitStatus: code, ExitedAt: protobuf.ToTimestamp(p.exitedAt)})
}

// Delete removes an exec, or the container: its VM is stopped and its
// rootfs unmounted.
func (s *Service) Delete(ctx context.Context, r *taskAPI.DeleteRequest) (*taskAPI.DeleteResponse, error) {
	s.mu.Lock()
	c, err := s.get(r.ID)
	if err != nil {
		s.mu.Unlock()
		return nil, err
	}
	p, err := c.proc(r.ExecID)
	if err != nil {
		s.mu.Unlock()
		return nil, err
	}
	if p.status == task.Status_RUNNING {
		s.mu.Unlock()
		return nil, fmt.Errorf("delete %s: it is running: %w", describe(c, p), errdefs.ErrFailedPrecondition)
	}
	if r.ExecID == "" {
		if _, err := c.life.begin(deleteOp); err != nil {
			s.mu.Unlock()
			return nil, fmt.Errorf("delete %s: %w", c.id, err)
		}
	}
	if p.status == task.Status_CREATED {
		s.exited(c, p, 0)
	}
	resp := &taskAPI.DeleteResponse{Pid: s.pidOf(p), ExitStatus: p.exitCode, ExitedAt: protobuf.ToTimestamp(p.exitedAt)}
	if r.ExecID != "" {
		delete(c.execs, r.ExecID)
		if p.cancel != nil {
			p.cancel()
		}
		s.mu.Unlock()
		return resp, nil
	}
	c.life.done(deleteOp, nil)
	delete(s.containers, c.id)
	s.mu.Unlock()
	for _, e := range c.execs {
		if e.cancel != nil {
			e.cancel()
		}
	}
	if p.cancel != nil {
		p.cancel()
	}
	if c.guestRoot != "" && c.vm != nil {
		// Its processes go with its root; the VM stays for the others.
		umCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		if err := c.vm.UnmountRoot(umCtx, c.guestRoot); err != nil {
			s.log.Warn("removing the container's root from the pod's VM", "container", c.id, "err", err)
		}
		cancel()
	}
	s.releaseTrees(c)
	if c.pod != nil {
		last := s.release(ctx, c.pod)
		if !last && c.guestRoot == "" && c.mounted {
			// The VM's root outlives its container while the pod's
			// others run: detach the rootfs, which the VM's open
			// descriptor keeps until it stops.
			if err := unix.Unmount(c.rootfs, unix.MNT_DETACH); err != nil {
				s.log.Warn("detaching the rootfs", "dir", c.rootfs, "err", err)
			}
			c.mounted = false
		}
	}
	if c.mounted {
		unmountRootfs(c.rootfs, s.log)
	}
	s.send(runtime.TaskDeleteEventTopic, &eventstypes.TaskDelete{ContainerID: c.id, Pid: resp.Pid,
		ExitStatus: resp.ExitStatus, ExitedAt: resp.ExitedAt, ID: c.id})
	return resp, nil
}

// release drops one user of pod, and stops its VM after the last (if it
// booted); it reports whether that was the last.
func (s *Service) release(ctx context.Context, pod *podVM) bool {
	s.mu.Lock()
	pod.users--
	last := pod.users == 0
	if last && s.pod == pod {
		s.pod = nil
	}
	s.mu.Unlock()
	if !last {
		return false
	}
	<-pod.ready // a boot in flight ends (its Create holds a user until then)
	if pod.vm != nil {
		closeCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		if err := pod.vm.Close(closeCtx); err != nil {
			s.log.Warn("stopping the VM", "err", err)
		}
		cancel()
	}
	return true
}

// attachVolumes serves c's read-only volumes not served yet and mounts
// its volumes into its root.
func (s *Service) attachVolumes(ctx context.Context, c *container) error {
	var ms []client.Mount
	for _, v := range c.volumes {
		ms = append(ms, v.mount)
		if v.mount.Kind != client.MountTree || slices.Contains(c.trees, v.mount.Name) {
			continue
		}
		s.mu.Lock()
		if s.trees == nil {
			s.trees = map[string]int{}
		}
		first := s.trees[v.mount.Name] == 0
		s.trees[v.mount.Name]++
		c.trees = append(c.trees, v.mount.Name)
		s.mu.Unlock()
		if first {
			if err := c.pod.vm.ServeDir(v.mount.Name, v.source); err != nil {
				return fmt.Errorf("serving %s: %w", v.source, err)
			}
		}
	}
	if len(ms) == 0 {
		return nil
	}
	return c.pod.vm.AddMounts(ctx, c.guestRoot, ms)
}

// releaseTrees drops c's uses of read-only volumes, and stops serving
// those no container uses any more.
func (s *Service) releaseTrees(c *container) {
	s.mu.Lock()
	var stop []string
	for _, name := range c.trees {
		if s.trees[name]--; s.trees[name] <= 0 {
			delete(s.trees, name)
			stop = append(stop, name)
		}
	}
	c.trees = nil
	s.mu.Unlock()
	if c.pod == nil || c.pod.vm == nil {
		return
	}
	for _, name := range stop {
		if err := c.pod.vm.StopServingDir(name); err != nil {
			s.log.Warn("stopping a read-only volume", "container", c.id, "tree", name, "err", err)
		}
	}
}

// sharing names another live application container of c's pod, or "".
// s.mu held.
func (s *Service) sharing(c *container) string {
	for _, o := range s.containers {
		if o != c && o.pod != nil && o.pod == c.pod {
			return o.id
		}
	}
	return ""
}

// Exec adds a process to a running container; Start starts it.
func (s *Service) Exec(ctx context.Context, r *taskAPI.ExecProcessRequest) (*ptypes.Empty, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c, err := s.get(r.ID)
	if err != nil {
		return nil, err
	}
	if r.ExecID == "" {
		return nil, fmt.Errorf("exec in %s: no exec ID: %w", c.id, errdefs.ErrInvalidArgument)
	}
	if _, ok := c.execs[r.ExecID]; ok {
		return nil, fmt.Errorf("exec %s in %s: %w", r.ExecID, c.id, errdefs.ErrAlreadyExists)
	}
	if c.vm == nil {
		return nil, fmt.Errorf("exec in %s: a pod's sandbox container runs nothing in the kiln runtime: %w", c.id, errdefs.ErrNotImplemented)
	}
	if c.init.status != task.Status_RUNNING {
		return nil, fmt.Errorf("exec in %s: the container is not running: %w", c.id, errdefs.ErrFailedPrecondition)
	}
	if r.Spec == nil {
		return nil, fmt.Errorf("exec %s in %s: no process spec: %w", r.ExecID, c.id, errdefs.ErrInvalidArgument)
	}
	var ps specs.Process
	if err := unmarshalProcess(r.Spec.GetValue(), &ps); err != nil {
		return nil, fmt.Errorf("exec %s in %s: process spec: %v: %w", r.ExecID, c.id, err, errdefs.ErrInvalidArgument)
	}
	opts, err := execOptions(&ps)
	if err != nil {
		return nil, fmt.Errorf("exec %s in %s: %v: %w", r.ExecID, c.id, err, errdefs.ErrInvalidArgument)
	}
	io := stdio{stdin: r.Stdin, stdout: r.Stdout, stderr: r.Stderr, terminal: r.Terminal}
	if err := io.check(); err != nil {
		return nil, fmt.Errorf("exec %s in %s: %v: %w", r.ExecID, c.id, err, errdefs.ErrInvalidArgument)
	}
	c.execs[r.ExecID] = &process{id: r.ExecID, cid: c.id, opts: opts, stdio: io, status: task.Status_CREATED, done: make(chan struct{})}
	s.send(runtime.TaskExecAddedEventTopic, &eventstypes.TaskExecAdded{ContainerID: c.id, ExecID: r.ExecID})
	return &ptypes.Empty{}, nil
}

// Kill signals a process (its group too with All).
func (s *Service) Kill(ctx context.Context, r *taskAPI.KillRequest) (*ptypes.Empty, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c, p, err := s.proc(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	sig := syscall.Signal(r.Signal)
	if r.Signal == 0 || r.Signal > 64 {
		return nil, fmt.Errorf("kill %s: signal %d: want 1 to 64: %w", describe(c, p), r.Signal, errdefs.ErrInvalidArgument)
	}
	switch {
	case p.status == task.Status_STOPPED:
		return nil, fmt.Errorf("kill %s: process already finished: %w", describe(c, p), errdefs.ErrNotFound)
	case p.gp == nil: // created, never started; or a pod's sandbox
		s.exited(c, p, 128+r.Signal)
		return &ptypes.Empty{}, nil
	}
	if err := c.life.check(signalOp); err != nil {
		return nil, fmt.Errorf("kill %s: %w", describe(c, p), err)
	}
	if r.All {
		err = p.gp.SignalGroup(sig)
	} else {
		err = p.gp.Signal(sig)
	}
	if err != nil {
		return nil, fmt.Errorf("kill %s: %w", describe(c, p), err)
	}
	return &ptypes.Empty{}, nil
}

// Wait waits for a process to exit.
func (s *Service) Wait(ctx context.Context, r *taskAPI.WaitRequest) (*taskAPI.WaitResponse, error) {
	s.mu.Lock()
	c, err := s.get(r.ID)
	var p *process
	if err == nil {
		p, err = c.proc(r.ExecID)
	}
	s.mu.Unlock()
	if err != nil {
		return nil, err
	}
	select {
	case <-p.done:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return &taskAPI.WaitResponse{ExitStatus: p.exitCode, ExitedAt: protobuf.ToTimestamp(p.exitedAt)}, nil
}

// State reports a process.
func (s *Service) State(ctx context.Context, r *taskAPI.StateRequest) (*taskAPI.StateResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c, p, err := s.proc(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	st := p.status
	if c.life.paused() && st == task.Status_RUNNING {
		st = task.Status_PAUSED
	}
	var exited *timestamppb.Timestamp
	if !p.exitedAt.IsZero() {
		exited = protobuf.ToTimestamp(p.exitedAt)
	}
	return &taskAPI.StateResponse{ID: p.idOr(c.id), Bundle: c.bundle, Pid: s.pidOf(p), Status: st,
		Stdin: p.stdio.stdin, Stdout: p.stdio.stdout, Stderr: p.stdio.stderr, Terminal: p.stdio.terminal,
		ExitStatus: p.exitCode, ExitedAt: exited}, nil
}

func (p *process) idOr(cid string) string {
	if p.id == "" {
		return cid
	}
	return p.id
}

// Pids lists the container's processes that Kiln started (guest PIDs).
func (s *Service) Pids(ctx context.Context, r *taskAPI.PidsRequest) (*taskAPI.PidsResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c, err := s.get(r.ID)
	if err != nil {
		return nil, err
	}
	var out []*task.ProcessInfo
	for _, p := range append([]*process{c.init}, mapValues(c.execs)...) {
		if p.status == task.Status_RUNNING {
			out = append(out, &task.ProcessInfo{Pid: s.pidOf(p)})
		}
	}
	return &taskAPI.PidsResponse{Processes: out}, nil
}

func mapValues(m map[string]*process) []*process {
	out := make([]*process, 0, len(m))
	for _, p := range m {
		out = append(out, p)
	}
	return out
}

// Pause stops the container's VM (every process in it).
func (s *Service) Pause(ctx context.Context, r *taskAPI.PauseRequest) (*ptypes.Empty, error) {
	return s.pauseResume(ctx, r.ID, true)
}

// Resume runs a paused container's VM again.
func (s *Service) Resume(ctx context.Context, r *taskAPI.ResumeRequest) (*ptypes.Empty, error) {
	return s.pauseResume(ctx, r.ID, false)
}

func (s *Service) pauseResume(ctx context.Context, id string, pause bool) (*ptypes.Empty, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c, err := s.get(id)
	if err != nil {
		return nil, err
	}
	if c.vm == nil {
		return nil, fmt.Errorf("container %s: a pod's sandbox container has no VM to pause: %w", id, errdefs.ErrNotImplemented)
	}
	op, to := resumeOp, ctrReady
	if pause {
		op, to = pauseOp, ctrPaused
	}
	from, err := c.life.begin(op)
	if err != nil {
		return nil, err
	}
	if from == to {
		c.life.done(op, nil) // nothing to do
		return &ptypes.Empty{}, nil
	}
	if o := s.sharing(c); o != "" && pause {
		err = fmt.Errorf("pause %s: its VM also runs container %s of the pod, which would stop too: %w", id, o, errdefs.ErrFailedPrecondition)
		c.life.done(op, err)
		return nil, err
	}
	if pause {
		err = c.vm.Pause(ctx)
	} else {
		err = c.vm.Resume(ctx)
	}
	if c.life.done(op, err); err != nil {
		return nil, fmt.Errorf("container %s: %w", id, err)
	}
	if pause {
		s.send(runtime.TaskPausedEventTopic, &eventstypes.TaskPaused{ContainerID: id})
	} else {
		s.send(runtime.TaskResumedEventTopic, &eventstypes.TaskResumed{ContainerID: id})
	}
	return &ptypes.Empty{}, nil
}

// Checkpoint saves the container's VM as a Kiln snapshot in r.Path; a task
// created with that checkpoint restores it (its VM as saved: memory,
// files, processes; its Start takes over the checkpointed init process).
// The container keeps running. A paused container (containerd's client
// pauses a task around its checkpoint) runs just long enough for the
// agent to quiesce the guest, and is paused again.
func (s *Service) Checkpoint(ctx context.Context, r *taskAPI.CheckpointTaskRequest) (_ *ptypes.Empty, err error) {
	s.mu.Lock()
	c, err := s.checkpointable(r)
	if err != nil {
		s.mu.Unlock()
		return nil, err
	}
	// The save runs without the service's lock (the pod's other calls
	// answer meanwhile); Pause, Resume, Delete, another Checkpoint and a
	// container joining the VM are refused until it ends (ctrMoves).
	from, err := c.life.begin(checkpointOp)
	if err != nil {
		s.mu.Unlock()
		return nil, fmt.Errorf("checkpoint %s: %w", r.ID, err)
	}
	running := c.init.status == task.Status_RUNNING
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		c.life.done(checkpointOp, err)
		s.mu.Unlock()
	}()
	if from == ctrPaused {
		if err := c.vm.Resume(ctx); err != nil {
			return nil, fmt.Errorf("checkpoint %s: resuming it to quiesce the guest: %w", r.ID, err)
		}
		defer func() {
			if perr := c.vm.Pause(context.WithoutCancel(ctx)); perr != nil && err == nil {
				err = fmt.Errorf("checkpoint %s: pausing it again: %w", r.ID, perr)
			}
		}()
	}
	if err := c.vm.Save(ctx, filepath.Join(r.Path, checkpointDir)); err != nil {
		return nil, fmt.Errorf("checkpoint %s: %w", r.ID, err)
	}
	if running {
		id := initDetachID(c.id)
		if c.adopt != "" {
			id = c.adopt // a restored task's init keeps its first ID
		}
		if err := writeCheckpointMeta(r.Path, checkpointMeta{Init: id}); err != nil {
			return nil, fmt.Errorf("checkpoint %s: %w", r.ID, err)
		}
	}
	s.send(runtime.TaskCheckpointedEventTopic, &eventstypes.TaskCheckpointed{ContainerID: r.ID})
	return &ptypes.Empty{}, nil
}

// checkpointable returns the container a Checkpoint names, if it can be
// checkpointed; s.mu held.
func (s *Service) checkpointable(r *taskAPI.CheckpointTaskRequest) (*container, error) {
	c, err := s.get(r.ID)
	if err != nil {
		return nil, err
	}
	if c.vm == nil {
		return nil, fmt.Errorf("checkpoint %s: a pod's sandbox container has no VM: %w", r.ID, errdefs.ErrNotImplemented)
	}
	if o := s.sharing(c); o != "" {
		return nil, fmt.Errorf("checkpoint %s: its VM also runs container %s of the pod: a checkpoint holds one container: %w", r.ID, o, errdefs.ErrFailedPrecondition)
	}
	if len(c.trees) > 0 {
		return nil, fmt.Errorf("checkpoint %s: it mounts read-only host folders (%d), which a restored VM would not have: %w", r.ID, len(c.trees), errdefs.ErrFailedPrecondition)
	}
	if r.Path == "" || !filepath.IsAbs(r.Path) {
		return nil, fmt.Errorf("checkpoint %s: path %q is not absolute: %w", r.ID, r.Path, errdefs.ErrInvalidArgument)
	}
	return c, nil
}

// ResizePty resizes a process's terminal.
func (s *Service) ResizePty(ctx context.Context, r *taskAPI.ResizePtyRequest) (*ptypes.Empty, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c, p, err := s.proc(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	if !p.stdio.terminal {
		return nil, fmt.Errorf("resize %s: it has no terminal: %w", describe(c, p), errdefs.ErrFailedPrecondition)
	}
	if r.Width == 0 || r.Height == 0 || r.Width > 65535 || r.Height > 65535 {
		return nil, fmt.Errorf("resize %s: %dx%d: want 1 to 65535 each: %w", describe(c, p), r.Width, r.Height, errdefs.ErrInvalidArgument)
	}
	if p.gp == nil {
		p.opts.Pty = &client.PtySize{Rows: r.Height, Cols: r.Width}
		return &ptypes.Empty{}, nil
	}
	if err := p.gp.Resize(client.PtySize{Rows: r.Height, Cols: r.Width}); err != nil {
		return nil, fmt.Errorf("resize %s: %w", describe(c, p), err)
	}
	return &ptypes.Empty{}, nil
}

// CloseIO closes a process's stdin.
func (s *Service) CloseIO(ctx context.Context, r *taskAPI.CloseIORequest) (*ptypes.Empty, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, p, err := s.proc(r.ID, r.ExecID)
	if err != nil {
		return nil, err
	}
	if r.Stdin && p.stdinHold != nil {
		p.stdinHold.Close()
	}
	return &ptypes.Empty{}, nil
}

// Update would change a running VM's resources: a microVM's vCPUs and
// memory are fixed at boot.
func (s *Service) Update(ctx context.Context, r *taskAPI.UpdateTaskRequest) (*ptypes.Empty, error) {
	return nil, fmt.Errorf("update %s: a Kiln VM's vCPUs and memory are fixed when it boots: %w", r.ID, errdefs.ErrNotImplemented)
}

// Stats reports the container's VM as the guest sees it (cgroup v2
// metrics: memory in use, CPU time, processes).
func (s *Service) Stats(ctx context.Context, r *taskAPI.StatsRequest) (*taskAPI.StatsResponse, error) {
	s.mu.Lock()
	c, err := s.get(r.ID)
	s.mu.Unlock()
	if err != nil {
		return nil, err
	}
	if c.vm == nil {
		return nil, fmt.Errorf("stats %s: a pod's sandbox container has no VM: %w", r.ID, errdefs.ErrNotImplemented)
	}
	any, err := guestMetrics(ctx, c.vm)
	if err != nil {
		return nil, fmt.Errorf("stats %s: %w", r.ID, err)
	}
	return &taskAPI.StatsResponse{Stats: any}, nil
}

// Connect reports the shim's and the init process's PIDs.
func (s *Service) Connect(ctx context.Context, r *taskAPI.ConnectRequest) (*taskAPI.ConnectResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var pid uint32
	if c := s.containers[r.ID]; c != nil {
		pid = s.pidOf(c.init)
	}
	return &taskAPI.ConnectResponse{ShimPid: uint32(os.Getpid()), TaskPid: pid, Version: "kiln-v2"}, nil
}

// Shutdown ends the shim once it holds no container.
func (s *Service) Shutdown(ctx context.Context, r *taskAPI.ShutdownRequest) (*ptypes.Empty, error) {
	s.mu.Lock()
	n := len(s.containers)
	s.mu.Unlock()
	if n > 0 && !r.Now {
		return &ptypes.Empty{}, nil
	}
	s.sd.Shutdown()
	return &ptypes.Empty{}, nil
}

// shortID is a host name from a container ID: its first 12 characters.
func shortID(id string) string {
	if len(id) > 12 {
		id = id[:12]
	}
	return id
}

// mountRootfs mounts containerd's rootfs mounts on bundle/rootfs (none:
// the bundle's rootfs is already there), and says whether it mounted.
func mountRootfs(bundle string, ms []*types.Mount) (string, bool, error) {
	dir := filepath.Join(bundle, "rootfs")
	if len(ms) == 0 {
		if fi, err := os.Stat(dir); err != nil || !fi.IsDir() {
			return "", false, fmt.Errorf("no rootfs mounts and no directory %s: %w", dir, errdefs.ErrInvalidArgument)
		}
		return dir, false, nil
	}
	var mounts []mount.Mount
	for _, m := range ms {
		mounts = append(mounts, mount.Mount{Type: m.Type, Source: m.Source, Options: m.Options})
	}
	if err := os.MkdirAll(dir, 0o711); err != nil {
		return "", false, fmt.Errorf("rootfs: %w", err)
	}
	if err := mount.All(mounts, dir); err != nil {
		return "", false, fmt.Errorf("mounting the rootfs on %s: %w", dir, err)
	}
	return dir, true, nil
}

// unmountRootfs undoes mountRootfs.
func unmountRootfs(dir string, log *slog.Logger) {
	if err := mount.UnmountRecursive(dir, 0); err != nil {
		log.Warn("unmounting the rootfs", "dir", dir, "err", err)
	}
}
