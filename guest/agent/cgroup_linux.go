package agent

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"

	"golang.org/x/sys/unix"
)

// Defaults for the sandbox cgroup.
const (
	DefaultPidsMax       = 4096
	DefaultMemoryReserve = 48 << 20
	// sandboxCgroup is the cgroup, below Config.CgroupRoot, that holds one
	// child cgroup per Exec.
	sandboxCgroup = "sandbox"
	// minSandboxMemory: below this, memory.max is left alone rather than
	// set to something no process could run in.
	minSandboxMemory = 16 << 20
)

// cgroups manages <root>/sandbox and the per-Exec cgroups below it
// (cgroup v2).
type cgroups struct {
	log *slog.Logger
	dir string // <root>/sandbox
	seq atomic.Uint64

	mu      sync.Mutex
	pending []string // per-Exec cgroups still populated when released
}

// setupCgroups creates <root>/sandbox with pids.max = pidsMax and
// memory.max = memTotal - memReserve, and enables the memory and pids
// controllers for it and for its children. A controller that cannot be
// enabled or a limit that cannot be set is logged and skipped; an error
// means the sandbox cgroup itself is unusable.
func setupCgroups(log *slog.Logger, root string, pidsMax int, memTotal, memReserve uint64) (*cgroups, error) {
	if _, err := os.Stat(filepath.Join(root, "cgroup.procs")); err != nil {
		return nil, fmt.Errorf("cgroup root %s is not a cgroup v2 hierarchy: %w", root, err)
	}
	enableControllers(log, root)
	dir := filepath.Join(root, sandboxCgroup)
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return nil, fmt.Errorf("creating cgroup %s: %w", dir, err)
	}
	if pidsMax > 0 {
		if err := writeCgroupFile(dir, "pids.max", strconv.Itoa(pidsMax)); err != nil {
			log.Warn("cgroup: no task limit", "err", err)
		}
	}
	if memTotal > memReserve && memTotal-memReserve >= minSandboxMemory {
		if err := writeCgroupFile(dir, "memory.max", strconv.FormatUint(memTotal-memReserve, 10)); err != nil {
			log.Warn("cgroup: no memory limit", "err", err)
		}
	} else {
		log.Warn("cgroup: too little memory for a limit", "mem_total", memTotal, "reserve", memReserve)
	}
	enableControllers(log, dir)
	log.Info("cgroup: sandbox ready", "dir", dir, "pids_max", pidsMax, "memory_max", memTotal-min(memTotal, memReserve))
	return &cgroups{log: log, dir: dir}, nil
}

// enableControllers turns on the memory and pids controllers for dir's
// children, one at a time so that a missing one does not stop the other,
// and every other controller dir has (cgroup.controllers): cpu, io,
// cpuset... are delegated down to each Exec's cgroup as on a host, so a
// container engine run there (dockerd, runc) finds them in its own cgroup.
func enableControllers(log *slog.Logger, dir string) {
	for _, c := range delegatedControllers(dir) {
		if err := writeCgroupFile(dir, "cgroup.subtree_control", "+"+c); err != nil {
			log.Warn("cgroup: cannot enable controller", "controller", c, "dir", dir, "err", err)
		}
	}
}

// delegatedControllers returns memory and pids, then the other
// controllers dir's cgroup.controllers lists, in its order.
func delegatedControllers(dir string) []string {
	want := []string{"memory", "pids"}
	if b, err := os.ReadFile(filepath.Join(dir, "cgroup.controllers")); err == nil {
		for _, c := range strings.Fields(string(b)) {
			if !slices.Contains(want, c) {
				want = append(want, c)
			}
		}
	}
	return want
}

func writeCgroupFile(dir, name, value string) error {
	p := filepath.Join(dir, name)
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE, 0o644)
	if err != nil {
		return fmt.Errorf("writing %s: %w", p, err)
	}
	_, err = f.WriteString(value)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("writing %q to %s: %w", value, p, err)
	}
	return nil
}

// execCgroup is the cgroup of one Exec.
type execCgroup struct {
	dir string
	fd  int // open O_DIRECTORY, for SysProcAttr.CgroupFD; -1 once closed
}

// newExec creates the cgroup for one Exec.
func (c *cgroups) newExec() (*execCgroup, error) {
	c.sweep()
	dir := filepath.Join(c.dir, "exec-"+strconv.FormatUint(c.seq.Add(1), 10))
	if err := os.Mkdir(dir, 0o755); err != nil {
		return nil, fmt.Errorf("creating cgroup %s: %w", dir, err)
	}
	fd, err := unix.Open(dir, unix.O_DIRECTORY|unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		os.Remove(dir)
		return nil, fmt.Errorf("opening cgroup %s: %w", dir, err)
	}
	return &execCgroup{dir: dir, fd: fd}, nil
}

// oomKilled reports whether the OOM killer killed a task of the cgroup.
func (e *execCgroup) oomKilled() bool {
	data, err := os.ReadFile(filepath.Join(e.dir, "memory.events"))
	if err != nil {
		return false
	}
	return parseKeyedCounters(data)["oom_kill"] > 0
}

// kill kills every task in the cgroup (cgroup.kill, Linux 5.14+).
func (e *execCgroup) kill() {
	if f, err := os.OpenFile(filepath.Join(e.dir, "cgroup.kill"), os.O_WRONLY, 0); err == nil {
		f.WriteString("1")
		f.Close()
	}
}

// release closes the cgroup's fd and removes it; if tasks still live in it
// (background processes of the Exec) the removal is retried later.
func (c *cgroups) release(e *execCgroup) {
	if e.fd >= 0 {
		syscall.Close(e.fd)
		e.fd = -1
	}
	if err := syscall.Rmdir(e.dir); err != nil && err != syscall.ENOENT {
		c.mu.Lock()
		c.pending = append(c.pending, e.dir)
		c.mu.Unlock()
	}
}

// sweep removes released cgroups whose tasks have gone since.
func (c *cgroups) sweep() {
	c.mu.Lock()
	defer c.mu.Unlock()
	kept := c.pending[:0]
	for _, dir := range c.pending {
		if err := syscall.Rmdir(dir); err == syscall.EBUSY {
			kept = append(kept, dir)
		} else if err != nil && err != syscall.ENOENT {
			c.log.Warn("cgroup: cannot remove", "dir", dir, "err", err)
		}
	}
	c.pending = kept
}
