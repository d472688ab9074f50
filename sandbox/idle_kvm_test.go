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
// quiet window (less what the exec that reads them costs), with the
// kernel's lockup watchdog off (the sandbox's default: nowatchdog) and
// turned on again at run time (as sandboxes booted before), so that one
// run shows both; and, where the guest has tracefs, the timers that
// expired and the tasks they woke (the window's last read included).
func BenchmarkKVMIdleWakeups(b *testing.B) {
	if err := kvmtest.Usable(); err != nil {
		b.Skipf("needs /dev/kvm: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	const settle, window = 10 * time.Second, 60 * time.Second
	sb, err := Start(ctx, Options{Runtime: testRuntime(b), CPUs: 1, MemoryMiB: 512, Hostname: "idle"})
	if err != nil {
		b.Fatalf("Start: %v", err)
	}
	defer sb.Close(context.Background())
	// The guest's timer expiries over the window name what woke it
	// (tracefs, where the kernel has it).
	const tr = "/sys/kernel/tracing"
	traceOn := "mountpoint -q " + tr + " || mount -t tracefs nodev " + tr + "; echo > " + tr + "/trace; " +
		"echo 1 > " + tr + "/events/timer/timer_expire_entry/enable; echo 1 > " + tr + "/events/timer/hrtimer_expire_entry/enable; " +
		"echo 1 > " + tr + "/events/sched/sched_wakeup/enable; echo 1 > " + tr + "/tracing_on"
	traceOff := "echo 0 > " + tr + "/tracing_on; echo 0 > " + tr + "/events/timer/enable; echo 0 > " + tr + "/events/sched/sched_wakeup/enable; " +
		"sed -n 's/.*\\(function\\|callback\\)=\\([^ ]*\\).*/\\2/p' " + tr + "/trace | sort | uniq -c | sort -rn | head -8; echo woken:; " +
		"sed -n 's/.*sched_wakeup: comm=\\(.*\\) pid=\\([0-9]*\\) .*/\\1[\\2]/p' " + tr + "/trace | sort | uniq -c | sort -rn | head -8"
	measure := func(what string) (loc, all float64) {
		time.Sleep(settle)
		_, _, st, _ := shTry(ctx, sb, traceOn)
		// What one read costs (an exec: the agent, its trampoline, cat)
		// is taken off the window's count: two reads back to back.
		first := interrupts(sh(b, ctx, sb, "cat /proc/interrupts"))
		before := interrupts(sh(b, ctx, sb, "cat /proc/interrupts"))
		time.Sleep(window)
		after := interrupts(sh(b, ctx, sb, "cat /proc/interrupts"))
		if st.Success() {
			top, _, _, _ := shTry(ctx, sb, traceOff)
			b.Logf("%s: timers expired over the window (count, function): %s", what, strings.Join(strings.Fields(top), " "))
		}
		var names []string
		var total, read uint64
		for k, v := range after {
			d, r := v-before[k], before[k]-first[k]
			if d > 0 {
				names = append(names, fmt.Sprintf("%s %d (a read %d)", k, d, r))
				total += d
				read += r
			}
		}
		sort.Strings(names)
		idle := func(d, r uint64) float64 { return max(float64(d)-float64(r), 0) / window.Seconds() }
		loc, all = idle(after["LOC"]-before["LOC"], before["LOC"]-first["LOC"]), idle(total, read)
		b.Logf("%s: %.2f timer interrupts/s, %.2f interrupts/s idle over %v, a read's own taken off (emulated or not: see the harness's mode); by source: %s",
			what, loc, all, window, strings.Join(names, ", "))
		return loc, all
	}
	for b.Loop() {
		loc, all := measure("watchdog off (nowatchdog)")
		b.Logf("compaction_proactiveness %s, watchdog %s", sh(b, ctx, sb, "cat /proc/sys/vm/compaction_proactiveness"), sh(b, ctx, sb, "cat /proc/sys/kernel/watchdog"))
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
