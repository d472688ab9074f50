package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/internal/kvmtest"
	"github.com/kilnvm/kiln/sandbox"
	"github.com/kilnvm/kiln/vmm"
	"github.com/kilnvm/kiln/vmmproc"
)

// TestMain lets the test binary serve as a VMM process (vmmproc.Main, as
// cmd/kiln-vmm): kiln run and fork, run in this process, start it as
// their kiln-vmm ($KILN_VMM, set here unless the caller set one), with
// vmmproc.SocketEnv set; the KVM tests' kilnd and library sandboxes start
// it as [self, "vmm"], the hidden `kiln vmm`.
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == "vmm" {
		os.Exit(vmmproc.Main(context.Background(), os.Args[2:]))
	}
	if os.Getenv(vmmproc.SocketEnv) != "" {
		os.Exit(vmmproc.Main(context.Background(), nil))
	}
	if os.Getenv(sandbox.VMMEnv) == "" {
		os.Setenv(sandbox.VMMEnv, os.Args[0])
	}
	os.Exit(m.Run())
}

// runKiln runs the CLI in-process and returns its exit code and output.

func runKiln(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	code := run(args, strings.NewReader(""), &stdout, &stderr)
	return code, stdout.String(), stderr.String()
}

// TestBootBadInput checks that each kind of bad input gets a one-line error
// naming the problem, a usage exit code, and no panic. None of these needs
// KVM: kiln checks kernel, memory and initrd before it opens /dev/kvm.
func TestBootBadInput(t *testing.T) {
	dir := t.TempDir()
	write := func(name string, data []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, data, 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	text := write("notes.txt", []byte("this is not a kernel\n"))
	kernel := kvmtest.Kernel(t).Image
	data, err := os.ReadFile(kernel)
	if err != nil {
		t.Fatal(err)
	}
	truncated := write("truncated", data[:len(data)/2])
	bigInitrd := write("big.cpio", make([]byte, 40<<20))
	tests := []struct {
		name string
		args []string
		want string
	}{
		{"missing kernel", []string{"--kernel", filepath.Join(dir, "nope")}, "no such file"},
		{"not a kernel", []string{"--kernel", text}, "not a Linux kernel"},
		{"truncated kernel", []string{"--kernel", truncated}, "truncated"},
		{"zero cpus", []string{"--kernel", kernel, "--cpus", "0"}, "0 vCPUs"},
		{"memory too small for the kernel", []string{"--kernel", kernel, "--mem", "32"}, "kernel needs memory up to"},
		{"initrd larger than memory", []string{"--kernel", kernel, "--mem", "96", "--initrd", bigInitrd}, "initrd of 40 MiB does not fit"},
		{"missing initrd", []string{"--kernel", kernel, "--initrd", filepath.Join(dir, "none.cpio")}, "read initrd"},
		{"stray argument", []string{"--kernel", kernel, "extra"}, "unexpected argument"},
		{"bad flag", []string{"--cpus", "two"}, "invalid value"},
		{"bad timeout", []string{"--timeout", "soon"}, "invalid value"},
		{"missing disk image", []string{"--kernel", kernel, "--disk", filepath.Join(dir, "none.img")}, "none.img"},
		{"disk option", []string{"--kernel", kernel, "--disk", text + ",fast"}, `unknown option "fast"`},
		{"bad MAC", []string{"--kernel", kernel, "--net", "tap9,mac=xyz"}, "bad MAC"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			code, stdout, stderr := runKiln(t, append([]string{"boot"}, tt.args...)...)
			if code != exitUsage {
				t.Errorf("exit code %d, want %d", code, exitUsage)
			}
			if !strings.Contains(stderr, tt.want) {
				t.Errorf("stderr %q does not mention %q", stderr, tt.want)
			}
			if strings.Contains(stderr, "goroutine ") || stdout != "" {
				t.Errorf("stdout %q, stderr %q", stdout, stderr)
			}
		})
	}
}

