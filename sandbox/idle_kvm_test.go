package sandbox

import (
	"context"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/internal/kvmtest"
)

// interrupts parses the guest's /proc/interrupts into each source's
// count, all CPUs summed: the numbered IRQs by their device name, the
// others (LOC: the local APIC timer) by their own.
func interrupts(text string) map[string]uint64 {
	out := map[string]uint64{}
	lines := strings.Split(text, "\n")
	if len(lines) < 2 {
		return out
	}
	cpus := len(strings.Fields(lines[0]))
	for _, l := range lines[1:] {
		f := strings.Fields(l)
		if len(f) < 2 {
			continue
		}
		name := strings.TrimSuffix(f[0], ":")
		var n uint64
		i := 1
		for ; i < len(f) && i <= cpus; i++ {
			v, err := strconv.ParseUint(f[i], 10, 64)
			if err != nil {
				break
			}
			n += v
		}
		if _, err := strconv.Atoi(name); err == nil && i < len(f) {
			name = f[len(f)-1] // the device's name
		}
		out[name] += n
	}
	return out
}

// BenchmarkKVMIdleWakeups counts an idle sandbox's wake-ups: its local
// APIC timer interrupts (LOC) and all its interrupts per second over a
// quiet window, with the kernel's lockup watchdog off (the sandbox's
// default: nowatchdog) and turned on again at run time (as sandboxes
// booted before), so that one run shows both.
func BenchmarkKVMIdleWakeups(b *testing.B) {
	if err := kvmtest.Usable(); err != nil {
		b.Skipf("needs /dev/kvm: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	const settle, window = 10 * time.Second, 30 * time.Second
	sb, err := Start(ctx, Options{Runtime: testRuntime(b), CPUs: 1, MemoryMiB: 512, Hostname: "idle"})
	if err != nil {
		b.Fatalf("Start: %v", err)
	}
	defer sb.Close(context.Background())
	measure := func(what string) (loc, all float64) {
		time.Sleep(settle)
		before := interrupts(sh(b, ctx, sb, "cat /proc/interrupts"))
		time.Sleep(window)
		after := interrupts(sh(b, ctx, sb, "cat /proc/interrupts"))
		var names []string
		var total uint64
		for k, v := range after {
			if d := v - before[k]; d > 0 {
				names = append(names, fmt.Sprintf("%s %d", k, d))
				total += d
			}
		}
		sort.Strings(names)
		loc, all = float64(after["LOC"]-before["LOC"])/window.Seconds(), float64(total)/window.Seconds()
		b.Logf("%s: %.2f timer interrupts/s, %.2f interrupts/s over %v (emulated or not: see the harness's mode); by source: %s",
			what, loc, all, window, strings.Join(names, ", "))
		return loc, all
	}
	for b.Loop() {
		loc, all := measure("watchdog off (nowatchdog)")
		sh(b, ctx, sb, "echo 1 > /proc/sys/kernel/watchdog")
		wloc, wall := measure("watchdog on")
		sh(b, ctx, sb, "echo 0 > /proc/sys/kernel/watchdog")
		b.ReportMetric(loc, "timer-irq/s")
		b.ReportMetric(all, "irq/s")
		b.ReportMetric(wloc, "watchdog-timer-irq/s")
		b.ReportMetric(wall, "watchdog-irq/s")
	}
}

func TestInterrupts(t *testing.T) {
	text := `           CPU0       CPU1
  0:         34          0   IO-APIC   2-edge      timer
  5:       1200         12   IO-APIC   5-edge      virtio0
NMI:          0          0   Non-maskable interrupts
LOC:       5000       4000   Local timer interrupts
ERR:          0
`
	got := interrupts(text)
	for k, want := range map[string]uint64{"timer": 34, "virtio0": 1212, "NMI": 0, "LOC": 9000, "ERR": 0} {
		if got[k] != want {
			t.Errorf("%s: %d, want %d (all: %v)", k, got[k], want, got)
		}
	}
}
