// Package sandbox starts Kiln sandboxes: a VM whose init is the guest agent
// (cmd/kiln-agent), with a vsock device through which the host drives it
// (guest/client). It is what `kiln run`, snapshots and the daemon build on:
// Start boots a VM and returns once the agent answers; Close powers it off.
package sandbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kilnvm/kiln/guest/client"
	"github.com/kilnvm/kiln/guestkernel"
	"github.com/kilnvm/kiln/hostfs"
	"github.com/kilnvm/kiln/image"
	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmm"
	"github.com/kilnvm/kiln/vmmproc"
)

// GuestCID is the vsock CID every sandbox's guest has. Each sandbox has its
// own vsock device and host socket, so they need not differ.
const GuestCID = 3

// Options describe a sandbox to start. The zero value, but for Agent where
// no kiln-agent binary can be found, starts the cached Debian kernel with
// 1 vCPU and 512 MiB, running commands in the agent's initramfs.
type Options struct {
	// Runtime is the kernel and the agent's initramfs to boot (required:
	// NewRuntime or FindRuntime makes one).
	Runtime Runtime
	// Disk, when set, is an image with the root filesystem (ext4 unless
	// RootFSType says otherwise), attached as /dev/vda; the agent switches
	// root to it.
	Disk         string
	DiskReadOnly bool
	RootFSType   string
	// CPUs and MemoryMiB size the VM (DefaultCPUs and DefaultMemoryMiB,
	// 1 and 512, when zero; CheckCPUs and CheckMemory bound them).
	CPUs, MemoryMiB int
	// Hostname is the guest's host name; "kiln" when empty.
	Hostname string
	// Cmdline is appended to the kernel command line.
	Cmdline string
	// Console receives the guest's serial console; nil keeps only its
	// tail, for error messages.
	Console io.Writer
	// Dir holds the sandbox's host files (its vsock socket); empty means a
	// new temporary directory, removed by Close.
	Dir string
	// BootTimeout bounds Start's wait for the agent; 0 means 5 minutes
	// (emulated KVM boots take a minute).
	BootTimeout time.Duration
	// Net, when set, gives the guest a network card (virtio-net, device
	// ID NetDevice) on a host tap, which is created when it does not
	// exist; a random MAC address when the spec has none. Each restored
	// or forked sandbox gets a tap and a MAC address of its own
	// (RestoreOptions.Net, ForkOptions.Net).
	Net *virtio.NetSpec
	// Devices are further virtio devices (data disks, say), after the
	// root disk and network card, each with an ID of its own (not one of
	// the IDs the sandbox uses: RootDevice, NetDevice, VsockDevice,
	// RNGDevice). They are saved, restored and forked with the sandbox:
	// a writable disk needs a path per child to fork
	// (ForkOptions.Disks).
	Devices []virtio.DeviceSpec
	// Process, when set, runs the VM in a VMM process of its own; nil
	// runs it in this process.
	Process *ProcessOptions
	Logger  *slog.Logger
	// SnapshotKey authenticates the sandbox's snapshots (Save): the
	// host key a restore checks them with. nil: the key of
	// SnapshotKeyFile.
	SnapshotKey []byte

	// Image, when set, is the root instead of Disk: an OCI image of the
	// images folder Images (DefaultImagesDir when empty), named as kiln
	// image ls shows it or by manifest digest. Its merged layers are laid
	// out as a read-only EROFS filesystem on a virtio disk (device
	// ImageDevice, package erofs: metadata built on the host, file data
	// read from the image's chunks on first read), under an overlay whose
	// upper layer is a tmpfs in guest RAM: writes vanish with the sandbox,
	// and snapshots and forks keep them. Its config's Env, WorkingDir and
	// User become the defaults of every exec.
	Image  string
	Images string
	// ImageTransport is how Image reaches the guest:
	// virtio.TransportEROFS (also "", the default) or virtio.Transport9P
	// (the tree over virtio-9p, a round trip per lookup: kept to compare
	// with, and for a guest kernel without erofs).
	ImageTransport string
	// WritableMiB caps an image root's writable layer (the tmpfs in guest
	// RAM): writes past it fail with ENOSPC. 0: tmpfs's default, half
	// the guest's memory; at most MemoryMiB.
	WritableMiB int
	// Init is what runs as process 1 of an image root: "" or InitAgent,
	// the agent; InitSystemd, the image's /sbin/init (systemd, booted to
	// its default target) with the agent as a systemd service.
	Init string
	// ImageRoots shares image trees among sandboxes of this process (one
	// tree per image, however many sandboxes and clones run it); nil: the
	// sandbox and its forks get their own.
	ImageRoots *image.Roots
	// RootDir, instead of Image or Disk, is a host directory that is the
	// root: served read-only over virtio-9p (package hostfs: symbolic
	// links are the guest's to resolve, never the host's), under the
	// same tmpfs overlay as an image root. A containerd shim gives a
	// container's mounted rootfs this way. Its files must not change
	// while the sandbox runs.
	RootDir string
}