func TestUnknownCommand(t *testing.T) {
	code, _, stderr := runKiln(t, "frobnicate")
	if code != exitUsage || !strings.Contains(stderr, `unknown command "frobnicate"`) {
		t.Errorf("code %d, stderr %q", code, stderr)
	}
	if code, _, _ := runKiln(t); code != exitUsage {
		t.Errorf("no arguments: code %d", code)
	}
}

// TestKVMBootCommand boots Debian's kernel through `kiln boot` twice: a guest
// that prints a marker, sees both vCPUs and runs `poweroff -f` exits 0; a
// guest whose init exits makes the kernel panic, and kiln exits non-zero
// with the panic's reason on one line.
//
// Both boot with "quiet": under emulated KVM each byte of a verbose boot
// log is a few VM exits, and the emulation corrupts a guest's state now
// and then at an exit (triple faults at random points of the log; in 12
// boots of one L1, 3 of 8 verbose boots failed, 0 of 4 quiet ones). What
// is tested here is kiln boot, not a long console.
func TestKVMBootCommand(t *testing.T) {
	kvmtest.Require(t)
	k := kvmtest.Kernel(t)
	cmdline := vmm.DefaultCmdline + " quiet"
	t.Run("marker, 2 CPUs, poweroff", func(t *testing.T) {
		initrd := kvmtest.BusyboxInitrd(t, `
mount -t proc proc /proc
mount -t sysfs sys /sys
echo "KILN-MARKER cpus=$(grep -c ^processor /proc/cpuinfo) online=$(cat /sys/devices/system/cpu/online)"
poweroff -f
`)
		code, stdout, stderr := runKiln(t, "boot", "--kernel", k.Image, "--initrd", initrd, "--cmdline", cmdline, "--cpus", "2", "--mem", "512", "--timeout", "5m")
		if code != exitOK {
			t.Fatalf("exit code %d; stderr %q; console:\n%s", code, stderr, stdout)
		}
		if !strings.Contains(stdout, "KILN-MARKER cpus=2 online=0-1") {
			t.Fatalf("no marker with 2 CPUs online:\n%s", stdout)
		}
	})
	t.Run("panic", func(t *testing.T) {
		initrd := kvmtest.BusyboxInitrd(t, "echo KILN-ABOUT-TO-EXIT\nexit 3\n")
		code, stdout, stderr := runKiln(t, "boot", "--kernel", k.Image, "--initrd", initrd, "--cmdline", cmdline, "--mem", "512", "--timeout", "5m")
		if code != exitGuest {
			t.Fatalf("exit code %d, want %d; stderr %q; console:\n%s", code, exitGuest, stderr, stdout)
		}
		if !strings.Contains(stdout, "KILN-ABOUT-TO-EXIT") {
			t.Errorf("init never ran; console:\n%s", stdout)
		}
		want := "kiln boot: guest stopped: panic: Kernel panic - not syncing: Attempted to kill init!"
		if !strings.HasPrefix(stderr, want) || strings.Count(strings.TrimSpace(stderr), "\n") != 0 {
			t.Errorf("stderr %q, want one line starting %q", stderr, want)
		}
	})
}

