// Package daemontest is a test double of daemon.Backend for the tests of
// the daemon, of kilnd and of the daemon's client: a "sandbox" is a host
// folder (its root, where the file calls go, through os.Root), a host
// process standing for its VMM process (sleep, which a test may kill -9),
// and its execs are host processes (os/exec). A detached exec
// (daemon.ExecOptions.DetachID) is recorded in the sandbox folder, so
// that a later server's Attach finds it. Nothing is isolated: it is for
// tests only, never for kilnd itself.
package daemontest

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/netip"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/accounts"
	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/vmmproc"
)

// errHoldExists: a hold under that ID exists already (as a VMM process's).
var errHoldExists = errors.New("a hold under that ID exists already")

// RootEnv names the environment variable through which an exec learns
// its sandbox's root folder on the host (the double runs commands on the
// host, not inside the root).
const RootEnv = "KILN_TEST_ROOT"

// The files of a sandbox folder.
const (
	rootDir     = "root"
	pidFile     = "vmm.pid"
	metaFile    = "meta.json"
	detachedDir = "detached" // ID.json per detached exec
)

// Backend is the test double. The zero value accepts every image with an
// empty root.
type Backend struct {
	// Images, when set, are the only images: reference → host folder
	// copied as the root. Another reference fails with NotFound.
	Images map[string]string
	// CreateHook, when set, is called before a sandbox starts; its error
	// fails the start.
	CreateHook func(ctx context.Context, spec daemon.CreateSpec) error
	// SaveHook, when set, is called before an instance saves into dir
	// (its sandbox folder is inDir); its error fails the save.
	SaveHook func(ctx context.Context, inDir, dir string) error

	mu   sync.Mutex
	live map[*Instance]struct{}
	// standIns are the PIDs of the stand-in VMM processes this backend
	// started or attached (KillAll).
	standIns map[int]bool
	// detached are the detached execs this process started, by sandbox
	// folder and ID: an Instance of a later Attach waits for them.
	detached map[string]*proc
	// kept are the values the sandboxes keep (Instance.Keep), by
	// sandbox folder: in this process's memory, as a VMM process keeps
	// them, so that they outlive a server over this backend; gone with
	// the stand-in VMM process.
	kept map[string]map[string][]byte
}

var _ daemon.Backend = (*Backend)(nil)

func (b *Backend) detachedProc(key string) *proc {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.detached[key]
}

// forgetDetachedOf forgets the detached execs of the sandbox folder dir.
func (b *Backend) forgetDetachedOf(dir string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	prefix := filepath.Join(dir, detachedDir) + string(filepath.Separator)
	for k := range b.detached {
		if strings.HasPrefix(k, prefix) {
			delete(b.detached, k)
		}
	}
}

func (b *Backend) setDetachedProc(key string, p *proc) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.detached == nil {
		b.detached = map[string]*proc{}
	}
	if p == nil {
		delete(b.detached, key)
	} else {
		b.detached[key] = p
	}
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

func (b *Backend) track(in *Instance, on bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.live == nil {
		b.live = map[*Instance]struct{}{}
	}
	if on {
		b.live[in] = struct{}{}
	} else {
		delete(b.live, in)
	}
}

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
}

// Create implements daemon.Backend: a root folder (from the image's
// folder or the checkpoint's root) and a stand-in VMM process.
func (b *Backend) Create(ctx context.Context, spec daemon.CreateSpec) (daemon.Instance, error) {
	if b.CreateHook != nil {
		if err := b.CreateHook(ctx, spec); err != nil {
			return nil, err
		}
	}
	root := filepath.Join(spec.Dir, rootDir)
	var m meta
	if spec.Frozen != nil {
		f, ok := spec.Frozen.(*Frozen)
		if !ok {
			return nil, fmt.Errorf("daemontest: %T is not this backend's in-memory checkpoint", spec.Frozen)
		}
		if f.dir == "" {
			return nil, errors.New("daemontest: the in-memory checkpoint was closed")
		}
		spec.Checkpoint = f.dir
	}
	switch {
	case spec.Checkpoint != "":
		mb, err := os.ReadFile(filepath.Join(spec.Checkpoint, metaFile))
		if err != nil {
			return nil, fmt.Errorf("daemontest: checkpoint %s: %w", spec.Checkpoint, err)
		}
		if err := json.Unmarshal(mb, &m); err != nil {
			return nil, fmt.Errorf("daemontest: checkpoint %s: %w", spec.Checkpoint, err)
		}
		if err := copyTree(filepath.Join(spec.Checkpoint, rootDir), root); err != nil {
			return nil, err
		}
	case spec.Image != "":
		m.Image = "sha256:" + fmt.Sprintf("%064x", len(spec.Image))
		if b.Images != nil {
			src, ok := b.Images[spec.Image]
			if !ok {
				return nil, status.Errorf(codes.NotFound, "daemontest: no image %q", spec.Image)
			}
			if err := copyTree(src, root); err != nil {
				return nil, err
			}
		} else if err := os.MkdirAll(root, 0o755); err != nil {
			return nil, fmt.Errorf("daemontest: %w", err)
		}
	default:
		return nil, errors.New("daemontest: no image and no checkpoint")
	}
	m.Hostname, m.Refreshes = spec.Hostname, 0
	if spec.CPUs > 0 {
		m.CPUs = spec.CPUs
	}
	if spec.MemoryMiB > 0 {
		m.MemoryMiB = spec.MemoryMiB
	}
	if err := checkNIC(spec, m.Net != nil); err != nil {
		return nil, err
	}
	m.Net = spec.Host.Net
	if err := writeMeta(spec.Dir, m); err != nil {
		return nil, err
	}
	cmd := exec.Command(standInArgs[0], standInArgs[1:]...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("daemontest: start the stand-in VMM process: %w", err)
	}
	pid := cmd.Process.Pid
	if err := os.WriteFile(filepath.Join(spec.Dir, pidFile), []byte(strconv.Itoa(pid)), 0o600); err != nil {
		cmd.Process.Kill()
		cmd.Wait()
		return nil, fmt.Errorf("daemontest: %w", err)
	}
	in, err := b.newInstance(spec.Dir, pid, m)
	if err != nil {
		cmd.Process.Kill()
		cmd.Wait()
		return nil, err
	}
	go func() {
		err := cmd.Wait()
		in.stopped(fmt.Sprintf("VMM process %d died: %v", pid, err))
	}()
	return in, nil
}

