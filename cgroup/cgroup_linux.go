package cgroup

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// DefaultMount is where the cgroup v2 hierarchy is mounted.
const DefaultMount = "/sys/fs/cgroup"

// The folders Open makes under the delegated root.
const (
	// SelfDir holds kilnd's own process when it started in the root
	// (cgroup v2 lets only leaves hold processes).
	SelfDir = "kilnd"
	// SandboxesDir holds a cgroup per sandbox.
	SandboxesDir = "sandboxes"
)

// Options say where Open finds the cgroup tree.
type Options struct {
	// Root is the delegated cgroup: a folder under Mount
	// ("/sys/fs/cgroup/kiln") or a cgroup path ("/kiln.slice"); empty:
	// the cgroup of the current process, as systemd's Delegate=yes gives
	// it to kilnd's unit.
	Root string
	// Mount is the cgroup v2 mount (DefaultMount when empty).
	Mount string
	// ProcSelf is /proc/self (for its cgroup file) when empty.
	ProcSelf string
	// Sys is /sys (for the block devices of io limits) when empty.
	Sys    string
	Logger *slog.Logger

	// fake: the tree is plain folders (unit tests): no cgroup2 mount
	// check, and removal is os.RemoveAll.
	fake bool
}

// Manager is kilnd's delegated subtree: Create and Get sandboxes'
// cgroups in it. Its methods are safe for concurrent use.
type Manager struct {
	root        string // the delegated root's folder
	sandboxes   string // root/sandboxes
	sys         string
	controllers map[string]bool // enabled for the sandboxes' cgroups
	log         *slog.Logger
	fake        bool
}

// Open opens the delegated cgroup root ("" for the current process's)
// with the default paths; see OpenOptions.
func Open(root string) (*Manager, error) { return OpenOptions(Options{Root: root}) }

// OpenOptions sets kilnd's subtree up: when the current process sits in
// the root it moves into root/kilnd (with all its threads), then it
// enables cpu, memory, pids and io for the root's children (those the
// root has: one warning names the missing ones; without memory it
// refuses) and makes root/sandboxes with the same controllers for its
// children.
func OpenOptions(opts Options) (*Manager, error) {
	mount := opts.Mount
	if mount == "" {
		mount = DefaultMount
	}
	mount = filepath.Clean(mount)
	procSelf := opts.ProcSelf
	if procSelf == "" {
		procSelf = "/proc/self"
	}
	sys := opts.Sys
	if sys == "" {
		sys = "/sys"
	}
	log := opts.Logger
	if log == nil {
		log = slog.Default()
	}
	if !opts.fake {
		var st unix.Statfs_t
		if err := unix.Statfs(mount, &st); err != nil {
			return nil, fmt.Errorf("cgroup: %s: %w", mount, err)
		}
		if st.Type != unix.CGROUP2_SUPER_MAGIC {
			return nil, fmt.Errorf("cgroup: %s is not a cgroup v2 mount (filesystem type %#x): kilnd needs the unified hierarchy (systemd.unified_cgroup_hierarchy=1)", mount, st.Type)
		}
	}
	b, err := os.ReadFile(filepath.Join(procSelf, "cgroup"))
	if err != nil {
		return nil, fmt.Errorf("cgroup: the current process's cgroup: %w", err)
	}
	selfPath, err := ParseProcCgroup(string(b))
	if err != nil {
		return nil, err
	}
	self := filepath.Join(mount, selfPath)
	root := opts.Root
	switch {
	case root == "":
		root = self
	case root == mount || strings.HasPrefix(root, mount+"/"):
		root = filepath.Clean(root)
	case strings.HasPrefix(root, "/"):
		root = filepath.Join(mount, root)
	default:
		return nil, fmt.Errorf("cgroup: root %q: want a folder under %s or a cgroup path starting with /", opts.Root, mount)
	}
	if root == mount {
		return nil, fmt.Errorf("cgroup: root %s is the host's root cgroup: give kilnd a cgroup of its own (Delegate=yes, or a folder under %s)", root, mount)
	}
	if fi, err := os.Stat(root); err != nil || !fi.IsDir() {
		return nil, fmt.Errorf("cgroup: root %s is not a cgroup folder: %v", root, err)
	}
	m := &Manager{root: root, sandboxes: filepath.Join(root, SandboxesDir), sys: sys, log: log, fake: opts.fake}
	if self == root {
		if err := m.moveSelf(); err != nil {
			return nil, err
		}
	}
	cb, err := os.ReadFile(filepath.Join(root, "cgroup.controllers"))
	if err != nil {
		return nil, fmt.Errorf("cgroup: root %s: %w", root, err)
	}
	have, err := ParseControllers(string(cb))
	if err != nil {
		return nil, fmt.Errorf("cgroup: root %s: %w", root, err)
	}
	m.controllers = map[string]bool{}
	var missing, enable []string
	for _, c := range wantControllers {
		if have[c] {
			m.controllers[c] = true
			enable = append(enable, "+"+c)
		} else {
			missing = append(missing, c)
		}
	}
	if !have["memory"] {
		return nil, fmt.Errorf("cgroup: root %s lacks the memory controller (it has %q): sandboxes' memory cannot be limited; delegate it (Delegate=yes) or enable it in the parent's cgroup.subtree_control", root, strings.TrimSpace(string(cb)))
	}
	if len(missing) > 0 {
		log.Warn("cgroup controllers missing in kilnd's cgroup: sandboxes go without those limits", "root", root, "missing", strings.Join(missing, " "))
	}
	ctl := strings.Join(enable, " ")
	if err := write(filepath.Join(root, "cgroup.subtree_control"), ctl); err != nil {
		return nil, fmt.Errorf("cgroup: enable %s under %s: %w (a cgroup with processes of its own cannot have children with controllers)", ctl, root, err)
	}
	if err := os.Mkdir(m.sandboxes, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
		return nil, fmt.Errorf("cgroup: %w", err)
	}
	if err := write(filepath.Join(m.sandboxes, "cgroup.subtree_control"), ctl); err != nil {
		return nil, fmt.Errorf("cgroup: enable %s under %s: %w", ctl, m.sandboxes, err)
	}
	return m, nil
}

