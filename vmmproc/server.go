// Package vmmproc runs one VM in a process of its own (kiln-vmm: Main) and
// drives it from another: the parent process that starts sandboxes (kiln,
// kilnd) keeps none of a VM's state, so a VMM that panics or is killed
// takes only its own sandbox down, and each VM can get its own seccomp
// filter, jail and cgroup. The API is gRPC over a Unix socket
// (vmmpb, versioned); a fork's frozen memory crosses as a descriptor on a
// sibling socket (SCM_RIGHTS), so children in other processes still share
// their parent's pages copy-on-write. A parent can attach to a VMM process
// it did not start, by its socket, as a daemon does after its own restart;
// the process holds in-memory checkpoints (frozen bases, by ID: Hold) for
// its parent, so that those outlive the parent too.
package vmmproc

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"runtime"
	"runtime/debug"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/jail"
	"github.com/kilnvm/kiln/memory"
	"github.com/kilnvm/kiln/seccomp"
	"github.com/kilnvm/kiln/snapshot"
	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmm"
	"github.com/kilnvm/kiln/vmmproc/vmmpb"
)

// APIVersion is the version of the VMM process API this package speaks.
const APIVersion = 1

// errNoVM: a request that needs the VM came before Create.
var errNoVM = errors.New("the VMM process has no VM yet (Create first)")

// lingerAfterStop is how long a VMM process whose VM has stopped waits for
// its parent to ask how (Wait) before it exits anyway.
const lingerAfterStop = 30 * time.Second

// ServeConfig configures Serve.
type ServeConfig struct {
	// Socket is the API's Unix socket path; the descriptor socket is
	// FDSocket(Socket). Both are created, and removed on return.
	Socket string
	// KVMPath is /dev/kvm when empty.
	KVMPath string
	Logger  *slog.Logger
	// OpenFS opens the trees of fs devices (image roots); nil refuses
	// them.
	OpenFS virtio.FSOpener
	// Seccomp is the mode of the seccomp filter (package seccomp) that
	// Create installs on the whole process once the VM is built and
	// before it runs: Serve is a VMM process's, never a library's, since
	// the filter cannot be undone.
	Seccomp seccomp.Mode
	// Jail, when set, is the jail (package jail) Create enters once the
	// VM is built, before the seccomp filter; Create adds the binds its
	// VM needs. The process must have been started in namespaces of its
	// own (vmmproc.Start with a JailConfig).
	Jail *jail.Config
	// HoldProcs builds the VM with vmm.Config.HoldProcs, its vCPUs
	// keeping their Ps while in the guest, and Create sizes the
	// process's GOMAXPROCS for them (vmm.ProcsFor). A process of its own
	// (ServeMain) sets it; a test serving in its own process need not.
	HoldProcs bool
}

