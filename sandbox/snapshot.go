package sandbox

import (
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"log/slog"
	"path/filepath"
	"slices"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/guest/client"
	"github.com/kilnvm/kiln/guestkernel"
	"github.com/kilnvm/kiln/image"
	"github.com/kilnvm/kiln/snapshot"
	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmm"
	"github.com/kilnvm/kiln/vmmproc"
)

// Labels a sandbox's snapshot carries in its manifest
// (snapshot.WithLabels), beside the VM: a snapshot without LabelHostname
// is not a sandbox's.
const (
	LabelHostname = "kiln.sandbox/hostname"
	// LabelModules is the kernel release of the sandbox's modules disk
	// (Runtime.Modules), when it has one: a restore refuses a disk of
	// another kernel.
	LabelModules = "kiln.sandbox/modules"
)

// Save writes a snapshot of the running sandbox into dir (which must not
// exist): the guest's filesystems are synced through the agent, the VM is
// paused and saved (snapshot.Save: atomic, nothing loadable is left on
// failure), and then it runs on. Disks are not copied: a sandbox restored
// from dir uses the same images (or those RestoreOptions.Disks names),
// which must not change meanwhile.
func (s *Sandbox) Save(ctx context.Context, dir string) error {
	s.life.Lock()
	defer s.life.Unlock()
	if err := s.client.Quiesce(ctx, false); err != nil {
		return fmt.Errorf("sandbox: save: quiesce the guest: %w", err)
	}
	labels := map[string]string{LabelHostname: s.hostname}
	if s.modules != "" {
		labels[LabelModules] = s.modules
	}
	key, err := snapshotKey(s.snapKey)
	if err != nil {
		return err
	}
	sign := []snapshot.Option{snapshot.WithKey(key), snapshot.ExpectDisks(s.disks)}
	if err := s.m.save(ctx, dir, labels, sign, s.log); err != nil {
		return fmt.Errorf("sandbox: %w", err)
	}
	return nil
}

// Pause stops the sandbox's vCPUs until Resume: its processes stand
// still, its memory stays; the agent does not answer meanwhile.
func (s *Sandbox) Pause(ctx context.Context) error {
	s.life.Lock()
	defer s.life.Unlock()
	if err := s.m.pause(ctx); err != nil {
		return fmt.Errorf("sandbox: pause: %w", err)
	}
	return nil
}

// Resume runs a paused sandbox's vCPUs again.
func (s *Sandbox) Resume(ctx context.Context) error {
	s.life.Lock()
	defer s.life.Unlock()
	if err := s.m.resume(ctx); err != nil {
		return fmt.Errorf("sandbox: resume: %w", err)
	}
	return nil
}

// execHostname is the command that renames the guest.
func execHostname(name string) client.ExecOptions {
	return client.ExecOptions{Argv: []string{"hostname", name}}
}

