// Package procstat reads a task's CPU times from /proc/PID/stat, the one
// line the kernel writes as "pid (comm) state ppid ...", where comm may
// hold spaces and parentheses.
package procstat

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// UserHZ is the unit of the line's times (USER_HZ: 100 on every Linux ABI
// Kiln runs on).
const UserHZ = 100

// Times are a task's CPU times in clock ticks (UserHZ a second).
type Times struct {
	// UTime and STime are user and system time (fields 14 and 15).
	UTime, STime uint64
	// Guest is time spent running a KVM guest (field 43), which the
	// kernel also counts in UTime; 0 where the line stops before it.
	Guest uint64
}

// Parse reads Times from the text of /proc/PID/stat. It needs the fields
// through stime; guest_time is read where the line has it.
func Parse(b []byte) (Times, error) {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return Times{}, fmt.Errorf("/proc stat: no command name")
	}
	f := strings.Fields(string(b[i+1:])) // f[0] is field 3, the state
	field := func(n int) (uint64, error) {
		v, err := strconv.ParseUint(f[n-3], 10, 64)
		if err != nil {
			return 0, fmt.Errorf("/proc stat field %d %q: %w", n, f[n-3], err)
		}
		return v, nil
	}
	if len(f) < 13 {
		return Times{}, fmt.Errorf("/proc stat: %d fields after the command name, want at least 13", len(f))
	}
	var t Times
	var err error
	if t.UTime, err = field(14); err != nil {
		return Times{}, err
	}
	if t.STime, err = field(15); err != nil {
		return Times{}, err
	}
	if len(f) >= 41 {
		if t.Guest, err = field(43); err != nil {
			return Times{}, err
		}
	}
	return t, nil
}

// Read reads /proc/PID/stat (pid 0: this process's) and parses it.
func Read(pid int) (Times, error) {
	p := "/proc/self/stat"
	if pid > 0 {
		p = fmt.Sprintf("/proc/%d/stat", pid)
	}
	b, err := os.ReadFile(p)
	if err != nil {
		return Times{}, err
	}
	return Parse(b)
}