// Serve serves the VMM API until the process's VM has stopped and its
// parent has been told (Wait), or lingerAfterStop after the stop, or ctx
// ends (which stops the VM).
func Serve(ctx context.Context, cfg ServeConfig) error {
	if cfg.Socket == "" {
		return errors.New("vmmproc: no socket path")
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	// The descriptor socket first: a parent that sees the API socket
	// may use both.
	fdln, err := listenUnix(FDSocket(cfg.Socket))
	if err != nil {
		return fmt.Errorf("vmmproc: %w", err)
	}
	defer fdln.Close()
	ln, err := listenUnix(cfg.Socket)
	if err != nil {
		return fmt.Errorf("vmmproc: %w", err)
	}
	defer ln.Close()

	s := newServer(cfg.KVMPath, log)
	s.openFS = cfg.OpenFS
	s.seccomp = cfg.Seccomp
	s.holdProcs = cfg.HoldProcs
	s.jail, s.socket, s.hostPID = cfg.Jail, cfg.Socket, hostPID()
	defer s.fds.closeAll()
	defer s.holds.closeAll()
	go s.fds.serveFDs(fdln)
	g := grpc.NewServer()
	vmmpb.RegisterVMMServer(g, s)
	served := make(chan error, 1)
	go func() { served <- g.Serve(ln) }()

	select {
	case <-ctx.Done():
		s.stopVM()
	case <-s.told:
	case err := <-served:
		s.stopVM()
		return fmt.Errorf("vmmproc: serve: %w", err)
	case <-linger(s.stopped, lingerAfterStop):
	}
	s.stopVM()
	<-s.done()
	// Let the last answers (Wait's) reach the parent.
	stopped := make(chan struct{})
	go func() { g.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(5 * time.Second):
		g.Stop()
	}
	return s.closeVM()
}

// server is the VMM API over one VM.
type server struct {
	vmmpb.UnimplementedVMMServer
	kvmPath   string
	openFS    virtio.FSOpener
	seccomp   seccomp.Mode
	jail      *jail.Config // nil: not jailed
	socket    string
	hostPID   int  // this process's ID in the host's PID namespace
	holdProcs bool // ServeConfig.HoldProcs
	log       *slog.Logger
	fds       *fdStore
	holds     *holdTable
	keeps     *keepTable // values kept for the parent (Keep), in memory only
	console   *fanout

	mu      sync.Mutex
	vm      *vmm.VM
	cancel  context.CancelFunc
	created bool          // Create claimed the process's one VM
	stopped chan struct{} // closed when Run returns or Create failed
	exit    vmm.Exit
	runErr  error

	tellOnce sync.Once
	told     chan struct{} // closed once a Wait answered after the stop
}

func newServer(kvmPath string, log *slog.Logger) *server {
	return &server{kvmPath: kvmPath, log: log, fds: newFDStore(), holds: newHoldTable(), keeps: newKeepTable(), console: newFanout(), stopped: make(chan struct{}), told: make(chan struct{})}
}

// done returns a channel closed when the VM has stopped (at once when
// there is none).
func (s *server) done() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.created {
		c := make(chan struct{})
		close(c)
		return c
	}
	return s.stopped
}

// linger returns a channel closed d after stopped is.
func linger(stopped <-chan struct{}, d time.Duration) <-chan struct{} {
	c := make(chan struct{})
	go func() {
		<-stopped
		time.Sleep(d)
		close(c)
	}()
	return c
}

func (s *server) stopVM() {
	s.mu.Lock()
	cancel := s.cancel
	s.mu.Unlock()
	if cancel != nil {
		cancel()
	}
}

func (s *server) closeVM() error {
	s.mu.Lock()
	vm := s.vm
	s.mu.Unlock()
	if vm == nil {
		return nil
	}
	return vm.Close()
}

// current returns the VM, or an error when there is none yet.
func (s *server) current() (*vmm.VM, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.vm == nil {
		return nil, status.Error(codes.FailedPrecondition, errNoVM.Error())
	}
	return s.vm, nil
}

func (s *server) Hello(context.Context, *vmmpb.HelloRequest) (*vmmpb.HelloResponse, error) {
	state := "none"
	if vm, err := s.current(); err == nil {
		state = vm.State().String()
	}
	pid := s.hostPID
	if pid == 0 {
		pid = os.Getpid()
	}
	return &vmmpb.HelloResponse{ApiVersion: APIVersion, Pid: int64(pid), State: state}, nil
}

// decodeStrict decodes JSON, refusing unknown fields: what crosses is the
// parent's plain data, and a mismatch of versions must not pass silently.
func decodeStrict(b []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return err
	}
	if dec.More() {
		return errors.New("trailing data")
	}
	return nil
}

