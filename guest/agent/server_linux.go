package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"runtime"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/filetree"
	"github.com/kilnvm/kiln/guest/agentpb"
)

// Config configures a Server. The zero value works (as a non-PID-1 server
// without cgroups, OOM protection or power-off).
type Config struct {
	// Logger receives structured logs; nil discards them.
	Logger *slog.Logger
	// Version is reported by Info as agent_version; empty means "dev".
	Version string

	// PowerOff is called shortly after a PowerOff call was answered. Nil
	// makes PowerOff fail with FailedPrecondition.
	PowerOff func() error
	// PowerOffDelay is how long after answering PowerOff the callback
	// runs; 0 means 100ms.
	PowerOffDelay time.Duration

	// ProtectFromOOM sets the agent's own oom_score_adj to -1000 when it
	// starts serving (children get 0 back through the trampoline). As PID 1
	// the agent always does.
	ProtectFromOOM bool

	// WritableDir is where an image root's writes are (pid1.ImageRWView:
	// the overlay's upper layer and the container engines' storage), for
	// ExportWritable and ImportWritable; empty: the root is no image's.
	WritableDir string

	// CgroupRoot is where cgroup v2 is mounted (e.g. /sys/fs/cgroup); the
	// agent runs Exec processes in per-call cgroups below
	// CgroupRoot/sandbox. Empty disables cgroups; if they do not work the
	// agent logs it and runs processes without them.
	CgroupRoot string
	// PidsMax is the sandbox's pids.max; 0 means DefaultPidsMax, negative
	// leaves it unlimited.
	PidsMax int
	// MemoryReserve is the memory left out of the sandbox's memory.max
	// (MemTotal - MemoryReserve); 0 means DefaultMemoryReserve.
	MemoryReserve uint64

	// Reaper waits for the processes the Server starts. Nil makes the
	// Server create its own, in orphan mode when the process is PID 1, and
	// run it while Serve runs. A Reaper passed here must be run by its
	// owner.
	Reaper *Reaper
	// TrampolinePath is the binary started as the exec trampoline; it must
	// call MaybeRunTrampoline first. Empty means /proc/self/exe.
	TrampolinePath string
	// OutputGrace is how long, after an Exec's process exited, its output
	// is read while the pipes stay silent (background processes may hold
	// them open); 0 means 500ms. Output that keeps coming is read for at
	// most MaxOutputDrain; 0 means 10s.
	OutputGrace    time.Duration
	MaxOutputDrain time.Duration

	// System performs the snapshot hooks; nil means LinuxSystem().
	System System

	// MaxDetached is how many detached processes (ExecStart.detach_id)
	// the agent keeps, running or exited; 0 means agentpb.MaxDetached.
	MaxDetached int

	// Defaults fill what an Exec leaves unset (an image's config); nil:
	// the agent's own defaults (DefaultEnv, "/", root).
	Defaults *ExecDefaults

	// ResolvConf is the file ConfigureNetwork writes the nameservers to;
	// empty means /etc/resolv.conf.
	ResolvConf string
	// NetworkNamespace is the network namespace (a path) ConfigureNetwork
	// configures; empty means the agent's own (tests point it at one
	// they made).
	NetworkNamespace string
}

// Server implements agentpb.AgentServer.
type Server struct {
	agentpb.UnimplementedAgentServer

	cfg        Config
	log        *slog.Logger
	sys        System
	reaper     *Reaper
	ownReaper  bool
	trampoline string

	initOnce sync.Once
	cgroups  *cgroups // nil: no cgroups
	// cgroupsOff is set once the kernel refused to start a process in a
	// cgroup for good.
	cgroupsOff atomic.Bool

	powerOnce sync.Once

	detached *detachedTable

	// netMu serializes ConfigureNetwork calls.
	netMu sync.Mutex

	// roots are the container roots MountRoot mounted.
	roots rootTable
	// rootsDir, treesDir and volumesDir are RootsDir, TreesDir and
	// VolumesDir (tests move them).
	rootsDir, treesDir, volumesDir string
	// findDisk finds a virtio disk by serial (AddMounts disk):
	// findVirtioDisk when nil; a test's own otherwise.
	findDisk func(serial string) (dev, sizeFile string, err error)
	// diskMounts are where AddMounts mounted disks read-write (paths in
	// the guest's root), for Quiesce's freeze_volumes.
	diskMu     sync.Mutex
	diskMounts []string
}

