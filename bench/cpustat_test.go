package bench

import (
	"os"
	"path/filepath"
	"testing"
	"time"
)

func TestParseProcStat(t *testing.T) {
	// 52 fields as Linux 6.1 writes them; utime 250, stime 40, guest 200.
	line := func(comm string, utime, stime, guest string) string {
		f := []string{"1234", comm, "S", "1", "1", "1", "0", "-1", "4194560", "100", "0", "0", "0", utime, stime,
			"0", "0", "20", "0", "3", "0", "100", "1000000", "200", "18446744073709551615", "1", "1", "0", "0", "0",
			"0", "0", "0", "0", "0", "0", "0", "17", "0", "0", "0", "0", guest, "0", "0", "0", "0", "0", "0", "0", "0", "0"}
		s := ""
		for i, x := range f {
			if i > 0 {
				s += " "
			}
			s += x
		}
		return s + "\n"
	}
	tests := []struct {
		name    string
		stat    string
		want    cpuTimes
		wantErr bool
	}{
		{"vmm", line("(kiln)", "250", "40", "200"), cpuTimes{Host: 900 * time.Millisecond, Guest: 2 * time.Second}, false},
		{"command with spaces and parens", line("(a) b (c))", "10", "5", "0"), cpuTimes{Host: 150 * time.Millisecond}, false},
		{"guest over user time", line("(x)", "1", "0", "5"), cpuTimes{Guest: 10 * time.Millisecond}, false},
		{"no command", "1234 kiln S 1", cpuTimes{}, true},
		{"short", "1234 (kiln) S 1 2 3", cpuTimes{}, true},
		{"not a number", line("(kiln)", "x", "40", "200"), cpuTimes{}, true},
		{"empty", "", cpuTimes{}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseProcStat(tt.stat)
			if (err != nil) != tt.wantErr || got != tt.want {
				t.Errorf("parseProcStat = %+v, %v; want %+v, error %v", got, err, tt.want, tt.wantErr)
			}
		})
	}
}

func FuzzParseProcStat(f *testing.F) {
	f.Add("1 (a) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32 33 34 35 36 37 38 39 40 41")
	f.Add("1 (a))) S")
	f.Fuzz(func(t *testing.T, s string) {
		c, err := parseProcStat(s)
		if err == nil && (c.Host < 0 || c.Guest < 0) {
			t.Errorf("parseProcStat(%q) = %+v: negative", s, c)
		}
	})
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