func (s *server) Create(ctx context.Context, req *vmmpb.CreateRequest) (*vmmpb.CreateResponse, error) {
	s.mu.Lock()
	busy := s.created
	s.created = true // claims the process's one VM
	s.mu.Unlock()
	if busy {
		return nil, status.Error(codes.AlreadyExists, "the VMM process has a VM already")
	}
	vm, err := s.build(req)
	if err == nil {
		// Once, before the seccomp filter: the process runs this one VM,
		// and each P costs its memory (caches, a GC worker), on a host
		// of many CPUs as on one of few.
		procs := vmm.ProcsFor(vm.CPUs())
		runtime.GOMAXPROCS(procs)
		s.log.Debug("GOMAXPROCS for one VM", "vcpus", vm.CPUs(), "gomaxprocs", procs, "hold_procs", s.holdProcs)
	}
	if err == nil && s.jail != nil {
		if err = s.enterJail(req, vm); err != nil {
			vm.Close()
		}
	}
	if err == nil {
		if err = s.confine(); err != nil {
			vm.Close()
		}
	}
	if err != nil {
		s.mu.Lock()
		close(s.stopped)
		s.runErr = err
		s.mu.Unlock()
		return nil, err
	}
	runCtx, cancel := context.WithCancel(context.Background())
	s.mu.Lock()
	s.vm, s.cancel = vm, cancel
	stopped := s.stopped
	s.mu.Unlock()
	go func() {
		exit, err := vm.Run(runCtx)
		s.mu.Lock()
		s.exit, s.runErr = exit, err
		s.mu.Unlock()
		s.console.close()
		close(stopped)
		s.log.Info("vm stopped", "exit", exit.String(), "err", err)
	}()
	// What building the VM allocated is garbage now (a boot's kernel and
	// initrd read into the heap: about 90 MiB in L1; a restore's decoded
	// state), but an idle VMM may not collect it for minutes, nor give
	// back the pages it freed: it would stay resident in every idle
	// sandbox. Collected and returned beside the running VM, off the
	// caller's wait.
	go debug.FreeOSMemory()
	return &vmmpb.CreateResponse{}, nil
}

// confine restricts the process once its VM is built and before the guest
// runs: the seccomp filter (package seccomp) on every thread. The guest
// never runs unfiltered; what the build opened (/dev/kvm, disks, taps) it
// keeps. The jail's steps (enterJail) go before the filter. A jailed
// process gets seccomp.JailedVMM (sockets of AF_UNIX only: its parent
// fetches its chunks and dials its vsock connections); an unjailed one
// VMM's, which keeps IP sockets for the chunks it fetches itself.
func (s *server) confine() error {
	if s.seccomp == seccomp.Off {
		s.log.Warn("SECCOMP FILTER OFF ($" + seccomp.EnvMode + "=off): this VMM process runs its guest with every system call open; a debugging switch only")
		return nil
	}
	p := seccomp.VMM()
	if s.jail != nil {
		p = seccomp.JailedVMM()
	}
	p.Mode = s.seccomp
	if err := p.Install(); err != nil {
		return status.Errorf(codes.Internal, "confine the VMM process: %v", err)
	}
	s.log.Info("seccomp filter installed", "mode", s.seccomp.String(), "syscalls", len(p.Syscalls), "ioctls", len(p.Ioctls), "socket_families", p.SocketFamilies)
	return nil
}

// vsockDialer is how the VM's vsock device dials the host side of its
// guest's connections: in a jail, through the parent (DialSocket, which
// vmmproc.Start's caller serves); else itself (nil).
func (s *server) vsockDialer() virtio.VsockDialer {
	if s.jail == nil {
		return nil
	}
	path := DialSocket(s.socket)
	return func(ctx context.Context, port uint32) (*net.UnixConn, error) {
		return DialVsock(ctx, path, port)
	}
}

