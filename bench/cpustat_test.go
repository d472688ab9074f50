package bench

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/internal/procstat"
)

func TestCPUTimesOf(t *testing.T) {
	tests := []struct {
		name string
		in   procstat.Times
		want cpuTimes
	}{
		{"vmm", procstat.Times{UTime: 250, STime: 40, Guest: 200}, cpuTimes{Host: 900 * time.Millisecond, Guest: 2 * time.Second}},
		{"no guest", procstat.Times{UTime: 10, STime: 5}, cpuTimes{Host: 150 * time.Millisecond}},
		{"guest over user time", procstat.Times{UTime: 1, Guest: 5}, cpuTimes{Guest: 10 * time.Millisecond}},
	}
	for _, tt := range tests {
		if got := cpuTimesOf(tt.in); got != tt.want {
			t.Errorf("%s: cpuTimesOf(%+v) = %+v, want %+v", tt.name, tt.in, got, tt.want)
		}
	}
}

func TestReadCPUTimesAndFindTask(t *testing.T) {
	if _, err := os.Stat("/proc/self/stat"); err != nil {
		t.Skip("no /proc")
	}
	start := time.Now()
	for time.Since(start) < 50*time.Millisecond {
	}
	c, err := readCPUTimes(0)
	if err != nil || c.Host <= 0 {
		t.Errorf("readCPUTimes(self) = %+v, %v; want some host time after spinning", c, err)
	}
	proc := t.TempDir()
	for pid, comm := range map[string]string{"7": "kworker/0:1", "42": "vhost-99", "notapid": "vhost-99"} {
		os.MkdirAll(filepath.Join(proc, pid), 0o755)
		os.WriteFile(filepath.Join(proc, pid, "comm"), []byte(comm+"\n"), 0o644)
	}
	if got := findTask(proc, "vhost-99"); got != 42 {
		t.Errorf("findTask(vhost-99) = %d, want 42", got)
	}
	if got := findTask(proc, "vhost-1"); got != 0 {
		t.Errorf("findTask(vhost-1) = %d, want 0", got)
	}
}

func TestReadKVMStats(t *testing.T) {
	dir := t.TempDir()
	write := func(vm string, v map[string]string) {
		os.MkdirAll(filepath.Join(dir, vm), 0o755)
		for k, s := range v {
			os.WriteFile(filepath.Join(dir, vm, k), []byte(s), 0o444)
		}
	}
	all := func(n string) map[string]string {
		m := map[string]string{}
		for _, k := range KVMExitKinds {
			m[k] = n + "\n"
		}
		return m
	}
	write("100-12", all("7"))
	write("200-9", all("3"))
	write("200-11", all("4"))
	bad := all("1")
	bad["io_exits"] = "x\n"
	write("300-5", bad)
	short := all("1")
	delete(short, "halt_exits")
	write("400-5", short)
	// Process 600's VM was made by its thread 601.
	write("601-10", all("5"))
	proc := t.TempDir()
	for _, tid := range []string{"600", "601", "602"} {
		os.MkdirAll(filepath.Join(proc, "600", "task", tid), 0o755)
	}
	tests := []struct {
		pid  int
		want uint64
		ok   bool
	}{{100, 7, true}, {200, 7, true}, {300, 0, false}, {400, 0, false}, {500, 0, false}, {600, 5, true}}
	for _, tt := range tests {
		got, ok := readKVMStats(dir, proc, tt.pid)
		if ok != tt.ok || (ok && (len(got) != len(KVMExitKinds) || got["exits"] != tt.want || got["irq_injections"] != tt.want)) {
			t.Errorf("readKVMStats(pid %d) = %v, %v; want each %d, %v", tt.pid, got, ok, tt.want, tt.ok)
		}
	}
}

func TestParseSchedstat(t *testing.T) {
	tests := []struct {
		in   string
		want time.Duration
		ok   bool
	}{
		{"123456789 2000 17\n", 123456789, true},
		{"0 0 0", 0, true},
		{"", 0, false},
		{"12 34", 0, false},
		{"-5 1 1", 0, false},
		{"x 1 1", 0, false},
		{"99999999999999999999 1 1", 0, false},
	}
	for _, tt := range tests {
		got, err := parseSchedstat([]byte(tt.in))
		if (err == nil) != tt.ok || got != tt.want {
			t.Errorf("parseSchedstat(%q) = %v, %v; want %v (ok %v)", tt.in, got, err, tt.want, tt.ok)
		}
	}
}

func TestProcessOnCPU(t *testing.T) {
	proc := t.TempDir()
	for tid, stat := range map[string]string{"10": "1000000 5 5\n", "11": "2500000 1 1\n"} {
		os.MkdirAll(filepath.Join(proc, "10", "task", tid), 0o755)
		os.WriteFile(filepath.Join(proc, "10", "task", tid, "schedstat"), []byte(stat), 0o644)
	}
	// A thread that exited between the listing and the read.
	os.MkdirAll(filepath.Join(proc, "10", "task", "12"), 0o755)
	if got, err := processOnCPU(proc, 10); err != nil || got != 3500*time.Microsecond {
		t.Errorf("processOnCPU = %v, %v; want 3.5ms", got, err)
	}
	os.WriteFile(filepath.Join(proc, "10", "task", "11", "schedstat"), []byte("garbage"), 0o644)
	if _, err := processOnCPU(proc, 10); err == nil || !strings.Contains(err.Error(), "thread 11") {
		t.Errorf("processOnCPU with a bad schedstat: %v, want an error naming thread 11", err)
	}
	if _, err := processOnCPU(proc, 99); err == nil {
		t.Error("processOnCPU of a missing process: no error")
	}
	if _, err := os.Stat("/proc/self/task"); err != nil {
		return
	}
	start := time.Now()
	for time.Since(start) < 20*time.Millisecond {
	}
	if got, err := processOnCPU("/proc", os.Getpid()); err != nil || got < 10*time.Millisecond {
		t.Errorf("processOnCPU(self) = %v, %v; want at least the 20 ms just spun", got, err)
	}
}