// checkNIC checks spec's network card as a VMM would: a restore has one
// exactly when its checkpoint had one (had), and its tap's network
// namespace exists.
func checkNIC(spec daemon.CreateSpec, had bool) error {
	n := spec.Host.Net
	if spec.Checkpoint != "" && had != (n != nil) {
		return fmt.Errorf("daemontest: checkpoint %s: it had a network card: %v, the restore has one: %v", spec.Checkpoint, had, n != nil)
	}
	if n == nil {
		return nil
	}
	if n.Tap == "" || n.MAC == "" {
		return fmt.Errorf("daemontest: network card %+v: no tap or MAC", *n)
	}
	if n.Netns != "" {
		if _, err := os.Stat(n.Netns); err != nil {
			return fmt.Errorf("daemontest: open tap %s: network namespace: %w", n.Tap, err)
		}
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
	pid, err := strconv.Atoi(strings.TrimSpace(string(pb)))
	if err != nil {
		return nil, fmt.Errorf("daemontest: attach %s: %s: %w", dir, pidFile, err)
	}
	if !alive(pid) {
		return nil, fmt.Errorf("daemontest: attach %s: VMM process %d is gone", dir, pid)
	}
	var m meta
	if mb, err := os.ReadFile(filepath.Join(dir, metaFile)); err == nil {
		json.Unmarshal(mb, &m)
	}
	in, err := b.newInstance(dir, pid, m)
	if err != nil {
		return nil, err
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

// standInArgs is the stand-in VMM process's command line.
var standInArgs = []string{"sleep", "1000000"}

// KillAll kills every stand-in VMM process this backend started or
// attached that still runs. kilnd leaves its sandboxes running when it
// stops (a restart attaches to them), so a test's cleanup calls this, or
// the stand-ins outlive the test binary. A PID whose process is no longer
// a stand-in (gone, and its number reused) is left alone.
func (b *Backend) KillAll() {
	b.mu.Lock()
	pids := make([]int, 0, len(b.standIns))
	for pid := range b.standIns {
		pids = append(pids, pid)
	}
	b.mu.Unlock()
	want := strings.Join(standInArgs, "\x00") + "\x00"
	for _, pid := range pids {
		cmd, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		if err == nil && string(cmd) == want && alive(pid) {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

// alive says process pid runs (and is not a zombie).
func alive(pid int) bool {
	if syscall.Kill(pid, 0) != nil {
		return false
	}
	st, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	if i := strings.LastIndexByte(string(st), ')'); i >= 0 && i+2 < len(st) {
		return st[i+2] != 'Z' && st[i+2] != 'X'
	}
	return true
}

func writeMeta(dir string, m meta) error {
	mb, _ := json.Marshal(m)
	if err := os.WriteFile(filepath.Join(dir, metaFile), mb, 0o600); err != nil {
		return fmt.Errorf("daemontest: %w", err)
	}
	return nil
}

func (b *Backend) newInstance(dir string, pid int, m meta) (*Instance, error) {
	b.mu.Lock()
	if b.standIns == nil {
		b.standIns = map[int]bool{}
	}
	b.standIns[pid] = true
	b.mu.Unlock()
	r, err := os.OpenRoot(filepath.Join(dir, rootDir))
	if err != nil {
		return nil, fmt.Errorf("daemontest: %w", err)
	}
	in := &Instance{b: b, dir: dir, pid: pid, meta: m, root: r, done: make(chan struct{}), procs: map[killer]struct{}{}}
	b.track(in, true)
	return in, nil
}

// Instance is a sandbox of the test double.
type Instance struct {
	b    *Backend
	dir  string
	pid  int
	meta meta
	root *os.Root

	mu       sync.Mutex
	done     chan struct{}
	exited   string
	poweroff bool // the guest powered itself off (PowerOffGuest)
	closed   bool
	detached bool
	procs    map[killer]struct{} // killed when the sandbox ends
}

// killer is an exec the sandbox's end kills.
type killer interface{ kill() }

var _ daemon.Instance = (*Instance)(nil)

func (in *Instance) Dir() string           { return in.dir }
func (in *Instance) PID() int              { return in.pid }
func (in *Instance) Image() string         { return in.meta.Image }
func (in *Instance) Done() <-chan struct{} { return in.done }

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
	select {
	case <-in.done:
		in.mu.Unlock()
		return
	default:
	}
	in.poweroff = true
	in.exited = "power-off: guest powered off (ACPI S5)"
	in.mu.Unlock()
	syscall.Kill(in.pid, syscall.SIGKILL)
}

// Root is the host folder of the sandbox's root.
func (in *Instance) Root() string { return filepath.Join(in.dir, rootDir) }

func (in *Instance) stopped(why string) {
	in.mu.Lock()
	defer in.mu.Unlock()
	select {
	case <-in.done:
		return
	default:
	}
	if in.exited == "" {
		in.exited = why
	}
	close(in.done)
	for p := range in.procs {
		p.kill()
	}
	in.b.track(in, false)
	in.b.forgetKept(in.dir)
}

// Keep implements daemon.Instance: in the backend's memory.
func (in *Instance) Keep(ctx context.Context, key string, value []byte) error {
	if err := vmmproc.CheckKeepKey(key); err != nil {
		return fmt.Errorf("daemontest: keep: %w", err)
	}
	if len(value) > vmmproc.MaxKeepValue {
		return fmt.Errorf("daemontest: keep %q: %d bytes: at most %d", key, len(value), vmmproc.MaxKeepValue)
	}
	select {
	case <-in.done:
		return errors.New("daemontest: keep: the sandbox has stopped")
	default:
	}
	b := in.b
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.kept == nil {
		b.kept = map[string]map[string][]byte{}
	}
	m := b.kept[in.dir]
	if m == nil {
		m = map[string][]byte{}
		b.kept[in.dir] = m
	}
	if len(value) == 0 {
		delete(m, key)
	} else {
		m[key] = bytes.Clone(value)
	}
	return nil
}

// Kept implements daemon.Instance.
func (in *Instance) Kept(ctx context.Context, key string) ([]byte, error) {
	b := in.b
	b.mu.Lock()
	defer b.mu.Unlock()
	v, ok := b.kept[in.dir][key]
	if !ok {
		return nil, fmt.Errorf("daemontest: kept %q: %w", key, daemon.ErrNotKept)
	}
	return bytes.Clone(v), nil
}

// Kept returns what the sandbox in folder dir keeps under key, for
// tests; nil when nothing.
func (b *Backend) Kept(dir, key string) []byte {
	b.mu.Lock()
	defer b.mu.Unlock()
	return bytes.Clone(b.kept[dir][key])
}

func (b *Backend) forgetKept(dir string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	delete(b.kept, dir)
}

// Start runs argv on the host, in the root (cwd mapped into it), in a
// process group of its own; ctx's end, the timeout or the sandbox's end
// kill the group.
func (in *Instance) Start(ctx context.Context, opts daemon.ExecOptions) (daemon.Process, error) {
	in.mu.Lock()
	defer in.mu.Unlock()
	select {
	case <-in.done:
		return nil, status.Error(codes.Unavailable, "daemontest: the sandbox has stopped")
	default:
	}
	bin, err := exec.LookPath(opts.Argv[0])
	if err != nil {
		return nil, status.Errorf(codes.NotFound, "daemontest: %s: %v", opts.Argv[0], err)
	}
	cwd := in.Root()
	if opts.Dir != "" {
		cwd = filepath.Join(cwd, filepath.FromSlash(opts.Dir))
		if fi, err := os.Stat(cwd); err != nil || !fi.IsDir() {
			return nil, status.Errorf(codes.InvalidArgument, "daemontest: working directory %s is not a directory", opts.Dir)
		}
	}
	cmd := exec.Command(bin, opts.Argv[1:]...)
	cmd.Dir = cwd
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH"), RootEnv + "=" + in.Root()}, opts.Env...)
	p := &proc{cmd: cmd, done: make(chan struct{}), fan: &fan{}}
	stdout, stderr := opts.Stdout, opts.Stderr
	if opts.DetachID != "" { // AttachDetached sees its output
		stdout, stderr = p.fan.writer(stdout, false), p.fan.writer(stderr, true)
	}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = opts.Stdin, stdout, stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if opts.User != "" {
		if cmd.Env, err = asUser(cmd, opts.User, cmd.Env); err != nil {
			return nil, err
		}
		if opts.Dir == "" {
			// The root is in the test's folders, which only root may
			// enter: a user's exec starts in the host's /.
			cmd.Dir = "/"
		}
	}
	var tty *os.File
	if opts.Pty != nil {
		if p.term, tty, err = onPty(cmd, opts.Pty); err != nil {
			return nil, err
		}
		defer tty.Close() // the child's now
	}
	var recPath string
	if id := opts.DetachID; id != "" {
		var err error
		if recPath, err = in.detachedPath(id); err != nil {
			return nil, err
		}
		if _, err := os.Stat(recPath); err == nil {
			return nil, status.Errorf(codes.AlreadyExists, "daemontest: a detached exec %q exists", id)
		}
		if err := os.MkdirAll(filepath.Dir(recPath), 0o700); err != nil {
			return nil, status.Errorf(codes.Internal, "daemontest: %v", err)
		}
		ctx = context.Background() // it outlives the call
	}
	if r, ok := cmd.Stdin.(io.Reader); ok && r != nil && p.term == nil {
		if _, isFile := r.(*os.File); !isFile {
			// Its own pipe, so that its exit is reported when it exits, as
			// the agent does, not when its stdin ends (exec.Cmd's Wait
			// waits for the copy of a non-file Stdin).
			cmd.Stdin = nil
			w, err := cmd.StdinPipe()
			if err != nil {
				return nil, status.Errorf(codes.Internal, "daemontest: stdin: %v", err)
			}
			go func() {
				io.Copy(w, r)
				w.Close()
			}()
		}
	}
	if err := cmd.Start(); err != nil {
		if p.term != nil {
			p.term.ptmx.Close()
		}
		return nil, status.Errorf(codes.Internal, "daemontest: start %s: %v", opts.Argv[0], err)
	}
	if p.term != nil {
		p.term.start(opts.Stdin, stdout)
	}
	in.procs[p] = struct{}{}
	if recPath != "" {
		rec := detachedRecord{ID: opts.DetachID, Pid: cmd.Process.Pid, Argv: opts.Argv, Started: time.Now().UnixNano()}
		if err := writeJSON(recPath, rec); err != nil {
			p.kill()
			return nil, err
		}
		in.b.setDetachedProc(recPath, p)
	}
	go p.wait(ctx, opts.Timeout, func() {
		in.mu.Lock()
		delete(in.procs, p)
		in.mu.Unlock()
	})
	return p, nil
}

// detachedRecord is a detached exec in the sandbox folder.
type detachedRecord struct {
	ID      string   `json:"id"`
	Pid     int      `json:"pid"`
	Argv    []string `json:"argv"`
	Started int64    `json:"started_unix_nanos"`
}

func (in *Instance) detachedPath(id string) (string, error) {
	if id == "" || len(id) > 128 || strings.ContainsAny(id, "/\x00") || id == "." || id == ".." {
		return "", status.Errorf(codes.InvalidArgument, "daemontest: detached exec ID %q", id)
	}
	return filepath.Join(in.dir, detachedDir, id+".json"), nil
}

func writeJSON(path string, v any) error {
	b, _ := json.Marshal(v)
	tmp := path + ".tmp-" + randHex()
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return fmt.Errorf("daemontest: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("daemontest: %w", err)
	}
	return nil
}

// Detached lists the detached execs the sandbox folder records, oldest
// first. One this process started is waited for as such; one a process
// gone since started is watched by pid, and its exit, which was that
// process's to learn, reads as killed (SIGKILL).
func (in *Instance) Detached(ctx context.Context) ([]daemon.DetachedExec, error) {
	paths, err := filepath.Glob(filepath.Join(in.dir, detachedDir, "*.json"))
	if err != nil {
		return nil, fmt.Errorf("daemontest: %w", err)
	}
	var out []daemon.DetachedExec
	in.mu.Lock()
	defer in.mu.Unlock()
	for _, path := range paths {
		var rec detachedRecord
		b, err := os.ReadFile(path)
		if err == nil {
			err = json.Unmarshal(b, &rec)
		}
		if err != nil {
			return nil, fmt.Errorf("daemontest: detached exec %s: %w", path, err)
		}
		d := daemon.DetachedExec{ID: rec.ID, Pid: rec.Pid, Argv: rec.Argv, Started: time.Unix(0, rec.Started)}
		if p := in.b.detachedProc(path); p != nil {
			d.Process = p
			select {
			case <-p.done:
				st := p.status
				d.Exit = &st
			default:
				in.procs[p] = struct{}{}
			}
		} else {
			fp := &foreignProc{pid: rec.Pid}
			d.Process = fp
			if alive(rec.Pid) {
				in.procs[fp] = struct{}{}
			} else {
				d.Exit = &daemon.ExitStatus{Code: -1, Signal: int(syscall.SIGKILL)}
			}
		}
		out = append(out, d)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Started.Before(out[j].Started) })
	return out, nil
}

// ForgetDetached removes the record of the exited detached exec id.
func (in *Instance) ForgetDetached(ctx context.Context, id string) error {
	path, err := in.detachedPath(id)
	if err != nil {
		return err
	}
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return status.Errorf(codes.NotFound, "daemontest: no detached exec %q", id)
	}
	var rec detachedRecord
	if err == nil {
		err = json.Unmarshal(b, &rec)
	}
	if err != nil {
		return fmt.Errorf("daemontest: detached exec %q: %w", id, err)
	}
	if p := in.b.detachedProc(path); p != nil && !p.exited() || p == nil && alive(rec.Pid) {
		return status.Errorf(codes.FailedPrecondition, "daemontest: detached exec %q still runs", id)
	}
	in.b.setDetachedProc(path, nil)
	if err := os.Remove(path); err != nil {
		return fmt.Errorf("daemontest: %w", err)
	}
	return nil
}

// foreignProc is a detached exec a process gone since started: not a
// child of this one, so it is watched by pid.
type foreignProc struct{ pid int }

func (p *foreignProc) Pid() int { return p.pid }

func (p *foreignProc) Signal(sig syscall.Signal) error {
	if !alive(p.pid) {
		return os.ErrProcessDone
	}
	return syscall.Kill(p.pid, sig)
}

func (p *foreignProc) SignalGroup(sig syscall.Signal) error {
	if !alive(p.pid) {
		return os.ErrProcessDone
	}
	return syscall.Kill(-p.pid, sig)
}

func (p *foreignProc) kill() { p.SignalGroup(syscall.SIGKILL) }

func (p *foreignProc) Wait() (daemon.ExitStatus, error) {
	for alive(p.pid) {
		time.Sleep(10 * time.Millisecond)
	}
	return daemon.ExitStatus{Code: -1, Signal: int(syscall.SIGKILL)}, nil
}

// proc is an exec of the double.
type proc struct {
	cmd      *exec.Cmd
	done     chan struct{}
	status   daemon.ExitStatus
	err      error
	timedOut bool
	mu       sync.Mutex
	term     *hostTerm // its terminal, or nil
	fan      *fan      // its attachers
}

func (p *proc) wait(ctx context.Context, timeout time.Duration, forget func()) {
	var timer <-chan time.Time
	if timeout > 0 {
		t := time.NewTimer(timeout)
		defer t.Stop()
		timer = t.C
	}
	exited := make(chan error, 1)
	go func() { exited <- p.cmd.Wait() }()
	var err error
	select {
	case err = <-exited:
	case <-ctx.Done():
		p.kill()
		err = <-exited
	case <-timer:
		p.mu.Lock()
		p.timedOut = true
		p.mu.Unlock()
		p.kill()
		err = <-exited
	}
	if p.term != nil {
		p.term.wait()
	}
	forget()
	st := daemon.ExitStatus{}
	var ee *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &ee):
		ws := ee.Sys().(syscall.WaitStatus)
		if ws.Signaled() {
			st.Code, st.Signal = -1, int(ws.Signal())
		} else {
			st.Code = ws.ExitStatus()
		}
	default:
		p.err = err
	}
	p.mu.Lock()
	st.TimedOut = p.timedOut
	p.mu.Unlock()
	p.status = st
	close(p.done)
}

func (p *proc) kill() {
	if !p.exited() {
		syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
	}
}

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

func (p *proc) Pid() int { return p.cmd.Process.Pid }

func (p *proc) Signal(sig syscall.Signal) error { return p.cmd.Process.Signal(sig) }

func (p *proc) SignalGroup(sig syscall.Signal) error { return syscall.Kill(-p.cmd.Process.Pid, sig) }

func (p *proc) Wait() (daemon.ExitStatus, error) {
	<-p.done
	return p.status, p.err
}

// rel turns a sandbox path (absolute, clean) into one of the root.
func rel(p string) string {
	p = strings.TrimPrefix(path.Clean(p), "/")
	if p == "" {
		return "."
	}
	return p
}

// fileErr gives a host file error the code the agent would.
func fileErr(op, p string, err error) error {
	code := codes.Internal
	switch {
	case errors.Is(err, fs.ErrNotExist):
		code = codes.NotFound
	case errors.Is(err, syscall.ENOTDIR), errors.Is(err, syscall.EISDIR), errors.Is(err, syscall.ENOTEMPTY):
		code = codes.FailedPrecondition
	case errors.Is(err, fs.ErrExist):
		code = codes.AlreadyExists
	case errors.Is(err, fs.ErrPermission):
		code = codes.PermissionDenied
	case strings.Contains(err.Error(), "escapes"):
		code = codes.InvalidArgument
	}
	return status.Errorf(code, "daemontest: %s %s: %v", op, p, err)
}

func (in *Instance) info(p string, fi fs.FileInfo) daemon.FileInfo {
	return in.infoNamed(p, fi, accounts.NewNames("/"))
}

// infoNamed describes p, its owner and group named by names (the host's).
func (in *Instance) infoNamed(p string, fi fs.FileInfo, names *accounts.Names) daemon.FileInfo {
	out := daemon.FileInfo{Path: p, Name: path.Base(p), Size: fi.Size(), Mode: fi.Mode(), ModTime: fi.ModTime(), IsDir: fi.IsDir()}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		out.UID, out.GID = st.Uid, st.Gid
		out.Owner, out.Group = names.User(st.Uid), names.Group(st.Gid)
	}
	if fi.Mode()&fs.ModeSymlink != 0 {
		out.Symlink, _ = in.root.Readlink(rel(p))
	}
	return out
}

