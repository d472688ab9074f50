// Package daemontest is a test double of daemon.Backend for the tests of
// the daemon, of kilnd and of the daemon's client: a "sandbox" is a host
// folder (its root, where the file calls go: package filetree's, the
// guest agent's own, its symlinks resolved in the root), a host
// process standing for its VMM process (sleep, which a test may kill -9),
// and its execs are host processes (os/exec). What a VMM process keeps in
// its memory (the values of Keep, the detached execs) this test process
// keeps, by sandbox folder, so that it outlives a server and its Backend
// as a VMM process does. Nothing is isolated: it is for tests only, never
// for kilnd itself.
package daemontest

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/daemon"
)

// Backend is the test double. The zero value accepts every image.
type Backend struct {
	// Images, when set, are the only images; another fails with
	// NotFound. A sandbox's root starts empty.
	Images []string
	// CreateHook, when set, is called before a sandbox starts; its error
	// fails the start.
	CreateHook func(ctx context.Context, spec daemon.CreateSpec) error
	// SaveHook, when set, is called before an instance saves into dir
	// (its sandbox folder is inDir); its error fails the save.
	SaveHook func(ctx context.Context, inDir, dir string) error

	mu   sync.Mutex
	live map[*Instance]bool
	// standIns are the stand-in VMM processes this backend started or
	// attached (KillAll).
	standIns map[int]bool
}

var _ daemon.Backend = (*Backend)(nil)

// The files of a sandbox folder: its root, its stand-in's PID, its meta
// and the folders of its holds.
const (
	rootDir  = "root"
	pidFile  = "vmm.pid"
	metaFile = "meta.json"
	holdsDir = "holds"
)

// standInArgs is the stand-in VMM process's command line.
var standInArgs = []string{"sleep", "1000000"}

// meta is what a sandbox folder and a checkpoint record.
type meta struct {
	Image    string `json:"image,omitempty"`
	Hostname string `json:"hostname,omitempty"`
	// Refreshes counts the Refresh calls since the sandbox started.
	Refreshes int `json:"refreshes,omitempty"`
	// Net is the sandbox's network card (CreateSpec.Host.Net): a
	// checkpoint of a sandbox with one restores only with one, as package
	// sandbox's do. Network is what the guest's card was last configured
	// with (a checkpoint keeps it, as a guest's memory does).
	Net     *daemon.NetSpec       `json:"net,omitempty"`
	Network *daemon.NetworkConfig `json:"network,omitempty"`
	// CPUs and MemoryMiB are the machine's (CreateSpec's, or its
	// checkpoint's when the spec gives none), which Info reports.
	CPUs      int `json:"cpus,omitempty"`
	MemoryMiB int `json:"memory_mib,omitempty"`
	// Volumes are the sandbox's volumes (AttachVolume), which a
	// checkpoint keeps in their slots as a guest's mounts are.
	Volumes []daemon.VolumeAttach `json:"volumes,omitempty"`
}

// vmm is what a sandbox's VMM process keeps in its memory.
type vmm struct {
	mu       sync.Mutex
	kept     map[string][]byte
	detached map[string]*proc // by ID
}

// vmms are the sandboxes' vmm, by folder: this process's, as VMM
// processes outlive any one server; gone with the stand-in.
var vmms sync.Map

func vmmOf(dir string) *vmm {
	v, _ := vmms.LoadOrStore(dir, &vmm{kept: map[string][]byte{}, detached: map[string]*proc{}})
	return v.(*vmm)
}

