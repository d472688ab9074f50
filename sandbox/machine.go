package sandbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/kilnvm/kiln/guestkernel"
	"github.com/kilnvm/kiln/image"
	"github.com/kilnvm/kiln/jail"
	"github.com/kilnvm/kiln/snapshot"
	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmm"
	"github.com/kilnvm/kiln/vmmproc"
)

// ProcessOptions run a sandbox's VM in a VMM process of its own (package
// vmmproc) instead of in the caller's process: a VMM that panics or is
// killed then fails its own sandbox only, and the caller can jail and
// limit each VM apart. Execs do not cross the VMM process: the agent's
// socket is in the sandbox's folder.
type ProcessOptions struct {
	// Command starts a VMM process: the kiln-vmm binary (FindVMM),
	// ["/usr/bin/kiln-vmm"].
	Command []string
	// Env is added to the VMM process's environment.
	Env []string
	// Cgroup, when set, is the cgroup v2 folder the VMM process starts
	// in (directly: clone3's CLONE_INTO_CGROUP), which holds the
	// sandbox's host limits. A fork's children do not inherit it:
	// ForkOptions.Cgroup gives each its own.
	Cgroup string
	// Jail, when set, jails each VMM process (package jail,
	// vmmproc.JailConfig): namespaces of its own (the network one of its
	// tap, or an empty one), a root holding only what it needs, a uid and
	// gid of its own, no capabilities. An image root's store is bound in
	// read-only; this process fetches the chunks it misses (serveChunks).
	// The VMM command must be built without cgo.
	Jail *JailOptions
}

// JailOptions jail a sandbox's VMM processes.
type JailOptions struct {
	// IDs gives each VMM process its uid and gid (one each, held while
	// it lives).
	IDs *jail.IDs
	// Binds are more host paths each jail holds.
	Binds []jail.Bind
}

// jailConfig makes the jail of a VMM process whose VM has devices (the
// boot's specs, or a restore's or fork's overrides): a new id, and the
// network namespace of its taps.
func (o *JailOptions) jailConfig(devices []virtio.DeviceSpec) (*vmmproc.JailConfig, error) {
	if o.IDs == nil {
		return nil, errors.New("sandbox: jail: no id allocator (JailOptions.IDs)")
	}
	netns, err := jailNetns(devices)
	if err != nil {
		return nil, err
	}
	id, f, err := o.IDs.Allocate()
	if err != nil {
		return nil, fmt.Errorf("sandbox: %w", err)
	}
	return &vmmproc.JailConfig{UID: id, GID: id, IDFile: f, Netns: netns, Binds: o.Binds}, nil
}

// jailNetns is the network namespace a jailed VMM process with devices
// starts in: its taps' (a name under /var/run/netns, a path, or this
// process's own for a tap in it), or "" (a new, empty one) without a
// tap.
func jailNetns(devices []virtio.DeviceSpec) (string, error) {
	netns, seen := "", false
	for _, d := range devices {
		if d.Kind != virtio.KindNet || d.Net == nil {
			continue
		}
		ns := "/proc/self/ns/net"
		switch n := d.Net.Netns; {
		case strings.ContainsRune(n, '/'):
			ns = n
		case n != "":
			ns = filepath.Join("/var/run/netns", n)
		}
		if seen && ns != netns {
			return "", fmt.Errorf("sandbox: a jailed VMM process has one network namespace: taps in %s and %s", netns, ns)
		}
		netns, seen = ns, true
	}
	return netns, nil
}

