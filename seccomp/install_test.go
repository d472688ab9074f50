package seccomp

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
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