// Create implements daemon.Backend: a root folder (empty, or the
// checkpoint's root) and a stand-in VMM process.
func (b *Backend) Create(ctx context.Context, spec daemon.CreateSpec) (daemon.Instance, error) {
	if b.CreateHook != nil {
		if err := b.CreateHook(ctx, spec); err != nil {
			return nil, err
		}
	}
	root := filepath.Join(spec.Dir, rootDir)
	var m meta
	if f, ok := spec.Frozen.(*Frozen); ok {
		f.mu.Lock()
		spec.Checkpoint = f.dir // "" once closed
		f.mu.Unlock()
	}
	switch {
	case spec.Checkpoint != "":
		if err := readJSON(filepath.Join(spec.Checkpoint, metaFile), &m); err != nil {
			return nil, err
		}
		if err := copyTree(filepath.Join(spec.Checkpoint, rootDir), root); err != nil {
			return nil, err
		}
	case spec.Image == "" || spec.Frozen != nil:
		return nil, errors.New("daemontest: no image and no checkpoint (or a closed one)")
	case b.Images != nil && !slices.Contains(b.Images, spec.Image):
		return nil, status.Errorf(codes.NotFound, "daemontest: no image %q", spec.Image)
	default:
		m.Image = fmt.Sprintf("sha256:%064x", len(spec.Image))
		if err := os.Mkdir(root, 0o755); err != nil {
			return nil, fmt.Errorf("daemontest: %w", err)
		}
	}
	m.Hostname, m.Refreshes = spec.Hostname, 0
	m.CPUs, m.MemoryMiB = orDefault(spec.CPUs, m.CPUs), orDefault(spec.MemoryMiB, m.MemoryMiB)
	if err := checkNIC(spec, m.Net != nil); err != nil {
		return nil, err
	}
	m.Net = spec.Host.Net
	attach, err := restoreVolumes(&m, spec.Volumes)
	if err != nil {
		return nil, err
	}
	for _, v := range attach {
		if err := mountVolume(root, v); err != nil {
			return nil, err
		}
	}
	m.Volumes = append(m.Volumes, attach...)
	if err := writeJSON(filepath.Join(spec.Dir, metaFile), m); err != nil {
		return nil, err
	}
	cmd := exec.Command(standInArgs[0], standInArgs[1:]...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("daemontest: start the stand-in VMM process: %w", err)
	}
	pid := cmd.Process.Pid
	err = os.WriteFile(filepath.Join(spec.Dir, pidFile), []byte(strconv.Itoa(pid)), 0o600)
	var in *Instance
	if err == nil {
		in, err = b.newInstance(spec.Dir, pid, m)
	}
	if err != nil {
		cmd.Process.Kill()
		cmd.Wait()
		return nil, fmt.Errorf("daemontest: %w", err)
	}
	go func() { in.stopped(fmt.Sprintf("VMM process %d died: %v", pid, cmd.Wait())) }()
	return in, nil
}

// orDefault is v, or def when v is not positive.
func orDefault(v, def int) int {
	if v > 0 {
		return v
	}
	return def
}

// checkNIC checks spec's network card as a VMM would: a restore has one
// exactly when its checkpoint had one (had), and its tap's network
// namespace exists.
func checkNIC(spec daemon.CreateSpec, had bool) error {
	n := spec.Host.Net
	switch {
	case spec.Checkpoint != "" && had != (n != nil):
		return fmt.Errorf("daemontest: checkpoint %s: it had a network card: %v, the restore has one: %v", spec.Checkpoint, had, n != nil)
	case n == nil:
		return nil
	case n.Tap == "" || n.MAC == "":
		return fmt.Errorf("daemontest: network card %+v: no tap or MAC", *n)
	}
	if _, err := os.Stat(n.Netns); n.Netns != "" && err != nil {
		return fmt.Errorf("daemontest: open tap %s: network namespace: %w", n.Tap, err)
	}
	return nil
}

