package seccomp

import (
	"encoding/binary"
	"errors"
	"slices"
	"testing"

	"github.com/elastic/go-seccomp-bpf/arch"
	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/kvm"
)

const (
	auditArchX8664 = 0xc000003e
	auditArchI386  = 0x40000003
	x32Bit         = 0x40000000
)

// run runs the program on one seccomp_data (nr, arch, ip, args) and
// returns the action. x/net/bpf loads words big-endian, so each 32-bit
// word is stored big-endian where the kernel's little-endian layout puts
// it: an argument's low word first.
func run(t *testing.T, insts []bpf.Instruction, nr, auditArch uint32, args ...uint64) uint32 {
	t.Helper()
	vm, err := bpf.NewVM(insts)
	if err != nil {
		t.Fatalf("NewVM: %v", err)
	}
	buf := make([]byte, 64)
	binary.BigEndian.PutUint32(buf[0:], nr)
	binary.BigEndian.PutUint32(buf[4:], auditArch)
	for i, a := range args {
		binary.BigEndian.PutUint32(buf[16+8*i:], uint32(a))
		binary.BigEndian.PutUint32(buf[16+8*i+4:], uint32(a>>32))
	}
	r, err := vm.Run(buf)
	if err != nil {
		t.Fatalf("run: %v", err)
	}
	return uint32(r)
}

// TestVMMPolicyAssembles checks that the VMM's allowlist resolves and
// assembles in every mode that has a filter, within the kernel's limit.
func TestVMMPolicyAssembles(t *testing.T) {
	for _, mode := range []Mode{Kill, Log} {
		p := VMM()
		p.Mode = mode
		insts, err := p.Assemble()
		if err != nil {
			t.Fatalf("%v: %v", mode, err)
		}
		if len(insts) == 0 || len(insts) > maxInstructions {
			t.Fatalf("%v: %d instructions", mode, len(insts))
		}
		t.Logf("%v: %d syscalls, %d ioctls, %d instructions", mode, len(p.Syscalls), len(p.Ioctls), len(insts))
	}
	p := VMM()
	p.Mode = Off
	if _, err := p.Assemble(); err == nil {
		t.Fatal("Assemble in mode off made a program")
	}
}

