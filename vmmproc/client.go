package vmmproc

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/internal/netnsthread"
	"github.com/kilnvm/kiln/seccomp"
	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmm"
	"github.com/kilnvm/kiln/vmmproc/vmmpb"
)

// SocketEnv is the environment variable through which Start tells the
// VMM process its socket. Main (kiln-vmm) reads it, as does a test
// binary that serves as its own VMM process.
const SocketEnv = "KILN_VMM_SOCKET"

// The files of a VMM process in its folder.
const (
	SocketFile = "vmm.sock"
	LogFile    = "vmm.log"
)

// StartConfig says how to start a VMM process.
type StartConfig struct {
	// Command is the program and arguments that serve the API on the
	// socket named by SocketEnv: ["/usr/bin/kiln", "vmm"].
	Command []string
	// Dir holds the process's socket (SocketFile) and log (LogFile).
	Dir string
	// Env is added to the process's environment.
	Env []string
	// StartTimeout bounds the wait for the socket (and ctx does); 2 minutes
	// when zero: a new process makes it in milliseconds on a host, but one
	// of four starting at once on an emulated CPU has taken over 30 s.
	StartTimeout time.Duration
	// Cgroup, when set, is a cgroup v2 folder the process starts in
	// directly (clone3's CLONE_INTO_CGROUP): it never runs outside it.
	Cgroup string
	// Jail, when set, jails the process (JailConfig); nil runs it as
	// the caller runs, in the caller's namespaces.
	Jail   *JailConfig
	Logger *slog.Logger
}

// Process is a VMM process, started by Start or attached to by Attach.
// Its methods are safe for concurrent use.
type Process struct {
	sock string
	log  *slog.Logger
	conn *grpc.ClientConn
	api  vmmpb.VMMClient
	pid  int
	// jailUID and jailGID are a jailed process's ids (0: not jailed).
	jailUID, jailGID int

	cmd     *exec.Cmd // nil when attached
	logPath string
	exited  chan struct{} // closed when a started process has exited
	exitErr error         // how it exited, once exited is closed

	closeOnce sync.Once
}

// ProcessError says that a VMM process died: its PID, how it exited and
// the end of its log.
type ProcessError struct {
	PID     int
	Status  string // "signal: killed", "exit status 2", or "gone" when attached
	LogTail string
	// Seccomp: its seccomp filter killed it (SIGSYS) for a system call
	// outside the allowlist (package seccomp); the kernel's log has an
	// audit line (type=1326) with the call's number.
	Seccomp bool
}

func (e *ProcessError) Error() string {
	msg := fmt.Sprintf("VMM process %d %s", e.PID, e.Status)
	if e.LogTail != "" {
		msg += "; its log ends:\n  " + strings.ReplaceAll(strings.TrimSpace(e.LogTail), "\n", "\n  ")
	}
	return msg
}

