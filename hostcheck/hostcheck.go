// Package hostcheck checks whether a host can run kilnd: KVM usable,
// cgroup v2 mounted and kilnd's cgroup delegated, nftables, /dev/net/tun,
// network namespaces, IPv4 forwarding, huge pages for guest RAM, the state
// folder's free space, the guest kernel cache and the guest agent. kiln doctor runs them.
//
// Each check is a plain function of a Host, whose paths (and the few
// kernel calls that cannot be faked with files) can be pointed elsewhere,
// so that tests run the checks over fake trees.
package hostcheck

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/guestkernel"
	"github.com/kilnvm/kiln/sandbox"
)

// Status is a check's verdict.
type Status int

const (
	OK   Status = iota // the host has it
	Warn               // it works, or a part does, but not as kilnd wants
	Fail               // it is missing or broken
)

func (s Status) String() string {
	switch s {
	case OK:
		return "ok"
	case Warn:
		return "warn"
	}
	return "FAIL"
}

// MarshalJSON writes the status as "ok", "warn" or "fail".
func (s Status) MarshalJSON() ([]byte, error) {
	if s == Fail {
		return json.Marshal("fail")
	}
	return json.Marshal(s.String())
}

// Result is one check's outcome.
type Result struct {
	Name   string `json:"name"`
	Status Status `json:"status"`
	// Detail says what was found.
	Detail string `json:"detail"`
	// Hint says what to do, when Status is not OK.
	Hint string `json:"hint,omitempty"`
	// Required: kilnd cannot run sandboxes (as configured) while this
	// check fails.
	Required bool `json:"required"`
}

// Host is what the checks look at: paths, and the kernel calls that no
// fake file can answer (nil: the real ones).
type Host struct {
	KVM            string // /dev/kvm
	CPUInfo        string // /proc/cpuinfo: vmx or svm
	SysModule      string // /sys/module: kvm_pvm
	CgroupMount    string // /sys/fs/cgroup
	ProcSelfCgroup string // /proc/self/cgroup
	// CgroupRoot is kilnd's --cgroup-root: "" for kilnd's own cgroup
	// (kilnd.service's when it exists, else this process's), "none" for
	// none (the cgroup checks are then not required).
	CgroupRoot     string
	Tun            string // /dev/net/tun
	NetNS          string // /proc/self/ns/net
	ProcSelfStatus string // /proc/self/status: CapEff
	IPForward      string // /proc/sys/net/ipv4/ip_forward
	ShmemTHP       string // /sys/kernel/mm/transparent_hugepage/shmem_enabled
	StateDir       string // kilnd's --state-dir
	KernelCache    string // Kiln's cache root (guestkernel.CacheDir)
	Agent          string // kiln-agent; "" for sandbox.FindAgent's
	VMM            string // kiln-vmm; "" for sandbox.FindVMM's
	// Network: kilnd is to give sandboxes networks (--net-pool), so the
	// network checks are required.
	Network bool

	// Statfs is unix.Statfs when nil.
	Statfs func(path string, st *unix.Statfs_t) error
	// ProbeKVM opens a KVM device, checks its API version and creates a
	// VM; nil: the real one.
	ProbeKVM func(path string) error
	// ListTables lists the nftables tables of this network namespace and
	// returns how many; nil: the real one (netlink).
	ListTables func() (int, error)
	// UnshareNet makes a network namespace and leaves it; nil: the real
	// one (unshare on a thread of its own).
	UnshareNet func() error
	// ProbeVerity seals a new file in a folder with fs-verity (then
	// removes it); nil: the real one.
	ProbeVerity func(dir string) error
}

// Default is this host, with kilnd's defaults.
func Default() Host {
	h := Host{
		KVM:            "/dev/kvm",
		CPUInfo:        "/proc/cpuinfo",
		SysModule:      "/sys/module",
		CgroupMount:    "/sys/fs/cgroup",
		ProcSelfCgroup: "/proc/self/cgroup",
		Tun:            "/dev/net/tun",
		NetNS:          "/proc/self/ns/net",
		ProcSelfStatus: "/proc/self/status",
		IPForward:      "/proc/sys/net/ipv4/ip_forward",
		ShmemTHP:       "/sys/kernel/mm/transparent_hugepage/shmem_enabled",
		StateDir:       "/var/lib/kiln",
		Network:        true,
	}
	if dir, err := guestkernel.CacheDir(); err == nil {
		h.KernelCache = dir
	}
	return h
}

// Check is one named check.
type Check struct {
	Name string
	Run  func(ctx context.Context, h *Host) Result
}