// TestVMMPolicyDecisions runs the VMM's program on calls it must allow
// and calls it must refuse.
func TestVMMPolicyDecisions(t *testing.T) {
	insts, err := VMM().Assemble()
	if err != nil {
		t.Fatal(err)
	}
	const (
		allow = unix.SECCOMP_RET_ALLOW
		kill  = unix.SECCOMP_RET_KILL_PROCESS
	)
	kvmReqs := kvm.IoctlRequests()
	tests := []struct {
		name string
		nr   uint32
		arch uint32
		args []uint64
		want uint32
	}{
		{"read", unix.SYS_READ, auditArchX8664, nil, allow},
		{"futex", unix.SYS_FUTEX, auditArchX8664, nil, allow},
		{"memfd_create", unix.SYS_MEMFD_CREATE, auditArchX8664, nil, allow},
		{"accept4", unix.SYS_ACCEPT4, auditArchX8664, nil, allow},
		{"ioctl KVM_RUN", unix.SYS_IOCTL, auditArchX8664, []uint64{5, uint64(kvmReqs[len(kvmReqs)/2])}, allow},
		{"ioctl first KVM request", unix.SYS_IOCTL, auditArchX8664, []uint64{5, uint64(kvmReqs[0])}, allow},
		{"ioctl TUNSETIFF", unix.SYS_IOCTL, auditArchX8664, []uint64{5, unix.TUNSETIFF}, allow},
		{"ioctl TIOCSTI", unix.SYS_IOCTL, auditArchX8664, []uint64{0, unix.TIOCSTI}, kill},
		{"ioctl KVM request with high bits", unix.SYS_IOCTL, auditArchX8664, []uint64{5, 1<<32 | uint64(kvmReqs[0])}, kill},
		// Each position in the list, not only the first: with the ioctl
		// group placed before the others, go-seccomp-bpf v1.6.0 allowed
		// KVM_RUN with high bits set (a jump past the high-word check),
		// which is why the group stays after the plain calls.
		{"ioctl middle KVM request with high bits", unix.SYS_IOCTL, auditArchX8664, []uint64{5, 1<<32 | uint64(kvmReqs[len(kvmReqs)/2])}, kill},
		{"ioctl last KVM request with high bits", unix.SYS_IOCTL, auditArchX8664, []uint64{5, 1<<63 | uint64(kvmReqs[len(kvmReqs)-1])}, kill},
		{"ioctl last KVM request", unix.SYS_IOCTL, auditArchX8664, []uint64{5, uint64(kvmReqs[len(kvmReqs)-1])}, allow},
		{"mount", unix.SYS_MOUNT, auditArchX8664, nil, kill},
		{"ptrace", unix.SYS_PTRACE, auditArchX8664, nil, kill},
		{"execve", unix.SYS_EXECVE, auditArchX8664, nil, kill},
		{"kexec_load", unix.SYS_KEXEC_LOAD, auditArchX8664, nil, kill},
		{"setns", unix.SYS_SETNS, auditArchX8664, nil, kill},
		{"unshare", unix.SYS_UNSHARE, auditArchX8664, nil, kill},
		{"bpf", unix.SYS_BPF, auditArchX8664, nil, kill},
		{"process_vm_writev", unix.SYS_PROCESS_VM_WRITEV, auditArchX8664, nil, kill},
		{"i386 ABI read", 3, auditArchI386, nil, kill},
		{"x32 read", x32Bit | unix.SYS_READ, auditArchX8664, nil, unix.SECCOMP_RET_ERRNO | uint32(unix.ENOSYS)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := run(t, insts, tt.nr, tt.arch, tt.args...); got != tt.want {
				t.Errorf("action %#x, want %#x", got, tt.want)
			}
		})
	}
	// Every listed request passes, whatever the descriptor.
	for _, req := range VMM().Ioctls {
		if got := run(t, insts, unix.SYS_IOCTL, auditArchX8664, 9, uint64(req)); got != allow {
			t.Errorf("ioctl %#x: action %#x, want allow", req, got)
		}
	}
}

// TestVMMPolicyContents checks that the names resolve and that the KVM,
// TUN and terminal requests are there, each once.
func TestVMMPolicyContents(t *testing.T) {
	p := VMM()
	nums, err := p.Numbers()
	if err != nil {
		t.Fatal(err)
	}
	if len(nums) != len(p.Syscalls) {
		t.Fatalf("%d names, %d numbers", len(p.Syscalls), len(nums))
	}
	names := map[string]bool{}
	for _, n := range p.Syscalls {
		if names[n] {
			t.Errorf("%s listed twice", n)
		}
		names[n] = true
	}
	for _, never := range []string{"ioctl", "execve", "execveat", "mount", "ptrace", "kexec_load", "init_module",
		"setns", "unshare", "chroot", "pivot_root", "setuid", "bpf", "perf_event_open", "process_vm_readv",
		"userfaultfd", "keyctl", "add_key", "reboot", "swapon", "seccomp", "open_by_handle_at"} {
		if names[never] {
			t.Errorf("the VMM allowlist has %s", never)
		}
	}
	reqs := map[uintptr]bool{}
	for _, r := range p.Ioctls {
		reqs[r] = true
	}
	for _, r := range append(kvm.IoctlRequests(), unix.TUNSETIFF, unix.TUNSETVNETHDRSZ, unix.TCGETS) {
		if !reqs[r] {
			t.Errorf("ioctl %#x missing", r)
		}
	}
}