// WriteFile writes the file whole or not at all (a temporary file renamed
// into place).
func (in *Instance) WriteFile(ctx context.Context, p string, r io.Reader, mode fs.FileMode, makeParents bool, ownerName string) (daemon.FileInfo, error) {
	u, err := owner(ownerName)
	if err != nil {
		return daemon.FileInfo{}, err
	}
	if makeParents {
		if err := in.mkdirs(rel(path.Dir(p)), 0o755, u); err != nil {
			return daemon.FileInfo{}, fileErr("write", p, err)
		}
	}
	tmp := rel(path.Dir(p)) + "/.kiln-write-" + randHex()
	f, err := in.root.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode.Perm())
	if err != nil {
		return daemon.FileInfo{}, fileErr("write", p, err)
	}
	_, err = io.Copy(f, r)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil && u != nil {
		err = in.root.Lchown(tmp, int(u.UID), int(u.GID))
	}
	if err == nil {
		err = in.root.Chmod(tmp, mode)
	}
	if err == nil {
		err = in.root.Rename(tmp, rel(p))
	}
	if err != nil {
		in.root.Remove(tmp)
		return daemon.FileInfo{}, fileErr("write", p, err)
	}
	return in.Stat(ctx, p, false)
}

func (in *Instance) ReadFile(ctx context.Context, p string, w io.Writer) (int64, error) {
	f, err := in.root.Open(rel(p))
	if err != nil {
		return 0, fileErr("read", p, err)
	}
	defer f.Close()
	n, err := io.CopyBuffer(w, f, make([]byte, 64<<10))
	if err != nil {
		return n, fileErr("read", p, err)
	}
	return n, nil
}

