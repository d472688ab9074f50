package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kilnvm/kiln/guestkernel"
)

func TestDefaultParallel(t *testing.T) {
	tests := []struct {
		name                          string
		numCPU, cpus, memAvail, memMi int
		want                          int
	}{
		{"two cores, one vCPU each", 2, 1, 23 * 1024, 4096, 2},
		{"two cores, two vCPUs each", 2, 2, 23 * 1024, 4096, 1},
		{"one core", 1, 1, 23 * 1024, 4096, 1},
		{"more vCPUs than cores", 2, 4, 23 * 1024, 4096, 1},
		{"memory limits", 16, 1, 12 * 1024, 4096, 2},
		{"memory unknown", 16, 2, 0, 4096, 8},
		{"too little memory for one", 8, 1, 1024, 4096, 1},
	}
	for _, tt := range tests {
		if got := defaultParallel(tt.numCPU, tt.cpus, tt.memAvail, tt.memMi); got != tt.want {
			t.Errorf("%s: defaultParallel(%d, %d, %d, %d) = %d, want %d", tt.name, tt.numCPU, tt.cpus, tt.memAvail, tt.memMi, got, tt.want)
		}
	}
}

func TestParseMemAvailable(t *testing.T) {
	tests := []struct {
		in   string
		want int
	}{
		{"MemTotal:       24576000 kB\nMemFree:        1000 kB\nMemAvailable:   23552000 kB\n", 23000},
		{"MemTotal:       24576000 kB\n", 0},
		{"MemAvailable: lots kB\n", 0},
		{"", 0},
	}
	for _, tt := range tests {
		if got := parseMemAvailable(strings.NewReader(tt.in)); got != tt.want {
			t.Errorf("parseMemAvailable(%q) = %d, want %d", tt.in, got, tt.want)
		}
	}
}

func TestUnitSlots(t *testing.T) {
	tests := []struct{ cpus, base, slots, want int }{
		{1, 1, 2, 1},
		{2, 1, 2, 2},
		{2, 1, 4, 2},
		{3, 2, 4, 2},
		{4, 1, 2, 2}, // never more than the pool has
		{2, 2, 2, 1},
		{0, 0, 0, 1},
	}
	for _, tt := range tests {
		if got := unitSlots(tt.cpus, tt.base, tt.slots); got != tt.want {
			t.Errorf("unitSlots(%d, %d, %d) = %d, want %d", tt.cpus, tt.base, tt.slots, got, tt.want)
		}
	}
}

func TestPhases(t *testing.T) {
	tests := []struct {
		tests []string
		want  string
	}{
		{nil, "[]"},
		{[]string{"TestKVMA", "TestKVMB"}, "[[0 1]]"},
		{[]string{"TestKVMA", "TestKVMWarmSnap", "TestKVMB", "TestKVMWarmDisk"}, "[[1 3] [0 2]]"},
		{[]string{"TestKVMWarmOnly"}, "[[0]]"},
		{[]string{"TestKVMWar", "TestKVMwarmLower"}, "[[0 1]]"},
	}
	for _, tt := range tests {
		if got := fmt.Sprint(phases(tt.tests)); got != tt.want {
			t.Errorf("phases(%q) = %s, want %s", tt.tests, got, tt.want)
		}
	}
}

func TestRunPool(t *testing.T) {
	tests := []struct {
		name    string
		slots   int
		weights []int
		// wantPeak, when set, is the most weight that must run at once:
		// each run waits (up to a few seconds) until it has.
		wantPeak int
		// alone lists the units that must have run with no other.
		alone []int
	}{
		{name: "two at once", slots: 2, weights: []int{1, 1, 1, 1, 1}, wantPeak: 2},
		{name: "one at a time", slots: 1, weights: []int{1, 1, 1}, wantPeak: 1},
		{name: "no slots is one", slots: 0, weights: []int{1, 1}, wantPeak: 1},
		{name: "heavy unit runs alone", slots: 2, weights: []int{1, 2, 1, 1}, alone: []int{1}},
		{name: "weight above the pool is clamped", slots: 3, weights: []int{5, 1, 1}, alone: []int{0}},
		{name: "three of weight one beside one of two", slots: 4, weights: []int{1, 1, 2, 1}, wantPeak: 4},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var mu sync.Mutex
			busy, peak := 0, 0
			running := map[int]bool{}
			var started []int
			overlapped := map[int]bool{}
			order := make([]int, len(tt.weights))
			for i := range order {
				order[i] = i
			}
			weight := func(i int) int { return tt.weights[i] }
			limit := max(tt.slots, 1)
			runPool(context.Background(), order, tt.slots, weight, func(i int) {
				w := min(tt.weights[i], limit)
				mu.Lock()
				started = append(started, i)
				busy += w
				peak = max(peak, busy)
				if busy > limit {
					t.Errorf("weight %d running at once, with %d slots", busy, limit)
				}
				for j := range running {
					overlapped[i], overlapped[j] = true, true
				}
				running[i] = true
				mu.Unlock()
				deadline := time.Now().Add(5 * time.Second)
				for tt.wantPeak > 0 && time.Now().Before(deadline) {
					mu.Lock()
					reached := peak >= tt.wantPeak
					mu.Unlock()
					if reached {
						break
					}
					time.Sleep(time.Millisecond)
				}
				time.Sleep(5 * time.Millisecond)
				mu.Lock()
				busy -= w
				delete(running, i)
				mu.Unlock()
			})
			// Runs start in order; with room for more than one, their
			// goroutines may record it out of order.
			if limit > 1 {
				slices.Sort(started)
			}
			if !slices.Equal(started, order) {
				t.Errorf("started %v, want %v", started, order)
			}
			if tt.wantPeak > 0 && peak != tt.wantPeak {
				t.Errorf("at most %d ran at once, want %d", peak, tt.wantPeak)
			}
			for _, i := range tt.alone {
				if overlapped[i] {
					t.Errorf("unit %d ran beside another", i)
				}
			}
		})
	}
}