// IdleCmdline is on every sandbox's kernel command line: it turns off
// what would wake an idle guest for nothing a sandbox needs, the lockup
// detectors' timers (nowatchdog; the host watches its VMM anyway) and
// proactive compaction, which polls every 500 ms (huge pages are not
// worth it in a guest's short life). docs/bench.md measures it.
const IdleCmdline = "nowatchdog sysctl.vm.compaction_proactiveness=0"

// The IDs of the devices every sandbox may have.
const (
	RootDevice  = "root"  // the root disk (Options.Disk)
	NetDevice   = "net0"  // the network card (Options.Net)
	VsockDevice = "vsock" // the agent's vsock device
	RNGDevice   = "rng"   // the entropy device
	// ModulesDevice is the kernel's modules disk (Runtime.Modules),
	// read-only: the guest finds it by this ID, its disk serial.
	ModulesDevice = "modules"
)

// Sandbox is a running VM with a connected agent.
//
// A Sandbox is safe for concurrent use: execs through its Client run
// side by side, while Save, Fork and Close run one at a time.
type Sandbox struct {
	m        machine
	client   *client.Client
	hostname string
	dir      string
	tempDir  bool
	console  *tail
	log      *slog.Logger
	started  time.Time
	// phases and lastMark time the start (mark); written by the
	// goroutine that starts the sandbox, before it is handed out.
	phases   []Phase
	lastMark time.Time

	// life serialises Save, Fork and Close.
	life sync.Mutex

	running bool          // run was called: done closes when the VM stops
	done    chan struct{} // closed when Run returns
	exit    vmm.Exit
	runErr  error

	closeOnce sync.Once
	closeErr  error

	image  string          // an image root's manifest digest; "" for none
	openFS virtio.FSOpener // how its VM opens image roots (this process's)
	// imageFS is its image root's spec and roots the Roots it opens
	// through (nil without one): a jailed VMM process's parent fetches
	// the image's missing chunks with them (serveChunks).
	imageFS *virtio.FSSpec
	roots   *image.Roots
	// trees are its root directory's device's trees (Options.RootDir) as
	// this process opened them (keepTrees), for ServeDir; nil otherwise.
	treesMu sync.Mutex
	trees   *hostfs.Trees
	// modules is the kernel release of its modules disk; "" for none.
	modules string
	// snapKey authenticates its snapshots; nil: SnapshotKeyFile's.
	snapKey []byte
	// disks are the images of its disks by device ID, as this process
	// gave them to its VM: its snapshots may name only these.
	disks map[string]string
}

// blockPaths returns disks with the image paths of the disks among specs
// over it (a new map).
func blockPaths(disks map[string]string, specs []virtio.DeviceSpec) map[string]string {
	out := maps.Clone(disks)
	if out == nil {
		out = map[string]string{}
	}
	for _, d := range specs {
		if d.Kind == virtio.KindBlock && d.Block != nil {
			out[d.ID] = d.Block.Path
		}
	}
	return out
}

// Image returns the manifest digest of the sandbox's image root, "" when
// its root is not an image.
func (s *Sandbox) Image() string { return s.image }