// RestoreOptions describe a sandbox restored from a snapshot.
type RestoreOptions struct {
	// Console receives the guest's serial console; nil keeps only its
	// tail, for error messages.
	Console io.Writer
	// Dir holds the sandbox's host files (its vsock socket); empty means a
	// new temporary directory, removed by Close. Each restored sandbox
	// needs its own.
	Dir string
	// Hostname, when set, renames the restored guest.
	Hostname string
	// Net is the restored sandbox's network card, required when the
	// snapshot's sandbox had one (and refused when it had none): a tap of
	// its own, and a MAC address (a new random one when empty) that the
	// guest's interface takes over from the snapshot's.
	Net *virtio.NetSpec
	// Disks give some of the snapshot's disks other images, by device
	// ID (RootDevice, or an ID of Options.Devices): a copy of the
	// original, say, so that the restored sandbox's writes do not reach
	// it. Each must have the size the snapshot's disk had. A disk not
	// named here reopens the image the snapshot's manifest names, once
	// the manifest is authenticated by SnapshotKey: a snapshot this
	// host saved. (snapshot.Load itself never opens a disk path a
	// snapshot records: each is named to it.)
	Disks map[string]string
	// RootDir, for a snapshot whose root was a host directory
	// (Options.RootDir), is the directory to serve, required (as disks
	// are, it is never taken from the snapshot): the caller vouches that
	// it holds the same tree (the same image's rootfs, mounted again).
	RootDir string
	// Timeout bounds the wait for the agent; 0 means 5 minutes (restored
	// clones started together share the CPUs).
	Timeout time.Duration
	// Process, when set, runs the restored VM in a VMM process of its
	// own (as Options.Process).
	Process *ProcessOptions
	Logger  *slog.Logger
	// SnapshotKey is the host key the snapshot must be authenticated by
	// (it was saved with: Options.SnapshotKey), and the restored
	// sandbox's snapshots will be; nil: the key of SnapshotKeyFile. A
	// snapshot it does not authenticate is refused before any of its
	// files but the manifest is read, and before any disk is opened.
	SnapshotKey []byte
	// SnapshotCache, when set, keeps the checked, sealed copy of the
	// snapshot's memory (snapshot.Cache) for the next restore of the
	// same snapshot in this process: its clones copy it once and share
	// its pages. Without it each restore reads and copies the memory.
	SnapshotCache *snapshot.Cache

	// Images is where an image-rooted snapshot's image is now, when its
	// images folder moved; empty: where it was. Image, when set, names
	// the image to restore against (by name or digest): it must be the
	// snapshot's own (the same manifest digest), since the guest's view
	// of its root (open files, cached pages) is of that image: another
	// is refused.
	Images, Image string
	// ImageRoots shares image trees, as Options.ImageRoots.
	ImageRoots *image.Roots
}

// Restore starts a sandbox from the snapshot in dir (written by Save) and
// waits until its agent answers. The machine and its devices come from
// the snapshot; the sandbox gets a vsock socket of its own, opts.Net and
// opts.Disks. Memory comes back copy-on-write from the snapshot's memory
// file, so many sandboxes restored from one snapshot share the pages none
// of them wrote. The guest then gets fresh entropy (its RNG would
// otherwise repeat every clone's) and the host's time.
func Restore(ctx context.Context, dir string, opts RestoreOptions) (*Sandbox, error) {
	start := time.Now()
	log := opts.Logger
	if log == nil {
		log = slog.Default()
	}
	if opts.Hostname != "" {
		if err := CheckHostname(opts.Hostname); err != nil {
			return nil, err
		}
	}
	key, err := snapshotKey(opts.SnapshotKey)
	if err != nil {
		return nil, err
	}
	info, err := snapshot.Info(dir, snapshot.WithKey(key))
	if err != nil {
		return nil, fmt.Errorf("sandbox: %w", err)
	}
	hostname, ok := info.Labels[LabelHostname]
	if !ok {
		return nil, fmt.Errorf("sandbox: snapshot %s is not a sandbox's (no %s label)", dir, LabelHostname)
	}
	if err := CheckHostname(hostname); err != nil {
		return nil, fmt.Errorf("sandbox: snapshot %s: %w", dir, err)
	}
	return restore(ctx, restoreSource{
		what: "snapshot " + dir, hostname: hostname, devices: info.Devices, modules: info.Labels[LabelModules],
		machine: func(s *Sandbox, cfg vmm.RestoreConfig) (machine, error) {
			s.snapKey = key
			return s.restoreMachine(ctx, dir, cfg, opts.Process, key, opts.SnapshotCache)
		},
		namedDisks: true,
	}, opts, log, start)
}

// restoreSource is what a sandbox is restored from: a snapshot (Restore)
// or a frozen base (RestoreFrozen).
type restoreSource struct {
	what     string              // "snapshot DIR", for messages
	hostname string              // the guest's host name in it
	devices  []virtio.DeviceSpec // the devices it has
	modules  string              // its modules disk's kernel release, when known
	// machine builds the restored machine of s from cfg.
	machine func(s *Sandbox, cfg vmm.RestoreConfig) (machine, error)
	// namedDisks: every disk must be named to the machine (a snapshot's
	// Load opens no disk path it records): those opts.Disks does not
	// name get the path of their spec in devices.
	namedDisks bool
}