// Start starts a VMM process and returns once it answers on its socket.
func Start(ctx context.Context, cfg StartConfig) (_ *Process, err error) {
	if cfg.Jail != nil && cfg.Jail.IDFile != nil {
		defer cfg.Jail.IDFile.Close() // the child has its own
	}
	if len(cfg.Command) == 0 {
		return nil, errors.New("vmmproc: no VMM command")
	}
	if cfg.Dir == "" {
		return nil, errors.New("vmmproc: no folder for the VMM process")
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	sock := filepath.Join(cfg.Dir, SocketFile)
	if len(sock) > 100 {
		return nil, fmt.Errorf("vmmproc: socket path %s is too long for a Unix socket", sock)
	}
	logPath := filepath.Join(cfg.Dir, LogFile)
	logf, err := os.OpenFile(logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("vmmproc: %w", err)
	}
	defer logf.Close() // the child has its own descriptor
	cmd := exec.Command(cfg.Command[0], cfg.Command[1:]...)
	cmd.Env = withGODEBUG(append(append(os.Environ(), cfg.Env...), SocketEnv+"="+sock))
	cmd.Stdout, cmd.Stderr = logf, logf
	// Its own process group: a terminal's ^C reaches the parent, which
	// stops its sandboxes in order.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if cfg.Cgroup != "" {
		fd, err := unix.Open(cfg.Cgroup, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return nil, fmt.Errorf("vmmproc: the VMM process's cgroup %s: %w", cfg.Cgroup, err)
		}
		defer unix.Close(fd) // the child is in it once started
		cmd.SysProcAttr.UseCgroupFD, cmd.SysProcAttr.CgroupFD = true, fd
	}
	start := cmd.Start
	if cfg.Jail != nil {
		env, err := jailSetup(cfg, cmd.SysProcAttr)
		if err != nil {
			return nil, err
		}
		cmd.Env = append(cmd.Env, env)
		cmd.ExtraFiles = []*os.File{cfg.Jail.IDFile}
		if ns := cfg.Jail.Netns; ns != "" {
			// Forked from a thread inside the sandbox's network
			// namespace, the process starts in it.
			start = func() error { return netnsthread.RunAt(ns, cmd.Start) }
		}
	}
	if err := start(); err != nil {
		if cfg.Cgroup != "" {
			return nil, fmt.Errorf("vmmproc: start %s in cgroup %s: %w", cfg.Command[0], cfg.Cgroup, err)
		}
		return nil, fmt.Errorf("vmmproc: start %s: %w", cfg.Command[0], err)
	}
	p := &Process{sock: sock, log: log, cmd: cmd, pid: cmd.Process.Pid, logPath: logPath, exited: make(chan struct{})}
	if cfg.Jail != nil {
		p.jailUID, p.jailGID = cfg.Jail.UID, cfg.Jail.GID
	}
	go func() {
		p.exitErr = cmd.Wait()
		if killedBySeccomp(p.exitErr) {
			log.Error("VMM process "+seccompStatus, "pid", p.pid, "log", logPath)
		}
		close(p.exited)
	}()
	defer func() {
		if err != nil {
			cmd.Process.Kill()
			<-p.exited
		}
	}()
	timeout := cfg.StartTimeout
	if timeout <= 0 {
		timeout = 2 * time.Minute
	}
	wctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		select {
		case <-p.exited:
			return nil, p.deathError()
		case <-wctx.Done():
			return nil, fmt.Errorf("vmmproc: VMM process %d made no socket within %v", p.pid, timeout)
		case <-time.After(10 * time.Millisecond):
		}
	}
	if err := p.dial(wctx); err != nil {
		return nil, err
	}
	return p, nil
}

// Attach connects to a running VMM process by its socket (one another
// parent started): the process goes on as it was. A process attached to
// is not the caller's child: its death shows as a broken connection.
func Attach(ctx context.Context, sock string, log *slog.Logger) (*Process, error) {
	if log == nil {
		log = slog.Default()
	}
	p := &Process{sock: sock, log: log, logPath: filepath.Join(filepath.Dir(sock), LogFile)}
	if err := p.dial(ctx); err != nil {
		return nil, err
	}
	return p, nil
}

// dial connects the API client and checks the process's API version.
func (p *Process) dial(ctx context.Context) error {
	conn, err := grpc.NewClient("unix://"+p.sock,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", p.sock)
		}))
	if err != nil {
		return fmt.Errorf("vmmproc: %w", err)
	}
	p.conn, p.api = conn, vmmpb.NewVMMClient(conn)
	hello, err := p.api.Hello(ctx, &vmmpb.HelloRequest{}, grpc.WaitForReady(true))
	if err != nil {
		conn.Close()
		if p.exited != nil {
			select {
			case <-p.exited:
				return p.deathError()
			default:
			}
		}
		return fmt.Errorf("vmmproc: VMM process at %s does not answer: %w", p.sock, err)
	}
	if hello.ApiVersion != APIVersion {
		conn.Close()
		return fmt.Errorf("vmmproc: VMM process at %s speaks API version %d, this kiln version %d", p.sock, hello.ApiVersion, APIVersion)
	}
	if p.pid == 0 {
		p.pid = int(hello.Pid)
		p.jailUID, p.jailGID = jailIDs(p.pid)
	}
	return nil
}

// Jailed reports whether the process runs in a jail (JailConfig), and
// its uid there.
func (p *Process) Jailed() (bool, int) { return p.jailUID != 0, p.jailUID }