// Start boots a sandbox and waits until its agent answers. ctx bounds the
// wait (with opts.BootTimeout), not the sandbox's life: Close ends that.
func Start(ctx context.Context, opts Options) (_ *Sandbox, err error) {
	start := time.Now()
	log := opts.Logger
	if log == nil {
		log = slog.Default()
	}
	cfg, err := opts.vmConfig()
	if err != nil {
		return nil, err
	}
	var root *imageRoot
	if opts.Image == "" && opts.RootDir == "" && opts.WritableMiB != 0 {
		return nil, errors.New("sandbox: Options.WritableMiB caps an image root's writable layer: it needs Options.Image or RootDir")
	}
	if err := opts.checkInit(); err != nil {
		return nil, err
	}
	if opts.Image != "" || opts.RootDir != "" {
		if opts.RootDir != "" {
			root, err = opts.resolveRootDir(cfg.MemoryMiB)
		} else {
			root, err = opts.resolveImage(cfg.MemoryMiB)
		}
		if err != nil {
			return nil, err
		}
		if cfg.Initrd, err = imageInitrd(cfg.Initrd, root.config); err != nil {
			return nil, err
		}
		cfg.Cmdline += " kiln.root=" + root.cmdlineRoot()
		if opts.WritableMiB > 0 {
			cfg.Cmdline += fmt.Sprintf(" kiln.overlaysize=%d", opts.WritableMiB)
		}
		cfg.Cmdline += opts.initCmdline()
		cfg.OpenFS = vmmproc.OpenImageFS(root.roots)
	}
	hostname := opts.Hostname
	if hostname == "" {
		hostname = "kiln"
	}
	s, err := newSandbox(log, opts.Dir, hostname, start)
	if err != nil {
		return nil, err
	}
	s.snapKey = opts.SnapshotKey
	defer func() {
		if err != nil {
			s.Close(context.Background())
		}
	}()
	if cfg.Devices, err = s.deviceSpecs(opts); err != nil {
		return nil, err
	}
	s.disks = blockPaths(nil, cfg.Devices)
	if opts.Runtime.Modules != "" {
		if s.modules, err = guestkernel.ReadModulesDisk(opts.Runtime.Modules); err != nil {
			return nil, fmt.Errorf("sandbox: Runtime.Modules: %w", err)
		}
	}
	if root != nil && root.spec.FS.EROFS() {
		// After the other disks, so that they keep the names they have
		// in a sandbox without it (the guest finds it by serial).
		cfg.Devices = append(cfg.Devices, root.spec)
	} else if root != nil {
		cfg.Devices = append([]virtio.DeviceSpec{root.spec}, cfg.Devices...)
	}
	// The volume slots last, for the same reason: the disks before keep
	// their names.
	slots := volumeSpecs()
	cfg.Devices = append(cfg.Devices, slots...)
	s.disks = blockPaths(s.disks, slots)
	if root != nil {
		s.image = root.spec.FS.Image
		if root.spec.FS.Dir != "" {
			cfg.OpenFS = s.keepTrees(cfg.OpenFS)
		}
		s.openFS = cfg.OpenFS
		if root.roots != nil {
			s.imageFS, s.roots = root.spec.FS, root.roots
		}
	}
	cfg.Console = s.consoleWriter(opts.Console)
	if s.m, err = s.startMachine(ctx, cfg, opts.Process); err != nil {
		return nil, err
	}
	s.run()
	if err = s.connect(ctx, opts.BootTimeout); err != nil {
		return nil, err
	}
	return s, nil
}

// newSandbox returns a sandbox without a VM yet, with its host folder: dir,
// or a new temporary one that Close removes.
func newSandbox(log *slog.Logger, dir, hostname string, started time.Time) (*Sandbox, error) {
	s := &Sandbox{dir: dir, log: log, console: newTail(16 << 10), started: started, done: make(chan struct{}), hostname: hostname}
	if s.dir == "" {
		var err error
		if s.dir, err = os.MkdirTemp("", "kiln-sandbox-"); err != nil {
			return nil, fmt.Errorf("sandbox: %w", err)
		}
		s.tempDir = true
	}
	return s, nil
}

// rootQueues is how many request queues the root disk of a VM of cpus
// vCPUs offers: one per vCPU (up to virtio.BlockMaxQueues), so that vCPUs
// doing I/O at once do not share a virtqueue; 0 (one queue) for one vCPU,
// which keeps the spec as it was before multi-queue disks.
func rootQueues(cpus int) int {
	if cpus <= 1 {
		return 0
	}
	return min(cpus, virtio.BlockMaxQueues)
}

