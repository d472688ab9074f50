package seccomp

import (
	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/kvm"
)

// vmmSyscalls is what a kiln-vmm process calls once its VM is built
// (vmmproc's server.Create installs the filter after the build: opening
// /dev/kvm, the kernel, disks and taps happens before). Each group says who
// needs it. Recorded from the VMM processes of the out-of-process KVM tests
// (testdata/recorded.txt), then reviewed.
func vmmSyscalls() []string {
	var all []string
	for _, g := range [][]string{
		// The Go runtime: threads, memory, scheduling, signals (vCPU kicks
		// are SIGURG by tgkill), timers, the netpoller, exit.
		{"futex", "clone", "clone3", "mmap", "munmap", "mprotect", "madvise", "mremap", "mincore",
			"sched_yield", "sched_getaffinity", "nanosleep", "clock_nanosleep", "clock_gettime", "gettimeofday",
			"rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "sigaltstack", "tgkill", "tkill", "gettid", "getpid", "getppid",
			"epoll_create1", "epoll_ctl", "epoll_pwait", "epoll_wait", "epoll_pwait2", "eventfd2", "pipe2",
			"getrandom", "exit", "exit_group", "restart_syscall", "setitimer", "timer_create", "timer_settime", "timer_delete",
			"uname", "getrlimit", "prlimit64", "rseq", "prctl", "sched_getparam", "sched_getscheduler"},
		// glibc's pthread_create, in a cgo or -race build (the tests).
		{"set_robust_list"},
		// Descriptors everywhere: gRPC, logs, disks, taps, eventfds.
		{"read", "write", "readv", "writev", "close", "fcntl", "dup", "dup2", "dup3", "poll", "ppoll", "pselect6", "select"},
		// Disks (blk), snapshots (Save: files in a folder, sparse memory,
		// fsync, rename; Load: openat2 beneath the folder) and the image
		// store's chunk files (image roots; an unjailed VMM process stores
		// the chunks it fetches, a run of them with one syncfs).
		{"openat", "openat2", "pread64", "pwrite64", "preadv", "pwritev", "lseek", "fstat", "newfstatat", "statx", "fstatfs", "statfs",
			"fsync", "fdatasync", "syncfs", "fallocate", "ftruncate", "flock", "getdents64", "mkdirat", "renameat", "renameat2",
			"unlinkat", "linkat", "fchmod", "fchmodat", "readlinkat", "faccessat", "faccessat2", "getcwd",
			"copy_file_range", "sendfile", "splice", "sync_file_range", "utimensat"},
		// Freeze, Hold, Keep: guest memory and frozen bases on memfds,
		// sealed.
		{"memfd_create"},
		// gRPC on the Unix sockets, descriptors by SCM_RIGHTS, vsock on
		// Unix sockets (accept; dial for guest connections), chunk fetches
		// over HTTP(S) and DNS.
		{"socket", "socketpair", "connect", "accept", "accept4", "bind", "listen", "shutdown",
			"getsockname", "getpeername", "getsockopt", "setsockopt",
			"sendto", "recvfrom", "sendmsg", "recvmsg", "sendmmsg", "recvmmsg"},
		// ioctl is allowed by request number only: vmmIoctls.
	} {
		all = append(all, g...)
	}
	return all
}

// vmmIoctls are the ioctl requests a VMM process issues: every KVM ioctl
// package kvm issues (system, VM and vCPU), the tap's (virtio-net: TUN's,
// for a tap opened inside the process), fs-verity's enable and measure
// (a snapshot's memory file, sealed at save and measured at restore), and
// the terminal and FIO requests read-only queries a library may issue on
// a descriptor (isatty, window size, bytes readable: FIONREAD is
// TIOCINQ).
func vmmIoctls() []uintptr {
	reqs := kvm.IoctlRequests()
	reqs = append(reqs,
		unix.TUNSETIFF, unix.TUNSETVNETHDRSZ, unix.TUNGETIFF,
		unix.FS_IOC_ENABLE_VERITY, unix.FS_IOC_MEASURE_VERITY,
		unix.TCGETS, unix.TIOCGWINSZ, unix.TIOCINQ,
	)
	return reqs
}