// machine is a sandbox's VM, in this process or in a VMM process.
type machine interface {
	// run runs the VM until it stops, and says how; called once.
	run() (vmm.Exit, error)
	// stop makes run return: the VM stops by force.
	stop()
	// save writes a snapshot into dir with labels, authenticated as sign
	// says (snapshot.WithKey, ExpectDisks).
	save(ctx context.Context, dir string, labels map[string]string, sign []snapshot.Option, log *slog.Logger) error
	// devices returns the specs of the VM's devices, in order.
	devices() []virtio.DeviceSpec
	// insertDisk puts the image f into the empty volume slot id
	// (vmm.VM.InsertDisk); it owns f from the call on (closes it, or
	// hands it over).
	insertDisk(ctx context.Context, id string, f *os.File, readOnly bool) error
	// device returns a live device by ID (in this process only).
	device(id string) virtio.Device
	diagnose() string
	// pause stops the vCPUs (the guest's clock stands still); resume
	// runs them again.
	pause(ctx context.Context) error
	resume(ctx context.Context) error
	// release frees what the VM holds, after run returned.
	release(ctx context.Context) error
}

// localVM is a VM in this process.
type localVM struct {
	vm     *vmm.VM
	ctx    context.Context
	cancel context.CancelFunc
	holds  localHolds // the sandbox's holds (Sandbox.Hold)
	kept   localKeeps // the sandbox's keeps (Sandbox.Keep)
}

func newLocalVM(vm *vmm.VM) *localVM {
	ctx, cancel := context.WithCancel(context.Background())
	return &localVM{vm: vm, ctx: ctx, cancel: cancel}
}

func (m *localVM) run() (vmm.Exit, error) { return m.vm.Run(m.ctx) }
func (m *localVM) stop()                  { m.cancel() }
func (m *localVM) save(ctx context.Context, dir string, labels map[string]string, sign []snapshot.Option, log *slog.Logger) error {
	return snapshot.Save(ctx, m.vm, dir, append([]snapshot.Option{snapshot.WithLogger(log), snapshot.WithLabels(labels)}, sign...)...)
}
func (m *localVM) devices() []virtio.DeviceSpec { return m.vm.Devices() }
func (m *localVM) insertDisk(_ context.Context, id string, f *os.File, readOnly bool) error {
	if err := m.vm.InsertDisk(id, f, readOnly); err != nil {
		f.Close()
		return err
	}
	return nil
}
func (m *localVM) device(id string) virtio.Device  { return m.vm.Device(id) }
func (m *localVM) diagnose() string                { return m.vm.Diagnose() }
func (m *localVM) pause(ctx context.Context) error { return m.vm.Pause(ctx) }
func (m *localVM) resume(context.Context) error    { return m.vm.Resume() }
func (m *processVM) pause(ctx context.Context) error {
	return m.p.Pause(ctx)
}
func (m *processVM) resume(ctx context.Context) error { return m.p.Resume(ctx) }
func (m *localVM) release(context.Context) error {
	m.cancel()
	m.holds.closeAll()
	m.kept.clearAll()
	return m.vm.Close()
}

// processVM is a VM in a VMM process.
type processVM struct {
	p    *vmmproc.Process
	opts ProcessOptions
	// specs are the VM's devices, read once it was created.
	specs  []virtio.DeviceSpec
	cancel context.CancelFunc // ends the console copy
	// vsock is the sandbox's vsock socket, which a jailed process
	// cannot unlink itself.
	vsock string
	// chunks serves a jailed process's image chunk fetches (nil: none).
	chunks *chunkServer
	// dial dials a jailed process's guest vsock connections (nil: not
	// jailed).
	dial *vmmproc.DialServer
}