// Checks are every check, in the order kiln doctor prints them.
func Checks() []Check {
	return []Check{
		{"kvm", CheckKVM},
		{"cgroup2", CheckCgroup2},
		{"cgroup-delegation", CheckDelegation},
		{"nftables", CheckNftables},
		{"tun", CheckTun},
		{"netns", CheckNetns},
		{"ip-forward", CheckIPForward},
		{"guest-ram-hugepages", CheckHugePages},
		{"disk", CheckDisk},
		{"snapshot-verity", CheckSnapshotVerity},
		{"guest-kernel", CheckKernel},
		{"agent", CheckAgent},
		{"vmm", CheckVMM},
	}
}

// Run runs every check on h.
func (h *Host) Run(ctx context.Context) []Result {
	var out []Result
	for _, c := range Checks() {
		if ctx.Err() != nil {
			out = append(out, Result{Name: c.Name, Status: Fail, Detail: "not run: " + ctx.Err().Error(), Required: true})
			continue
		}
		r := c.Run(ctx, h)
		r.Name = c.Name
		out = append(out, r)
	}
	return out
}

// Failed reports whether a required check failed.
func Failed(rs []Result) bool {
	for _, r := range rs {
		if r.Required && r.Status == Fail {
			return true
		}
	}
	return false
}

func (h *Host) statfs(path string, st *unix.Statfs_t) error {
	if h.Statfs != nil {
		return h.Statfs(path, st)
	}
	return unix.Statfs(path, st)
}

// CheckKernel: the guest kernel cache has a current kernel.
func CheckKernel(_ context.Context, h *Host) Result {
	r := Result{Required: true}
	if h.KernelCache == "" {
		r.Status, r.Detail = Fail, "no kernel cache: $KILN_CACHE, $XDG_CACHE_HOME and $HOME are unset"
		r.Hint = "set KILN_CACHE (kilnd.service uses KILN_CACHE=/var/cache/kiln) and run make kernel"
		return r
	}
	k, err := guestkernel.FindIn(h.KernelCache)
	if err != nil {
		r.Status, r.Detail = Fail, err.Error()
		r.Hint = fmt.Sprintf("KILN_CACHE=%s make kernel (kilnd.service uses KILN_CACHE=/var/cache/kiln)", h.KernelCache)
		return r
	}
	r.Detail = fmt.Sprintf("%s in %s", k.Version, h.KernelCache)
	if k.Vmlinux == "" {
		r.Detail += " (no vmlinux: boots through the bzImage's decompressor, slower)"
	}
	return r
}

// CheckAgent: the static guest agent is there and executable.
func CheckAgent(_ context.Context, h *Host) Result {
	r := Result{Required: true}
	p := h.Agent
	if p == "" {
		var err error
		if p, err = sandbox.FindAgent(); err != nil {
			r.Status, r.Detail = Fail, err.Error()
			r.Hint = "make install puts kiln-agent beside kiln and kilnd; or set $KILN_AGENT (kilnd: --agent)"
			return r
		}
	}
	return checkBinary(r, p, "kiln-agent")
}

// CheckVMM: the kiln-vmm binary every sandbox's VMM process runs is
// there and executable.
func CheckVMM(_ context.Context, h *Host) Result {
	r := Result{Required: true}
	p := h.VMM
	if p == "" {
		var err error
		if p, err = sandbox.FindVMM(); err != nil {
			r.Status, r.Detail = Fail, err.Error()
			r.Hint = "make install puts kiln-vmm beside kiln and kilnd; or set $KILN_VMM (kilnd: --vmm)"
			return r
		}
	}
	return checkBinary(r, p, "kiln-vmm")
}

// checkBinary fills in r for the binary p built from ./cmd/name: an
// executable ELF file (its absolute path the detail).
func checkBinary(r Result, p, name string) Result {
	fi, err := os.Stat(p)
	if err != nil {
		r.Status, r.Detail, r.Hint = Fail, err.Error(), "make build (bin/"+name+") or make install"
		return r
	}
	if !fi.Mode().IsRegular() || fi.Mode().Perm()&0o111 == 0 {
		r.Status, r.Detail, r.Hint = Fail, p+" is not an executable file", "chmod 755 "+p
		return r
	}
	f, err := os.Open(p)
	if err != nil {
		r.Status, r.Detail = Fail, err.Error()
		return r
	}
	defer f.Close()
	magic := make([]byte, 4)
	if _, err := f.ReadAt(magic, 0); err != nil || string(magic) != "\x7fELF" {
		r.Status, r.Detail, r.Hint = Fail, p+" is not an ELF binary", "rebuild it: CGO_ENABLED=0 go build -o "+p+" ./cmd/"+name
		return r
	}
	abs, _ := filepath.Abs(p)
	r.Detail = abs
	return r
}