func TestRunPoolCancel(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	var mu sync.Mutex
	var ran []int
	runPool(ctx, []int{0, 1, 2, 3}, 1, func(int) int { return 1 }, func(i int) {
		mu.Lock()
		ran = append(ran, i)
		mu.Unlock()
		if i == 1 {
			cancel()
		}
	})
	if !slices.Equal(ran, []int{0, 1}) {
		t.Errorf("ran %v after a cancel in the second, want [0 1]", ran)
	}
}

// fakeQEMU stands in for qemu-system-x86_64: it finds the job script that
// the L1 initramfs (uncompressed cpio) would run and runs it with sh,
// logging "start UNIT" and "end UNIT" lines to its log.
const fakeQEMU = `#!/bin/sh
while [ $# -gt 0 ]; do
  [ "$1" = -initrd ] && initrd=$2
  shift
done
script=$(grep -ao "chroot /host /bin/sh '[^']*'" "$initrd" | sed "s/^chroot \/host \/bin\/sh '//; s/'\$//")
unit=$(basename "$(dirname "$script")")
echo "start $unit" >> "$FAKE_QEMU_LOG"
echo "booted $unit"
sh "$script"
echo "end $unit" >> "$FAKE_QEMU_LOG"
`

// fakeTestBinary passes the one test -test.run names after waiting (5 s
// at most) until as many tests as FAKE_TOGETHER have begun at once, so that
// a serial run shows; a warm test leaves a mark in the shared folder
// (the test checks that it started first).
const fakeTestBinary = `#!/bin/sh
name=$(echo "$2" | tr -d '^$')
case $name in
TestKVMWarm*)
  echo warm > "$KILN_TEST_SHARED/$name" ;;
*)
  touch "$FAKE_STARTED/$name"
  n=0
  while [ "$(ls "$FAKE_STARTED" | wc -l)" -lt "$FAKE_TOGETHER" ] && [ $n -lt 500 ]; do sleep 0.01; n=$((n+1)); done
  [ $n -lt 500 ] || { echo "--- FAIL: $name (5.00s)"; echo "ran alone"; exit 1; } ;;
esac
echo "=== RUN   $name"
echo "--- PASS: $name (1.50s)"
echo PASS
`

// fakeKernel is a kernel whose modules are empty files, for
// buildL1Initramfs.
func fakeKernel(t *testing.T) *guestkernel.Kernel {
	t.Helper()
	if _, err := os.Stat("/bin/busybox"); err != nil {
		t.Skip("busybox-static not installed")
	}
	dir := t.TempDir()
	dep := ""
	for _, m := range []string{"kvm_amd", "virtio_pci", "9pnet_virtio", "9p"} {
		if err := os.WriteFile(filepath.Join(dir, m+".ko"), nil, 0o644); err != nil {
			t.Fatal(err)
		}
		dep += m + ".ko:\n"
	}
	if err := os.WriteFile(filepath.Join(dir, "modules.dep"), []byte(dep), 0o644); err != nil {
		t.Fatal(err)
	}
	return &guestkernel.Kernel{ModulesDir: dir, Image: "/k"}
}

