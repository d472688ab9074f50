package bench

import (
	"os"
	"path/filepath"
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