// build makes the VM a Create asks for.
func (s *server) build(req *vmmpb.CreateRequest) (*vmm.VM, error) {
	var overrides []virtio.DeviceSpec
	if len(req.OverridesJson) > 0 {
		if err := decodeStrict(req.OverridesJson, &overrides); err != nil {
			return nil, status.Errorf(codes.InvalidArgument, "device overrides: %v", err)
		}
	}
	rcfg := vmm.RestoreConfig{Devices: overrides, Console: s.console, KVMPath: s.kvmPath, Logger: s.log, OpenFS: s.openFS, VsockDial: s.vsockDialer(), HoldProcs: s.holdProcs, VCPUSeccomp: seccomp.Off}
	switch src := req.Source.(type) {
	case *vmmpb.CreateRequest_BootSpecJson:
		var spec vmm.Spec
		if err := decodeStrict(src.BootSpecJson, &spec); err != nil {
			return nil, status.Errorf(codes.InvalidArgument, "VM spec: %v", err)
		}
		if len(overrides) > 0 {
			return nil, status.Error(codes.InvalidArgument, "device overrides are for restores; a booted VM has its spec's devices")
		}
		vm, err := vmm.New(vmm.Config{Spec: spec, Console: s.console, KVMPath: s.kvmPath, Logger: s.log, OpenFS: s.openFS, VsockDial: s.vsockDialer(), HoldProcs: s.holdProcs, VCPUSeccomp: seccomp.Off})
		if err != nil {
			return nil, statusFor(err)
		}
		return vm, nil
	case *vmmpb.CreateRequest_SnapshotDir:
		// This process holds no host key: the caller checked the
		// snapshot and pins its manifest, and hands over its memory,
		// checked and sealed.
		if len(req.SnapshotManifestSha256) != sha256.Size || req.SnapshotMemoryToken == "" {
			return nil, status.Error(codes.InvalidArgument, "a snapshot restore needs the manifest's digest and the sealed memory (snapshot.Verify)")
		}
		f, err := s.fds.take(req.SnapshotMemoryToken)
		if err != nil {
			return nil, status.Errorf(codes.FailedPrecondition, "snapshot memory: %v", err)
		}
		fd, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
		f.Close()
		if err != nil {
			return nil, status.Errorf(codes.Internal, "snapshot memory: %v", err)
		}
		vm, err := snapshot.Load(src.SnapshotDir, rcfg,
			snapshot.WithManifestDigest([sha256.Size]byte(req.SnapshotManifestSha256)), snapshot.WithSealedMemory(fd))
		if err != nil {
			return nil, statusFor(err)
		}
		return vm, nil
	case *vmmpb.CreateRequest_Fork:
		var st vmm.State
		if err := decodeStrict(src.Fork.StateJson, &st); err != nil {
			return nil, status.Errorf(codes.InvalidArgument, "fork state: %v", err)
		}
		if err := st.Validate(); err != nil {
			return nil, status.Errorf(codes.InvalidArgument, "fork state: %v", err)
		}
		f, err := s.fds.take(src.Fork.MemoryToken)
		if err != nil {
			return nil, status.Errorf(codes.FailedPrecondition, "fork memory: %v", err)
		}
		// The mapping owns the descriptor it is given: a duplicate, so
		// that the File (closed here) keeps its own.
		fd, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
		f.Close()
		if err != nil {
			return nil, status.Errorf(codes.Internal, "fork memory: %v", err)
		}
		mem, err := memory.MapFile(fd, st.Layout(), true)
		if err != nil {
			unix.Close(fd)
			return nil, status.Errorf(codes.InvalidArgument, "fork memory: %v", err)
		}
		vm, err := vmm.Restore(rcfg, &st, mem)
		if err != nil {
			return nil, statusFor(err)
		}
		return vm, nil
	}
	return nil, status.Error(codes.InvalidArgument, "Create needs a boot spec, a snapshot or a fork")
}

func (s *server) Pause(ctx context.Context, _ *vmmpb.PauseRequest) (*vmmpb.PauseResponse, error) {
	vm, err := s.current()
	if err != nil {
		return nil, err
	}
	if err := vm.Pause(ctx); err != nil {
		return nil, statusFor(err)
	}
	return &vmmpb.PauseResponse{}, nil
}

func (s *server) Resume(context.Context, *vmmpb.ResumeRequest) (*vmmpb.ResumeResponse, error) {
	vm, err := s.current()
	if err != nil {
		return nil, err
	}
	if err := vm.Resume(); err != nil {
		return nil, statusFor(err)
	}
	return &vmmpb.ResumeResponse{}, nil
}