// TestKVMRunCommand runs a command in a sandbox through `kiln run`: its
// stdout and stderr arrive on kiln's, and kiln exits with its exit code.
// The same run saves the sandbox (--save) with a counting loop left
// running; `kiln run --from` finds the loop still counting, and `kiln
// fork` runs a command in two clones at once, each named for its index and
// each output line prefixed by it.
func TestKVMRunCommand(t *testing.T) {
	kvmtest.Require(t)
	kvmtest.Kernel(t)
	dir := filepath.Join(t.TempDir(), "snap")
	// As root the sandbox has a network card, and the restored sandbox and
	// each clone a tap and MAC address of their own.
	var netSave, netFrom, netFork []string
	if os.Geteuid() == 0 {
		p := fmt.Sprintf("kr%d", os.Getpid()%100000)
		netSave, netFrom, netFork = []string{"--net", p + "s"}, []string{"--net", p + "r"}, []string{"--net", p + "f"}
	}
	loop := "(i=0; while :; do i=$((i+1)); echo $i > /run/n.new; mv /run/n.new /run/n; sleep 0.2; done) >/dev/null 2>&1 &"
	// In this process (--in-process): its vCPU thread, and no other, is
	// under the VMM's seccomp filter while the VM runs, and ends with it.
	stop, filtered := watchFilteredThreads(t)
	args := append([]string{"run", "--in-process", "--agent", kvmtest.AgentBinary(t), "--boot-timeout", "8m", "--save", dir}, netSave...)
	code, stdout, stderr := runKiln(t, append(args, "--", "sh", "-c", "echo out; echo err >&2; "+loop+" sleep 1; exit 3")...)
	if code != 3 || stdout != "out\n" || stderr != "err\n" {
		t.Fatalf("exit code %d (want 3), stdout %q (want \"out\\n\"), stderr %q (want \"err\\n\")", code, stdout, stderr)
	}
	stop()
	if len(filtered) != 1 {
		t.Fatalf("kiln run --in-process with 1 vCPU: %d threads of this process were filtered while it ran (%v), want 1", len(filtered), filtered)
	}
	if left := filteredThreads(t); len(left) > 0 && !(len(left) == 1 && left[0] == os.Getpid()) {
		// A locked goroutine that ends on the main thread wedges it:
		// the only filtered thread that may stay.
		t.Fatalf("threads %v still filtered after kiln run --in-process returned", left)
	}
	t.Logf("in process: vCPU thread %v filtered while the VM ran", filtered)

	args = append([]string{"run", "--from", dir, "--boot-timeout", "5m"}, netFrom...)
	code, stdout, stderr = runKiln(t, append(args, "--", "sh", "-c", "a=$(cat /run/n); sleep 1; echo $a $(cat /run/n)")...)
	var before, after int
	if _, err := fmt.Sscan(stdout, &before, &after); code != 0 || err != nil || before < 1 || after <= before {
		t.Fatalf("kiln run --from: exit code %d, stdout %q (want two growing counts), stderr %q", code, stdout, stderr)
	}
	t.Logf("restored: the loop counts %d, then %d", before, after)

	// The clones in VMM processes of their own: kiln-vmm ($KILN_VMM), which is
	// this test binary (TestMain).
	args = append([]string{"fork", "--vmm-process", "--from", dir, "-n", "2", "--boot-timeout", "5m"}, netFork...)
	code, stdout, stderr = runKiln(t, append(args, "--", "sh", "-c", "test -s /run/n && hostname && cat /sys/class/net/*/address | grep -vx 00:00:00:00:00:00 || true")...)
	lines := strings.Split(strings.TrimSpace(stdout), "\n")
	slices.Sort(lines)
	want := []string{"[0] kiln-0", "[1] kiln-1"}
	if netFork != nil { // and each clone's MAC address, all different
		if len(lines) == 4 && lines[0][:4] == "[0] " && lines[2][:4] == "[1] " && lines[0][4:] != lines[2][4:] {
			want = []string{lines[0], "[0] kiln-0", lines[2], "[1] kiln-1"}
		}
	}
	if code != 0 || !slices.Equal(lines, want) {
		t.Fatalf("kiln fork --vmm-process -n 2: exit code %d, stdout %q (want host names and, as root, two different MAC addresses), stderr %q", code, stdout, stderr)
	}
}