func (in *Instance) Stat(ctx context.Context, p string, noFollow bool) (daemon.FileInfo, error) {
	stat := in.root.Stat
	if noFollow {
		stat = in.root.Lstat
	}
	fi, err := stat(rel(p))
	if err != nil {
		return daemon.FileInfo{}, fileErr("stat", p, err)
	}
	return in.info(p, fi), nil
}

func sortEntries(ents []fs.DirEntry) {
	sort.Slice(ents, func(i, j int) bool { return ents[i].Name() < ents[j].Name() })
}

func (in *Instance) Mkdir(ctx context.Context, p string, mode fs.FileMode, parents bool, ownerName string) error {
	u, err := owner(ownerName)
	if err != nil {
		return err
	}
	if parents {
		err = in.mkdirs(rel(p), mode.Perm(), u)
	} else {
		err = in.root.Mkdir(rel(p), mode.Perm())
		if err == nil && u != nil {
			err = in.root.Lchown(rel(p), int(u.UID), int(u.GID))
		}
	}
	if err != nil {
		return fileErr("mkdir", p, err)
	}
	return nil
}

func (in *Instance) Remove(ctx context.Context, p string, recursive bool) error {
	var err error
	if recursive {
		if _, serr := in.root.Lstat(rel(p)); serr != nil {
			return fileErr("remove", p, serr)
		}
		err = in.root.RemoveAll(rel(p))
	} else {
		err = in.root.Remove(rel(p))
	}
	if err != nil {
		return fileErr("remove", p, err)
	}
	return nil
}