// Attach implements daemon.Backend: the stand-in VMM process must still
// run.
func (b *Backend) Attach(ctx context.Context, dir string, paused bool) (daemon.Instance, error) {
	pb, err := os.ReadFile(filepath.Join(dir, pidFile))
	if err != nil {
		return nil, fmt.Errorf("daemontest: attach %s: %w", dir, err)
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(string(pb)))
	if !alive(pid) {
		return nil, fmt.Errorf("daemontest: attach %s: VMM process %d is gone", dir, pid)
	}
	var m meta
	readJSON(filepath.Join(dir, metaFile), &m)
	in, err := b.newInstance(dir, pid, m)
	if err != nil {
		return nil, fmt.Errorf("daemontest: attach %s: %w", dir, err)
	}
	go func() {
		for alive(pid) {
			select {
			case <-in.done:
				return
			case <-time.After(10 * time.Millisecond):
			}
		}
		in.stopped(fmt.Sprintf("VMM process %d is gone", pid))
	}()
	return in, nil
}

func (b *Backend) newInstance(dir string, pid int, m meta) (*Instance, error) {
	if _, err := os.Stat(filepath.Join(dir, rootDir)); err != nil {
		return nil, err
	}
	in := &Instance{b: b, dir: dir, pid: pid, meta: m, done: make(chan struct{}), procs: map[*proc]bool{}}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.live == nil {
		b.live, b.standIns = map[*Instance]bool{}, map[int]bool{}
	}
	b.live[in], b.standIns[pid] = true, true
	return in, nil
}

// Live returns how many sandboxes of this backend are running and not
// closed (detached ones count).
func (b *Backend) Live() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.live)
}

// ByPID returns the live sandbox whose stand-in VMM process is pid, or
// nil.
func (b *Backend) ByPID(pid int) *Instance {
	b.mu.Lock()
	defer b.mu.Unlock()
	for in := range b.live {
		if in.pid == pid {
			return in
		}
	}
	return nil
}

