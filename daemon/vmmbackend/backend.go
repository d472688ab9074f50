// Package vmmbackend is kilnd's daemon.Backend: each sandbox runs in a VMM
// process of its own through package sandbox (Start with
// Options.Process, Restore from a checkpoint, Attach to take a running
// one over, Save and Fork). It is the one package of the daemon's that
// knows the layers below the seam (sandbox, vmmproc, snapshot, image and
// the guest's client); it converts their types to the daemon's plain
// ones. cmd/kilnd makes one (New) and passes it in daemon.Config.
package vmmbackend

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sync/singleflight"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/guest/client"
	"github.com/kilnvm/kiln/image"
	"github.com/kilnvm/kiln/sandbox"
	"github.com/kilnvm/kiln/snapshot"
	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmm"
	"github.com/kilnvm/kiln/vmmproc"
)

// Backend runs each sandbox in a VMM process of its own through package
// sandbox.
type Backend struct {
	// Runtime is the kernel and agent initramfs every sandbox boots.
	Runtime sandbox.Runtime
	// Images is the images folder of image-rooted sandboxes. An image
	// not in it is pulled on the first create that names it (plain HTTP
	// for loopback registries only, as kiln image pull).
	Images string
	// Process starts a VMM process: ["/usr/bin/kiln-vmm"].
	Process sandbox.ProcessOptions
	Logger  *slog.Logger
	// SnapshotKey authenticates the checkpoints it saves and restores
	// (sandbox.Options.SnapshotKey); nil: sandbox.SnapshotKeyFile's.
	SnapshotKey []byte
	// snapshots keeps the checked, sealed memory of the checkpoints
	// restored last, shared by their clones' VMM processes.
	snapshots     *snapshot.Cache
	snapshotsOnce sync.Once
	// roots shares image trees among the sandboxes this process reads
	// (the VMM processes open their own).
	roots *image.Roots
	once  sync.Once
	pulls singleflight.Group // one pull per reference at a time
}

func (b *Backend) log() *slog.Logger {
	if b.Logger == nil {
		return slog.Default()
	}
	return b.Logger
}

func (b *Backend) snapshotCache() *snapshot.Cache {
	b.snapshotsOnce.Do(func() { b.snapshots = snapshot.NewCache(0) })
	return b.snapshots
}

func (b *Backend) imageRoots() *image.Roots {
	b.once.Do(func() { b.roots = image.NewRoots(image.Options{Logger: b.Logger}) })
	return b.roots
}

// Create implements Backend.
func (b *Backend) Create(ctx context.Context, spec daemon.CreateSpec) (daemon.Instance, error) {
	if len(b.Process.Command) == 0 {
		return nil, errors.New("daemon: no VMM process command (Backend.Process.Command)")
	}
	proc := b.Process
	log := sandboxLog(b.log(), spec.Dir)
	proc.Cgroup = spec.Host.Cgroup // the VMM process starts in it
	if len(spec.Volumes) > daemon.MaxVolumes {
		return nil, status.Errorf(codes.InvalidArgument, "%d volumes, at most %d", len(spec.Volumes), daemon.MaxVolumes)
	}
	var s *sandbox.Sandbox
	var err error
	// filled are the volume slots the checkpoint's sandbox held: they
	// reopen the volume there (named to the restore), mounted as it was.
	var filled map[int]string
	switch {
	case spec.Frozen != nil:
		f, ok := spec.Frozen.(*sandboxFrozen)
		if !ok {
			return nil, fmt.Errorf("daemon: %T is not an in-memory checkpoint of this backend", spec.Frozen)
		}
		filled = sandbox.FilledVolumes(f.f.Devices())
		s, err = sandbox.RestoreFrozen(ctx, f.f, sandbox.RestoreOptions{
			Dir: spec.Dir, Hostname: spec.Hostname, Process: &proc, Logger: log, Net: netSpec(spec.Host.Net),
			Images: b.Images, ImageRoots: b.imageRoots(), SnapshotKey: b.SnapshotKey,
			Disks: volumeDisks(spec.Volumes, filled),
		})
	case spec.Checkpoint != "":
		if len(spec.Volumes) > 0 {
			if filled, err = sandbox.SnapshotVolumes(spec.Checkpoint, b.SnapshotKey); err != nil {
				return nil, markErr(err)
			}
		}
		s, err = sandbox.Restore(ctx, spec.Checkpoint, sandbox.RestoreOptions{
			Dir: spec.Dir, Hostname: spec.Hostname, Process: &proc, Logger: log, Net: netSpec(spec.Host.Net),
			Images: b.Images, ImageRoots: b.imageRoots(),
			SnapshotKey: b.SnapshotKey, SnapshotCache: b.snapshotCache(),
			Disks: volumeDisks(spec.Volumes, filled),
		})
	case spec.Image != "":
		if err := b.ensureImage(ctx, spec.Image); err != nil {
			return nil, err
		}
		opts := sandbox.Options{
			Runtime: b.Runtime, CPUs: spec.CPUs, MemoryMiB: spec.MemoryMiB, Hostname: spec.Hostname, Net: netSpec(spec.Host.Net),
			Dir: spec.Dir, Process: &proc, Logger: log,
			Image: spec.Image, Images: b.Images, ImageRoots: b.imageRoots(), WritableMiB: spec.WritableMiB,
			Init: spec.Init, SnapshotKey: b.SnapshotKey,
		}
		s, err = sandbox.Start(ctx, opts)
	default:
		return nil, errors.New("daemon: a sandbox needs an image or a checkpoint")
	}
	if err != nil {
		return nil, markErr(err)
	}
	in := newSandboxInstance(s, b)
	for _, v := range spec.Volumes {
		if _, ok := filled[v.Slot]; ok {
			continue // restored in its slot, mounted as it was
		}
		if err := in.AttachVolume(ctx, v); err != nil {
			in.Close(context.Background())
			return nil, err
		}
	}
	return in, nil
}

