package seccomp

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// childEnv makes the test binary a child that installs the VMM's filter and
// then does what the variable names (childMain).
const childEnv = "KILN_SECCOMP_TEST_CHILD"

func TestMain(m *testing.M) {
	if what := os.Getenv(childEnv); what != "" {
		os.Exit(childMain(what))
	}
	os.Exit(m.Run())
}

// childMain installs the VMM policy and does what: "allowed" (everyday
// work, then reports every thread's seccomp state) or a forbidden call.
func childMain(what string) int {
	switch what {
	case "jailed-unix", "jailed-inet", "jailed-inet6", "jailed-netlink", "vmm-inet":
		return socketChild(what)
	case "thread", "thread-mount":
		return threadChild(what)
	}
	if err := VMM().Install(); err != nil {
		fmt.Fprintln(os.Stderr, "install:", err)
		return 3
	}
	switch what {
	case "allowed":
		if err := allowedWork(); err != nil {
			fmt.Fprintln(os.Stderr, "allowed work:", err)
			return 4
		}
		fmt.Println("allowed work done")
		return 0
	case "mount":
		err := unix.Mount("none", os.TempDir(), "tmpfs", 0, "")
		fmt.Fprintln(os.Stderr, "mount returned:", err)
	case "ptrace":
		_, _, errno := unix.Syscall(unix.SYS_PTRACE, unix.PTRACE_TRACEME, 0, 0)
		fmt.Fprintln(os.Stderr, "ptrace returned:", errno)
	case "kexec_load":
		_, _, errno := unix.Syscall6(unix.SYS_KEXEC_LOAD, 0, 0, 0, 0, 0, 0)
		fmt.Fprintln(os.Stderr, "kexec_load returned:", errno)
	case "ioctl":
		// TIOCSTI (push a byte into a terminal's input) is no request
		// of the VMM's.
		b := byte('x')
		err := unix.IoctlSetPointerInt(0, unix.TIOCSTI, int(b))
		fmt.Fprintln(os.Stderr, "ioctl TIOCSTI returned:", err)
	default:
		fmt.Fprintln(os.Stderr, "unknown child", what)
		return 5
	}
	return 6 // not killed
}

// socketChild installs JailedVMM (or VMM, for vmm-*) and opens sockets:
// Unix ones must work; an IP or netlink one is outside the jailed list
// (the process is killed) and inside the unjailed one.
func socketChild(what string) int {
	p := JailedVMM()
	if strings.HasPrefix(what, "vmm-") {
		p = VMM()
	}
	if err := p.Install(); err != nil {
		fmt.Fprintln(os.Stderr, "install:", err)
		return 3
	}
	// AF_UNIX: a socket, a pair, and a listener dialled through package
	// net (what gRPC, chunkrpc and the vsock dials do).
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		fmt.Fprintln(os.Stderr, "socket(AF_UNIX):", err)
		return 4
	}
	unix.Close(fd)
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		fmt.Fprintln(os.Stderr, "socketpair(AF_UNIX):", err)
		return 4
	}
	unix.Close(pair[0])
	unix.Close(pair[1])
	sock := filepath.Join(os.TempDir(), fmt.Sprintf("kiln-seccomp-%d.sock", os.Getpid()))
	ln, err := net.Listen("unix", sock)
	if err != nil {
		fmt.Fprintln(os.Stderr, "listen unix:", err)
		return 4
	}
	defer os.Remove(sock)
	c, err := net.Dial("unix", sock)
	if err != nil {
		fmt.Fprintln(os.Stderr, "dial unix:", err)
		return 4
	}
	c.Close()
	ln.Close()
	fmt.Println("unix sockets work")
	family := map[string]int{"jailed-inet": unix.AF_INET, "vmm-inet": unix.AF_INET, "jailed-inet6": unix.AF_INET6, "jailed-netlink": unix.AF_NETLINK}[what]
	if family == 0 {
		return 0
	}
	fd, err = unix.Socket(family, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	fmt.Fprintf(os.Stderr, "socket(%d) returned: %v\n", family, err)
	if err != nil {
		return 7
	}
	unix.Close(fd)
	return 0
}