// KillAll kills every stand-in VMM process this backend started or
// attached that still runs. kilnd leaves its sandboxes running when it
// stops (a restart attaches to them), so a test's cleanup calls this, or
// the stand-ins outlive the test binary. A PID whose process is no longer
// a stand-in (gone, and its number reused) is left alone.
func (b *Backend) KillAll() {
	b.mu.Lock()
	defer b.mu.Unlock()
	want := strings.Join(standInArgs, "\x00") + "\x00"
	for pid := range b.standIns {
		if cmd, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid)); err == nil && string(cmd) == want && alive(pid) {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

// alive says process pid runs (and is not a zombie).
func alive(pid int) bool {
	st, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if syscall.Kill(pid, 0) != nil || err != nil {
		return false
	}
	i := bytes.LastIndexByte(st, ')')
	return i < 0 || i+2 >= len(st) || st[i+2] != 'Z' && st[i+2] != 'X'
}

// Instance is a sandbox of the test double.
type Instance struct {
	b    *Backend
	dir  string
	pid  int
	meta meta // under mu

	mu       sync.Mutex
	done     chan struct{}
	exited   string
	poweroff bool // the guest powered itself off (PowerOffGuest)
	closed   bool
	procs    map[*proc]bool // killed when the sandbox ends
	freezes  int            // FreezeVolumes calls
}

var _ daemon.Instance = (*Instance)(nil)

func (in *Instance) Dir() string           { return in.dir }
func (in *Instance) PID() int              { return in.pid }
func (in *Instance) Done() <-chan struct{} { return in.done }

// Image implements daemon.Instance.
func (in *Instance) Image() string {
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.meta.Image
}

// Exited implements daemon.Instance.
func (in *Instance) Exited() string {
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.exited
}

// PoweredOff implements daemon.Instance.
func (in *Instance) PoweredOff() bool {
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.poweroff && in.exited != ""
}

// PowerOffGuest plays the guest powering itself off: the stand-in VMM
// process ends, as a real one does at the guest's ACPI S5.
func (in *Instance) PowerOffGuest() {
	in.mu.Lock()
	defer in.mu.Unlock()
	if !in.ended() {
		in.poweroff = true
		in.exited = "power-off: guest powered off (ACPI S5)"
		syscall.Kill(in.pid, syscall.SIGKILL)
	}
}

// ended says the sandbox has stopped.
func (in *Instance) ended() bool {
	select {
	case <-in.done:
		return true
	default:
		return false
	}
}

// rootPath is the host folder of the sandbox's root.
func (in *Instance) rootPath() string { return filepath.Join(in.dir, rootDir) }

func (in *Instance) stopped(why string) {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.ended() {
		return
	}
	if in.exited == "" {
		in.exited = why
	}
	vmms.Delete(in.dir) // before Close returns: a new sandbox may get the folder
	close(in.done)
	for p := range in.procs {
		p.kill()
	}
	in.b.mu.Lock()
	delete(in.b.live, in)
	in.b.mu.Unlock()
}

// Keep implements daemon.Instance: in this process's memory, bounded as
// a VMM process's.
func (in *Instance) Keep(ctx context.Context, key string, value []byte) error {
	if len(value) > daemon.MaxKeepValue {
		return fmt.Errorf("daemontest: keep %q: %d bytes: at most %d", key, len(value), daemon.MaxKeepValue)
	}
	if in.ended() {
		return errors.New("daemontest: keep: the sandbox has stopped")
	}
	v := vmmOf(in.dir)
	v.mu.Lock()
	defer v.mu.Unlock()
	if len(value) == 0 {
		delete(v.kept, key)
	} else {
		v.kept[key] = bytes.Clone(value)
	}
	return nil
}

// Kept returns what the sandbox in folder dir keeps under key, for
// tests; nil when nothing (as once it has ended).
func (b *Backend) Kept(dir, key string) []byte {
	v, ok := vmms.Load(dir)
	if !ok {
		return nil
	}
	v.(*vmm).mu.Lock()
	defer v.(*vmm).mu.Unlock()
	return bytes.Clone(v.(*vmm).kept[key])
}

// Kept implements daemon.Instance.
func (in *Instance) Kept(ctx context.Context, key string) ([]byte, error) {
	v := vmmOf(in.dir)
	v.mu.Lock()
	defer v.mu.Unlock()
	if val, ok := v.kept[key]; ok {
		return bytes.Clone(val), nil
	}
	return nil, fmt.Errorf("daemontest: kept %q: %w", key, daemon.ErrNotKept)
}

// Refresh records the new host name and counts the call (meta.json).
func (in *Instance) Refresh(ctx context.Context, hostname string) error {
	return in.setMeta(func(m *meta) error {
		m.Hostname = hostname
		m.Refreshes++
		return nil
	})
}

// ConfigureNetwork records cfg as the guest's network; the sandbox must
// have a card, and cfg its MAC.
func (in *Instance) ConfigureNetwork(ctx context.Context, cfg daemon.NetworkConfig) error {
	return in.setMeta(func(m *meta) error {
		switch {
		case m.Net == nil:
			return status.Error(codes.FailedPrecondition, "daemontest: the sandbox has no network card")
		case cfg.MAC != m.Net.MAC:
			return status.Errorf(codes.InvalidArgument, "daemontest: MAC %s: the card's is %s", cfg.MAC, m.Net.MAC)
		case len(cfg.Addresses) == 0:
			return status.Error(codes.InvalidArgument, "daemontest: no address")
		}
		cfg.Addresses = slices.Clone(cfg.Addresses)
		cfg.Nameservers = append([]netip.Addr(nil), cfg.Nameservers...)
		m.Network = &cfg
		return nil
	})
}

// setMeta changes the sandbox's meta with f and writes it.
func (in *Instance) setMeta(f func(*meta) error) error {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.closed {
		return errors.New("daemontest: the sandbox is closed")
	}
	m := in.meta
	if err := f(&m); err != nil {
		return err
	}
	in.meta = m
	return writeJSON(filepath.Join(in.dir, metaFile), m)
}

// Network returns the sandbox's network card and what its guest was last
// configured with (nil when never: a restore keeps its checkpoint's).
func (in *Instance) Network() (*daemon.NetSpec, *daemon.NetworkConfig) {
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.meta.Net, in.meta.Network
}

// Pause stops the stand-in VMM process (SIGSTOP); Resume continues it.
func (in *Instance) Pause(ctx context.Context) error  { return in.signal(syscall.SIGSTOP) }
func (in *Instance) Resume(ctx context.Context) error { return in.signal(syscall.SIGCONT) }

// DialPort connects to port on the host's loopback, where the double's
// execs (host processes) listen; a refused connection is
// daemon.ErrPortRefused.
func (in *Instance) DialPort(ctx context.Context, port int) (net.Conn, error) {
	if in.ended() {
		return nil, fmt.Errorf("daemontest: sandbox %s: %w", in.dir, daemon.ErrMachineExited)
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp4", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
	if errors.Is(err, syscall.ECONNREFUSED) {
		return nil, fmt.Errorf("daemontest: port %d: %w", port, daemon.ErrPortRefused)
	}
	return c, err
}

func (in *Instance) signal(sig syscall.Signal) error {
	if err := syscall.Kill(in.pid, sig); err != nil {
		return fmt.Errorf("daemontest: signal VMM process %d: %w", in.pid, err)
	}
	return nil
}

// Info reports the machine's memory (MemoryMiB; 512 when unknown) with
// the root's files counted as used, as a guest's tmpfs upper layer is,
// and the root as its disk: DiskUsed the size of its files, DiskTotal
// the host file system's size under it.
func (in *Instance) Info(ctx context.Context) (daemon.GuestInfo, error) {
	in.mu.Lock()
	m, closed := in.meta, in.closed || in.ended()
	in.mu.Unlock()
	if closed {
		return daemon.GuestInfo{}, status.Error(codes.Unavailable, "daemontest: info: the sandbox has stopped")
	}
	var used uint64
	filepath.WalkDir(in.rootPath(), func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil // removed meanwhile
		}
		if fi, err := d.Info(); err == nil && fi.Mode().IsRegular() {
			used += uint64(fi.Size())
		}
		return nil
	})
	var st syscall.Statfs_t
	if err := syscall.Statfs(in.rootPath(), &st); err != nil {
		return daemon.GuestInfo{}, fmt.Errorf("daemontest: info: %w", err)
	}
	mem := uint64(orDefault(m.MemoryMiB, 512)) << 20
	return daemon.GuestInfo{Hostname: m.Hostname, MemTotal: mem, MemAvailable: mem - min(used, mem), NumCPU: max(m.CPUs, 1),
		DiskTotal: st.Blocks * uint64(st.Bsize), DiskUsed: used}, nil
}