// JailIDs returns the uid and gid of a jailed process (0, 0 if not).
func (p *Process) JailIDs() (uid, gid int) { return p.jailUID, p.jailGID }

// PID returns the process's ID (in the host's PID namespace, for a jailed
// one too).
func (p *Process) PID() int { return p.pid }

// Socket returns the process's API socket.
func (p *Process) Socket() string { return p.sock }

// logTail returns the last lines of the process's log.
func (p *Process) logTail() string {
	b, err := os.ReadFile(p.logPath)
	if err != nil {
		return ""
	}
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(lines) > 20 {
		lines = lines[len(lines)-20:]
	}
	return strings.Join(lines, "\n")
}

// seccompStatus is a ProcessError's Status when the filter killed it.
const seccompStatus = "killed by its seccomp filter (SIGSYS): it made a system call outside its allowlist"

// killedBySeccomp reports whether a process's Wait error says SIGSYS killed
// it: the seccomp filter's SECCOMP_RET_KILL_PROCESS (a Go program's own
// SIGSYS would be a crash with exit status 2, not a death by the signal).
func killedBySeccomp(err error) bool {
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		return false
	}
	ws, ok := ee.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGSYS
}

// deathError describes a started process that has exited.
func (p *Process) deathError() error {
	st := "exited with status 0"
	bySeccomp := killedBySeccomp(p.exitErr)
	switch {
	case bySeccomp:
		st = seccompStatus
	case p.exitErr != nil:
		st = "died: " + p.exitErr.Error()
	}
	return &ProcessError{PID: p.pid, Status: st, LogTail: p.logTail(), Seccomp: bySeccomp}
}

// gone reports whether the process is known to be dead, and how.
func (p *Process) gone() error {
	if p.exited != nil {
		select {
		case <-p.exited:
			return p.deathError()
		default:
			return nil
		}
	}
	if p.pid > 0 && syscall.Kill(p.pid, 0) == syscall.ESRCH {
		return &ProcessError{PID: p.pid, Status: "is gone", LogTail: p.logTail()}
	}
	return nil
}