// startProcess starts a VMM process for the sandbox s, with its console
// copied into the sandbox's console writer w.
// devices are the VM's devices as far as they are known before it is
// built (for a jail's network namespace).
func startProcess(ctx context.Context, s *Sandbox, opts ProcessOptions, w io.Writer, devices []virtio.DeviceSpec) (*processVM, error) {
	cfg := vmmproc.StartConfig{Command: opts.Command, Dir: s.dir, Env: opts.Env, Cgroup: opts.Cgroup, Logger: s.log}
	if opts.Jail != nil {
		j, err := opts.Jail.jailConfig(devices)
		if err != nil {
			return nil, err
		}
		cfg.Jail = j
	}
	m := &processVM{opts: opts, vsock: s.VsockPath()}
	if cfg.Jail != nil {
		if err := m.serveJail(s, cfg.Jail.UID, cfg.Jail.GID, s.roots, s.imageFS); err != nil {
			cfg.Jail.IDFile.Close() // vmmproc.Start would have: the id is free again
			return nil, err
		}
	}
	p, err := vmmproc.Start(ctx, cfg)
	if err != nil {
		m.closeJail()
		return nil, fmt.Errorf("sandbox: %w", err)
	}
	cctx, cancel := context.WithCancel(context.Background())
	go p.CopyConsole(cctx, w)
	m.p, m.cancel = p, cancel
	return m, nil
}

// serveJail serves what a jailed VMM process of uid and gid asks its
// parent for: the guest's vsock connections to the host
// (vmmproc.DialSocket) and, for an image root fs, the image's missing
// chunks (vmmproc.ChunkSocket). The jail reaches both sockets by their
// paths, in the sandbox's folder, which gets search permission for
// others (0711: no listing; its other files keep their own modes, none of
// them open to others).
func (m *processVM) serveJail(s *Sandbox, uid, gid int, roots *image.Roots, fs *virtio.FSSpec) error {
	if err := letJailSearch(s.dir); err != nil {
		return err
	}
	d, err := vmmproc.ServeVsockDial(vmmproc.DialSocket(vmmSocket(s.dir)), uid, gid, s.VsockPath(), s.log)
	if err != nil {
		return fmt.Errorf("sandbox: %w", err)
	}
	m.dial = d
	if fs == nil {
		return nil
	}
	c, err := serveChunks(vmmproc.ChunkSocket(vmmSocket(s.dir)), uid, gid, roots, *fs, s.log)
	if err != nil {
		m.closeJail()
		return err
	}
	m.chunks = c
	return nil
}

// closeJail stops serving the jailed process's sockets.
func (m *processVM) closeJail() {
	if m.chunks != nil {
		m.chunks.Close()
		m.chunks = nil
	}
	if m.dial != nil {
		m.dial.Close()
		m.dial = nil
	}
}

// letJailSearch gives others search permission on dir (a jailed VMM
// process's uid reaches its sockets there), and nothing more.
func letJailSearch(dir string) error {
	fi, err := os.Stat(dir)
	if err != nil {
		return fmt.Errorf("sandbox: %w", err)
	}
	if perm := fi.Mode().Perm(); perm&0o001 == 0 {
		if err := os.Chmod(dir, perm|0o011); err != nil {
			return fmt.Errorf("sandbox: let the jail reach its sockets: %w", err)
		}
	}
	return nil
}

// describe reads the devices of the process's new VM.
func (m *processVM) describe(ctx context.Context) error {
	d, err := m.p.Describe(ctx)
	if err != nil {
		return fmt.Errorf("sandbox: %w", err)
	}
	m.specs = d.Devices
	return nil
}

func (m *processVM) run() (vmm.Exit, error) { return m.p.Wait(context.Background()) }

func (m *processVM) stop() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	m.p.Stop(ctx) // a dead process has stopped already
}

// save has the VMM process save, without the key (a VMM process never
// holds it), and then signs what it saved: snapshot.Sign checks its
// state and memory files against its manifest, and that its disks are
// the sandbox's own (a VMM process that a guest took over could name any
// host file as a disk in the snapshot it writes).
func (m *processVM) save(ctx context.Context, dir string, labels map[string]string, sign []snapshot.Option, _ *slog.Logger) error {
	if err := m.p.Save(ctx, dir, labels); err != nil {
		return err
	}
	if err := snapshot.Sign(ctx, dir, sign...); err != nil {
		if rerr := os.RemoveAll(dir); rerr != nil {
			return fmt.Errorf("%w (and removing it: %v)", err, rerr)
		}
		return err
	}
	return nil
}