// Close kills the execs and the stand-in VMM process, and removes the
// folder.
func (in *Instance) Close(ctx context.Context) error {
	in.mu.Lock()
	closed := in.closed
	in.closed = true
	in.mu.Unlock()
	if closed {
		return nil
	}
	syscall.Kill(in.pid, syscall.SIGKILL)
	select {
	case <-in.done:
	case <-ctx.Done():
		return fmt.Errorf("daemontest: close: %w", ctx.Err())
	}
	if err := in.unmountVolumes(); err != nil {
		return fmt.Errorf("daemontest: close: %w", err)
	}
	if err := os.RemoveAll(in.dir); err != nil {
		return fmt.Errorf("daemontest: close: %w", err)
	}
	return nil
}

// Detach leaves the sandbox running for a later Attach: nothing to do.
func (in *Instance) Detach() {}

// writeJSON writes v to path whole or not at all.
func writeJSON(path string, v any) error {
	b, _ := json.Marshal(v)
	tmp := path + ".tmp-" + randHex()
	err := os.WriteFile(tmp, b, 0o600)
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("daemontest: %w", err)
	}
	return nil
}

func readJSON(path string, v any) error {
	b, err := os.ReadFile(path)
	if err == nil {
		err = json.Unmarshal(b, v)
	}
	if err != nil {
		return fmt.Errorf("daemontest: %w", err)
	}
	return nil
}
