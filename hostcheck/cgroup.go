package hostcheck

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// cgroup2Magic is CGROUP2_SUPER_MAGIC, statfs's f_type of a cgroup2 mount.
const cgroup2Magic = 0x63677270

// tmpfsMagic is TMPFS_MAGIC: /sys/fs/cgroup of a v1 or hybrid host.
const tmpfsMagic = 0x01021994

// wantControllers are the controllers kilnd limits sandboxes with; memory
// is the one it cannot do without.
var wantControllers = []string{"cpu", "memory", "pids", "io"}

// CheckCgroup2: cgroup v2 is mounted at CgroupMount (the unified
// hierarchy, not v1 or hybrid).
func CheckCgroup2(_ context.Context, h *Host) Result {
	r := Result{Required: h.CgroupRoot != "none"}
	var st unix.Statfs_t
	if err := h.statfs(h.CgroupMount, &st); err != nil {
		r.Status, r.Detail = Fail, fmt.Sprintf("statfs %s: %v", h.CgroupMount, err)
		r.Hint = "mount cgroup2 there: boot with systemd.unified_cgroup_hierarchy=1 (the default since Debian 11)"
		return r
	}
	if st.Type == cgroup2Magic {
		r.Detail = h.CgroupMount + " is cgroup2"
		return r
	}
	r.Status = Fail
	what := fmt.Sprintf("filesystem type %#x", st.Type)
	if st.Type == tmpfsMagic {
		what = "tmpfs, with cgroup v1 hierarchies below it"
		var u unix.Statfs_t
		if h.statfs(filepath.Join(h.CgroupMount, "unified"), &u) == nil && u.Type == cgroup2Magic {
			what = "tmpfs: a cgroup v1 hybrid host (v1 controllers, cgroup2 only at " + filepath.Join(h.CgroupMount, "unified") + " without them)"
		}
	}
	r.Detail = fmt.Sprintf("%s is not cgroup2 but %s", h.CgroupMount, what)
	r.Hint = "boot with systemd.unified_cgroup_hierarchy=1 (kernel command line) for the unified hierarchy; or run kilnd with --cgroup-root none (no per-sandbox limits)"
	if !r.Required {
		r.Status = Warn
	}
	return r
}

// CheckDelegation: kilnd's cgroup (CgroupRoot; "" for kilnd.service's,
// else this process's) lets it make a cgroup per sandbox: its
// cgroup.controllers offers cpu, memory, pids and io, and its
// cgroup.subtree_control and cgroup.procs are writable.
func CheckDelegation(_ context.Context, h *Host) Result {
	if h.CgroupRoot == "none" {
		return Result{Status: Warn, Detail: "off (--cgroup-root none): sandboxes run without cpu, memory and pids limits",
			Hint: "drop --cgroup-root none to limit each sandbox in a cgroup of its own"}
	}
	r := Result{Required: true}
	dir, which, err := h.kilndCgroup()
	if err != nil {
		r.Status, r.Detail = Fail, err.Error()
		r.Hint = "kilnd needs cgroup v2: see the cgroup2 check"
		return r
	}
	b, err := os.ReadFile(filepath.Join(dir, "cgroup.controllers"))
	if err != nil {
		r.Status, r.Detail = Fail, fmt.Sprintf("%s (%s): %v", dir, which, err)
		r.Hint = "is " + h.CgroupMount + " cgroup2? see the cgroup2 check"
		return r
	}
	have := map[string]bool{}
	for _, c := range strings.Fields(string(b)) {
		have[c] = true
	}
	var missing []string
	for _, c := range wantControllers {
		if !have[c] {
			missing = append(missing, c)
		}
	}
	var unwritable []string
	for _, f := range []string{"cgroup.subtree_control", "cgroup.procs"} {
		if err := writable(filepath.Join(dir, f)); err != nil {
			unwritable = append(unwritable, f)
		}
	}
	r.Detail = fmt.Sprintf("%s (%s): controllers %q", dir, which, strings.TrimSpace(string(b)))
	switch {
	case len(unwritable) > 0:
		r.Status = Fail
		r.Detail += "; cannot write " + strings.Join(unwritable, ", ")
		r.Hint = "delegate it: Delegate=yes in kilnd.service (packaging/), or run kilnd as root with --cgroup-root a cgroup it owns"
	case !have["memory"]:
		r.Status = Fail
		r.Detail += "; missing " + strings.Join(missing, " ")
		r.Hint = "enable the memory controller in the parent's cgroup.subtree_control (Delegate=yes does this for kilnd.service)"
	case len(missing) > 0:
		r.Status = Warn
		r.Detail += "; missing " + strings.Join(missing, " ") + " (those limits are off)"
		r.Hint = "enable them in the parent's cgroup.subtree_control (Delegate=yes asks systemd for all)"
	}
	return r
}

// kilndCgroup is the cgroup the delegation check looks at and what it is.
func (h *Host) kilndCgroup() (dir, which string, err error) {
	if h.CgroupRoot != "" {
		return h.CgroupRoot, "--cgroup-root", nil
	}
	svc := filepath.Join(h.CgroupMount, "system.slice", "kilnd.service")
	if fi, err := os.Stat(svc); err == nil && fi.IsDir() {
		return svc, "kilnd.service's", nil
	}
	f, err := os.Open(h.ProcSelfCgroup)
	if err != nil {
		return "", "", fmt.Errorf("this process's cgroup: %w", err)
	}
	defer f.Close()
	p, err := ParseProcCgroup(f)
	if err != nil {
		return "", "", fmt.Errorf("%s: %w", h.ProcSelfCgroup, err)
	}
	return filepath.Join(h.CgroupMount, p), "this process's: kilnd.service is not running; under it kilnd gets a delegated one", nil
}

// errNoUnified is /proc/self/cgroup without a cgroup v2 ("0::") line.
var errNoUnified = errors.New("no cgroup v2 entry (0::/PATH): the process is in no unified hierarchy")

// ParseProcCgroup returns the cgroup v2 path ("0::/PATH") of a
// /proc/PID/cgroup file.
func ParseProcCgroup(r interface{ Read([]byte) (int, error) }) (string, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 4096), 1<<16)
	for sc.Scan() {
		rest, ok := strings.CutPrefix(sc.Text(), "0::")
		if !ok {
			continue
		}
		if !strings.HasPrefix(rest, "/") {
			return "", fmt.Errorf("cgroup v2 path %q is not absolute", rest)
		}
		clean := filepath.Clean(rest)
		if clean != rest && rest != "/" && clean+"/" != rest {
			return "", fmt.Errorf("cgroup v2 path %q is not clean", rest)
		}
		if strings.Contains(rest, " (deleted)") {
			return "", fmt.Errorf("cgroup v2 path %q: the cgroup is deleted", rest)
		}
		return clean, nil
	}
	if err := sc.Err(); err != nil {
		return "", err
	}
	return "", errNoUnified
}

// writable reports whether path opens for writing (nothing is written).
func writable(path string) error {
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	return f.Close()
}