func (s *server) Save(ctx context.Context, req *vmmpb.SaveRequest) (*vmmpb.SaveResponse, error) {
	vm, err := s.current()
	if err != nil {
		return nil, err
	}
	if req.Dir == "" {
		return nil, status.Error(codes.InvalidArgument, "no snapshot directory")
	}
	opts := []snapshot.Option{snapshot.WithLogger(s.log), snapshot.WithLabels(req.Labels)}
	if token, ok := strings.CutPrefix(req.Dir, saveFDPrefix); ok {
		// A folder the parent made and passed (a jailed process sees no
		// host path).
		d, err := s.fds.take(token)
		if err != nil {
			return nil, status.Errorf(codes.FailedPrecondition, "snapshot folder: %v", err)
		}
		defer d.Close()
		if err := snapshot.SaveAt(ctx, vm, d, opts...); err != nil {
			return nil, statusFor(err)
		}
		return &vmmpb.SaveResponse{}, nil
	}
	if s.jail != nil {
		return nil, status.Error(codes.InvalidArgument, "a jailed VMM process saves into a folder passed as a descriptor (fd:TOKEN), not a host path")
	}
	if err := snapshot.Save(ctx, vm, req.Dir, opts...); err != nil {
		return nil, statusFor(err)
	}
	return &vmmpb.SaveResponse{}, nil
}

func (s *server) Freeze(ctx context.Context, _ *vmmpb.FreezeRequest) (*vmmpb.FreezeResponse, error) {
	vm, err := s.current()
	if err != nil {
		return nil, err
	}
	st, base, err := vm.Freeze(ctx)
	if err != nil {
		return nil, statusFor(err)
	}
	b, err := json.Marshal(st)
	if err != nil {
		base.Close()
		return nil, status.Errorf(codes.Internal, "encode state: %v", err)
	}
	token, err := newToken()
	if err == nil {
		err = s.fds.put(token, base)
	}
	if err != nil {
		base.Close()
		return nil, status.Errorf(codes.ResourceExhausted, "hold the frozen memory: %v", err)
	}
	return &vmmpb.FreezeResponse{StateJson: b, MemoryToken: token}, nil
}

// InsertDisk fills a volume slot with the image whose descriptor the
// parent put on the ".fd" socket.
func (s *server) InsertDisk(_ context.Context, req *vmmpb.InsertDiskRequest) (*vmmpb.InsertDiskResponse, error) {
	if req.DeviceId == "" || req.Path == "" || len(req.Path) > 4096 {
		return nil, status.Error(codes.InvalidArgument, "insert disk: a device ID and the image's path (1 to 4096 bytes) are needed")
	}
	f, err := s.fds.take(req.Token)
	if err != nil {
		return nil, status.Errorf(codes.FailedPrecondition, "insert disk: image: %v", err)
	}
	vm, err := s.current()
	if err != nil {
		f.Close()
		return nil, err
	}
	// A duplicate named by the image's host path: the VM's specs and
	// snapshots name the image by it.
	fd, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	f.Close()
	if err != nil {
		return nil, status.Errorf(codes.Internal, "insert disk: image: %v", err)
	}
	img := os.NewFile(uintptr(fd), req.Path)
	if err := vm.InsertDisk(req.DeviceId, img, req.ReadOnly); err != nil {
		img.Close()
		var se *vmm.StateError
		if errors.As(err, &se) {
			return nil, statusFor(err)
		}
		return nil, status.Error(codes.FailedPrecondition, err.Error())
	}
	return &vmmpb.InsertDiskResponse{}, nil
}

