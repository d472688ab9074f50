// Package seccomp builds and installs the VMM process's seccomp filter: an
// allowlist of system calls, by name, with ioctl restricted to the request
// numbers Kiln issues (KVM's from package kvm, TUN's, a few terminal and
// FIO ones). Anything else kills the whole process (SECCOMP_RET_KILL_PROCESS,
// which its parent sees as SIGSYS); a call under another architecture's
// ABI (not AUDIT_ARCH_X86_64) kills it too, and an x32 call is refused
// (ENOSYS).
//
// JailedVMM is the list of a jailed VMM process: socket and socketpair
// with AF_UNIX only (Policy.SocketFamilies), since its parent fetches its
// image chunks and dials its vsock connections.
//
// Install sets NO_NEW_PRIVS on every thread and loads the filter with
// SECCOMP_FILTER_FLAG_TSYNC, so every thread of the process has it and
// every thread started later inherits it. InstallThread loads it on the
// calling, locked thread alone (an in-process VM's vCPU threads, package
// vmm). The program is assembled in pure Go by
// github.com/elastic/go-seccomp-bpf, the socket family check by hand.
//
// The allowlist (allowlist_amd64.go) was recorded from the VMM processes of
// the out-of-process KVM tests and reviewed by hand; testdata/recorded.txt
// is the raw record and docs/security.md says how to record again (Mode
// Log: KILN_SECCOMP=log).
package seccomp
