package seccomp

import (
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"

	libseccomp "github.com/elastic/go-seccomp-bpf"
	"github.com/elastic/go-seccomp-bpf/arch"
	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"
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
	// SocketFamilies, when not nil, are the only address families
	// (argument 0, the domain) socket and socketpair are allowed with;
	// any other is outside the list. socket and socketpair are then not
	// in Syscalls. Nil leaves them to Syscalls.
	SocketFamilies []int
	// Mode is what a call outside the list does.
	Mode Mode
}

// VMM returns the reviewed allowlist of a kiln-vmm process, in Kill
// mode.
func VMM() *Policy {
	return &Policy{Syscalls: vmmSyscalls(), Ioctls: vmmIoctls(), Mode: Kill}
}

// JailedVMM returns the allowlist of a jailed kiln-vmm process, in
// Kill mode: VMM's, with socket and socketpair for AF_UNIX only. A
// jailed VMM fetches no image chunk itself (its parent does, over
// image/chunkrpc's Unix socket) and dials its guest's vsock connections
// through its parent (vmmproc.DialSocket, a Unix socket); its tap was
// opened before the filter (open /dev/net/tun and TUN ioctls, no
// socket). So a VMM taken over cannot open an IP, netlink or packet
// socket in the sandbox's network namespace, whatever the egress policy.
func JailedVMM() *Policy {
	p := VMM()
	p.Syscalls = slices.DeleteFunc(p.Syscalls, func(n string) bool { return n == "socket" || n == "socketpair" })
	p.SocketFamilies = []int{unix.AF_UNIX}
	return p
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
		if (n == "socket" || n == "socketpair") && p.SocketFamilies != nil {
			return nil, fmt.Errorf("seccomp: %s is both allowed outright and restricted to address families", n)
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
	if p.SocketFamilies != nil {
		if insts, err = p.appendSocketFamilies(insts, def); err != nil {
			return nil, err
		}
	}
	if len(insts) > maxInstructions {
		return nil, fmt.Errorf("seccomp: the program has %d instructions, the kernel takes %d", len(insts), maxInstructions)
	}
	return insts, nil
}

// maxInstructions is the kernel's BPF_MAXINSNS for a classic filter.
const maxInstructions = 4096

// Offsets in struct seccomp_data, and the byte order the kernel gives it
// (x86-64: little-endian, so an argument's low word comes first).
const (
	dataNr   = 0
	dataArch = 4
	dataArgs = 16
)

// appendSocketFamilies replaces the program's last instruction, its
// default action, with the check of socket's and socketpair's domain.
// Every path of go-seccomp-bpf's program that matched nothing ends on
// that instruction (the groups' fall-throughs and the architecture
// check's jump), and the accumulator may hold an argument there (the
// ioctl group's failed compare), so the check starts again from the
// architecture and the number. It is not a group of go-seccomp-bpf's:
// after a failed argument check its next syscall in a group compares
// the argument, not the number, against its number.
func (p *Policy) appendSocketFamilies(insts []bpf.Instruction, def libseccomp.Action) ([]bpf.Instruction, error) {
	last, ok := insts[len(insts)-1].(bpf.RetConstant)
	if !ok || last.Val != uint32(def) {
		return nil, fmt.Errorf("seccomp: the program ends with %v, not its default action", insts[len(insts)-1])
	}
	info, err := arch.GetInfo("")
	if err != nil {
		return nil, fmt.Errorf("seccomp: %w", err)
	}
	seen := map[int]bool{}
	for _, f := range p.SocketFamilies {
		if f < 0 || f > 0xffff || seen[f] {
			return nil, fmt.Errorf("seccomp: socket family %d: negative, too large or listed twice", f)
		}
		seen[f] = true
	}
	ret := func(a libseccomp.Action) bpf.Instruction { return bpf.RetConstant{Val: uint32(a)} }
	// One block per call: if the number is not this call's, skip the
	// block; the domain's high word must be 0 and its low word one of
	// the families; else the default action.
	block := func(nr int) []bpf.Instruction {
		n := len(p.SocketFamilies)
		b := []bpf.Instruction{
			bpf.LoadAbsolute{Off: dataNr, Size: 4},
			bpf.JumpIf{Cond: bpf.JumpNotEqual, Val: uint32(nr), SkipTrue: uint8(n + 5)},
			bpf.LoadAbsolute{Off: dataArgs + 4, Size: 4}, // argument 0, high word
			bpf.JumpIf{Cond: bpf.JumpNotEqual, Val: 0, SkipTrue: uint8(n + 1)},
			bpf.LoadAbsolute{Off: dataArgs, Size: 4}, // argument 0, low word
		}
		for i, f := range p.SocketFamilies {
			b = append(b, bpf.JumpIf{Cond: bpf.JumpEqual, Val: uint32(f), SkipTrue: uint8(n - i)})
		}
		return append(b, ret(def), ret(libseccomp.ActionAllow))
	}
	if len(p.SocketFamilies) > 200 {
		return nil, fmt.Errorf("seccomp: %d socket families: at most 200", len(p.SocketFamilies))
	}
	out := append([]bpf.Instruction(nil), insts[:len(insts)-1]...)
	out = append(out,
		bpf.LoadAbsolute{Off: dataArch, Size: 4},
		bpf.JumpIf{Cond: bpf.JumpEqual, Val: uint32(info.ID), SkipFalse: 1},
		bpf.Jump{Skip: 1},
		ret(def),
	)
	out = append(out, block(info.SyscallNames["socket"])...)
	out = append(out, block(info.SyscallNames["socketpair"])...)
	return append(out, ret(def)), nil
}
