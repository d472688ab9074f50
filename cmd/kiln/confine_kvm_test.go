package main

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/internal/kvmtest"
	"github.com/kilnvm/kiln/sandbox"
	"github.com/kilnvm/kiln/vmmproc"
)

// TestKVMRunConfined runs the built kiln and kiln-vmm (cgo-free, as make
// build builds them) as root with kiln's defaults: `kiln run -- sleep 30`.
// From the moment its VMM process says its filter is on until kiln exits,
// every task of every process of kiln's tree that holds /dev/kvm (or a
// KVM VM or vCPU descriptor) shows Seccomp 2, NoNewPrivs 1, no effective capability and
// a uid other than root's; at least one such process exists, and it is
// not kiln itself: the CLI keeps no KVM descriptor.
func TestKVMRunConfined(t *testing.T) {
	kvmtest.Require(t)
	kvmtest.Kernel(t)
	if os.Geteuid() != 0 {
		t.Fatalf("run as root (the harness does): kiln run jails its VMM processes as root only, uid %d here", os.Geteuid())
	}
	kiln := kvmtest.KilnBinary(t)
	cmd := exec.Command(kiln, "run", "--agent", kvmtest.AgentBinary(t), "--boot-timeout", "8m", "--", "sleep", "30")
	// Its VMM processes run kiln-vmm, cgo-free as make build builds it.
	cmd.Env = append(os.Environ(), sandbox.VMMEnv+"="+kvmtest.VMMBinary(t))
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	begin := time.Now()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	ended := false
	defer func() {
		if !ended {
			cmd.Process.Kill()
			<-exited
		}
	}()
	cli := cmd.Process.Pid

	// Scan every 500 ms until kiln exits; check from the first scan at
	// which a holder's vmm.log says its filter went on.
	confined, scans := 0, 0
	seen := map[int]bool{}
	deadline := time.After(12 * time.Minute)
	for done := false; !done; {
		select {
		case err := <-exited:
			ended = true
			if err != nil {
				t.Fatalf("kiln run: %v; stdout %q, stderr %q", err, stdout.String(), stderr.String())
			}
			done = true
			continue
		case <-deadline:
			t.Fatalf("kiln run still running after 12 min; stderr %q", stderr.String())
		case <-time.After(500 * time.Millisecond):
		}
		holders := kvmHolders(t, cli)
		if confined == 0 {
			for _, pid := range holders {
				if filterOn(pid) {
					confined++
					t.Logf("VMM process %d confined after %v", pid, time.Since(begin).Round(time.Millisecond))
					break
				}
			}
			if confined == 0 {
				continue
			}
		}
		scans++
		for _, pid := range holders {
			if pid == cli {
				t.Fatalf("kiln itself (PID %d) holds a KVM descriptor", cli)
			}
			if err := checkConfined(pid); err != nil {
				// A process that exited meanwhile has no tasks to check.
				if _, serr := os.Stat(fmt.Sprintf("/proc/%d", pid)); serr == nil {
					t.Fatalf("scan %d: %v", scans, err)
				}
			}
			if !seen[pid] {
				seen[pid] = true
				t.Logf("process %d holds KVM descriptors: every task confined", pid)
			}
		}
	}
	if confined == 0 || len(seen) == 0 {
		t.Fatalf("no confined process holding /dev/kvm was seen; stderr %q", stderr.String())
	}
	if scans < 20 { // the sleep alone is 60 scans
		t.Fatalf("only %d scans while the VM ran", scans)
	}
	t.Logf("kiln run -- sleep 30: %d processes holding KVM, all tasks confined over %d scans, %v in all",
		len(seen), scans, time.Since(begin).Round(time.Millisecond))
}

// kvmHolders returns the PIDs of root's tree (root and its descendants)
// that hold /dev/kvm, a KVM VM or a vCPU descriptor.
func kvmHolders(t *testing.T, root int) []int {
	t.Helper()
	var kvm unix.Stat_t
	if err := unix.Stat("/dev/kvm", &kvm); err != nil {
		t.Fatal(err)
	}
	ents, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	parent := map[int]int{}
	var holders []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		st, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
		if err != nil {
			continue
		}
		parent[pid] = statusInt(string(st), "PPid:")
		fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
		if err != nil {
			continue
		}
		for _, fd := range fds {
			p := fmt.Sprintf("/proc/%d/fd/%s", pid, fd.Name())
			link, _ := os.Readlink(p)
			var s unix.Stat_t
			isKVM := unix.Stat(p, &s) == nil && s.Mode&unix.S_IFMT == unix.S_IFCHR && s.Rdev == kvm.Rdev
			if isKVM || strings.HasPrefix(link, "anon_inode:kvm-") {
				holders = append(holders, pid)
				break
			}
		}
	}
	var mine []int
	for _, pid := range holders {
		for p, hops := pid, 0; p > 1 && hops < 64; p, hops = parent[p], hops+1 {
			if p == root {
				mine = append(mine, pid)
				break
			}
		}
	}
	return mine
}

// filterOn says whether the VMM process pid's log says its seccomp filter
// went on: from then on every thread it has or starts is filtered.
func filterOn(pid int) bool {
	env, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid))
	if err != nil {
		return false
	}
	for _, kv := range bytes.Split(env, []byte{0}) {
		if sock, ok := strings.CutPrefix(string(kv), vmmproc.SocketEnv+"="); ok {
			log, err := os.ReadFile(filepath.Join(filepath.Dir(sock), vmmproc.LogFile))
			return err == nil && bytes.Contains(log, []byte("seccomp filter installed"))
		}
	}
	return false
}

// checkConfined checks every task of pid: Seccomp 2, NoNewPrivs 1, no
// effective capability, and no uid of root's.
func checkConfined(pid int) error {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return err
	}
	if len(tasks) == 0 {
		return errors.New("no tasks")
	}
	for _, task := range tasks {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/status", pid, task.Name()))
		if err != nil {
			return err
		}
		st := string(b)
		for _, want := range []string{"\nSeccomp:\t2\n", "\nNoNewPrivs:\t1\n", "\nCapEff:\t0000000000000000\n"} {
			if !strings.Contains(st, want) {
				return fmt.Errorf("process %d task %s lacks %q:\n%s", pid, task.Name(), strings.TrimSpace(want), st)
			}
		}
		for _, l := range strings.Split(st, "\n") {
			if f := strings.Fields(l); len(f) == 5 && f[0] == "Uid:" {
				for _, u := range f[1:] {
					if u == "0" {
						return fmt.Errorf("process %d task %s runs as root: %s", pid, task.Name(), l)
					}
				}
			}
		}
	}
	return nil
}

// statusInt is the number after key in a /proc status file, or 0.
func statusInt(status, key string) int {
	for _, l := range strings.Split(status, "\n") {
		if v, ok := strings.CutPrefix(l, key); ok {
			n, _ := strconv.Atoi(strings.TrimSpace(v))
			return n
		}
	}
	return 0
}