// Refresh records the new host name (Hostname) and counts the call.
func (in *Instance) Refresh(ctx context.Context, hostname string) error {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.closed {
		return errors.New("daemontest: refresh a closed sandbox")
	}
	in.meta.Hostname = hostname
	in.meta.Refreshes++
	return writeMeta(in.dir, in.meta)
}

// ConfigureNetwork records cfg as the guest's network; the sandbox must
// have a card, and cfg its MAC.
func (in *Instance) ConfigureNetwork(ctx context.Context, cfg daemon.NetworkConfig) error {
	in.mu.Lock()
	defer in.mu.Unlock()
	switch {
	case in.closed:
		return errors.New("daemontest: configure the network of a closed sandbox")
	case in.meta.Net == nil:
		return status.Error(codes.FailedPrecondition, "daemontest: the sandbox has no network card")
	case cfg.MAC != in.meta.Net.MAC:
		return status.Errorf(codes.InvalidArgument, "daemontest: MAC %s: the card's is %s", cfg.MAC, in.meta.Net.MAC)
	case len(cfg.Addresses) == 0:
		return status.Error(codes.InvalidArgument, "daemontest: no address")
	}
	c := cfg
	c.Addresses = append([]netip.Prefix(nil), cfg.Addresses...)
	c.Nameservers = append([]netip.Addr(nil), cfg.Nameservers...)
	in.meta.Network = &c
	return writeMeta(in.dir, in.meta)
}