// rpcErr turns an RPC's failure into the process's death when that is
// why it failed.
func (p *Process) rpcErr(op string, err error) error {
	if err == nil {
		return nil
	}
	if status.Code(err) == codes.Unavailable {
		// The connection broke: give the process a moment to be reaped.
		for range 20 {
			if d := p.gone(); d != nil {
				return fmt.Errorf("vmmproc: %s: %w", op, d)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	return fmt.Errorf("vmmproc: %s: %s", op, status.Convert(err).Message())
}

// Boot builds the process's VM from spec and starts it.
func (p *Process) Boot(ctx context.Context, spec vmm.Spec) error {
	b, err := json.Marshal(spec)
	if err != nil {
		return fmt.Errorf("vmmproc: %w", err)
	}
	_, err = p.api.Create(ctx, &vmmpb.CreateRequest{Source: &vmmpb.CreateRequest_BootSpecJson{BootSpecJson: b}})
	return p.rpcErr("boot", err)
}

// Restore builds the process's VM from the snapshot in dir, with
// overrides of its devices, and starts it. The caller checked the
// snapshot with the host key (snapshot.Verify), which the VMM process
// never gets: manifest is the digest of the manifest it checked, mem the
// memory's sealed copy, passed to the process (which maps it
// copy-on-write; the caller keeps and closes its descriptor).
func (p *Process) Restore(ctx context.Context, dir string, manifest [sha256.Size]byte, mem *os.File, overrides []virtio.DeviceSpec) error {
	ob, err := json.Marshal(overrides)
	if err != nil {
		return fmt.Errorf("vmmproc: %w", err)
	}
	token, err := newToken()
	if err != nil {
		return fmt.Errorf("vmmproc: %w", err)
	}
	if err := putFD(ctx, FDSocket(p.sock), token, mem); err != nil {
		return fmt.Errorf("vmmproc: restore: %w", err)
	}
	_, err = p.api.Create(ctx, &vmmpb.CreateRequest{
		Source:        &vmmpb.CreateRequest_SnapshotDir{SnapshotDir: dir},
		OverridesJson: ob, SnapshotManifestSha256: manifest[:], SnapshotMemoryToken: token,
	})
	return p.rpcErr("restore", err)
}

// Freeze makes the process's VM the frozen base of a fork (vmm.VM.Freeze)
// and returns its state and the base's descriptor, which the caller
// closes once it has handed it to every child (RestoreFork).
func (p *Process) Freeze(ctx context.Context) (*vmm.State, *os.File, error) {
	resp, err := p.api.Freeze(ctx, &vmmpb.FreezeRequest{})
	if err != nil {
		return nil, nil, p.rpcErr("freeze", err)
	}
	var st vmm.State
	if err := decodeStrict(resp.StateJson, &st); err != nil {
		return nil, nil, fmt.Errorf("vmmproc: freeze: state: %w", err)
	}
	f, err := getFD(ctx, FDSocket(p.sock), resp.MemoryToken)
	if err != nil {
		return nil, nil, fmt.Errorf("vmmproc: freeze: %w", err)
	}
	return &st, f, nil
}

// RestoreFork builds the process's VM as a child of a Freeze: st and the
// frozen base (mapped copy-on-write), with overrides of its devices, and
// starts it.
func (p *Process) RestoreFork(ctx context.Context, st *vmm.State, base *os.File, overrides []virtio.DeviceSpec) error {
	sb, err := json.Marshal(st)
	if err != nil {
		return fmt.Errorf("vmmproc: %w", err)
	}
	ob, err := json.Marshal(overrides)
	if err != nil {
		return fmt.Errorf("vmmproc: %w", err)
	}
	token, err := newToken()
	if err != nil {
		return fmt.Errorf("vmmproc: %w", err)
	}
	if err := putFD(ctx, FDSocket(p.sock), token, base); err != nil {
		return fmt.Errorf("vmmproc: fork: %w", err)
	}
	_, err = p.api.Create(ctx, &vmmpb.CreateRequest{
		Source:        &vmmpb.CreateRequest_Fork{Fork: &vmmpb.ForkSource{StateJson: sb, MemoryToken: token}},
		OverridesJson: ob,
	})
	return p.rpcErr("fork", err)
}

// InsertDisk puts the image f into the VM's empty volume slot id
// (vmm.VM.InsertDisk), read-only or not (f must be open for writing when
// not). f crosses to the process as a descriptor (a jailed one cannot
// open host paths); f.Name(), the image's path, names it in the VM's
// devices and snapshots. The caller keeps f and closes it.
func (p *Process) InsertDisk(ctx context.Context, id string, f *os.File, readOnly bool) error {
	if f == nil {
		return fmt.Errorf("vmmproc: insert disk %q: no image file given", id)
	}
	token, err := newToken()
	if err != nil {
		return fmt.Errorf("vmmproc: %w", err)
	}
	if err := putFD(ctx, FDSocket(p.sock), token, f); err != nil {
		return fmt.Errorf("vmmproc: insert disk %q: %w", id, err)
	}
	_, err = p.api.InsertDisk(ctx, &vmmpb.InsertDiskRequest{DeviceId: id, Token: token, Path: f.Name(), ReadOnly: readOnly})
	return p.rpcErr("insert disk", err)
}

// Pause pauses the VM.
func (p *Process) Pause(ctx context.Context) error {
	_, err := p.api.Pause(ctx, &vmmpb.PauseRequest{})
	return p.rpcErr("pause", err)
}

// Resume resumes the VM.
func (p *Process) Resume(ctx context.Context) error {
	_, err := p.api.Resume(ctx, &vmmpb.ResumeRequest{})
	return p.rpcErr("resume", err)
}

// Save writes a snapshot of the VM into dir with labels. A jailed process
// writes into a folder passed as a descriptor, renamed to dir after.
func (p *Process) Save(ctx context.Context, dir string, labels map[string]string) error {
	if p.jailUID != 0 {
		return p.saveStaged(ctx, dir, labels)
	}
	_, err := p.api.Save(ctx, &vmmpb.SaveRequest{Dir: dir, Labels: labels})
	return p.rpcErr("save", err)
}

// Stop stops the VM by force; Wait then returns.
func (p *Process) Stop(ctx context.Context) error {
	_, err := p.api.Stop(ctx, &vmmpb.StopRequest{})
	return p.rpcErr("stop", err)
}

// Description is what Describe says of the VM.
type Description struct {
	Devices   []virtio.DeviceSpec
	State     string
	Diagnosis string
	// GuestMemory is where the guest's RAM lies in the process.
	GuestMemory []MemoryRange
	// Runtime is the VMM process's own Go runtime memory by class.
	Runtime RuntimeMemory
}

// RuntimeMemory is a VMM process's Go runtime memory by class, in bytes
// (runtime/metrics' /memory/classes): heap objects (live and not yet
// swept), heap unused (reserved for objects, holding none), heap free
// (free pages still resident) and released (returned to the OS),
// goroutine and OS thread stacks, the runtime's metadata, other, and the
// total it mapped; and its goroutines and threads.
type RuntimeMemory struct {
	HeapObjects, HeapUnused, HeapFree, HeapReleased uint64
	Stacks, OSStacks, Metadata, Other, Total        uint64
	Goroutines, Threads                             uint64
}

// MemoryRange is a range of a process's address space.
type MemoryRange struct {
	Addr uintptr
	Size uint64
}

// Describe returns the VM's devices, state and a diagnosis.
func (p *Process) Describe(ctx context.Context) (Description, error) {
	resp, err := p.api.Describe(ctx, &vmmpb.DescribeRequest{})
	if err != nil {
		return Description{}, p.rpcErr("describe", err)
	}
	d := Description{State: resp.State, Diagnosis: resp.Diagnosis}
	if r := resp.Runtime; r != nil {
		d.Runtime = RuntimeMemory{
			HeapObjects: r.HeapObjects, HeapUnused: r.HeapUnused, HeapFree: r.HeapFree, HeapReleased: r.HeapReleased,
			Stacks: r.Stacks, OSStacks: r.OsStacks, Metadata: r.Metadata, Other: r.Other, Total: r.Total,
			Goroutines: r.Goroutines, Threads: r.Threads,
		}
	}
	for _, r := range resp.GuestMemory {
		d.GuestMemory = append(d.GuestMemory, MemoryRange{Addr: uintptr(r.HostAddr), Size: r.Size})
	}
	if err := decodeStrict(resp.DevicesJson, &d.Devices); err != nil {
		return d, fmt.Errorf("vmmproc: describe: devices: %w", err)
	}
	return d, nil
}

// Wait returns how the VM stopped, once it has. When the process died
// instead, the error is a *ProcessError.
func (p *Process) Wait(ctx context.Context) (vmm.Exit, error) {
	resp, err := p.api.Wait(ctx, &vmmpb.WaitRequest{}, grpc.WaitForReady(false))
	if err != nil {
		return vmm.Exit{Reason: vmm.ReasonError, Message: "the VMM process failed"}, p.rpcErr("wait", err)
	}
	exit := vmm.Exit{Reason: parseReason(resp.Reason), Message: resp.Message}
	if resp.Error != "" {
		return exit, errors.New(resp.Error)
	}
	return exit, nil
}

func parseReason(s string) vmm.Reason {
	for r := vmm.ReasonPowerOff; r <= vmm.ReasonError; r++ {
		if r.String() == s {
			return r
		}
	}
	return vmm.ReasonError
}

// CopyConsole copies what the guest prints on its console to w until the
// VM stops or ctx ends.
func (p *Process) CopyConsole(ctx context.Context, w io.Writer) error {
	stream, err := p.api.Console(ctx, &vmmpb.ConsoleRequest{})
	if err != nil {
		return p.rpcErr("console", err)
	}
	for {
		c, err := stream.Recv()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return p.rpcErr("console", err)
		}
		w.Write(c.Data)
	}
}

// Close stops the VM (when it still runs), waits up to ctx's end for a
// started process to exit and kills it then, and closes the connection.
// Of an attached process it only closes the connection.
func (p *Process) Close(ctx context.Context) error {
	var err error
	p.closeOnce.Do(func() {
		if p.cmd != nil {
			select {
			case <-p.exited:
			default:
				sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
				p.api.Stop(sctx, &vmmpb.StopRequest{})
				p.api.Wait(sctx, &vmmpb.WaitRequest{})
				cancel()
				select {
				case <-p.exited:
				case <-ctx.Done():
				case <-time.After(10 * time.Second):
				}
				select {
				case <-p.exited:
				default:
					p.log.Warn("VMM process did not exit; killing it", "pid", p.pid)
					p.cmd.Process.Kill()
					<-p.exited
				}
			}
			if p.jailUID != 0 {
				// A jailed process cannot unlink its sockets from a
				// folder it may not write.
				removeSockets(p.sock, FDSocket(p.sock))
			}
		}
		err = p.conn.Close()
	})
	return err
}

// removeSockets removes the Unix sockets at paths (and nothing else).
func removeSockets(paths ...string) {
	for _, path := range paths {
		if fi, err := os.Lstat(path); err == nil && fi.Mode()&os.ModeSocket != 0 {
			os.Remove(path)
		}
	}
}

// Exited is closed when a started process has exited (nil for an attached
// one).
func (p *Process) Exited() <-chan struct{} { return p.exited }

// HoldProcsEnv, set to false (or 0), runs a VMM process's vCPUs without
// holding their Ps (ServeConfig.HoldProcs), for the benchmarks' A/B; unset
// or true, they hold them.
const HoldProcsEnv = "KILN_HOLD_PROCS"

// holdProcsFrom reads HoldProcsEnv's value.
func holdProcsFrom(v string) (bool, error) {
	if v == "" {
		return true, nil
	}
	on, err := strconv.ParseBool(v)
	if err != nil {
		return false, fmt.Errorf("$%s=%q: want true or false", HoldProcsEnv, v)
	}
	return on, nil
}

// ServeMain is the main of a VMM process: it serves on the socket SocketEnv
// names (or sock, when not empty) until done, logging to stderr, and
// returns the process's exit code. openFS opens image roots (nil: none).
// $KILN_SECCOMP (seccomp.EnvMode) is the seccomp filter's mode: kill (the
// default), log (record what the VMM calls) or off (debugging only).
// $KILN_HOLD_PROCS (HoldProcsEnv) turns holding the vCPUs' Ps off.
func ServeMain(ctx context.Context, sock string, openFS virtio.FSOpener) int {
	if sock == "" {
		sock = os.Getenv(SocketEnv)
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	if sock == "" {
		log.Error("no socket: set " + SocketEnv + " or pass --socket")
		return 2
	}
	mode, err := seccomp.ParseMode(os.Getenv(seccomp.EnvMode))
	if err != nil {
		log.Error("vmm process: bad $"+seccomp.EnvMode, "err", err)
		return 2
	}
	jc, err := readJail()
	if err != nil {
		log.Error("vmm process: bad jail", "err", err)
		return 2
	}
	hold, err := holdProcsFrom(os.Getenv(HoldProcsEnv))
	if err != nil {
		log.Error("vmm process", "err", err)
		return 2
	}
	if err := Serve(ctx, ServeConfig{Socket: sock, Logger: log, OpenFS: openFS, Seccomp: mode, Jail: jc, HoldProcs: hold}); err != nil {
		log.Error("vmm process", "err", err)
		return 1
	}
	return 0
}

// vmmGODEBUG are the Go runtime settings a VMM process starts with, ahead
// of any GODEBUG its parent has (which so can override them).
//
// disablethp=1: where the host gives anonymous memory transparent huge
// pages always (Debian's default), a VMM process's few MiB of Go heap sit
// in 2 MiB pages that are mostly empty, in every sandbox (go.dev/issue/64332;
// docs/bench.md, density). It is a run-time setting only (no //go:debug
// line takes it). Guest RAM is no Go heap: it keeps the huge pages
// package memory advises.
const vmmGODEBUG = "disablethp=1"

// withGODEBUG returns env with vmmGODEBUG ahead of its GODEBUG's settings
// (the last GODEBUG entry is the one a process gets).
func withGODEBUG(env []string) []string {
	for i := len(env) - 1; i >= 0; i-- {
		if v, ok := strings.CutPrefix(env[i], "GODEBUG="); ok {
			if v == "" {
				env[i] = "GODEBUG=" + vmmGODEBUG
			} else {
				env[i] = "GODEBUG=" + vmmGODEBUG + "," + v
			}
			return env
		}
	}
	return append(env, "GODEBUG="+vmmGODEBUG)
}