func TestRunUnitsParallel(t *testing.T) {
	goBin, err := goTool()
	if err != nil {
		t.Skip(err)
	}
	k := fakeKernel(t)
	tests := []struct {
		name     string
		parallel int
		tests    []string
		together int
	}{
		{"two at once, warm first", 2, []string{"TestKVMA", "TestKVMWarmA", "TestKVMB", "TestKVMC", "TestKVMD"}, 2},
		{"one at a time", 1, []string{"TestKVMWarmA", "TestKVMA", "TestKVMB"}, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			job, shared, dir := t.TempDir(), t.TempDir(), t.TempDir()
			started := filepath.Join(dir, "started")
			for _, d := range []string{filepath.Join(job, "bin"), filepath.Join(job, "out"), started} {
				if err := os.MkdirAll(d, 0o755); err != nil {
					t.Fatal(err)
				}
			}
			qemu := filepath.Join(dir, "qemu")
			bin := filepath.Join(job, "bin", "0.test")
			if err := os.WriteFile(qemu, []byte(fakeQEMU), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(bin, []byte(fakeTestBinary), 0o755); err != nil {
				t.Fatal(err)
			}
			logPath := filepath.Join(dir, "qemu.log")
			t.Setenv("FAKE_QEMU_LOG", logPath)
			env := []string{"PATH=" + os.Getenv("PATH"), "FAKE_STARTED=" + started, "FAKE_TOGETHER=" + fmt.Sprint(tt.together), "KILN_TEST_SHARED=" + shared}
			var units []testBinary
			for j, name := range tt.tests {
				id := fmt.Sprintf("0-%d", j)
				units = append(units, testBinary{
					pkg: testPackage{ImportPath: "p", Dir: dir}, path: bin, test: name,
					out: filepath.Join(job, "out", id+".out"), rc: filepath.Join(job, "out", id+".rc"),
					dir: filepath.Join(job, "units", id),
				})
			}
			var console writeCounter
			o := options{cpus: 1, parallel: tt.parallel, timeout: time.Minute}
			l1 := l1Config{qemu: qemu, kernel: k, memMiB: 256, timeout: time.Minute, job: job, shared: shared,
				console: &lockedWriter{w: &console}, log: discardLogger()}
			results := runUnits(context.Background(), o, l1, env, units, discardLogger())
			ty := newTally()
			for _, r := range results {
				if r.err != nil || len(r.retries) > 0 {
					t.Errorf("%s: %v, retries %q", r.u.name(), r.err, r.retries)
				}
				collectL1Results(context.Background(), goBin, r.u, ty)
			}
			if ty.kvmPassed != len(tt.tests) || len(ty.reasons()) > 0 {
				t.Errorf("%d of %d passed: %q\n%s", ty.kvmPassed, len(tt.tests), ty.reasons(), console.String())
			}
			for _, d := range ty.durations {
				if d.elapsed != 1500*time.Millisecond {
					t.Errorf("%s took %v, want test2json's 1.5s", d.name, d.elapsed)
				}
			}
			// Each unit has its own files, and its console lines its name.
			for _, u := range units {
				if _, err := os.Stat(filepath.Join(u.dir, "done")); err != nil {
					t.Errorf("%s: no done marker in its own folder: %v", u.test, err)
				}
				if !strings.Contains(console.String(), "L1 "+u.test+"| booted "+filepath.Base(u.dir)+"\n") {
					t.Errorf("%s: no console line of its own:\n%s", u.test, console.String())
				}
			}
			data, err := os.ReadFile(logPath)
			if err != nil {
				t.Fatal(err)
			}
			// The warm test is in the first pool-full to start (those start
			// at once, so their log lines come in any order).
			if first := startOrder(string(data)); !slices.Contains(first[:min(tt.parallel, len(first))], filepath.Base(units[warmIndex(tt.tests)].dir)) {
				t.Errorf("the warm test was not among the first %d to start:\n%s", tt.parallel, data)
			}
			if _, err := os.Stat(filepath.Join(shared, "TestKVMWarmA")); err != nil {
				t.Errorf("no warm mark in the shared folder: %v", err)
			}
			if peak := peakRunning(string(data)); peak != tt.parallel {
				t.Errorf("at most %d L1 VMs ran at once, want %d:\n%s", peak, tt.parallel, data)
			}
		})
	}
}

// warmIndex is the index of the first warm test in tests.
func warmIndex(tests []string) int {
	for i, name := range tests {
		if strings.HasPrefix(name, warmPrefix) {
			return i
		}
	}
	return -1
}

// startOrder is the X of the "start X" lines, in order.
func startOrder(log string) []string {
	var out []string
	for _, line := range strings.Split(log, "\n") {
		if x, ok := strings.CutPrefix(line, "start "); ok {
			out = append(out, x)
		}
	}
	return out
}

// peakRunning reads "start X" and "end X" lines and returns the most X that
// had started and not ended at once.
func peakRunning(log string) int {
	n, peak := 0, 0
	for _, line := range strings.Split(log, "\n") {
		switch {
		case strings.HasPrefix(line, "start "):
			n++
			peak = max(peak, n)
		case strings.HasPrefix(line, "end "):
			n--
		}
	}
	return peak
}

func TestUnitOrder(t *testing.T) {
	names := []string{"TestKVMShort", "TestKVMWarmSnap", "TestKVMBootCommand", "TestKVMLong", "TestKVMNew"}
	weight := func(i int) int {
		if names[i] == "TestKVMBootCommand" {
			return 2
		}
		return 1
	}
	expected := map[string]time.Duration{"TestKVMShort": time.Second, "TestKVMLong": time.Hour, "TestKVMWarmSnap": time.Minute}
	var got []string
	for _, i := range unitOrder(names, weight, expected) {
		got = append(got, names[i])
	}
	// The two-place unit, the warm test, then the rest longest first (an
	// unknown one counts as unknownDuration).
	want := []string{"TestKVMBootCommand", "TestKVMWarmSnap", "TestKVMLong", "TestKVMNew", "TestKVMShort"}
	if !slices.Equal(got, want) {
		t.Errorf("unitOrder = %q, want %q", got, want)
	}
}