// restore is Restore's and RestoreFrozen's common part: it makes a
// sandbox of src with opts, starts its VM, waits until its agent answers
// and makes its guest unique (freshen).
func restore(ctx context.Context, src restoreSource, opts RestoreOptions, log *slog.Logger, start time.Time) (_ *Sandbox, err error) {
	if i := slices.IndexFunc(src.devices, func(d virtio.DeviceSpec) bool { return d.ID == VsockDevice }); i < 0 || src.devices[i].Kind != virtio.KindVsock {
		return nil, fmt.Errorf("sandbox: %s is not a sandbox's (no %q vsock device)", src.what, VsockDevice)
	}
	s, err := newSandbox(log, opts.Dir, src.hostname, start)
	if err != nil {
		return nil, err
	}
	s.snapKey = opts.SnapshotKey // its snapshots' (RestoreFrozen's too)
	defer func() {
		if err != nil {
			s.Close(context.Background())
		}
	}()
	oldMAC := specMAC(src.devices)
	if err := checkNewNIC(src.what, oldMAC != "", opts.Net != nil, "RestoreOptions.Net"); err != nil {
		return nil, err
	}
	overrides, err := s.overrides(src.devices, opts.Net, func(id string) (string, bool) {
		if p, ok := opts.Disks[id]; ok {
			return p, ok
		}
		if src.namedDisks {
			if i := slices.IndexFunc(src.devices, func(d virtio.DeviceSpec) bool { return d.ID == id }); i >= 0 && src.devices[i].Block != nil {
				return src.devices[i].Block.Path, true
			}
		}
		return "", false
	})
	if err != nil {
		return nil, err
	}
	for id := range opts.Disks {
		i := slices.IndexFunc(src.devices, func(d virtio.DeviceSpec) bool { return d.ID == id && d.Kind == virtio.KindBlock })
		if i < 0 {
			return nil, fmt.Errorf("sandbox: RestoreOptions.Disks names %q, which is not a disk of %s", id, src.what)
		}
		if src.devices[i].Block.EmptySlot() {
			return nil, fmt.Errorf("sandbox: RestoreOptions.Disks names %q, an empty volume slot in %s: it restores empty (AttachVolume fills it after)", id, src.what)
		}
	}
	if s.modules, err = checkModulesDisk(src, opts.Disks); err != nil {
		return nil, err
	}
	s.disks = blockPaths(blockPaths(nil, src.devices), overrides)
	cfg := vmm.RestoreConfig{Devices: overrides, Console: s.consoleWriter(opts.Console), Logger: log}
	if err := s.restoreImage(src.what, src.devices, opts, &cfg); err != nil {
		return nil, err
	}
	s.mark(PhasePrepare)
	if s.m, err = src.machine(s, cfg); err != nil {
		return nil, err
	}
	s.mark(PhaseRestore)
	s.run()
	timeout := opts.Timeout
	if timeout <= 0 {
		timeout = 5 * time.Minute
	}
	if err := s.connect(ctx, timeout); err != nil {
		return nil, err
	}
	s.mark(PhaseAgent)
	if err := s.freshen(ctx, opts.Hostname, oldMAC); err != nil {
		return nil, err
	}
	s.mark(PhaseFreshen)
	return s, nil
}

// checkModulesDisk checks the modules disk src's sandbox had, if any, as
// it will reopen: the disk disks names for ModulesDevice, else the one at
// the path its spec saved. It must still be a complete modules disk, of
// the kernel release src recorded (its guest runs that kernel): a disk
// of another kernel is refused. It returns the disk's release.
func checkModulesDisk(src restoreSource, disks map[string]string) (string, error) {
	i := slices.IndexFunc(src.devices, func(d virtio.DeviceSpec) bool { return d.ID == ModulesDevice && d.Kind == virtio.KindBlock })
	if i < 0 || src.devices[i].Block == nil {
		return "", nil
	}
	path := src.devices[i].Block.Path
	if p, ok := disks[ModulesDevice]; ok {
		path = p
	}
	rel, err := guestkernel.ReadModulesDisk(path)
	if err != nil {
		want := src.modules
		if want == "" {
			want = "its kernel"
		}
		return "", fmt.Errorf("sandbox: %s: its modules disk (of %s) cannot be reopened: %w (a runtime of that kernel, NewRuntime, builds it again)", src.what, want, err)
	}
	if src.modules != "" && rel != src.modules {
		return "", fmt.Errorf("sandbox: %s runs kernel %s; the modules disk %s is kernel %s's: it restores only with its own kernel's modules", src.what, src.modules, path, rel)
	}
	return rel, nil
}