// deviceSpecs returns the devices of a new sandbox, in the order every
// sandbox has them: the root disk when opts.Disk is set, the network card
// when opts.Net is, opts.Devices, the kernel's modules disk when the
// runtime has one (after the other disks, so that theirs keep their
// names: /dev/vda the root), the vsock device on the sandbox's socket, an
// entropy device.
func (s *Sandbox) deviceSpecs(opts Options) ([]virtio.DeviceSpec, error) {
	var devs []virtio.DeviceSpec
	if opts.Disk != "" {
		devs = append(devs, virtio.DeviceSpec{ID: RootDevice, Kind: virtio.KindBlock,
			Block: &virtio.BlockSpec{Path: opts.Disk, ReadOnly: opts.DiskReadOnly, Queues: rootQueues(opts.CPUs)}})
	}
	if opts.Net != nil {
		nic, err := netSpec(opts.Net)
		if err != nil {
			return nil, err
		}
		devs = append(devs, nic)
	}
	for _, d := range opts.Devices {
		switch d.ID {
		case RootDevice, NetDevice, VsockDevice, RNGDevice, ImageDevice, ModulesDevice:
			return nil, fmt.Errorf("sandbox: device ID %q is the sandbox's own; give the device another", d.ID)
		}
		if slices.ContainsFunc(volumeSpecs(), func(v virtio.DeviceSpec) bool { return v.ID == d.ID }) {
			return nil, fmt.Errorf("sandbox: device ID %q is a volume slot's; give the device another", d.ID)
		}
		if err := d.Validate(); err != nil {
			return nil, fmt.Errorf("sandbox: %w", err)
		}
		devs = append(devs, d)
	}
	if opts.Runtime.Modules != "" {
		devs = append(devs, modulesSpec(opts.Runtime.Modules))
	}
	return append(devs, s.vsockSpec(), virtio.DeviceSpec{ID: RNGDevice, Kind: virtio.KindRNG, RNG: &virtio.RNGSpec{}}), nil
}

// modulesSpec is the device of the modules disk at path: read-only (one
// host file, opened O_RDONLY, shared by every sandbox), its serial the
// device ID, which the agent looks for (kiln.modules=).
func modulesSpec(path string) virtio.DeviceSpec {
	return virtio.DeviceSpec{ID: ModulesDevice, Kind: virtio.KindBlock,
		Block: &virtio.BlockSpec{Path: path, ReadOnly: true, Serial: ModulesDevice}}
}

// vsockSpec is the sandbox's vsock device, on its socket.
func (s *Sandbox) vsockSpec() virtio.DeviceSpec {
	return virtio.DeviceSpec{ID: VsockDevice, Kind: virtio.KindVsock, Vsock: &virtio.VsockSpec{CID: GuestCID, Path: s.VsockPath()}}
}

// netSpec is the spec of the network card n describes, with a random MAC
// address when it has none: the address is then known before the card
// opens, and a snapshot records it.
func netSpec(n *virtio.NetSpec) (virtio.DeviceSpec, error) {
	nic := *n
	if nic.MAC == "" {
		mac, err := virtio.RandomMAC()
		if err != nil {
			return virtio.DeviceSpec{}, fmt.Errorf("sandbox: %w", err)
		}
		nic.MAC = mac.String()
	}
	spec := virtio.DeviceSpec{ID: NetDevice, Kind: virtio.KindNet, Net: &nic}
	if err := spec.Validate(); err != nil {
		return spec, fmt.Errorf("sandbox: network card: %w", err)
	}
	return spec, nil
}

// consoleWriter is where the VM's console goes: the sandbox's tail, and w
// when set.
func (s *Sandbox) consoleWriter(w io.Writer) io.Writer {
	if w == nil {
		return s.console
	}
	return io.MultiWriter(w, s.console)
}

// run runs the VM in the background until Close or the guest stops.
func (s *Sandbox) run() {
	s.running = true
	go func() {
		defer close(s.done)
		s.exit, s.runErr = s.m.run()
		s.log.Debug("sandbox VM stopped", "exit", s.exit.String())
	}()
}