// NewServer returns a Server for cfg. It changes nothing in the system
// until it serves.
func NewServer(cfg Config) *Server {
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Version == "" {
		cfg.Version = "dev"
	}
	if cfg.PowerOffDelay <= 0 {
		cfg.PowerOffDelay = 100 * time.Millisecond
	}
	if cfg.PidsMax == 0 {
		cfg.PidsMax = DefaultPidsMax
	}
	if cfg.MemoryReserve == 0 {
		cfg.MemoryReserve = DefaultMemoryReserve
	}
	if cfg.OutputGrace <= 0 {
		cfg.OutputGrace = 500 * time.Millisecond
	}
	if cfg.MaxDetached <= 0 {
		cfg.MaxDetached = agentpb.MaxDetached
	}
	if cfg.MaxOutputDrain <= 0 {
		cfg.MaxOutputDrain = 10 * time.Second
	}
	s := &Server{
		cfg:        cfg,
		log:        cfg.Logger,
		sys:        cfg.System,
		reaper:     cfg.Reaper,
		trampoline: cfg.TrampolinePath,
		detached:   newDetachedTable(cfg.MaxDetached),
		rootsDir:   RootsDir,
		treesDir:   TreesDir,
		volumesDir: VolumesDir,
	}
	if s.sys == nil {
		s.sys = LinuxSystem()
	}
	if s.reaper == nil {
		s.reaper = NewReaper(cfg.Logger.With("component", "reaper"), os.Getpid() == 1)
		s.ownReaper = true
	}
	if s.trampoline == "" {
		s.trampoline = "/proc/self/exe"
	}
	return s
}

// Reaper returns the Reaper the Server waits for its processes with. Users
// of Register whose Server owns its Reaper must run it.
func (s *Server) Reaper() *Reaper { return s.reaper }

// init applies the system-wide settings of the configuration, once.
func (s *Server) init() {
	s.initOnce.Do(func() {
		if s.cfg.ProtectFromOOM || os.Getpid() == 1 {
			if err := writeOOMScoreAdj(-1000); err != nil {
				s.log.Warn("agent is not protected from the OOM killer", "err", err)
			}
		}
		if s.cfg.CgroupRoot != "" {
			memTotal := uint64(0)
			if data, err := os.ReadFile("/proc/meminfo"); err == nil {
				memTotal = parseMeminfo(data)["MemTotal"]
			}
			cg, err := setupCgroups(s.log, s.cfg.CgroupRoot, s.cfg.PidsMax, memTotal, s.cfg.MemoryReserve)
			if err != nil {
				s.log.Warn("running processes without cgroup limits", "err", err)
			} else {
				s.cgroups = cg
			}
		}
	})
}

// Register registers the service on g and applies the configuration's
// system settings (OOM protection, cgroups). The caller serves g and, if
// the Server owns its Reaper, runs s.Reaper(). Serve does all of this.
func (s *Server) Register(g *grpc.Server) {
	s.init()
	agentpb.RegisterAgentServer(g, s)
}

// ServerOptions returns the gRPC server options Serve uses: interceptors
// that log every call and turn a panic into an Internal error.
func (s *Server) ServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(s.unaryInterceptor),
		grpc.ChainStreamInterceptor(s.streamInterceptor),
		grpc.WriteBufferSize(agentpb.BufferSize),
		grpc.ReadBufferSize(agentpb.BufferSize),
		grpc.InitialWindowSize(agentpb.StreamWindow),
		grpc.InitialConnWindowSize(agentpb.ConnWindow),
	}
}

// stopGrace is how long Serve lets calls finish after ctx ends before it
// cancels them.
const stopGrace = 2 * time.Second

