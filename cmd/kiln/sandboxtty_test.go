package main

import (
	"bytes"
	"io"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/creack/pty"
	"golang.org/x/sys/unix"
)

// TestSandboxTTY: exec -t runs the command on a terminal of kiln's
// terminal's size, follows its resizes and puts kiln's terminal back;
// without a terminal it is a usage error.
func TestSandboxTTY(t *testing.T) {
	startKilnd(t)
	code, out, errOut := kilnIn(t, "", "sandbox", "create", "--image", "busybox")
	if code != 0 {
		t.Fatalf("create: exit %d: %s", code, errOut)
	}
	id := oneID(t, "create", out)

	if code, _, errOut := kilnIn(t, "", "sandbox", "exec", "-t", id, "--", "true"); code != exitUsage || !strings.Contains(errOut, "not a terminal") {
		t.Errorf("-t without a terminal: exit %d, %q", code, errOut)
	}

	master, tty, err := pty.Open()
	if err != nil {
		t.Fatal(err)
	}
	defer master.Close()
	defer tty.Close()
	if err := pty.Setsize(master, &pty.Winsize{Rows: 33, Cols: 77}); err != nil {
		t.Fatal(err)
	}
	before, err := unix.IoctlGetTermios(int(tty.Fd()), unix.TCGETS)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var shown bytes.Buffer
	go func() {
		buf := make([]byte, 4096)
		for {
			n, err := master.Read(buf)
			mu.Lock()
			shown.Write(buf[:n])
			mu.Unlock()
			if err != nil {
				return
			}
		}
	}()
	seen := func(s string) bool {
		mu.Lock()
		defer mu.Unlock()
		return strings.Contains(strings.ReplaceAll(shown.String(), "\r\n", "\n"), s)
	}
	wait := func(what string, cond func() bool) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				mu.Lock()
				t.Fatalf("no %s; the terminal shows %q", what, shown.String())
			}
		}
	}
	var stderr bytes.Buffer
	done := make(chan int, 1)
	go func() {
		done <- run([]string{"sandbox", "exec", "-t", id, "--", "sh", "-c", `tty; stty size; while read x; do stty size; done; exit 5`}, tty, tty, &stderr)
	}()
	wait("33 77", func() bool { return seen("\n33 77\n") })
	if raw, err := unix.IoctlGetTermios(int(tty.Fd()), unix.TCGETS); err != nil || raw.Lflag&unix.ICANON != 0 {
		t.Errorf("kiln's terminal is not raw while the command runs: %+v %v", raw, err)
	}
	pty.Setsize(master, &pty.Winsize{Rows: 40, Cols: 100})
	syscall.Kill(os.Getpid(), syscall.SIGWINCH)
	wait("40 100", func() bool {
		io.WriteString(master, "\n")
		return seen("\n40 100\n")
	})
	io.WriteString(master, "\x04") // EOF for the remote read
	select {
	case code := <-done:
		if code != 5 {
			t.Errorf("exec -t: exit %d, stderr %q", code, stderr.String())
		}
	case <-time.After(20 * time.Second):
		t.Fatal("exec -t did not end")
	}
	if !seen("/dev/pts/") {
		t.Errorf("tty: %q", shown.String())
	}
	after, err := unix.IoctlGetTermios(int(tty.Fd()), unix.TCGETS)
	if err != nil || after.Lflag != before.Lflag || after.Iflag != before.Iflag || after.Oflag != before.Oflag {
		t.Errorf("kiln's terminal was not restored: %+v, was %+v (%v)", after, before, err)
	}
}

// TestSandboxMv: mv renames inside a sandbox; errors are the daemon's or
// usage.
func TestSandboxMv(t *testing.T) {
	startKilnd(t)
	_, out, _ := kilnIn(t, "", "sandbox", "create", "--image", "busybox")
	id := oneID(t, "create", out)
	if code, _, errOut := kilnIn(t, "moved", "sandbox", "cp", "-", id+":/a"); code != 0 {
		t.Fatalf("cp in: %d %s", code, errOut)
	}
	if code, out, errOut := kilnIn(t, "", "sandbox", "mv", id+":/a", "/b"); code != 0 || out != "" {
		t.Errorf("mv: exit %d, %q, %q", code, out, errOut)
	}
	if code, out, _ := kilnIn(t, "", "sandbox", "cp", id+":/b", "-"); code != 0 || out != "moved" {
		t.Errorf("after mv: exit %d, %q", code, out)
	}
	for _, tt := range []struct {
		args []string
		code int
		err  string
	}{
		{[]string{id + ":/a", "/c"}, exitFailed, "NotFound"},
		{[]string{"/a", "/c"}, exitUsage, "ID:SRC"},
		{[]string{id + ":/b", "sb-other:/c"}, exitUsage, "different sandboxes"},
		{[]string{id + ":/b", "rel"}, exitUsage, "absolute"},
	} {
		code, _, errOut := kilnIn(t, "", append([]string{"sandbox", "mv"}, tt.args...)...)
		if code != tt.code || !strings.Contains(errOut, tt.err) {
			t.Errorf("mv %q: exit %d, %q; want %d naming %q", tt.args, code, errOut, tt.code, tt.err)
		}
	}
}