// connect waits for the agent to answer, or the VM to stop, or the boot
// timeout.
func (s *Sandbox) connect(ctx context.Context, timeout time.Duration) error {
	if timeout <= 0 {
		timeout = 5 * time.Minute
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	go func() {
		select {
		case <-s.done:
			cancel()
		case <-ctx.Done():
		}
	}()
	c, err := client.WaitReady(ctx, s.VsockPath())
	if err != nil {
		select {
		case <-s.done:
			return fmt.Errorf("sandbox: the VM stopped before its agent answered: %s%s", s.exitString(), s.consoleTail())
		default:
		}
		return fmt.Errorf("sandbox: agent did not answer within %v: %w%s", timeout, err, s.consoleTail())
	}
	s.client = c
	s.log.Debug("sandbox ready", "elapsed", time.Since(s.started))
	return nil
}

func (s *Sandbox) exitString() string {
	if s.runErr != nil {
		return s.runErr.Error()
	}
	return s.exit.String()
}

// consoleTail returns the end of the guest's console, for an error message.
func (s *Sandbox) consoleTail() string {
	t := strings.TrimSpace(s.console.String())
	if t == "" {
		return ""
	}
	lines := strings.Split(t, "\n")
	if len(lines) > 25 {
		lines = lines[len(lines)-25:]
	}
	return "\nguest console (last lines):\n  " + strings.Join(lines, "\n  ")
}

// Client returns the agent client.
func (s *Sandbox) Client() *client.Client { return s.client }

// VM returns the sandbox's VM.
// It is nil for a sandbox whose VM runs in a VMM process of its own
// (ProcessOptions).
func (s *Sandbox) VM() *vmm.VM {
	if l, ok := s.m.(*localVM); ok {
		return l.vm
	}
	return nil
}

// PID returns the process that runs the sandbox's VM: this one, or its
// VMM process.
func (s *Sandbox) PID() int {
	if p, ok := s.m.(*processVM); ok {
		return p.p.PID()
	}
	return os.Getpid()
}

// Dir is the sandbox's host folder: its vsock socket and, with
// ProcessOptions, its VMM process's socket and log (Attach takes it).
func (s *Sandbox) Dir() string { return s.dir }

// VsockPath is the host Unix socket of the sandbox's vsock device.
func (s *Sandbox) VsockPath() string { return filepath.Join(s.dir, "vsock.sock") }

// DialPort connects to TCP port port on the guest's loopback through its
// agent (client.DialPort): what listens on the port in the guest is
// reached without the guest having a network card. A guest that refuses
// says why in a *client.PortError.
func (s *Sandbox) DialPort(ctx context.Context, port int) (net.Conn, error) {
	return client.DialPort(ctx, s.VsockPath(), port)
}

// Console returns what the guest's serial console printed lately.
func (s *Sandbox) Console() string { return s.console.String() }

// Done is closed when the VM has stopped.
func (s *Sandbox) Done() <-chan struct{} { return s.done }

// Exit returns how the VM stopped; call it after Done is closed.
func (s *Sandbox) Exit() (vmm.Exit, error) { return s.exit, s.runErr }

// Close powers the guest off through its agent and waits for the VM to
// stop, up to ctx's end (or 30 seconds), then stops it by force, and
// releases everything Start made.
func (s *Sandbox) Close(ctx context.Context) error {
	s.closeOnce.Do(func() {
		s.life.Lock()
		defer s.life.Unlock()
		s.closeErr = s.close(ctx)
	})
	return s.closeErr
}

func (s *Sandbox) close(ctx context.Context) error {
	var errs []error
	if s.m != nil {
		if s.client != nil {
			pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			if err := s.client.PowerOff(pctx); err != nil {
				s.log.Debug("agent power-off", "err", err)
			}
			select {
			case <-s.done:
			case <-pctx.Done():
				s.log.Warn("sandbox did not power off in time; stopping it")
			}
			cancel()
		}
		if s.running {
			s.m.stop()
			<-s.done
		}
	}
	if s.client != nil {
		s.client.Close()
	}
	if s.m != nil {
		errs = append(errs, s.m.release(ctx)) // and its devices
	}
	if s.tempDir {
		errs = append(errs, os.RemoveAll(s.dir))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("sandbox: close: %w", err)
	}
	return nil
}

// vmConfig turns the options into a VM config (without devices).
func (o Options) vmConfig() (vmm.Config, error) {
	cfg := vmm.Config{Spec: vmm.Spec{CPUs: o.CPUs, MemoryMiB: o.MemoryMiB}, Logger: o.Logger}
	hostname := o.Hostname
	if hostname == "" {
		hostname = "kiln"
	}
	if err := checkCmdlineWord("hostname", hostname); err != nil {
		return cfg, err
	}

	if cfg.CPUs == 0 {
		cfg.CPUs = DefaultCPUs
	}
	if cfg.MemoryMiB == 0 {
		cfg.MemoryMiB = DefaultMemoryMiB
	}
	if err := CheckCPUs(cfg.CPUs); err != nil {
		return cfg, fmt.Errorf("sandbox: Options.CPUs: %w", err)
	}
	if err := CheckMemory(cfg.MemoryMiB); err != nil {
		return cfg, fmt.Errorf("sandbox: Options.MemoryMiB: %w", err)
	}
	if o.Runtime.Kernel == "" || o.Runtime.Initrd == "" {
		return cfg, errors.New("sandbox: no runtime: Options.Runtime needs a kernel and the agent's initramfs (NewRuntime, or FindRuntime for the cached kernel and the agent beside kiln)")
	}
	cfg.Kernel, cfg.Initrd = o.Runtime.Kernel, o.Runtime.Initrd
	cmdline := []string{vmm.DefaultCmdline, "quiet", IdleCmdline, "kiln.hostname=" + hostname}
	if o.Runtime.Modules != "" {
		cmdline = append(cmdline, "kiln.modules="+ModulesDevice)
	}
	if o.Disk != "" {
		cmdline = append(cmdline, "kiln.root=/dev/vda")
		if o.RootFSType != "" {
			if err := checkCmdlineWord("root filesystem type", o.RootFSType); err != nil {
				return cfg, err
			}
			cmdline = append(cmdline, "kiln.rootfstype="+o.RootFSType)
		}
		if o.DiskReadOnly {
			cmdline = append(cmdline, "kiln.ro")
		}
	}
	if o.Cmdline != "" {
		cmdline = append(cmdline, o.Cmdline)
	}
	cfg.Cmdline = strings.Join(cmdline, " ")
	return cfg, nil
}

// CheckHostname checks a sandbox host name as Options and RestoreOptions
// take it, so that a caller can refuse a bad one before it starts anything.
func CheckHostname(name string) error { return checkCmdlineWord("hostname", name) }

// checkCmdlineWord refuses a value that would break the kernel command line.
// The kernel splits its command line at more than ' ' and '\t' (its isspace
// takes \v, \f, \r and the byte 0xa0, which UTF-8 text holds, as spaces)
// and a NUL ends it, so only printable ASCII is taken: a value must never
// add a parameter.
func checkCmdlineWord(what, v string) error {
	bad := v == "" || len(v) > 64 || strings.ContainsAny(v, "\"'\\=")
	for i := 0; i < len(v) && !bad; i++ {
		bad = v[i] <= ' ' || v[i] > '~'
	}
	if bad {
		return fmt.Errorf("sandbox: %s %q: want 1 to 64 printable ASCII characters, no spaces, quotes, backslashes or '='", what, v)
	}
	return nil
}

// nic returns the sandbox's network card, or nil without one.
// (live in this process only).
func (s *Sandbox) nic() *virtio.Net {
	if s.m == nil {
		return nil
	}
	n, _ := s.m.device(NetDevice).(*virtio.Net)
	return n
}

// netSpecOf returns the spec of the sandbox's network card, or nil.
func (s *Sandbox) netSpecOf() *virtio.NetSpec {
	if s.m == nil {
		return nil
	}
	for _, d := range s.m.devices() {
		if d.ID == NetDevice && d.Net != nil {
			return d.Net
		}
	}
	return nil
}

// MAC returns the guest's network card's address, or nil without one.
func (s *Sandbox) MAC() net.HardwareAddr {
	if n := s.nic(); n != nil {
		return n.MAC()
	}
	if n := s.netSpecOf(); n != nil {
		mac, _ := net.ParseMAC(n.MAC) // the sandbox always gives one
		return mac
	}
	return nil
}

// Tap returns the name of the host tap behind the guest's network card, or
// "" without one.
func (s *Sandbox) Tap() string {
	if n := s.nic(); n != nil {
		return n.TapName()
	}
	if n := s.netSpecOf(); n != nil {
		return n.Tap
	}
	return ""
}

// Devices returns the specs of the sandbox's devices, in order.
func (s *Sandbox) Devices() []virtio.DeviceSpec { return s.m.devices() }

// Diagnose describes the sandbox's VM (vCPU exit counts, each virtio
// queue's indices, the vsock connections) for a report when its guest
// seems stuck. Call it while the sandbox runs.
func (s *Sandbox) Diagnose() string { return s.m.diagnose() }