// volumeDisks names the images of the volumes whose slots a checkpoint
// holds filled (filled) to its restore (RestoreOptions.Disks); nil when
// none.
func volumeDisks(vols []daemon.VolumeAttach, filled map[int]string) map[string]string {
	var out map[string]string
	for _, v := range vols {
		if _, ok := filled[v.Slot]; !ok {
			continue
		}
		if out == nil {
			out = map[string]string{}
		}
		out[sandbox.VolumeDevice(v.Slot)] = v.Path
	}
	return out
}

// sandboxLog is log for the sandbox in folder dir: its lines name the
// sandbox by its folder's name (a sandbox's ID, or a pool's or template
// builder's folder).
func sandboxLog(log *slog.Logger, dir string) *slog.Logger {
	return log.With("sandbox", filepath.Base(dir))
}

// ensureImage pulls ref into the images folder unless it is there: lazily,
// so only the manifest, config and estargz TOCs (or the whole of plain
// layers, indexed). Concurrent creates of one missing image pull it once.
// Its errors are gRPC statuses: NotFound for a name no registry knows,
// InvalidArgument for a bad reference or image, Unavailable otherwise.
func (b *Backend) ensureImage(ctx context.Context, ref string) error {
	dir := b.Images
	if dir == "" { // where sandbox.Start looks, too
		var err error
		if dir, err = sandbox.DefaultImagesDir(); err != nil {
			return status.Errorf(codes.FailedPrecondition, "images folder: %v", err)
		}
	}
	im, err := b.imageRoots().Images(dir)
	if err != nil {
		return status.Errorf(codes.FailedPrecondition, "images folder: %v", err)
	}
	if _, err := im.Get(ref); err == nil {
		return nil
	}
	_, err, _ = b.pulls.Do(ref, func() (any, error) {
		if _, err := im.Get(ref); err == nil {
			return nil, nil
		}
		b.log().Info("pulling an image for a sandbox", "image", ref)
		_, err := im.Pull(ctx, ref, image.PullOptions{})
		return nil, err
	})
	switch {
	case err == nil:
		return nil
	case errors.Is(err, image.ErrNotFound):
		return status.Errorf(codes.NotFound, "%v", err)
	case errors.Is(err, image.ErrInvalid):
		return status.Errorf(codes.InvalidArgument, "%v", err)
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return err
	}
	return status.Errorf(codes.Unavailable, "pulling %s: %v", ref, err)
}