// TestPolicyErrors: bad policies fail with errors naming what is wrong.
func TestPolicyErrors(t *testing.T) {
	tests := []struct {
		name string
		p    Policy
		is   error
	}{
		{"unknown name", Policy{Syscalls: []string{"read", "no_such_call"}}, ErrUnknownSyscall},
		{"ioctl twice", Policy{Syscalls: []string{"read"}, Ioctls: []uintptr{1, 1}}, nil},
		{"ioctl both ways", Policy{Syscalls: []string{"ioctl"}, Ioctls: []uintptr{1}}, nil},
		{"duplicate name", Policy{Syscalls: []string{"read", "read"}}, nil},
		{"socket both ways", Policy{Syscalls: []string{"read", "socket"}, SocketFamilies: []int{unix.AF_UNIX}}, nil},
		{"socket family twice", Policy{Syscalls: []string{"read"}, SocketFamilies: []int{unix.AF_UNIX, unix.AF_UNIX}}, nil},
		{"negative socket family", Policy{Syscalls: []string{"read"}, SocketFamilies: []int{-1}}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := tt.p.Assemble()
			if err == nil {
				t.Fatal("no error")
			}
			if tt.is != nil && !errors.Is(err, tt.is) {
				t.Fatalf("%v, want %v", err, tt.is)
			}
			t.Log(err)
		})
	}
}

func TestParseMode(t *testing.T) {
	tests := []struct {
		in   string
		want Mode
		bad  bool
	}{
		{"", Kill, false}, {"kill", Kill, false}, {"LOG", Log, false}, {" off ", Off, false}, {"allow", Kill, true},
	}
	for _, tt := range tests {
		got, err := ParseMode(tt.in)
		if (err != nil) != tt.bad || got != tt.want {
			t.Errorf("ParseMode(%q) = %v, %v", tt.in, got, err)
		}
	}
}

// The library's table is this architecture's: names in the list are the
// kernel's x86-64 ones.
func TestArch(t *testing.T) {
	info, err := arch.GetInfo("")
	if err != nil {
		t.Fatal(err)
	}
	if info.ID != auditArchX8664 {
		t.Fatalf("arch %s %#x", info.Name, info.ID)
	}
}

