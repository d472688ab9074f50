package bench

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// userHZ is the unit of /proc/PID/stat's times (USER_HZ, 100 on Linux).
const userHZ = 100

// cpuTimes is a task's CPU time from /proc/PID/stat.
type cpuTimes struct {
	// Host is user and system time outside any KVM guest.
	Host time.Duration
	// Guest is time spent running a KVM guest (vCPU threads in KVM_RUN);
	// the kernel also counts it in user time, which Host leaves it out of.
	Guest time.Duration
}

func (a cpuTimes) sub(b cpuTimes) cpuTimes {
	return cpuTimes{Host: a.Host - b.Host, Guest: a.Guest - b.Guest}
}

// parseProcStat reads utime, stime and guest_time from the text of
// /proc/PID/stat (fields 14, 15 and 43; the command, field 2, may hold
// spaces and parentheses, so fields count from its last ')').
func parseProcStat(s string) (cpuTimes, error) {
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return cpuTimes{}, fmt.Errorf("proc stat %.40q: no command field", s)
	}
	f := strings.Fields(s[i+1:]) // f[0] is field 3, the state
	if len(f) < 41 {
		return cpuTimes{}, fmt.Errorf("proc stat: %d fields after the command, want at least 41", len(f))
	}
	var v [3]uint64
	for k, field := range []int{14, 15, 43} {
		n, err := strconv.ParseUint(f[field-3], 10, 64)
		if err != nil {
			return cpuTimes{}, fmt.Errorf("proc stat field %d: %w", field, err)
		}
		v[k] = n
	}
	utime, stime, guest := v[0], v[1], v[2]
	if guest > utime {
		guest = utime
	}
	tick := time.Second / userHZ
	return cpuTimes{Host: time.Duration(utime-guest+stime) * tick, Guest: time.Duration(guest) * tick}, nil
}

// readCPUTimes reads /proc/PID/stat (pid 0: this process).
func readCPUTimes(pid int) (cpuTimes, error) {
	p := "/proc/self/stat"
	if pid > 0 {
		p = fmt.Sprintf("/proc/%d/stat", pid)
	}
	b, err := os.ReadFile(p)
	if err != nil {
		return cpuTimes{}, err
	}
	return parseProcStat(string(b))
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