// Attach implements Backend. A paused sandbox is resumed for the agent to
// answer, then paused again.
func (b *Backend) Attach(ctx context.Context, dir string, paused bool) (daemon.Instance, error) {
	if paused {
		if err := vmmCall(ctx, dir, b.log(), (*vmmproc.Process).Resume); err != nil {
			return nil, err
		}
	}
	s, err := sandbox.Attach(ctx, dir, sandbox.AttachOptions{Process: b.Process, ImageRoots: b.imageRoots(), Logger: sandboxLog(b.log(), dir)})
	if err != nil {
		stopVMM(ctx, dir, b.log())
		return nil, markErr(err)
	}
	in := newSandboxInstance(s, b)
	in.paused = paused
	if paused {
		if err := in.Pause(ctx); err != nil {
			return in, err
		}
	}
	return in, nil
}

// vmmCall makes one call to the VMM process of the sandbox folder dir over
// a connection of its own (package sandbox has no pause of its own).
func vmmCall(ctx context.Context, dir string, log *slog.Logger, call func(*vmmproc.Process, context.Context) error) error {
	p, err := vmmproc.Attach(ctx, filepath.Join(dir, vmmproc.SocketFile), log)
	if err != nil {
		return fmt.Errorf("daemon: %w", err)
	}
	defer p.Close(context.Background()) // attached: closes the connection only
	if err := call(p, ctx); err != nil {
		return markErr(fmt.Errorf("daemon: %w", err))
	}
	return nil
}

// stopVMM stops the VMM process of the sandbox folder dir, if one still
// answers there, so that a sandbox that could not be taken over leaves
// no process behind.
func stopVMM(ctx context.Context, dir string, log *slog.Logger) {
	sock := filepath.Join(dir, vmmproc.SocketFile)
	if _, err := os.Stat(sock); err != nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	p, err := vmmproc.Attach(ctx, sock, log)
	if err != nil {
		return
	}
	pid := p.PID()
	p.Stop(ctx)
	p.Close(ctx)
	reap(pid, 5*time.Second)
}

// sandboxInstance is a sandbox of package sandbox, in a VMM process.
type sandboxInstance struct {
	s       *sandbox.Sandbox
	b       *Backend
	pid     int
	closing sync.Once
	// ctx ends when the instance is closed or detached: the waits for
	// its detached processes end with it.
	ctx    context.Context
	cancel context.CancelFunc

	mu     sync.Mutex
	paused bool // Close resumes it first, for the agent to power it off
}

func newSandboxInstance(s *sandbox.Sandbox, b *Backend) *sandboxInstance {
	ctx, cancel := context.WithCancel(context.Background())
	return &sandboxInstance{s: s, b: b, pid: s.PID(), ctx: ctx, cancel: cancel}
}

func (in *sandboxInstance) Dir() string           { return in.s.Dir() }
func (in *sandboxInstance) PID() int              { return in.pid }
func (in *sandboxInstance) Image() string         { return in.s.Image() }
func (in *sandboxInstance) Done() <-chan struct{} { return in.s.Done() }

func (in *sandboxInstance) Exited() string {
	exit, err := in.s.Exit()
	if err != nil {
		return err.Error()
	}
	return exit.String()
}

func (in *sandboxInstance) PoweredOff() bool {
	exit, err := in.s.Exit()
	return err == nil && exit.Reason == vmm.ReasonPowerOff
}

func (in *sandboxInstance) Start(ctx context.Context, opts daemon.ExecOptions) (daemon.Process, error) {
	p, err := in.s.Client().Start(ctx, execOptions(opts))
	if err != nil {
		return nil, err
	}
	if opts.DetachID == "" {
		return process{p}, nil
	}
	return &detachedProcess{in: in, id: opts.DetachID, pid: p.Pid(), stream: p}, nil
}

func (in *sandboxInstance) Detached(ctx context.Context) ([]daemon.DetachedExec, error) {
	ds, err := in.s.Client().ListDetached(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]daemon.DetachedExec, len(ds))
	for i, d := range ds {
		out[i] = daemon.DetachedExec{ID: d.ID, Pid: d.Pid, Argv: d.Argv, Started: d.Started,
			Process: &detachedProcess{in: in, id: d.ID, pid: d.Pid}}
		if d.Exited {
			st := exitStatus(d.Status)
			out[i].Exit = &st
		}
	}
	return out, nil
}