// Network returns the sandbox's network card and what its guest was last
// configured with (nil when never: a restore keeps its checkpoint's).
func (in *Instance) Network() (*daemon.NetSpec, *daemon.NetworkConfig) {
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.meta.Net, in.meta.Network
}

// Hostname is the host name the sandbox was started or last refreshed
// with, and how many times it was refreshed.
func (in *Instance) Hostname() (string, int) {
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.meta.Hostname, in.meta.Refreshes
}

// Pause stops the stand-in VMM process (SIGSTOP); Resume continues it.
func (in *Instance) Pause(ctx context.Context) error  { return in.signal(syscall.SIGSTOP) }
func (in *Instance) Resume(ctx context.Context) error { return in.signal(syscall.SIGCONT) }

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
	m, closed := in.meta, in.closed
	in.mu.Unlock()
	select {
	case <-in.done:
		closed = true
	default:
	}
	if closed {
		return daemon.GuestInfo{}, status.Error(codes.Unavailable, "daemontest: info: the sandbox has stopped")
	}
	var used uint64
	err := filepath.WalkDir(in.Root(), func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil // removed meanwhile
		}
		if fi, err := d.Info(); err == nil && fi.Mode().IsRegular() {
			used += uint64(fi.Size())
		}
		return nil
	})
	if err != nil {
		return daemon.GuestInfo{}, fmt.Errorf("daemontest: info: %w", err)
	}
	var st syscall.Statfs_t
	if err := syscall.Statfs(in.Root(), &st); err != nil {
		return daemon.GuestInfo{}, fmt.Errorf("daemontest: info: %w", err)
	}
	mem := uint64(m.MemoryMiB) << 20
	if mem == 0 {
		mem = 512 << 20
	}
	avail := uint64(0)
	if used < mem {
		avail = mem - used
	}
	return daemon.GuestInfo{Hostname: m.Hostname, MemTotal: mem, MemAvailable: avail, NumCPU: max(m.CPUs, 1),
		DiskTotal: st.Blocks * uint64(st.Bsize), DiskUsed: used}, nil
}