// threadChild installs VMM's filter on one locked thread (InstallThread):
// that thread alone shows it; a forbidden call there kills the process
// (thread-mount); once its goroutine has ended, locked, no thread of the
// process is filtered and the others still do what the filter forbids
// (start a process: execve).
func threadChild(what string) int {
	// The main thread stays with this goroutine: a locked goroutine that
	// ends there wedges the main thread rather than ending it.
	runtime.LockOSThread()
	type result struct {
		tid int
		err error
	}
	done := make(chan result)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread ends with the goroutine
		tid := unix.Gettid()
		if err := VMM().InstallThread(); err != nil {
			done <- result{tid, fmt.Errorf("install: %w", err)}
			return
		}
		if what == "thread-mount" {
			err := unix.Mount("none", os.TempDir(), "tmpfs", 0, "")
			fmt.Fprintln(os.Stderr, "mount returned:", err)
			done <- result{tid, errors.New("not killed")}
			return
		}
		// Everyday work on the filtered thread: memory, a file, time.
		b := make([]byte, 1<<20)
		f := filepath.Join(os.TempDir(), fmt.Sprintf("kiln-seccomp-thread-%d", os.Getpid()))
		err := os.WriteFile(f, b, 0o600)
		os.Remove(f)
		time.Sleep(time.Millisecond)
		if err == nil {
			err = taskFiltered(tid, true)
		}
		done <- result{tid, err}
	}()
	r := <-done
	if r.err != nil {
		fmt.Fprintln(os.Stderr, r.err)
		return 4
	}
	// The filtered thread goes once its goroutine has ended.
	deadline := time.Now().Add(5 * time.Second)
	for {
		if _, err := os.Stat(fmt.Sprintf("/proc/self/task/%d", r.tid)); os.IsNotExist(err) {
			break
		}
		if time.Now().After(deadline) {
			fmt.Fprintf(os.Stderr, "thread %d still there after its locked goroutine ended\n", r.tid)
			return 4
		}
		time.Sleep(10 * time.Millisecond)
	}
	for _, tid := range threads() {
		var n int
		fmt.Sscan(tid, &n)
		if err := taskFiltered(n, false); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 4
		}
	}
	// execve, outside the list, from goroutines on any thread.
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// This test binary, running no test: without childEnv.
			cmd := exec.Command(os.Args[0], "-test.run=^$")
			cmd.Env = slices.DeleteFunc(os.Environ(), func(kv string) bool { return strings.HasPrefix(kv, childEnv+"=") })
			if err := cmd.Run(); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		fmt.Fprintln(os.Stderr, "exec after the filtered thread ended:", err)
		return 4
	}
	fmt.Printf("thread %d filtered alone and gone; %d threads unfiltered, exec works\n", r.tid, len(threads()))
	return 0
}

// taskFiltered checks thread tid's Seccomp and NoNewPrivs lines: 2 and 1
// when want, else Seccomp 0.
func taskFiltered(tid int, want bool) error {
	st, err := os.ReadFile(fmt.Sprintf("/proc/self/task/%d/status", tid))
	if err != nil {
		return err
	}
	filtered := bytes.Contains(st, []byte("\nSeccomp:\t2\n")) && bytes.Contains(st, []byte("\nNoNewPrivs:\t1\n"))
	unfiltered := bytes.Contains(st, []byte("\nSeccomp:\t0\n"))
	if want && !filtered || !want && !unfiltered {
		return fmt.Errorf("thread %d: want filtered %v:\n%s", tid, want, st)
	}
	return nil
}

// allowedWork is what a filtered process still does: goroutines, a file
// written and read, time and sleep, a pipe, a thread started after the
// install; then every thread must show the filter.
func allowedWork() error {
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			f := filepath.Join(os.TempDir(), fmt.Sprintf("kiln-seccomp-%d-%d", os.Getpid(), i))
			if err := os.WriteFile(f, []byte("kiln"), 0o600); err != nil {
				errs <- err
				return
			}
			defer os.Remove(f)
			b, err := os.ReadFile(f)
			if err != nil || string(b) != "kiln" {
				errs <- fmt.Errorf("read back %q: %v", b, err)
			}
			time.Sleep(time.Millisecond)
		}(i)
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return err
	}
	if time.Now().IsZero() {
		return errors.New("no time")
	}
	r, w, err := os.Pipe()
	if err != nil {
		return err
	}
	go w.Write([]byte("p"))
	buf := make([]byte, 1)
	if _, err := r.Read(buf); err != nil {
		return err
	}
	// A thread born after the install: a locked goroutine blocking in a
	// syscall makes the runtime start another.
	started := make(chan struct{})
	release := make(chan struct{})
	go func() {
		runtime.LockOSThread()
		close(started)
		<-release
	}()
	<-started
	before := threads()
	// More locked goroutines than there are threads: each parks its own
	// thread, so idle ones (the race detector's runtime keeps several)
	// cannot take them all, and at least two threads are new.
	for i := 0; i < len(before)+2; i++ {
		go func() {
			runtime.LockOSThread()
			<-release
		}()
	}
	time.Sleep(50 * time.Millisecond)
	after := threads()
	defer close(release)
	if len(after) <= len(before) {
		return fmt.Errorf("no new thread started (%d before, %d after)", len(before), len(after))
	}
	for _, tid := range after {
		st, err := os.ReadFile(fmt.Sprintf("/proc/self/task/%s/status", tid))
		if err != nil {
			return err
		}
		if !bytes.Contains(st, []byte("\nSeccomp:\t2\n")) || !bytes.Contains(st, []byte("\nNoNewPrivs:\t1\n")) {
			return fmt.Errorf("thread %s is not filtered:\n%s", tid, st)
		}
	}
	fmt.Printf("%d threads, %d born after the install, all Seccomp: 2, NoNewPrivs: 1\n", len(after), len(after)-len(before))
	return nil
}