func (in *sandboxInstance) ForgetDetached(ctx context.Context, id string) error {
	return in.s.Client().ForgetDetached(ctx, id)
}

func (in *sandboxInstance) AttachDetached(ctx context.Context, id string, stdout, stderr io.Writer) (daemon.ExitStatus, error) {
	st, err := in.s.Client().AttachDetached(ctx, id, stdout, stderr)
	return exitStatus(st), err
}

// detachedProcess is a detached process of a sandboxInstance: signalled
// through the agent's table, and waited for through its Exec call when
// this server started it (stream), else (or once the call broke) through
// the agent's WaitDetached.
type detachedProcess struct {
	in     *sandboxInstance
	id     string
	pid    int
	stream *client.Process // nil: started by an earlier server
}

// detachedSignalTimeout bounds a signal to a detached process.
const detachedSignalTimeout = 30 * time.Second

func (p *detachedProcess) Pid() int { return p.pid }

func (p *detachedProcess) Signal(sig syscall.Signal) error { return p.signal(sig, false) }

func (p *detachedProcess) SignalGroup(sig syscall.Signal) error { return p.signal(sig, true) }

func (p *detachedProcess) signal(sig syscall.Signal, group bool) error {
	ctx, cancel := context.WithTimeout(p.in.ctx, detachedSignalTimeout)
	defer cancel()
	err := p.in.s.Client().SignalDetached(ctx, p.id, sig, group)
	if status.Code(err) == codes.Unimplemented && p.stream != nil {
		// An agent older than detached processes (a snapshot it made)
		// runs it as a plain exec: signal it through its call.
		if group {
			return p.stream.SignalGroup(sig)
		}
		return p.stream.Signal(sig)
	}
	return err
}

// Resize resizes the terminal through the process's Exec call, which
// carries its terminal's input: once that is gone (a server started
// since) there is no way to it.
func (p *detachedProcess) Resize(size daemon.PtySize) error {
	if p.stream == nil {
		return status.Errorf(codes.FailedPrecondition, "detached process %s: its terminal is reachable only from the server that started it", p.id)
	}
	return p.stream.Resize(client.PtySize(size))
}

func (p *detachedProcess) Wait() (daemon.ExitStatus, error) {
	var err error
	if p.stream != nil {
		var st client.ExitStatus
		if st, err = p.stream.Wait(); err == nil {
			return exitStatus(st), nil
		}
	}
	// The call broke (or there is none): ask the agent, riding out
	// a connection being re-established.
	for delay := 50 * time.Millisecond; ; delay = min(2*delay, 2*time.Second) {
		d, werr := p.in.s.Client().WaitDetached(p.in.ctx, p.id)
		if werr == nil {
			return exitStatus(d.Status), nil
		}
		if err == nil {
			err = werr
		}
		if p.in.ctx.Err() != nil || status.Code(werr) != codes.Unavailable {
			return daemon.ExitStatus{}, err
		}
		select {
		case <-p.in.ctx.Done():
		case <-p.in.s.Done():
			return daemon.ExitStatus{}, err
		case <-time.After(delay):
		}
	}
}

func (in *sandboxInstance) WriteFile(ctx context.Context, path string, r io.Reader, mode fs.FileMode, makeParents bool, owner string) (daemon.FileInfo, error) {
	var opts []client.WriteOption
	if makeParents {
		opts = append(opts, client.MakeParents())
	}
	if owner != "" {
		opts = append(opts, client.WriteOwner(owner))
	}
	return fileInfo(in.s.Client().WriteFileInfo(ctx, path, r, mode, opts...))
}

func (in *sandboxInstance) ReadFile(ctx context.Context, path string, w io.Writer) (int64, error) {
	return in.s.Client().ReadFile(ctx, path, w)
}

func (in *sandboxInstance) Stat(ctx context.Context, path string, noFollow bool) (daemon.FileInfo, error) {
	if noFollow {
		return fileInfo(in.s.Client().Lstat(ctx, path))
	}
	return fileInfo(in.s.Client().Stat(ctx, path))
}

func (in *sandboxInstance) List(ctx context.Context, path string, depth int) ([]daemon.FileInfo, error) {
	fis, err := in.s.Client().ListDepth(ctx, path, depth)
	if err != nil {
		return nil, err
	}
	out := make([]daemon.FileInfo, len(fis))
	for i, fi := range fis {
		out[i] = plainFileInfo(fi)
	}
	return out, nil
}