// Save copies the root into dir/root.
func (in *Instance) Save(ctx context.Context, dir string) error {
	if h := in.b.SaveHook; h != nil {
		if err := h(ctx, in.dir, dir); err != nil {
			return err
		}
	}
	if err := os.Mkdir(dir, 0o700); err != nil {
		return fmt.Errorf("daemontest: save: %w", err)
	}
	if err := writeMeta(dir, in.meta); err != nil {
		return err
	}
	return copyTree(in.Root(), filepath.Join(dir, rootDir))
}

// holdsDir holds the double's "in-memory" checkpoints: each a folder as
// Save writes, in the sandbox's folder (so that they outlive a server, as
// a VMM process's holds do, and go with the sandbox).
const holdsDir = "holds"

func (in *Instance) holdPath(id string) (string, error) {
	if id == "" || strings.ContainsAny(id, "/\x00") || id == "." || id == ".." {
		return "", fmt.Errorf("daemontest: hold ID %q", id)
	}
	return filepath.Join(in.dir, holdsDir, id), nil
}

// Hold keeps a copy of the root under id.
func (in *Instance) Hold(ctx context.Context, id string) error {
	p, err := in.holdPath(id)
	if err != nil {
		return err
	}
	if _, err := os.Stat(p); err == nil {
		return fmt.Errorf("daemontest: hold %q: %w", id, errHoldExists)
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return fmt.Errorf("daemontest: hold: %w", err)
	}
	return in.Save(ctx, p)
}

// Release drops the hold id.
func (in *Instance) Release(ctx context.Context, id string) error {
	p, err := in.holdPath(id)
	if err != nil {
		return err
	}
	return os.RemoveAll(p)
}

// Held lists the holds, sorted.
func (in *Instance) Held(ctx context.Context) ([]string, error) {
	ents, err := os.ReadDir(filepath.Join(in.dir, holdsDir))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("daemontest: held: %w", err)
	}
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out, nil
}

// Frozen is the double's in-memory checkpoint handed out: a copy of the
// hold, removed by Close.
type Frozen struct {
	id  string
	mu  sync.Mutex
	dir string
}

func (f *Frozen) ID() string { return f.id }

func (f *Frozen) Close() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.dir == "" {
		return nil
	}
	err := os.RemoveAll(filepath.Dir(f.dir))
	f.dir = ""
	return err
}