// TestJailedVMMPolicyDecisions runs JailedVMM's program (and VMM's, for
// the families it leaves open) on socket and socketpair with each
// domain, and on the calls around them: the family check must let only
// AF_UNIX through, compare all 64 bits of the domain, and leave the rest
// of the list as VMM has it.
func TestJailedVMMPolicyDecisions(t *testing.T) {
	const (
		allow = unix.SECCOMP_RET_ALLOW
		kill  = unix.SECCOMP_RET_KILL_PROCESS
		logA  = unix.SECCOMP_RET_LOG
	)
	jailed, err := JailedVMM().Assemble()
	if err != nil {
		t.Fatal(err)
	}
	unjailed, err := VMM().Assemble()
	if err != nil {
		t.Fatal(err)
	}
	logged := JailedVMM()
	logged.Mode = Log
	logProg, err := logged.Assemble()
	if err != nil {
		t.Fatal(err)
	}
	kvmReqs := kvm.IoctlRequests()
	tests := []struct {
		name     string
		nr       uint32
		arch     uint32
		args     []uint64
		jailed   uint32
		unjailed uint32
	}{
		{"socket AF_UNIX", unix.SYS_SOCKET, auditArchX8664, []uint64{unix.AF_UNIX, unix.SOCK_STREAM}, allow, allow},
		{"socket AF_INET", unix.SYS_SOCKET, auditArchX8664, []uint64{unix.AF_INET, unix.SOCK_STREAM}, kill, allow},
		{"socket AF_INET6", unix.SYS_SOCKET, auditArchX8664, []uint64{unix.AF_INET6, unix.SOCK_DGRAM}, kill, allow},
		{"socket AF_NETLINK", unix.SYS_SOCKET, auditArchX8664, []uint64{unix.AF_NETLINK, unix.SOCK_RAW}, kill, allow},
		{"socket AF_PACKET", unix.SYS_SOCKET, auditArchX8664, []uint64{unix.AF_PACKET, unix.SOCK_RAW}, kill, allow},
		{"socket AF_VSOCK", unix.SYS_SOCKET, auditArchX8664, []uint64{unix.AF_VSOCK, unix.SOCK_STREAM}, kill, allow},
		{"socket AF_UNIX with high bits", unix.SYS_SOCKET, auditArchX8664, []uint64{1<<32 | unix.AF_UNIX}, kill, allow},
		{"socket AF_UNSPEC", unix.SYS_SOCKET, auditArchX8664, []uint64{unix.AF_UNSPEC}, kill, allow},
		{"socketpair AF_UNIX", unix.SYS_SOCKETPAIR, auditArchX8664, []uint64{unix.AF_UNIX, unix.SOCK_SEQPACKET}, allow, allow},
		{"socketpair AF_INET", unix.SYS_SOCKETPAIR, auditArchX8664, []uint64{unix.AF_INET}, kill, allow},
		{"i386 socketcall", 102, auditArchI386, []uint64{1}, kill, kill},
		{"x32 socket AF_INET", x32Bit | unix.SYS_SOCKET, auditArchX8664, []uint64{unix.AF_INET}, unix.SECCOMP_RET_ERRNO | uint32(unix.ENOSYS), unix.SECCOMP_RET_ERRNO | uint32(unix.ENOSYS)},
		{"connect", unix.SYS_CONNECT, auditArchX8664, []uint64{3}, allow, allow},
		{"read", unix.SYS_READ, auditArchX8664, nil, allow, allow},
		{"mount", unix.SYS_MOUNT, auditArchX8664, nil, kill, kill},
		{"ioctl KVM_RUN", unix.SYS_IOCTL, auditArchX8664, []uint64{5, uint64(kvmReqs[0])}, allow, allow},
		{"ioctl last KVM request with high bits", unix.SYS_IOCTL, auditArchX8664, []uint64{5, 1<<63 | uint64(kvmReqs[len(kvmReqs)-1])}, kill, kill},
		// The ioctl group's failed compare leaves an argument word in
		// the accumulator: one equal to socket's number must not pass
		// as a socket call.
		{"ioctl whose request's high word is socket's number", unix.SYS_IOCTL, auditArchX8664, []uint64{unix.AF_UNIX, uint64(unix.SYS_SOCKET) << 32}, kill, kill},
		{"ioctl whose request is socket's number", unix.SYS_IOCTL, auditArchX8664, []uint64{unix.AF_UNIX, unix.SYS_SOCKET}, kill, kill},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := run(t, jailed, tt.nr, tt.arch, tt.args...); got != tt.jailed {
				t.Errorf("JailedVMM: action %#x, want %#x", got, tt.jailed)
			}
			if got := run(t, unjailed, tt.nr, tt.arch, tt.args...); got != tt.unjailed {
				t.Errorf("VMM: action %#x, want %#x", got, tt.unjailed)
			}
			want := tt.jailed
			if want == kill && tt.arch == auditArchX8664 {
				want = logA
			}
			if tt.arch != auditArchX8664 {
				want = logA // another ABI: the default action too
			}
			if got := run(t, logProg, tt.nr, tt.arch, tt.args...); got != want {
				t.Errorf("JailedVMM in mode log: action %#x, want %#x", got, want)
			}
		})
	}
	// Apart from socket and socketpair, the two lists decide alike.
	p := JailedVMM()
	if slices.Contains(p.Syscalls, "socket") || slices.Contains(p.Syscalls, "socketpair") || len(p.Syscalls) != len(VMM().Syscalls)-2 {
		t.Errorf("JailedVMM's plain calls: %d, socket or socketpair among them", len(p.Syscalls))
	}
	for _, name := range p.Syscalls {
		nums, err := (&Policy{Syscalls: []string{name}}).Numbers()
		if err != nil {
			t.Fatal(err)
		}
		if got := run(t, jailed, uint32(nums[0]), auditArchX8664); got != allow {
			t.Errorf("%s: action %#x, want allow", name, got)
		}
	}
}