func (in *sandboxInstance) Mkdir(ctx context.Context, path string, mode fs.FileMode, parents bool, owner string) error {
	var opts []client.MkdirOption
	if owner != "" {
		opts = append(opts, client.MkdirOwner(owner))
	}
	return in.s.Client().Mkdir(ctx, path, mode, parents, opts...)
}

func (in *sandboxInstance) Move(ctx context.Context, source, destination string) (daemon.FileInfo, error) {
	return fileInfo(in.s.Client().Move(ctx, source, destination))
}

func (in *sandboxInstance) Watch(ctx context.Context, path string, recursive bool, fn func(daemon.WatchEvent) error) error {
	return in.s.Client().Watch(ctx, path, recursive, func(ev client.WatchEvent) error { return fn(watchEvent(ev)) })
}

func (in *sandboxInstance) Remove(ctx context.Context, path string, recursive bool) error {
	return in.s.Client().Remove(ctx, path, recursive)
}

func (in *sandboxInstance) Pause(ctx context.Context) error {
	if err := vmmCall(ctx, in.s.Dir(), in.b.log(), (*vmmproc.Process).Pause); err != nil {
		return err
	}
	in.setPaused(true)
	return nil
}

func (in *sandboxInstance) Resume(ctx context.Context) error {
	if err := vmmCall(ctx, in.s.Dir(), in.b.log(), (*vmmproc.Process).Resume); err != nil {
		return err
	}
	in.setPaused(false)
	return nil
}

func (in *sandboxInstance) setPaused(p bool) {
	in.mu.Lock()
	in.paused = p
	in.mu.Unlock()
}

func (in *sandboxInstance) ConfigureNetwork(ctx context.Context, cfg daemon.NetworkConfig) error {
	return markErr(in.s.ConfigureNetwork(ctx, client.NetworkConfig(cfg)))
}

func (in *sandboxInstance) Refresh(ctx context.Context, hostname string) error {
	return markErr(in.s.Refresh(ctx, hostname))
}

// sandboxFrozen is package sandbox's in-memory checkpoint.
type sandboxFrozen struct{ f *sandbox.Frozen }

func (f *sandboxFrozen) ID() string   { return f.f.ID() }
func (f *sandboxFrozen) Close() error { return f.f.Close() }

func (in *sandboxInstance) Hold(ctx context.Context, id string) error {
	return markErr(in.s.Hold(ctx, id))
}

func (in *sandboxInstance) Release(ctx context.Context, id string) error {
	return markErr(in.s.Release(ctx, id))
}

func (in *sandboxInstance) Held(ctx context.Context) ([]string, error) {
	ids, err := in.s.Held(ctx)
	return ids, markErr(err)
}

func (in *sandboxInstance) Frozen(ctx context.Context, id string) (daemon.Frozen, error) {
	f, err := in.s.Frozen(ctx, id)
	if err != nil {
		return nil, markErr(err)
	}
	return &sandboxFrozen{f}, nil
}

func (in *sandboxInstance) Adopt(ctx context.Context, f daemon.Frozen) error {
	sf, ok := f.(*sandboxFrozen)
	if !ok {
		return fmt.Errorf("daemon: %T is not an in-memory checkpoint of this backend", f)
	}
	return markErr(in.s.Adopt(ctx, sf.f))
}

func (in *sandboxInstance) Keep(ctx context.Context, key string, value []byte) error {
	return markErr(in.s.Keep(ctx, key, value))
}

func (in *sandboxInstance) Kept(ctx context.Context, key string) ([]byte, error) {
	v, err := in.s.Kept(ctx, key)
	return v, markErr(err)
}

func (in *sandboxInstance) Save(ctx context.Context, dir string) error {
	return markErr(in.s.Save(ctx, dir))
}

func (in *sandboxInstance) DialPort(ctx context.Context, port int) (net.Conn, error) {
	c, err := client.DialPort(ctx, in.s.VsockPath(), port)
	return c, markErr(err)
}

func (in *sandboxInstance) ExportWritable(ctx context.Context, w io.Writer) (int64, error) {
	return in.s.Client().ExportWritable(ctx, w)
}

