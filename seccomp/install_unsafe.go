package seccomp

import (
	"errors"
	"fmt"
	"runtime"
	"syscall"
	"unsafe"

	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"
)

// Install loads the policy into the calling process: NO_NEW_PRIVS on every
// thread (seccomp requires it without CAP_SYS_ADMIN; the jailer may have
// set it already), then the filter with SECCOMP_FILTER_FLAG_TSYNC, so
// every thread has it from now on and every later thread inherits it. A
// policy in Mode Off installs nothing. It cannot be undone.
func (p *Policy) Install() error {
	if p.Mode == Off {
		return nil
	}
	filter, err := p.sockFilter()
	if err != nil {
		return err
	}
	// The filter is installed from the thread that set NO_NEW_PRIVS.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := setNoNewPrivs(); err != nil {
		return err
	}
	tid, errno := loadFilter(filter, unix.SECCOMP_FILTER_FLAG_TSYNC)
	if errno != 0 {
		return fmt.Errorf("seccomp: load the filter (%d instructions): %w", len(filter), errno)
	}
	if tid != 0 {
		// TSYNC names the thread it could not synchronize.
		return fmt.Errorf("seccomp: thread %d of the process cannot take the filter (TSYNC)", tid)
	}
	return nil
}

// InstallThread loads the policy on the calling OS thread alone (no
// TSYNC): NO_NEW_PRIVS on this thread, then the filter. The other
// threads of the process are left as they are. The caller must have
// locked its goroutine to the thread (runtime.LockOSThread) and must
// never unlock it: the goroutine ends locked, and the Go runtime then
// ends the thread with it (the main thread it wedges: asleep for good),
// so no other goroutine ever runs under the filter. (The runtime starts no thread from a locked one: it asks its
// template thread, so no thread inherits the filter either.) A policy in
// Mode Off installs nothing. It cannot be undone.
func (p *Policy) InstallThread() error {
	if p.Mode == Off {
		return nil
	}
	filter, err := p.sockFilter()
	if err != nil {
		return err
	}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("seccomp: set NO_NEW_PRIVS on this thread: %w", err)
	}
	if _, errno := loadFilter(filter, 0); errno != 0 {
		return fmt.Errorf("seccomp: load the filter on this thread (%d instructions): %w", len(filter), errno)
	}
	return nil
}

// loadFilter is seccomp(SECCOMP_SET_MODE_FILTER, flags, filter) on the
// calling thread; with TSYNC, tid names a thread that could not take it.
func loadFilter(filter []unix.SockFilter, flags uintptr) (tid uintptr, errno syscall.Errno) {
	prog := unix.SockFprog{Len: uint16(len(filter)), Filter: &filter[0]}
	tid, _, errno = unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, flags, uintptr(unsafe.Pointer(&prog)))
	runtime.KeepAlive(filter)
	return tid, errno
}

// sockFilter is the policy's program as the kernel takes it.
func (p *Policy) sockFilter() ([]unix.SockFilter, error) {
	insts, err := p.Assemble()
	if err != nil {
		return nil, err
	}
	raw, err := bpf.Assemble(insts)
	if err != nil {
		return nil, fmt.Errorf("seccomp: encode the program: %w", err)
	}
	filter := make([]unix.SockFilter, len(raw))
	for i, r := range raw {
		filter[i] = unix.SockFilter{Code: r.Op, Jt: r.Jt, Jf: r.Jf, K: r.K}
	}
	return filter, nil
}

// setNoNewPrivs sets NO_NEW_PRIVS on every thread of the process (and so
// on every thread started later), or on the calling thread alone where
// the runtime cannot reach all threads (cgo): TSYNC then copies it to the
// others as it synchronizes their filters.
func setNoNewPrivs() error {
	_, _, errno := syscall.AllThreadsSyscall(syscall.SYS_PRCTL, unix.PR_SET_NO_NEW_PRIVS, 1, 0)
	if errno == 0 {
		return nil
	}
	if !errors.Is(errno, syscall.ENOTSUP) {
		return fmt.Errorf("seccomp: set NO_NEW_PRIVS on every thread: %w", errno)
	}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("seccomp: set NO_NEW_PRIVS: %w", err)
	}
	return nil
}
