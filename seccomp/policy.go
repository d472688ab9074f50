package seccomp

import (
	"errors"
	"fmt"
	"sort"
	"strings"

	libseccomp "github.com/elastic/go-seccomp-bpf"
	"github.com/elastic/go-seccomp-bpf/arch"
	"golang.org/x/net/bpf"
)

// EnvMode is the environment variable a VMM process reads its Mode from
// (vmmproc.ServeMain): "kill" (or unset), "log" or "off".
const EnvMode = "KILN_SECCOMP"

// Mode says what a filter does with a call outside its allowlist.
type Mode int

const (
	// Kill kills the process (SECCOMP_RET_KILL_PROCESS): production.
	Kill Mode = iota
	// Log lets the call through and has the kernel log it (SECCOMP_RET_LOG:
	// an audit line of type=1326 with syscall=N in the kernel log): for
	// recording what a workload calls.
	Log
	// Off installs nothing: a debugging switch only.
	Off
)

func (m Mode) String() string {
	switch m {
	case Kill:
		return "kill"
	case Log:
		return "log"
	case Off:
		return "off"
	}
	return fmt.Sprintf("Mode(%d)", int(m))
}

// ParseMode parses a Mode as EnvMode spells it; "" is Kill.
func ParseMode(s string) (Mode, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "", "kill":
		return Kill, nil
	case "log":
		return Log, nil
	case "off":
		return Off, nil
	}
	return Kill, fmt.Errorf("seccomp: mode %q: want kill, log or off", s)
}

// Policy is an allowlist: system calls allowed outright, and the ioctl
// request numbers allowed (any other ioctl is outside the list).
type Policy struct {
	// Syscalls are allowed whatever their arguments, by name.
	Syscalls []string
	// Ioctls are the ioctl requests (argument 1) allowed.
	Ioctls []uintptr
	// Mode is what a call outside the list does.
	Mode Mode
}

// VMM returns the reviewed allowlist of a `kiln vmm` process, in Kill
// mode.
func VMM() *Policy {
	return &Policy{Syscalls: vmmSyscalls(), Ioctls: vmmIoctls(), Mode: Kill}
}

// ErrUnknownSyscall: a Policy names a system call the architecture does not
// have.
var ErrUnknownSyscall = errors.New("seccomp: unknown system call")

// Numbers resolves the policy's syscall names to this architecture's
// numbers, sorted.
func (p *Policy) Numbers() ([]int, error) {
	info, err := arch.GetInfo("")
	if err != nil {
		return nil, fmt.Errorf("seccomp: %w", err)
	}
	var nums []int
	var unknown []string
	for _, n := range p.Syscalls {
		num, ok := info.SyscallNames[n]
		if !ok {
			unknown = append(unknown, n)
			continue
		}
		nums = append(nums, num)
	}
	if len(unknown) > 0 {
		return nil, fmt.Errorf("%w on %s: %s", ErrUnknownSyscall, info.Name, strings.Join(unknown, ", "))
	}
	sort.Ints(nums)
	return nums, nil
}

// action is the default action of the mode.
func (p *Policy) action() (libseccomp.Action, error) {
	switch p.Mode {
	case Kill:
		return libseccomp.ActionKillProcess, nil
	case Log:
		return libseccomp.ActionLog, nil
	}
	return 0, fmt.Errorf("seccomp: no filter in mode %v", p.Mode)
}

// Assemble returns the policy's BPF program: the architecture check (a
// call under another ABI gets the default action; an x32 one ENOSYS),
// the plain allowlist, then ioctl by request number, then the default
// action.
func (p *Policy) Assemble() ([]bpf.Instruction, error) {
	if _, err := p.Numbers(); err != nil {
		return nil, err
	}
	def, err := p.action()
	if err != nil {
		return nil, err
	}
	for _, n := range p.Syscalls {
		if n == "ioctl" && len(p.Ioctls) > 0 {
			return nil, errors.New("seccomp: ioctl is both allowed outright and restricted to request numbers")
		}
	}
	// The plain calls come first and the ioctl requests after them, in
	// p.Ioctls' order (KVM_RUN first): placed first, go-seccomp-bpf
	// v1.6.0's ioctl group let a request with high bits set through
	// (TestVMMPolicyDecisions).
	groups := []libseccomp.SyscallGroup{{Names: p.Syscalls, Action: libseccomp.ActionAllow}}
	if len(p.Ioctls) > 0 {
		// A group of its own, and the last: after a failed argument
		// check the accumulator holds the argument, not the syscall
		// number, so nothing but the default action may follow it.
		var conds []libseccomp.NameWithConditions
		seen := map[uintptr]bool{}
		for _, req := range p.Ioctls {
			if seen[req] {
				return nil, fmt.Errorf("seccomp: ioctl request %#x listed twice", req)
			}
			seen[req] = true
			conds = append(conds, libseccomp.NameWithConditions{Name: "ioctl", Conditions: libseccomp.ArgumentConditions{
				{Argument: 1, Operation: libseccomp.Equal, Value: uint64(req)},
			}})
		}
		groups = append(groups, libseccomp.SyscallGroup{NamesWithCondtions: conds, Action: libseccomp.ActionAllow})
	}
	pol := libseccomp.Policy{DefaultAction: def, Syscalls: groups}
	insts, err := pol.Assemble()
	if err != nil {
		return nil, fmt.Errorf("seccomp: assemble: %w", err)
	}
	if len(insts) > maxInstructions {
		return nil, fmt.Errorf("seccomp: the program has %d instructions, the kernel takes %d", len(insts), maxInstructions)
	}
	return insts, nil
}

// maxInstructions is the kernel's BPF_MAXINSNS for a classic filter.
const maxInstructions = 4096