func (in *sandboxInstance) ImportWritable(ctx context.Context, r io.Reader) error {
	return in.s.Client().ImportWritable(ctx, r)
}

func (in *sandboxInstance) Info(ctx context.Context) (daemon.GuestInfo, error) {
	info, err := in.s.Client().Info(ctx)
	return daemon.GuestInfo(info), err
}

func (in *sandboxInstance) Fork(ctx context.Context, hosts []daemon.HostSpec) ([]daemon.Instance, error) {
	var opts sandbox.ForkOptions
	if len(hosts) > 0 && hosts[0].Net != nil {
		opts.Net = func(i int) *virtio.NetSpec { return netSpec(hosts[i].Net) }
	}
	if len(hosts) > 0 && hosts[0].Cgroup != "" {
		opts.Cgroup = func(i int) string { return hosts[i].Cgroup }
	}
	kids, err := in.s.Fork(ctx, len(hosts), opts)
	if errors.Is(err, sandbox.ErrWritableVolume) {
		return nil, status.Errorf(codes.FailedPrecondition, "vmmbackend: %v", err)
	}
	if err != nil {
		return nil, markErr(err)
	}
	out := make([]daemon.Instance, len(kids))
	for i, k := range kids {
		out[i] = newSandboxInstance(k, in.b)
	}
	return out, nil
}

// Close stops the VM, makes sure its VMM process is gone (an attached
// one is not this process's child) and removes the sandbox's folder.
func (in *sandboxInstance) Close(ctx context.Context) error {
	var err error
	in.closing.Do(func() {
		in.mu.Lock()
		paused := in.paused
		in.mu.Unlock()
		if paused {
			// A paused guest cannot power off: resume it (best effort;
			// Close stops the VM by force after its wait anyway).
			rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			in.Resume(rctx)
			cancel()
		}
		in.cancel()
		errs := []error{in.s.Close(ctx)}
		errs = append(errs, reap(in.pid, 10*time.Second))
		if rerr := os.RemoveAll(in.s.Dir()); rerr != nil {
			errs = append(errs, rerr)
		}
		err = errors.Join(errs...)
	})
	return err
}

// Detach closes the agent's connection and leaves the VMM process running.
func (in *sandboxInstance) Detach() {
	in.cancel()
	if c := in.s.Client(); c != nil {
		c.Close()
	}
}

// reap waits up to wait for process pid to be gone, then kills it.
func reap(pid int, wait time.Duration) error {
	if pid <= 0 || pid == os.Getpid() {
		return nil
	}
	deadline := time.Now().Add(wait)
	for time.Now().Before(deadline) {
		if syscall.Kill(pid, 0) == syscall.ESRCH || zombie(pid) {
			return nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && err != syscall.ESRCH {
		return fmt.Errorf("daemon: kill VMM process %d: %w", pid, err)
	}
	return nil
}

// zombie says process pid has exited and waits for its parent to reap it
// (an adopted VMM process whose parent, a kilnd killed since, is gone and
// whose new parent does not reap): it holds nothing any more.
func zombie(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// pid (comm) S ...: comm may hold spaces and parentheses.
	i := bytes.LastIndexByte(b, ')')
	return i >= 0 && i+2 < len(b) && (b[i+2] == 'Z' || b[i+2] == 'X')
}

// AttachVolume implements daemon.Instance: sandbox.AttachVolume. A
// sandbox without the slot (a checkpoint saved before volume slots) is
// FailedPrecondition.
func (in *sandboxInstance) AttachVolume(ctx context.Context, v daemon.VolumeAttach) error {
	err := in.s.AttachVolume(ctx, sandbox.Volume{Slot: v.Slot, Path: v.Path, ReadOnly: v.ReadOnly, MountPath: v.MountPath})
	if errors.Is(err, sandbox.ErrNoVolumeSlot) {
		return status.Errorf(codes.FailedPrecondition, "vmmbackend: sandbox %s: %v", in.s.Dir(), err)
	}
	return markErr(err)
}

// FreezeVolumes implements daemon.Instance.
func (in *sandboxInstance) FreezeVolumes(ctx context.Context) error {
	return markErr(in.s.FreezeVolumes(ctx))
}