func (m *processVM) devices() []virtio.DeviceSpec { return m.specs }

// insertDisk hands f to the VMM process, which fills the slot, and reads
// the VM's devices again (the slot's spec now names the image).
func (m *processVM) insertDisk(ctx context.Context, id string, f *os.File, readOnly bool) error {
	err := m.p.InsertDisk(ctx, id, f, readOnly)
	f.Close() // the process has its own descriptor
	if err != nil {
		return fmt.Errorf("sandbox: %w", err)
	}
	return m.describe(ctx)
}
func (m *processVM) device(string) virtio.Device { return nil }

func (m *processVM) diagnose() string {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	d, err := m.p.Describe(ctx)
	if err != nil {
		return fmt.Sprintf("VMM process %d: %v", m.p.PID(), err)
	}
	return fmt.Sprintf("VMM process %d, VM %s\n%s", m.p.PID(), d.State, d.Diagnosis)
}

func (m *processVM) release(ctx context.Context) error {
	m.cancel()
	err := m.p.Close(ctx)
	if jailed, _ := m.p.Jailed(); jailed && m.vsock != "" {
		select {
		case <-m.p.Exited():
			if fi, serr := os.Lstat(m.vsock); serr == nil && fi.Mode()&os.ModeSocket != 0 {
				os.Remove(m.vsock)
			}
		default: // attached: it may still run
		}
	}
	m.closeJail()
	return err
}

// startMachine builds the machine of a new sandbox from cfg: in this
// process, or in a VMM process when proc is set.
func (s *Sandbox) startMachine(ctx context.Context, cfg vmm.Config, proc *ProcessOptions) (machine, error) {
	if proc == nil {
		vm, err := vmm.New(cfg)
		if err != nil {
			return nil, fmt.Errorf("sandbox: %w", err)
		}
		return newLocalVM(vm), nil
	}
	return s.processMachine(ctx, *proc, cfg.Console, cfg.Spec.Devices, func(p *vmmproc.Process) error { return p.Boot(ctx, cfg.Spec) })
}

// restoreMachine builds the machine of a sandbox restored from the
// snapshot in dir, authenticated by key. A VMM process does not get the
// key: this process checks the snapshot (snapshot.Verify) and hands it
// the manifest's digest and the memory's sealed copy.
func (s *Sandbox) restoreMachine(ctx context.Context, dir string, cfg vmm.RestoreConfig, proc *ProcessOptions, key []byte, cache *snapshot.Cache) (machine, error) {
	v, err := snapshot.Verify(ctx, dir, snapshot.WithKey(key), snapshot.WithCache(cache))
	if err != nil {
		return nil, fmt.Errorf("sandbox: %w", err)
	}
	defer v.Memory.Close()
	s.mark(PhaseMemory)
	if proc == nil {
		vm, err := snapshot.LoadVerified(v, cfg)
		if err != nil {
			return nil, fmt.Errorf("sandbox: %w", err)
		}
		return newLocalVM(vm), nil
	}
	return s.processMachine(ctx, *proc, cfg.Console, cfg.Devices, func(p *vmmproc.Process) error {
		return p.Restore(ctx, dir, v.ManifestSHA256, v.Memory, cfg.Devices)
	})
}

// processMachine starts a VMM process for s, has create build its VM, and
// reads the VM's devices.
func (s *Sandbox) processMachine(ctx context.Context, proc ProcessOptions, console io.Writer, devices []virtio.DeviceSpec, create func(*vmmproc.Process) error) (machine, error) {
	m, err := startProcess(ctx, s, proc, console, devices)
	if err != nil {
		return nil, err
	}
	s.markTimed(PhaseSpawn)
	if err := create(m.p); err != nil {
		m.release(context.Background())
		return nil, fmt.Errorf("sandbox: %w", err)
	}
	if err := m.describe(ctx); err != nil {
		m.release(context.Background())
		return nil, err
	}
	return m, nil
}