// TestRunBadInput: kiln run refuses bad flags before it boots anything.
func TestRunBadInput(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"run"}, "no command given"},
		{[]string{"run", "-e", "NOEQUALS", "--", "true"}, `-e "NOEQUALS": want NAME=VALUE`},
		{[]string{"run", "-e", "=v", "--", "true"}, "want NAME=VALUE"},
		{[]string{"run", "-w", "relative/dir", "--", "true"}, "want an absolute path"},
		{[]string{"run", "--bogus", "--", "true"}, "flag provided but not defined"},
		{[]string{"run", "--net", ",mac=x", "--", "true"}, "no tap name"},
		{[]string{"run", "--init", "openrc", "--image", "x", "--", "true"}, `--init: sandbox: init "openrc"`},
		{[]string{"run", "--init", "systemd", "--", "true"}, "--init systemd boots an image's /sbin/init: give --image"},
		{[]string{"run", "--init", "systemd", "--from", "/nonexistent", "--", "true"}, "--init: the snapshot given with --from fixes these"},
		{[]string{"run", "--hostname", "a b", "--agent", "/nonexistent", "--kernel", "/k", "--", "true"}, "hostname"},
	} {
		code, _, stderr := runKiln(t, tc.args...)
		if code != exitUsage && code != exitRunFailed {
			t.Errorf("%q: exit code %d", tc.args, code)
		}
		if !strings.Contains(stderr, tc.want) {
			t.Errorf("%q: stderr %q, want %q", tc.args, stderr, tc.want)
		}
	}
}

// TestForkBadInput: kiln fork refuses bad flags before it restores anything.
func TestForkBadInput(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"fork", "-n", "2", "--", "true"}, "--from DIR is required"},
		{[]string{"fork", "--from", "/nonexistent", "-n", "0", "--", "true"}, "-n 0: want 1 to"},
		{[]string{"fork", "--from", "/nonexistent", "-n", "100000", "--", "true"}, "want 1 to"},
		{[]string{"fork", "--from", "/nonexistent", "-n", "2"}, "no command given"},
		{[]string{"fork", "--from", "/nonexistent", "--hostname", "a b", "--", "true"}, "--hostname"},
		{[]string{"fork", "--from", "/nonexistent", "--", "true"}, "/nonexistent"},
		{[]string{"fork", "--from", "/nonexistent", "-n", "10", "--net", "averylongtapname", "--", "true"}, "--net"},
		{[]string{"fork", "--from", "/nonexistent", "--net", "t,mac=02:00:00:00:00:01", "--", "true"}, "--net"},
	} {
		code, _, stderr := runKiln(t, tc.args...)
		if code == exitOK {
			t.Errorf("%q: exit code 0", tc.args)
		}
		if !strings.Contains(stderr, tc.want) {
			t.Errorf("%q: stderr %q, want %q", tc.args, stderr, tc.want)
		}
	}
}

func TestWithDefaults(t *testing.T) {
	got := strings.Join(withDefaults([]string{"PATH=/opt/bin", "A=1"}), " ")
	if got != "PATH=/opt/bin A=1 HOME=/root TERM=xterm" {
		t.Fatalf("env %q", got)
	}
}

// watchFilteredThreads notes, every 100 ms until stop, each thread of this
// process that is under a seccomp filter (Seccomp 2 and NoNewPrivs 1).
// Threads filtered before the call (a main thread a locked goroutine
// wedged) are left out.
func watchFilteredThreads(t *testing.T) (stop func(), seen map[int]bool) {
	seen = map[int]bool{}
	before := map[int]bool{}
	for _, tid := range filteredThreads(t) {
		before[tid] = true
	}
	quit, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		for {
			for _, tid := range filteredThreads(t) {
				if !before[tid] {
					seen[tid] = true
				}
			}
			select {
			case <-quit:
				return
			case <-time.After(100 * time.Millisecond):
			}
		}
	}()
	return func() { close(quit); <-done }, seen
}

// filteredThreads returns the threads of this process that are under a
// seccomp filter with NO_NEW_PRIVS.
func filteredThreads(t *testing.T) []int {
	ents, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Error(err)
		return nil
	}
	var tids []int
	for _, e := range ents {
		st, err := os.ReadFile(filepath.Join("/proc/self/task", e.Name(), "status"))
		if err != nil {
			continue // gone meanwhile
		}
		if strings.Contains(string(st), "\nSeccomp:\t2\n") && strings.Contains(string(st), "\nNoNewPrivs:\t1\n") {
			tid, _ := strconv.Atoi(e.Name())
			tids = append(tids, tid)
		}
	}
	return tids
}
