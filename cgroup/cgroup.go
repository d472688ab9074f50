// Package cgroup is kilnd's part of the host's cgroup v2 tree: the subtree
// systemd delegates to it (Delegate=yes), in which kilnd's own process
// sits in root/kilnd and every sandbox's VMM process in a cgroup of its
// own, root/sandboxes/<id>, with the sandbox's limits: cpu.max from its
// vCPUs, memory.max from its memory plus a bounded VMM overhead (no swap,
// the whole group killed on OOM), pids.max, and optional io.max lines for
// its disks.
//
// A Manager is opened on the delegated root (Open); Create makes a
// sandbox's cgroup and returns it as a Group, whose folder (or an
// O_PATH descriptor of it) a VMM process starts in directly
// (clone3's CLONE_INTO_CGROUP). Paths are configurable (Options.Mount,
// Options.ProcSelf), so that tests run on a fake tree in a temporary
// folder.
package cgroup

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// The controllers a sandbox's cgroup uses. Memory is required; the others
// are used when the delegated root has them.
var wantControllers = []string{"cpu", "memory", "pids", "io"}

// Limits are a sandbox's share of the host.
type Limits struct {
	// CPUs caps CPU time at this many CPUs (cpu.max); 0: no cap.
	CPUs int
	// MemoryMiB is the guest's memory and OverheadMiB the VMM process's
	// own (page tables, device buffers, the Go runtime): memory.max is
	// their sum. 0 and 0: no cap.
	MemoryMiB   uint64
	OverheadMiB uint64
	// PidsMax caps the cgroup's tasks (pids.max); 0: no cap.
	PidsMax int
	// IO caps the sandbox's disks (io.max), one line each.
	IO []IOLimit
}

// MemoryMax is memory.max in bytes (0: none).
func (l Limits) MemoryMax() uint64 { return (l.MemoryMiB + l.OverheadMiB) << 20 }

// IOLimit caps one block device: bytes and operations per second, read
// and write; 0 leaves that one unlimited ("max").
type IOLimit struct {
	// Device is a block device ("/dev/vda"), a file on the device to cap
	// (a disk image: the whole disk its filesystem lies on), or "MAJ:MIN".
	Device                                 string
	ReadBPS, WriteBPS, ReadIOPS, WriteIOPS uint64
}

// Events are a cgroup's memory.events counters.
type Events struct {
	// Low, High and Max count the times the cgroup's memory went past
	// memory.low, memory.high and memory.max (reclaim was forced).
	Low, High, Max uint64
	// OOM counts the times the cgroup hit memory.max with nothing left to
	// reclaim; OOMKill the processes the OOM killer killed in it;
	// OOMGroupKill the times it killed the whole group.
	OOM, OOMKill, OOMGroupKill uint64
}

// ErrInvalidID is what Create and Get say of an ID that cannot name a
// cgroup folder.
var ErrInvalidID = errors.New("cgroup: invalid ID")

// maxIDLen bounds an ID.
const maxIDLen = 128

// CheckID refuses an ID that is empty, long, has a slash, a NUL or a
// control character, or is only dots.
func CheckID(id string) error {
	if id == "" {
		return fmt.Errorf("%w: empty", ErrInvalidID)
	}
	if len(id) > maxIDLen {
		return fmt.Errorf("%w: %d bytes, at most %d", ErrInvalidID, len(id), maxIDLen)
	}
	if strings.Trim(id, ".") == "" {
		return fmt.Errorf("%w: %q is only dots", ErrInvalidID, id)
	}
	for _, c := range id {
		if c == '/' || c < 0x20 || c == 0x7f {
			return fmt.Errorf("%w: %q has a slash or a control character", ErrInvalidID, id)
		}
	}
	// The kernel's own files start with a controller's name and a dot
	// ("memory.max"); a cgroup named so would still work, but it reads
	// as one of them.
	if strings.HasPrefix(id, "cgroup.") {
		return fmt.Errorf("%w: %q reads as a cgroup interface file", ErrInvalidID, id)
	}
	return nil
}

