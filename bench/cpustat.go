package bench

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/kilnvm/kiln/internal/procstat"
)

// cpuTimes is a task's CPU time.
type cpuTimes struct {
	// Host is user and system time outside any KVM guest.
	Host time.Duration
	// Guest is time spent running a KVM guest (vCPU threads in KVM_RUN);
	// the kernel also counts it in user time, which Host leaves it out of.
	Guest time.Duration
}

// readCPUTimes reads a task's CPU time (pid 0: this process's).
func readCPUTimes(pid int) (cpuTimes, error) {
	t, err := procstat.Read(pid)
	if err != nil {
		return cpuTimes{}, err
	}
	return cpuTimesOf(t), nil
}

// cpuTimesOf splits a task's ticks into time outside and inside a guest.
func cpuTimesOf(t procstat.Times) cpuTimes {
	guest := min(t.Guest, t.UTime)
	tick := time.Second / procstat.UserHZ
	return cpuTimes{Host: time.Duration(t.UTime-guest+t.STime) * tick, Guest: time.Duration(guest) * tick}
}

// findTask returns the pid of a process whose /proc/PID/comm is comm (a
// kernel thread such as vhost-1234), or 0.
func findTask(proc, comm string) int {
	dirs, _ := filepath.Glob(filepath.Join(proc, "[0-9]*", "comm"))
	for _, p := range dirs {
		b, err := os.ReadFile(p)
		if err != nil || strings.TrimSpace(string(b)) != comm {
			continue
		}
		pid, err := strconv.Atoi(filepath.Base(filepath.Dir(p)))
		if err == nil {
			return pid
		}
	}
	return 0
}

// kvmDebugfs is where KVM keeps each VM's statistics (a folder PID-FD per
// VM), when debugfs is mounted.
const kvmDebugfs = "/sys/kernel/debug/kvm"

// KVMExitKinds are the per-VM KVM counters the vsock benchmark reads per
// round trip: all exits, those to the VMM for MMIO (a virtio-mmio
// register), port I/O, host interrupts, HLT, and the interrupts injected.
var KVMExitKinds = []string{"exits", "mmio_exits", "io_exits", "irq_exits", "halt_exits", "irq_injections"}

// readKVMStats sums KVMExitKinds over the VMs that process pid made, in
// dir (a process has one VM at a time here). KVM names a VM's folder for
// the thread that created it, which in a Go VMM is seldom the main one,
// so each of the process's threads (proc/PID/task) is looked for. ok is
// false when there is none.
func readKVMStats(dir, proc string, pid int) (map[string]uint64, bool) {
	ids := []string{strconv.Itoa(pid)}
	if tasks, err := os.ReadDir(filepath.Join(proc, strconv.Itoa(pid), "task")); err == nil {
		for _, t := range tasks {
			if t.Name() != ids[0] {
				ids = append(ids, t.Name())
			}
		}
	}
	var vms []string
	for _, id := range ids {
		m, _ := filepath.Glob(filepath.Join(dir, id+"-*"))
		vms = append(vms, m...)
	}
	if len(vms) == 0 {
		return nil, false
	}
	out := make(map[string]uint64, len(KVMExitKinds))
	for _, vm := range vms {
		for _, k := range KVMExitKinds {
			b, err := os.ReadFile(filepath.Join(vm, k))
			if err != nil {
				return nil, false
			}
			n, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
			if err != nil {
				return nil, false
			}
			out[k] += n
		}
	}
	return out, true
}

// processOnCPU sums the time every thread of process pid has spent on a
// CPU, guest time included (proc/PID/task/TID/schedstat, nanoseconds:
// finer than stat's 10 ms ticks, which an idle process's few
// milliseconds a second would round away). Threads that have exited are
// not counted.
func processOnCPU(proc string, pid int) (time.Duration, error) {
	tasks, err := os.ReadDir(filepath.Join(proc, strconv.Itoa(pid), "task"))
	if err != nil {
		return 0, fmt.Errorf("bench: threads of process %d: %w", pid, err)
	}
	var sum time.Duration
	for _, t := range tasks {
		b, err := os.ReadFile(filepath.Join(proc, strconv.Itoa(pid), "task", t.Name(), "schedstat"))
		if errors.Is(err, fs.ErrNotExist) {
			continue // the thread exited
		}
		if err != nil {
			return 0, fmt.Errorf("bench: process %d: %w", pid, err)
		}
		d, err := parseSchedstat(b)
		if err != nil {
			return 0, fmt.Errorf("bench: process %d thread %s: %w", pid, t.Name(), err)
		}
		sum += d
	}
	return sum, nil
}

// parseSchedstat reads a schedstat line's first field: nanoseconds on a
// CPU.
func parseSchedstat(b []byte) (time.Duration, error) {
	f := strings.Fields(string(b))
	if len(f) != 3 {
		return 0, fmt.Errorf("schedstat %q: want 3 fields", b)
	}
	ns, err := strconv.ParseUint(f[0], 10, 63)
	if err != nil {
		return 0, fmt.Errorf("schedstat %q: %w", b, err)
	}
	return time.Duration(ns), nil
}