// Serve serves the agent API on ln until ctx ends (then it returns nil) or
// serving fails. It runs the Server's own Reaper meanwhile. When ctx ends
// it lets calls finish for a moment, then cancels them: their processes are
// killed, but for detached ones (ExecStart.detach_id), which run on.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	opts := append(s.ServerOptions(), grpc.WaitForHandlers(true))
	g := grpc.NewServer(opts...)
	s.Register(g)

	// The reaper outlives the gRPC server: handlers that were cancelled
	// wait for their killed processes.
	reapCtx, stopReaper := context.WithCancel(context.WithoutCancel(ctx))
	defer stopReaper()
	var reaping sync.WaitGroup
	if s.ownReaper {
		reaping.Go(func() {
			if err := s.reaper.Run(reapCtx); err != nil {
				s.log.Error("reaper", "err", err)
			}
		})
	}
	defer reaping.Wait()

	s.log.Info("agent serving", "addr", ln.Addr().String(), "version", s.cfg.Version)
	served := make(chan error, 1)
	go func() { served <- g.Serve(ln) }()
	select {
	case err := <-served:
		g.Stop()
		stopReaper()
		return fmt.Errorf("agent: serving on %s: %w", ln.Addr(), err)
	case <-ctx.Done():
	}
	stopped := make(chan struct{})
	go func() {
		g.GracefulStop()
		close(stopped)
	}()
	select {
	case <-stopped:
	case <-time.After(stopGrace):
		g.Stop()
		<-stopped
	}
	<-served
	stopReaper()
	s.log.Info("agent stopped")
	return nil
}