// forkMachines makes the machines of n children of m: devices(i) gives
// child i's overrides and is called while m is paused; cgroup(i), when
// set, the cgroup child i's VMM process starts in.
func forkMachines(ctx context.Context, m machine, children []*Sandbox, devices func(i int) ([]virtio.DeviceSpec, error), cgroup func(i int) string, log *slog.Logger) ([]machine, error) {
	switch m := m.(type) {
	case *localVM:
		vms, err := m.vm.Fork(ctx, len(children), vmm.ForkConfig{
			Devices: devices,
			Console: func(i int) io.Writer { return children[i].console },
			Logger:  log,
		})
		if err != nil {
			return nil, fmt.Errorf("sandbox: %w", err)
		}
		out := make([]machine, len(vms))
		for i, vm := range vms {
			out[i] = newLocalVM(vm)
		}
		return out, nil
	case *processVM:
		return m.fork(ctx, children, devices, cgroup)
	}
	return nil, errors.New("sandbox: fork: unknown machine")
}

// fork makes the children of a VM in a VMM process, each in a VMM process
// of its own over the parent's frozen memory (passed as a descriptor), so
// that they share its pages copy-on-write as in-process children do.
func (m *processVM) fork(ctx context.Context, children []*Sandbox, devices func(i int) ([]virtio.DeviceSpec, error), cgroup func(i int) string) (_ []machine, err error) {
	// Paused for the whole of the parent's part: devices(i) may copy a
	// writable disk as it is at the fork.
	if err := m.p.Pause(ctx); err != nil {
		return nil, fmt.Errorf("sandbox: fork: %w", err)
	}
	resumed := false
	resume := func() error {
		if resumed {
			return nil
		}
		resumed = true
		rctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		return m.p.Resume(rctx)
	}
	defer func() {
		if rerr := resume(); rerr != nil && err == nil {
			err = fmt.Errorf("sandbox: fork: resume the parent: %w", rerr)
		}
	}()
	st, base, err := m.p.Freeze(ctx)
	if err != nil {
		return nil, fmt.Errorf("sandbox: fork: %w", err)
	}
	defer base.Close()
	overrides := make([][]virtio.DeviceSpec, len(children))
	for i := range children {
		if overrides[i], err = devices(i); err != nil {
			return nil, fmt.Errorf("sandbox: fork: child %d's devices: %w", i, err)
		}
	}
	if err := resume(); err != nil {
		return nil, fmt.Errorf("sandbox: fork: resume the parent: %w", err)
	}
	out := make([]machine, 0, len(children))
	defer func() {
		if err != nil {
			for _, c := range out {
				c.release(context.Background())
			}
		}
	}()
	for i, c := range children {
		opts := m.opts
		opts.Cgroup = "" // the parent's is its own
		if cgroup != nil {
			opts.Cgroup = cgroup(i)
		}
		cm, err := startProcess(ctx, c, opts, c.console, overrides[i])
		if err != nil {
			return nil, fmt.Errorf("sandbox: fork: child %d: %w", i, err)
		}
		out = append(out, cm)
		if err := cm.p.RestoreFork(ctx, st, base, overrides[i]); err != nil {
			return nil, fmt.Errorf("sandbox: fork: child %d: %w", i, err)
		}
		if err := cm.describe(ctx); err != nil {
			return nil, fmt.Errorf("sandbox: fork: child %d: %w", i, err)
		}
	}
	return out, nil
}

// AttachOptions are what Attach needs beyond the sandbox's folder.
type AttachOptions struct {
	// Process starts the VMM processes of the sandbox's fork children
	// (the attached one was started by another parent).
	Process ProcessOptions
	// ImageRoots fetch a jailed VMM process's missing image chunks (new
	// ones if nil), as Options.ImageRoots.
	ImageRoots *image.Roots
	Logger     *slog.Logger
}