func threads() []string {
	ents, _ := os.ReadDir("/proc/self/task")
	var tids []string
	for _, e := range ents {
		tids = append(tids, e.Name())
	}
	return tids
}

// child runs the test binary as a filtered child doing what.
func child(t *testing.T, what string) (stdout, stderr string, err error) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+what)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err = cmd.Run()
	return out.String(), errOut.String(), err
}

// TestInstallAllows: under the filter the everyday work runs, and every
// thread, old and new, is filtered.
func TestInstallAllows(t *testing.T) {
	out, errOut, err := child(t, "allowed")
	if err != nil {
		t.Fatalf("child: %v\nstdout %s\nstderr %s", err, out, errOut)
	}
	if !strings.Contains(out, "all Seccomp: 2") {
		t.Fatalf("child said %q", out)
	}
	t.Log(strings.TrimSpace(out))
}

// TestInstallSocketFamilies: under JailedVMM's filter Unix sockets work
// and an IP or netlink socket kills the process (SIGSYS); under VMM's an
// IP socket opens.
func TestInstallSocketFamilies(t *testing.T) {
	for _, tt := range []struct {
		what   string
		killed bool
	}{
		{"jailed-unix", false},
		{"jailed-inet", true},
		{"jailed-inet6", true},
		{"jailed-netlink", true},
		{"vmm-inet", false},
	} {
		t.Run(tt.what, func(t *testing.T) {
			out, errOut, err := child(t, tt.what)
			if !strings.Contains(out, "unix sockets work") {
				t.Fatalf("child: %v\nstdout %s\nstderr %s", err, out, errOut)
			}
			if !tt.killed {
				if err != nil {
					t.Fatalf("child: %v\nstdout %s\nstderr %s", err, out, errOut)
				}
				return
			}
			var ee *exec.ExitError
			if !errors.As(err, &ee) {
				t.Fatalf("child: %v, want killed\nstderr %s", err, errOut)
			}
			if ws := ee.Sys().(syscall.WaitStatus); !ws.Signaled() || ws.Signal() != syscall.SIGSYS {
				t.Fatalf("child ended %v, want killed by SIGSYS\nstderr %s", ee, errOut)
			}
			if strings.Contains(errOut, "returned") {
				t.Fatalf("the call returned: %s", errOut)
			}
		})
	}
}

// TestInstallThread: InstallThread filters the calling thread alone,
// which ends with its locked goroutine; a forbidden call on it kills the
// process.
func TestInstallThread(t *testing.T) {
	out, errOut, err := child(t, "thread")
	if err != nil || !strings.Contains(out, "filtered alone and gone") {
		t.Fatalf("child: %v\nstdout %s\nstderr %s", err, out, errOut)
	}
	t.Log(strings.TrimSpace(out))
	out, errOut, err = child(t, "thread-mount")
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		t.Fatalf("child: %v, want killed\nstdout %s\nstderr %s", err, out, errOut)
	}
	if ws := ee.Sys().(syscall.WaitStatus); !ws.Signaled() || ws.Signal() != syscall.SIGSYS || strings.Contains(errOut, "returned") {
		t.Fatalf("child ended %v, want killed by SIGSYS at the mount\nstderr %s", ee, errOut)
	}
}

// TestInstallKills: a forbidden call kills the whole process with SIGSYS.
func TestInstallKills(t *testing.T) {
	for _, what := range []string{"mount", "ptrace", "kexec_load", "ioctl"} {
		t.Run(what, func(t *testing.T) {
			out, errOut, err := child(t, what)
			var ee *exec.ExitError
			if !errors.As(err, &ee) {
				t.Fatalf("child: %v\nstdout %s\nstderr %s", err, out, errOut)
			}
			ws := ee.Sys().(syscall.WaitStatus)
			if !ws.Signaled() || ws.Signal() != syscall.SIGSYS {
				t.Fatalf("child ended %v, want killed by SIGSYS\nstderr %s", ee, errOut)
			}
			if strings.Contains(errOut, "returned") {
				t.Fatalf("the call returned: %s", errOut)
			}
		})
	}
}