// moveSelf moves the current process, with all its threads, from the
// root into root/kilnd.
func (m *Manager) moveSelf() error {
	dir := filepath.Join(m.root, SelfDir)
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("cgroup: %w", err)
	}
	// cgroup.procs moves the whole thread group.
	if err := write(filepath.Join(dir, "cgroup.procs"), strconv.Itoa(os.Getpid())); err != nil {
		return fmt.Errorf("cgroup: move kilnd's process into %s: %w", dir, err)
	}
	m.log.Info("kilnd's process moved out of its delegated cgroup's root", "cgroup", dir)
	return nil
}

// Root is the delegated root's folder.
func (m *Manager) Root() string { return m.root }

// Controllers lists the controllers the sandboxes' cgroups have.
func (m *Manager) Controllers() []string {
	var out []string
	for _, c := range wantControllers {
		if m.controllers[c] {
			out = append(out, c)
		}
	}
	return out
}

// Path is the folder of sandbox id's cgroup (whether or not it exists).
func (m *Manager) Path(id string) string { return filepath.Join(m.sandboxes, id) }

// Create makes sandbox id's cgroup with limits l. An ID in use is an
// error (fs.ErrExist): Get takes over one a previous kilnd made.
func (m *Manager) Create(id string, l Limits) (_ *Group, err error) {
	if err := CheckID(id); err != nil {
		return nil, err
	}
	if len(l.IO) > 0 && !m.controllers["io"] {
		return nil, fmt.Errorf("cgroup: sandbox %s has io limits, and kilnd's cgroup %s lacks the io controller", id, m.root)
	}
	type file struct{ name, val string }
	var files []file
	if l.CPUs < 0 || l.PidsMax < 0 {
		return nil, fmt.Errorf("cgroup: sandbox %s: negative limits (cpus %d, pids %d)", id, l.CPUs, l.PidsMax)
	}
	if l.CPUs > 0 && m.controllers["cpu"] {
		files = append(files, file{"cpu.max", fmt.Sprintf("%d 100000", l.CPUs*100000)})
	}
	if mx := l.MemoryMax(); mx > 0 {
		files = append(files, file{"memory.max", strconv.FormatUint(mx, 10)})
	}
	if l.PidsMax > 0 && m.controllers["pids"] {
		files = append(files, file{"pids.max", strconv.Itoa(l.PidsMax)})
	}
	var ioLines []string
	for i, lim := range l.IO {
		dev, err := m.blockDevice(lim.Device)
		if err != nil {
			return nil, fmt.Errorf("cgroup: sandbox %s: io limit %d: %w", id, i, err)
		}
		ioLines = append(ioLines, ioLine(dev, lim))
	}
	dir := m.Path(id)
	if err := os.Mkdir(dir, 0o755); err != nil {
		return nil, fmt.Errorf("cgroup: sandbox %s: %w", id, err)
	}
	g := &Group{ID: id, Path: dir, m: m}
	defer func() {
		if err != nil {
			m.rmdir(dir)
		}
	}()
	for _, f := range files {
		if err := write(filepath.Join(dir, f.name), f.val); err != nil {
			return nil, fmt.Errorf("cgroup: sandbox %s: %s: %w", id, f.name, err)
		}
	}
	// No swap (the file exists with swap accounting only), and an OOM
	// kill takes the whole VMM process, not a thread of it.
	if _, err := os.Stat(filepath.Join(dir, "memory.swap.max")); err == nil || m.fake {
		if err := write(filepath.Join(dir, "memory.swap.max"), "0"); err != nil {
			return nil, fmt.Errorf("cgroup: sandbox %s: memory.swap.max: %w", id, err)
		}
	}
	if err := write(filepath.Join(dir, "memory.oom.group"), "1"); err != nil {
		return nil, fmt.Errorf("cgroup: sandbox %s: memory.oom.group: %w", id, err)
	}
	// One write per device: the kernel takes one line a write.
	for _, line := range ioLines {
		if err := write(filepath.Join(dir, "io.max"), line); err != nil {
			return nil, fmt.Errorf("cgroup: sandbox %s: io.max %q: %w", id, line, err)
		}
	}
	return g, nil
}