func (s *server) Wait(ctx context.Context, _ *vmmpb.WaitRequest) (*vmmpb.WaitResponse, error) {
	select {
	case <-s.done():
	case <-ctx.Done():
		return nil, status.FromContextError(ctx.Err()).Err()
	}
	s.mu.Lock()
	resp := &vmmpb.WaitResponse{Reason: s.exit.Reason.String(), Message: s.exit.Message}
	if s.runErr != nil {
		resp.Error = s.runErr.Error()
	}
	s.mu.Unlock()
	s.tellOnce.Do(func() {
		// Exit once this answer is on its way (Serve stops gracefully).
		go func() { time.Sleep(100 * time.Millisecond); close(s.told) }()
	})
	return resp, nil
}

func (s *server) Stop(context.Context, *vmmpb.StopRequest) (*vmmpb.StopResponse, error) {
	s.stopVM()
	return &vmmpb.StopResponse{}, nil
}

func (s *server) Describe(context.Context, *vmmpb.DescribeRequest) (*vmmpb.DescribeResponse, error) {
	vm, err := s.current()
	if err != nil {
		return nil, err
	}
	b, err := json.Marshal(vm.Devices())
	if err != nil {
		return nil, status.Errorf(codes.Internal, "encode devices: %v", err)
	}
	resp := &vmmpb.DescribeResponse{DevicesJson: b, State: vm.State().String(), Diagnosis: vm.Diagnose(), Runtime: runtimeMemory()}
	if mem := vm.Memory(); mem != nil {
		for i, r := range mem.Regions() {
			resp.GuestMemory = append(resp.GuestMemory, &vmmpb.MemoryRange{HostAddr: uint64(mem.HostAddr(i)), Size: r.Size})
		}
	}
	return resp, nil
}

func (s *server) Console(_ *vmmpb.ConsoleRequest, stream vmmpb.VMM_ConsoleServer) error {
	ch, cancel := s.console.subscribe()
	defer cancel()
	for {
		select {
		case b, ok := <-ch:
			if !ok {
				return nil
			}
			if err := stream.Send(&vmmpb.ConsoleChunk{Data: b}); err != nil {
				return err
			}
		case <-stream.Context().Done():
			return nil
		}
	}
}

// statusFor turns a VMM error into a gRPC status: bad input and refused
// lifecycle operations are the caller's to correct.
func statusFor(err error) error {
	var se *vmm.StateError
	var spec *virtio.SpecError
	var ce *vmm.ConfigError
	switch {
	case errors.As(err, &se):
		return status.Error(codes.FailedPrecondition, err.Error())
	case errors.As(err, &ce), errors.As(err, &spec), errors.Is(err, snapshot.ErrMismatch):
		return status.Error(codes.InvalidArgument, err.Error())
	case errors.Is(err, snapshot.ErrCorrupt), errors.Is(err, snapshot.ErrChecksum), errors.Is(err, snapshot.ErrFormatVersion), errors.Is(err, snapshot.ErrAuth):
		return status.Error(codes.DataLoss, err.Error())
	case errors.Is(err, snapshot.ErrExists):
		return status.Error(codes.AlreadyExists, err.Error())
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return status.FromContextError(err).Err()
	}
	return status.Error(codes.Internal, err.Error())
}

// fanout copies the guest's console to every subscriber, dropping what a
// slow one cannot take (the console is for people and diagnoses).
type fanout struct {
	mu     sync.Mutex
	subs   map[chan []byte]bool
	closed bool
}

func newFanout() *fanout { return &fanout{subs: map[chan []byte]bool{}} }

var _ io.Writer = (*fanout)(nil)

func (f *fanout) Write(p []byte) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for c := range f.subs {
		select {
		case c <- bytes.Clone(p):
		default:
		}
	}
	return len(p), nil
}

func (f *fanout) subscribe() (<-chan []byte, func()) {
	c := make(chan []byte, 256)
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		close(c)
		return c, func() {}
	}
	f.subs[c] = true
	return c, func() {
		f.mu.Lock()
		defer f.mu.Unlock()
		if f.subs[c] {
			delete(f.subs, c)
			close(c)
		}
	}
}

func (f *fanout) close() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.closed = true
	for c := range f.subs {
		delete(f.subs, c)
		close(c)
	}
}