// specMAC returns the MAC address of the network card among specs, or "".
func specMAC(specs []virtio.DeviceSpec) string {
	for _, d := range specs {
		if d.ID == NetDevice && d.Net != nil {
			return d.Net.MAC
		}
	}
	return ""
}

// overrides returns what a restored or forked sandbox s changes of the
// devices it comes from (specs): its own vsock socket, nic as its network
// card, and the disks that disk names another image for.
func (s *Sandbox) overrides(specs []virtio.DeviceSpec, nic *virtio.NetSpec, disk func(id string) (string, bool)) ([]virtio.DeviceSpec, error) {
	out := []virtio.DeviceSpec{s.vsockSpec()}
	if nic != nil {
		n, err := netSpec(nic)
		if err != nil {
			return nil, err
		}
		out = append(out, n)
	}
	for _, d := range specs {
		if d.Kind != virtio.KindBlock || d.Block.EmptySlot() {
			continue // an empty volume slot has no image to name
		}
		p, ok := disk(d.ID)
		if !ok {
			continue
		}
		if p == "" {
			return nil, fmt.Errorf("sandbox: no image path for disk %q", d.ID)
		}
		b := *d.Block
		b.Path, b.FD = p, 0
		out = append(out, virtio.DeviceSpec{ID: d.ID, Kind: virtio.KindBlock, Block: &b})
	}
	return out, nil
}

// freshen makes a restored guest unique: new entropy for its RNG, the
// host's time, a new host name when asked, and its network card's new
// address where the snapshot's card had oldMAC.
func (s *Sandbox) freshen(ctx context.Context, hostname, oldMAC string) error {
	seed := make([]byte, 64)
	if _, err := rand.Read(seed); err != nil {
		return fmt.Errorf("sandbox: entropy for the guest: %w", err)
	}
	if _, err := s.client.Reseed(ctx, seed); err != nil {
		return fmt.Errorf("sandbox: reseed the guest's RNG: %w", err)
	}
	if err := s.client.SetClock(ctx, time.Now()); err != nil {
		return fmt.Errorf("sandbox: set the guest's clock: %w", err)
	}
	if hostname != "" && hostname != s.hostname {
		if err := checkCmdlineWord("hostname", hostname); err != nil {
			return err
		}
		// An agent older than SetHostname (a snapshot it made) is
		// renamed by hostname(1), a fork and exec in the guest.
		if err := s.client.SetHostname(ctx, hostname); status.Code(err) == codes.Unimplemented {
			if st, err := s.client.Exec(ctx, execHostname(hostname)); err != nil || !st.Success() {
				return fmt.Errorf("sandbox: set the host name to %s: %v %v", hostname, st, err)
			}
		} else if err != nil {
			return fmt.Errorf("sandbox: set the host name to %s: %w", hostname, err)
		}
		s.hostname = hostname
	}
	if mac := s.MAC(); mac != nil && oldMAC != "" && oldMAC != mac.String() {
		if st, err := s.client.Exec(ctx, execSetMAC(oldMAC, mac.String())); err != nil || !st.Success() {
			return fmt.Errorf("sandbox: give the guest's interface its new MAC address %s: %v %v", mac, st, err)
		}
	}
	return nil
}