// SetMemoryMax sets sandbox id's memory.max to bytes (the limit a
// sandbox's checkpoints grow: each in-memory base it holds is memory its
// VMM process pays for).
func (m *Manager) SetMemoryMax(id string, bytes uint64) error {
	if err := CheckID(id); err != nil {
		return err
	}
	if bytes == 0 {
		return fmt.Errorf("cgroup: sandbox %s: memory.max 0", id)
	}
	if err := write(filepath.Join(m.Path(id), "memory.max"), strconv.FormatUint(bytes, 10)); err != nil {
		return fmt.Errorf("cgroup: sandbox %s: memory.max: %w", id, err)
	}
	return nil
}

// Get returns sandbox id's cgroup, made by Create (in this process or a
// previous kilnd).
func (m *Manager) Get(id string) (*Group, error) {
	if err := CheckID(id); err != nil {
		return nil, err
	}
	dir := m.Path(id)
	fi, err := os.Stat(dir)
	if err != nil {
		return nil, fmt.Errorf("cgroup: sandbox %s: %w", id, err)
	}
	if !fi.IsDir() {
		return nil, fmt.Errorf("cgroup: sandbox %s: %s is not a folder", id, dir)
	}
	return &Group{ID: id, Path: dir, m: m}, nil
}

// List returns the IDs of the sandboxes' cgroups there are, for pruning
// those of sandboxes that are gone.
func (m *Manager) List() ([]string, error) {
	ents, err := os.ReadDir(m.sandboxes)
	if err != nil {
		return nil, fmt.Errorf("cgroup: %w", err)
	}
	var out []string
	for _, e := range ents {
		if e.IsDir() && CheckID(e.Name()) == nil {
			out = append(out, e.Name())
		}
	}
	return out, nil
}

// Events reads sandbox id's memory.events.
func (m *Manager) Events(id string) (Events, error) {
	g, err := m.Get(id)
	if err != nil {
		return Events{}, err
	}
	return g.Events()
}

// Remove kills what is left in sandbox id's cgroup and removes it; a
// cgroup that is not there is no error.
func (m *Manager) Remove(ctx context.Context, id string) error {
	if err := CheckID(id); err != nil {
		return err
	}
	g := &Group{ID: id, Path: m.Path(id), m: m}
	return g.Remove(ctx)
}

func (m *Manager) rmdir(dir string) error {
	if m != nil && m.fake {
		return os.RemoveAll(dir)
	}
	return unix.Rmdir(dir)
}

// blockDevice resolves an IOLimit's device to the MAJ:MIN of a whole
// disk (io.max takes no partitions).
func (m *Manager) blockDevice(dev string) (string, error) {
	if dev == "" {
		return "", errors.New("no device")
	}
	var mm string
	if maj, min, ok := parseMajMin(dev); ok {
		mm = fmt.Sprintf("%d:%d", maj, min)
	} else {
		var st unix.Stat_t
		if err := unix.Stat(dev, &st); err != nil {
			return "", fmt.Errorf("device %s: %w", dev, err)
		}
		d := st.Dev // a file: the device its filesystem lies on
		if st.Mode&unix.S_IFMT == unix.S_IFBLK {
			d = st.Rdev
		}
		mm = fmt.Sprintf("%d:%d", unix.Major(d), unix.Minor(d))
	}
	sysDev := filepath.Join(m.sys, "dev", "block", mm)
	if _, err := os.Stat(sysDev); err != nil {
		if mm == dev {
			return mm, nil // as given: the kernel checks it
		}
		return "", fmt.Errorf("device %s: %s is not a block device (no %s)", dev, mm, sysDev)
	}
	if _, err := os.Stat(filepath.Join(sysDev, "partition")); err == nil {
		// A partition: its disk is the parent folder in sysfs.
		real, err := filepath.EvalSymlinks(sysDev)
		if err != nil {
			return "", fmt.Errorf("device %s: %w", dev, err)
		}
		b, err := os.ReadFile(filepath.Join(filepath.Dir(real), "dev"))
		if err != nil {
			return "", fmt.Errorf("device %s: the disk of partition %s: %w", dev, mm, err)
		}
		mm = strings.TrimSpace(string(b))
	}
	return mm, nil
}