// ParseEvents parses memory.events ("low 0\nhigh 0\nmax 12\n...").
// Unknown keys are skipped (newer kernels add some); a malformed line is
// an error.
func ParseEvents(s string) (Events, error) {
	var e Events
	for i, line := range strings.Split(s, "\n") {
		line = strings.TrimSpace(line)
		if line == "" {
			continue
		}
		k, v, ok := strings.Cut(line, " ")
		if !ok {
			return Events{}, fmt.Errorf("cgroup: memory.events line %d %q: want KEY VALUE", i+1, line)
		}
		n, err := strconv.ParseUint(strings.TrimSpace(v), 10, 64)
		if err != nil {
			return Events{}, fmt.Errorf("cgroup: memory.events line %d %q: %w", i+1, line, err)
		}
		switch k {
		case "low":
			e.Low = n
		case "high":
			e.High = n
		case "max":
			e.Max = n
		case "oom":
			e.OOM = n
		case "oom_kill":
			e.OOMKill = n
		case "oom_group_kill":
			e.OOMGroupKill = n
		}
	}
	return e, nil
}

// ParseControllers parses cgroup.controllers or cgroup.subtree_control
// ("cpuset cpu io memory pids").
func ParseControllers(s string) (map[string]bool, error) {
	out := map[string]bool{}
	for _, c := range strings.Fields(s) {
		for _, r := range c {
			if !(r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '_') {
				return nil, fmt.Errorf("cgroup: controller %q: want lower-case letters, digits and '_'", c)
			}
		}
		out[c] = true
	}
	return out, nil
}

// ParseProcCgroup returns the cgroup v2 path of a /proc/PID/cgroup
// ("0::/system.slice/kilnd.service"): the "0::" line; the v1 lines of a
// hybrid host are skipped. No such line is an error: the process is not
// in a cgroup v2 hierarchy.
func ParseProcCgroup(s string) (string, error) {
	for _, line := range strings.Split(s, "\n") {
		rest, ok := strings.CutPrefix(line, "0::")
		if !ok {
			continue
		}
		p := strings.TrimSpace(rest)
		if !strings.HasPrefix(p, "/") {
			return "", fmt.Errorf("cgroup: /proc/self/cgroup: v2 path %q is not absolute", p)
		}
		if strings.Contains(p, "/../") || strings.HasSuffix(p, "/..") || strings.Contains(p, "\x00") {
			return "", fmt.Errorf("cgroup: /proc/self/cgroup: v2 path %q is not clean", p)
		}
		// A process whose cgroup was removed from under it reads
		// "/path (deleted)".
		if strings.HasSuffix(p, " (deleted)") {
			return "", fmt.Errorf("cgroup: /proc/self/cgroup: the process's cgroup %q was removed", strings.TrimSuffix(p, " (deleted)"))
		}
		return p, nil
	}
	return "", errors.New("cgroup: /proc/self/cgroup has no cgroup v2 line (0::/path): this host is not on the unified hierarchy")
}

// parseProcs parses cgroup.procs: one PID a line.
func parseProcs(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Fields(s) {
		n, err := strconv.Atoi(f)
		if err != nil || n <= 0 {
			return nil, fmt.Errorf("cgroup: cgroup.procs: %q is not a PID", f)
		}
		out = append(out, n)
	}
	return out, nil
}

// ioLine is an io.max line for device dev (MAJ:MIN).
func ioLine(dev string, l IOLimit) string {
	v := func(n uint64) string {
		if n == 0 {
			return "max"
		}
		return strconv.FormatUint(n, 10)
	}
	return fmt.Sprintf("%s rbps=%s wbps=%s riops=%s wiops=%s", dev, v(l.ReadBPS), v(l.WriteBPS), v(l.ReadIOPS), v(l.WriteIOPS))
}

// parseMajMin accepts "MAJ:MIN".
func parseMajMin(s string) (uint32, uint32, bool) {
	a, b, ok := strings.Cut(s, ":")
	if !ok {
		return 0, 0, false
	}
	maj, err1 := strconv.ParseUint(a, 10, 32)
	min, err2 := strconv.ParseUint(b, 10, 32)
	return uint32(maj), uint32(min), err1 == nil && err2 == nil
}