// Attach takes over the sandbox whose VM runs in the VMM process with the
// folder dir (a sandbox started with ProcessOptions, by this process or
// another one, which may have exited since): it connects to the VMM
// process and to the agent, and returns the sandbox as it runs. Close
// stops it as it would one this process started.
func Attach(ctx context.Context, dir string, opts AttachOptions) (_ *Sandbox, err error) {
	log := opts.Logger
	if log == nil {
		log = slog.Default()
	}
	p, err := vmmproc.Attach(ctx, vmmSocket(dir), log)
	if err != nil {
		return nil, fmt.Errorf("sandbox: attach %s: %w", dir, err)
	}
	m := &processVM{p: p, opts: opts.Process, cancel: func() {}}
	if err := m.describe(ctx); err != nil {
		p.Close(ctx)
		return nil, err
	}
	s := &Sandbox{dir: dir, log: log, console: newTail(16 << 10), started: time.Now(), done: make(chan struct{})}
	defer func() {
		if err != nil {
			s.Close(context.Background())
		}
	}()
	cctx, cancel := context.WithCancel(context.Background())
	m.cancel = cancel
	go p.CopyConsole(cctx, s.console)
	s.m = m
	s.image = imageOf(m.specs)
	s.modules = modulesOf(m.specs)
	m.serveAttachedJail(s, opts)
	s.run()
	if err := s.connect(ctx, time.Minute); err != nil {
		return nil, err
	}
	info, err := s.client.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("sandbox: attach %s: %w", dir, err)
	}
	s.hostname = info.Hostname
	return s, nil
}

// modulesOf returns the kernel release of the modules disk among specs,
// "" when there is none (or it cannot be read: it only labels snapshots).
func modulesOf(specs []virtio.DeviceSpec) string {
	for _, d := range specs {
		if d.ID == ModulesDevice && d.Kind == virtio.KindBlock && d.Block != nil {
			rel, _ := guestkernel.ReadModulesDisk(d.Block.Path)
			return rel
		}
	}
	return ""
}

// vmmSocket is the VMM process's socket in a sandbox folder.
func vmmSocket(dir string) string { return filepath.Join(dir, vmmproc.SocketFile) }

// GuestMemory returns the process that holds the sandbox's guest RAM and
// where the RAM lies in it, for a caller that measures it
// (/proc/PID/smaps).
func (s *Sandbox) GuestMemory(ctx context.Context) (int, []vmmproc.MemoryRange, error) {
	switch m := s.m.(type) {
	case *localVM:
		mem := m.vm.Memory()
		if mem == nil {
			return 0, nil, errors.New("sandbox: the VM has no memory")
		}
		var out []vmmproc.MemoryRange
		for i, r := range mem.Regions() {
			out = append(out, vmmproc.MemoryRange{Addr: mem.HostAddr(i), Size: r.Size})
		}
		return os.Getpid(), out, nil
	case *processVM:
		d, err := m.p.Describe(ctx)
		if err != nil {
			return 0, nil, fmt.Errorf("sandbox: %w", err)
		}
		return m.p.PID(), d.GuestMemory, nil
	}
	return 0, nil, errors.New("sandbox: no VM")
}

// Describe describes the sandbox's VMM process: its VM's devices, state
// and guest memory, and the process's own Go runtime memory. A sandbox
// whose VM runs in this process has no VMM process to describe.
func (s *Sandbox) Describe(ctx context.Context) (vmmproc.Description, error) {
	m, ok := s.m.(*processVM)
	if !ok {
		return vmmproc.Description{}, errors.New("sandbox: the VM runs in this process, not a VMM process of its own")
	}
	d, err := m.p.Describe(ctx)
	if err != nil {
		return d, fmt.Errorf("sandbox: %w", err)
	}
	return d, nil
}