func (s *Server) unaryInterceptor(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (resp any, err error) {
	start := time.Now()
	defer func() {
		if p := recover(); p != nil {
			s.log.Error("panic in handler", "method", info.FullMethod, "panic", fmt.Sprint(p), "stack", string(debug.Stack()))
			err = status.Errorf(codes.Internal, "agent: internal error in %s", info.FullMethod)
		}
		s.logCall(info.FullMethod, start, err)
	}()
	return handler(ctx, req)
}

func (s *Server) streamInterceptor(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) (err error) {
	start := time.Now()
	defer func() {
		if p := recover(); p != nil {
			s.log.Error("panic in handler", "method", info.FullMethod, "panic", fmt.Sprint(p), "stack", string(debug.Stack()))
			err = status.Errorf(codes.Internal, "agent: internal error in %s", info.FullMethod)
		}
		s.logCall(info.FullMethod, start, err)
	}()
	return handler(srv, ss)
}

func (s *Server) logCall(method string, start time.Time, err error) {
	code := status.Code(err)
	level := slog.LevelDebug
	switch code {
	case codes.OK, codes.Canceled, codes.NotFound, codes.AlreadyExists, codes.InvalidArgument:
	default:
		level = slog.LevelWarn
	}
	attrs := []slog.Attr{slog.String("method", method), slog.Duration("took", time.Since(start)), slog.String("code", code.String())}
	if err != nil {
		attrs = append(attrs, slog.String("err", err.Error()))
	}
	s.log.LogAttrs(context.Background(), level, "call", attrs...)
}

// Health answers ok while the agent serves.
func (s *Server) Health(context.Context, *agentpb.HealthRequest) (*agentpb.HealthResponse, error) {
	return &agentpb.HealthResponse{Ok: true}, nil
}

// Info reports on the guest. Fields that cannot be read are left zero (and
// logged).
func (s *Server) Info(context.Context, *agentpb.InfoRequest) (*agentpb.InfoResponse, error) {
	resp := &agentpb.InfoResponse{
		NumCpu:       uint32(runtime.NumCPU()),
		AgentVersion: s.cfg.Version,
	}
	var uts unix.Utsname
	if err := unix.Uname(&uts); err == nil {
		resp.KernelRelease = unix.ByteSliceToString(uts.Release[:])
		resp.Hostname = unix.ByteSliceToString(uts.Nodename[:])
	} else {
		s.log.Warn("info: uname", "err", err)
	}
	if data, err := os.ReadFile("/proc/uptime"); err != nil {
		s.log.Warn("info: uptime", "err", err)
	} else if up, err := parseUptime(data); err != nil {
		s.log.Warn("info: uptime", "err", err)
	} else {
		resp.UptimeNs = uint64(up)
	}
	if data, err := os.ReadFile("/proc/meminfo"); err != nil {
		s.log.Warn("info: meminfo", "err", err)
	} else {
		m := parseMeminfo(data)
		resp.MemTotalBytes = m["MemTotal"]
		resp.MemAvailableBytes = m["MemAvailable"]
	}
	var st unix.Statfs_t
	if err := unix.Statfs("/", &st); err != nil {
		s.log.Warn("info: statfs /", "err", err)
	} else {
		bs := uint64(st.Bsize)
		resp.DiskTotalBytes = st.Blocks * bs
		resp.DiskUsedBytes = (st.Blocks - min(st.Bfree, st.Blocks)) * bs
	}
	return resp, nil
}

// Quiesce syncs all filesystems and, if asked, drops the caches.
func (s *Server) Quiesce(_ context.Context, req *agentpb.QuiesceRequest) (*agentpb.QuiesceResponse, error) {
	if err := s.sys.Sync(); err != nil {
		return nil, status.Errorf(codes.Internal, "quiesce: %v", err)
	}
	if req.GetFreezeVolumes() {
		if err := s.freezeDisks(); err != nil {
			return nil, status.Errorf(codes.Internal, "quiesce: %v", err)
		}
	}
	if req.GetDropCaches() {
		if err := s.sys.DropCaches(); err != nil {
			return nil, status.Errorf(codes.Internal, "quiesce: %v", err)
		}
	}
	return &agentpb.QuiesceResponse{}, nil
}

// Bounds on Reseed's entropy.
const (
	MinReseedBytes = 32
	MaxReseedBytes = 4096
)

// Reseed adds the entropy to the kernel's pool.
func (s *Server) Reseed(_ context.Context, req *agentpb.ReseedRequest) (*agentpb.ReseedResponse, error) {
	n := len(req.GetEntropy())
	if n < MinReseedBytes || n > MaxReseedBytes {
		return nil, status.Errorf(codes.InvalidArgument, "reseed: entropy must be %d to %d bytes, got %d", MinReseedBytes, MaxReseedBytes, n)
	}
	credited, err := s.sys.AddEntropy(req.GetEntropy())
	if err != nil {
		return nil, status.Errorf(statusCodeOf(err), "reseed: %v", err)
	}
	if !credited {
		s.log.Info("reseed: entropy mixed in but not credited")
	}
	return &agentpb.ReseedResponse{Credited: credited}, nil
}

// SetClock sets the realtime clock.
func (s *Server) SetClock(_ context.Context, req *agentpb.SetClockRequest) (*agentpb.SetClockResponse, error) {
	n := req.GetUnixNanos()
	if n <= 0 {
		return nil, status.Errorf(codes.InvalidArgument, "set clock: unix_nanos must be positive, got %d", n)
	}
	if err := s.sys.SetClock(time.Unix(0, n)); err != nil {
		return nil, status.Errorf(statusCodeOf(err), "set clock: %v", err)
	}
	return &agentpb.SetClockResponse{}, nil
}

// PowerOff answers, then calls Config.PowerOff after PowerOffDelay (once,
// however often it is asked).
func (s *Server) PowerOff(context.Context, *agentpb.PowerOffRequest) (*agentpb.PowerOffResponse, error) {
	if s.cfg.PowerOff == nil {
		return nil, status.Error(codes.FailedPrecondition, "power off: not configured in this agent")
	}
	s.powerOnce.Do(func() {
		s.log.Info("powering off", "in", s.cfg.PowerOffDelay)
		time.AfterFunc(s.cfg.PowerOffDelay, func() {
			if err := s.cfg.PowerOff(); err != nil {
				s.log.Error("power off failed", "err", err)
			}
		})
	})
	return &agentpb.PowerOffResponse{}, nil
}

// maxHostname is the longest host name the kernel takes (HOST_NAME_MAX).
const maxHostname = 64

// SetHostname sets the kernel's host name, as hostname(1) does.
func (s *Server) SetHostname(_ context.Context, req *agentpb.SetHostnameRequest) (*agentpb.SetHostnameResponse, error) {
	name := req.GetName()
	if name == "" || len(name) > maxHostname {
		return nil, invalidf("set hostname %s: want 1 to %d bytes, got %d", quoteShort(name), maxHostname, len(name))
	}
	for i := 0; i < len(name); i++ {
		if c := name[i]; c <= ' ' || c >= 0x7f {
			return nil, invalidf("set hostname %s: byte %d (%q) is not a printable ASCII character other than space", quoteShort(name), i, c)
		}
	}
	if err := s.sys.SetHostname(name); err != nil {
		return nil, status.Errorf(statusCodeOf(err), "set hostname: %v", err)
	}
	return &agentpb.SetHostnameResponse{}, nil
}

// statusCodeOf maps err's errno to a code (Internal without one).
func statusCodeOf(err error) codes.Code {
	if errno := errnoOf(err); errno != 0 {
		return filetree.Code(errno)
	}
	if errors.Is(err, context.Canceled) {
		return codes.Canceled
	}
	return codes.Internal
}