// Frozen hands out a copy of the hold id.
func (in *Instance) Frozen(ctx context.Context, id string) (daemon.Frozen, error) {
	p, err := in.holdPath(id)
	if err != nil {
		return nil, err
	}
	if _, err := os.Stat(p); err != nil {
		return nil, fmt.Errorf("daemontest: hold %q: %w", id, daemon.ErrNotHeld)
	}
	tmp, err := os.MkdirTemp(filepath.Dir(in.dir), ".frozen-")
	if err != nil {
		return nil, fmt.Errorf("daemontest: frozen: %w", err)
	}
	if err := copyTree(p, filepath.Join(tmp, "ck")); err != nil {
		os.RemoveAll(tmp)
		return nil, err
	}
	return &Frozen{id: id, dir: filepath.Join(tmp, "ck")}, nil
}

// Adopt holds a copy of f.
func (in *Instance) Adopt(ctx context.Context, f daemon.Frozen) error {
	df, ok := f.(*Frozen)
	if !ok {
		return fmt.Errorf("daemontest: %T is not this backend's in-memory checkpoint", f)
	}
	p, err := in.holdPath(df.id)
	if err != nil {
		return err
	}
	if _, err := os.Stat(p); err == nil {
		return fmt.Errorf("daemontest: adopt %q: %w", df.id, errHoldExists)
	}
	df.mu.Lock()
	defer df.mu.Unlock()
	if df.dir == "" {
		return errors.New("daemontest: adopt a closed checkpoint")
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return fmt.Errorf("daemontest: adopt: %w", err)
	}
	return copyTree(df.dir, p)
}

// Fork makes n children, each a copy of the root, in folders beside this
// one's.
func (in *Instance) Fork(ctx context.Context, hosts []daemon.HostSpec) ([]daemon.Instance, error) {
	n := len(hosts)
	tmp, err := os.MkdirTemp(filepath.Dir(in.dir), ".fork-")
	if err != nil {
		return nil, fmt.Errorf("daemontest: fork: %w", err)
	}
	defer os.RemoveAll(tmp)
	if err := in.Save(ctx, filepath.Join(tmp, "ck")); err != nil {
		return nil, err
	}
	in.mu.Lock()
	hasNIC := in.meta.Net != nil
	in.mu.Unlock()
	var out []daemon.Instance
	for i := range n {
		if (hosts[i].Net != nil) != hasNIC {
			closeAll(out)
			return nil, fmt.Errorf("daemontest: fork: child %d has a network card: %v, the sandbox has one: %v", i, hosts[i].Net != nil, hasNIC)
		}
		dir := filepath.Join(filepath.Dir(in.dir), "fork-"+randHex())
		if err := os.Mkdir(dir, 0o700); err != nil {
			closeAll(out)
			return nil, fmt.Errorf("daemontest: fork: %w", err)
		}
		c, err := in.b.Create(ctx, daemon.CreateSpec{Dir: dir, Checkpoint: filepath.Join(tmp, "ck"), Host: hosts[i]})
		if err != nil {
			os.RemoveAll(dir)
			closeAll(out)
			return nil, err
		}
		out = append(out, c)
	}
	return out, nil
}

func closeAll(ins []daemon.Instance) {
	for _, c := range ins {
		c.Close(context.Background())
	}
}

// Close kills the execs and the stand-in VMM process, and removes the
// folder.
func (in *Instance) Close(ctx context.Context) error {
	in.mu.Lock()
	if in.closed {
		in.mu.Unlock()
		return nil
	}
	in.closed = true
	in.mu.Unlock()
	syscall.Kill(in.pid, syscall.SIGKILL)
	select {
	case <-in.done:
	case <-ctx.Done():
		return fmt.Errorf("daemontest: close: %w", ctx.Err())
	}
	in.root.Close()
	in.b.forgetDetachedOf(in.dir)
	in.b.forgetKept(in.dir)
	if err := os.RemoveAll(in.dir); err != nil {
		return fmt.Errorf("daemontest: close: %w", err)
	}
	return nil
}

// Detach leaves the sandbox running for a later Attach.
func (in *Instance) Detach() {
	in.mu.Lock()
	in.detached = true
	in.mu.Unlock()
}

func randHex() string {
	b := make([]byte, 6)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// copyTree copies the folder src to dst (which must not exist): regular
// files, folders and symlinks.
func copyTree(src, dst string) error {
	err := filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		r, _ := filepath.Rel(src, p)
		t := filepath.Join(dst, r)
		fi, err := d.Info()
		if err != nil {
			return err
		}
		switch {
		case d.IsDir():
			return os.Mkdir(t, fi.Mode().Perm())
		case fi.Mode()&fs.ModeSymlink != 0:
			l, err := os.Readlink(p)
			if err != nil {
				return err
			}
			return os.Symlink(l, t)
		case fi.Mode().IsRegular():
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			return os.WriteFile(t, b, fi.Mode().Perm())
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("daemontest: copy %s: %w", src, err)
	}
	return nil
}

// LiveDirs is a debugging aid: the folders of the live sandboxes.
func (b *Backend) LiveDirs() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []string
	for in := range b.live {
		out = append(out, in.dir)
	}
	return out
}