// Group is one sandbox's cgroup.
type Group struct {
	ID   string
	Path string // its folder
	m    *Manager
}

// OpenFD opens the cgroup's folder as an O_PATH descriptor, for clone3's
// CLONE_INTO_CGROUP (syscall.SysProcAttr.CgroupFD); the caller closes it.
func (g *Group) OpenFD() (*os.File, error) { return OpenFD(g.Path) }

// OpenFD opens a cgroup folder as an O_PATH descriptor.
func OpenFD(dir string) (*os.File, error) {
	fd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("cgroup: open %s: %w", dir, err)
	}
	return os.NewFile(uintptr(fd), dir), nil
}

// Events reads the cgroup's memory.events.
func (g *Group) Events() (Events, error) {
	b, err := os.ReadFile(filepath.Join(g.Path, "memory.events"))
	if err != nil {
		return Events{}, fmt.Errorf("cgroup: %w", err)
	}
	e, err := ParseEvents(string(b))
	if err != nil {
		return Events{}, fmt.Errorf("cgroup: %s: %w", g.Path, err)
	}
	return e, nil
}

// Current is the cgroup's memory use in bytes (memory.current).
func (g *Group) Current() (uint64, error) { return g.readUint("memory.current") }

// Peak is the cgroup's highest memory use in bytes (memory.peak, Linux
// 5.19 and later).
func (g *Group) Peak() (uint64, error) { return g.readUint("memory.peak") }

// MemoryMax is the cgroup's memory.max in bytes (0: "max").
func (g *Group) MemoryMax() (uint64, error) { return g.readUint("memory.max") }

func (g *Group) readUint(name string) (uint64, error) {
	b, err := os.ReadFile(filepath.Join(g.Path, name))
	if err != nil {
		return 0, fmt.Errorf("cgroup: %w", err)
	}
	s := strings.TrimSpace(string(b))
	if s == "max" {
		return 0, nil
	}
	n, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("cgroup: %s/%s: %q: %w", g.Path, name, s, err)
	}
	return n, nil
}

// Procs lists the processes in the cgroup.
func (g *Group) Procs() ([]int, error) {
	b, err := os.ReadFile(filepath.Join(g.Path, "cgroup.procs"))
	if err != nil {
		return nil, fmt.Errorf("cgroup: %w", err)
	}
	return parseProcs(string(b))
}

// Kill kills every process in the cgroup (cgroup.kill; a signal to each
// on kernels before 5.14).
func (g *Group) Kill() error {
	err := write(filepath.Join(g.Path, "cgroup.kill"), "1")
	if err == nil || !errors.Is(err, fs.ErrNotExist) && !errors.Is(err, fs.ErrPermission) {
		if err != nil {
			return fmt.Errorf("cgroup: kill %s: %w", g.Path, err)
		}
		return nil
	}
	pids, perr := g.Procs()
	if perr != nil {
		return perr
	}
	for _, pid := range pids {
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && err != syscall.ESRCH {
			return fmt.Errorf("cgroup: kill process %d of %s: %w", pid, g.Path, err)
		}
	}
	return nil
}

// Remove kills what is left in the cgroup and removes its folder,
// retrying while the kernel still lists dying processes in it, until ctx
// ends. A cgroup that is gone already is no error.
func (g *Group) Remove(ctx context.Context) error {
	delay := time.Millisecond
	for {
		if _, err := os.Stat(g.Path); errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		if pids, err := g.Procs(); err == nil && len(pids) > 0 {
			g.Kill()
		}
		err := g.m.rmdir(g.Path)
		if err == nil || errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		if !errors.Is(err, unix.EBUSY) && !errors.Is(err, unix.ENOTEMPTY) {
			return fmt.Errorf("cgroup: remove %s: %w", g.Path, err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("cgroup: remove %s: its processes are still exiting: %w (%v)", g.Path, ctx.Err(), err)
		case <-time.After(delay):
		}
		delay = min(2*delay, 100*time.Millisecond)
	}
}

// write writes one value to a cgroup interface file.
func write(path, val string) error {
	// O_CREATE: a fake tree's files are plain ones; the kernel's exist.
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return err
	}
	_, err = f.WriteString(val)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}