// checkNewNIC checks that a restored or forked sandbox gets a network card
// of its own (given by field) exactly when what it comes from (what) has
// one.
func checkNewNIC(what string, had, given bool, field string) error {
	switch {
	case had && !given:
		return fmt.Errorf("sandbox: %s has a network card: %s must give each new sandbox a tap of its own", what, field)
	case !had && given:
		return fmt.Errorf("sandbox: %s has no network card for %s", what, field)
	}
	return nil
}

// execSetMAC is the command that moves the guest interface with address
// oldMAC to newMAC (busybox or iproute2 ip; virtio-net takes a new address
// while up).
func execSetMAC(oldMAC, newMAC string) client.ExecOptions {
	const script = `for d in /sys/class/net/*; do
  if [ "$(cat "$d/address")" = "$1" ]; then exec ip link set dev "${d##*/}" address "$2"; fi
done
echo "no interface has address $1" >&2; exit 1`
	return client.ExecOptions{Argv: []string{"sh", "-c", script, "setmac", oldMAC, newMAC}}
}

// restoreImage sets cfg up for the image root of what is restored (what:
// "snapshot DIR", with the devices devs), if it has one: the opener of its
// tree, and the device moved to opts.Images. It refuses opts.Image when
// that is another image than the snapshot's.
func (s *Sandbox) restoreImage(what string, devs []virtio.DeviceSpec, opts RestoreOptions, cfg *vmm.RestoreConfig) error {
	i := slices.IndexFunc(devs, func(d virtio.DeviceSpec) bool { return d.Kind == virtio.KindFS })
	if i < 0 {
		if opts.RootDir != "" {
			return fmt.Errorf("sandbox: %s has no root directory: RestoreOptions.RootDir does not apply", what)
		}
		if opts.Image != "" || opts.Images != "" {
			return fmt.Errorf("sandbox: %s has no image root: RestoreOptions.Image and Images do not apply", what)
		}
		return nil
	}
	dev := devs[i]
	fs := *dev.FS
	if fs.Dir != "" {
		if opts.Image != "" || opts.Images != "" {
			return fmt.Errorf("sandbox: %s's root is the host directory %s: RestoreOptions.Image and Images do not apply", what, fs.Dir)
		}
		// As a disk is, the directory is named by the caller, never
		// taken from the snapshot.
		if opts.RootDir == "" {
			return fmt.Errorf("sandbox: %s's root is a host directory: RestoreOptions.RootDir must name the directory to serve", what)
		}
		abs, err := filepath.Abs(opts.RootDir)
		if err != nil {
			return fmt.Errorf("sandbox: root directory: %w", err)
		}
		cfg.Devices = append(cfg.Devices, virtio.DeviceSpec{ID: dev.ID, Kind: virtio.KindFS, FS: &virtio.FSSpec{Tag: fs.Tag, Dir: abs}})
		cfg.OpenFS = s.keepTrees(vmmproc.OpenImageFS(nil))
		s.openFS = cfg.OpenFS
		return nil
	}
	roots := opts.ImageRoots
	if roots == nil {
		roots = image.NewRoots(image.Options{Logger: s.log})
	}
	moved := false
	if opts.Images != "" {
		abs, err := filepath.Abs(opts.Images)
		if err != nil {
			return fmt.Errorf("sandbox: images folder: %w", err)
		}
		moved, fs.Images = abs != fs.Images, abs
	}
	if opts.Image != "" {
		im, err := roots.Images(fs.Images)
		if err != nil {
			return fmt.Errorf("sandbox: %w", err)
		}
		img, err := im.Get(opts.Image)
		if err != nil {
			return fmt.Errorf("sandbox: %w", err)
		}
		if string(img.Manifest) != fs.Image {
			return fmt.Errorf("sandbox: %s runs image %s; %s is %s: it restores only against its own image", what, fs.Image, opts.Image, img.Manifest)
		}
	}
	if moved {
		cfg.Devices = append(cfg.Devices, virtio.DeviceSpec{ID: dev.ID, Kind: virtio.KindFS, FS: &fs})
	}
	cfg.OpenFS = vmmproc.OpenImageFS(roots)
	s.image, s.openFS = fs.Image, cfg.OpenFS
	s.imageFS, s.roots = &fs, roots
	return nil
}
