package main

import (
	"bufio"
	"context"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// warmPrefix starts the names of the KVM tests that start before all
// others (in tcg mode, first in the pool of L1 VMs; in direct mode, in a go
// test run of their own), so that what they leave in the shared folder
// (kvmtest.Shared) is there by the time the tests that use it start.
const warmPrefix = "TestKVMWarm"

// l1Overhead is the memory, in MiB, one QEMU TCG process takes beyond its
// guest's RAM (mostly the translation cache), for defaultParallel.
const l1Overhead = 1024

// defaultParallel is how many L1 VMs run at once by default: one per cpus
// host CPUs (an emulated vCPU keeps a host CPU busy), no more than
// memAvailMiB holds at memMiB each plus l1Overhead (memAvailMiB 0:
// unknown, no limit), and at least one.
func defaultParallel(numCPU, cpus, memAvailMiB, memMiB int) int {
	n := numCPU / max(cpus, 1)
	if memAvailMiB > 0 {
		n = min(n, memAvailMiB/(memMiB+l1Overhead))
	}
	return max(n, 1)
}

// memAvailableMiB returns MemAvailable from /proc/meminfo in MiB, or 0 when
// it cannot be read.
func memAvailableMiB() int {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0
	}
	defer f.Close()
	return parseMemAvailable(f)
}

// parseMemAvailable reads the MemAvailable line of /proc/meminfo (in kB)
// and returns it in MiB, or 0 when there is none.
func parseMemAvailable(r io.Reader) int {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) >= 2 && f[0] == "MemAvailable:" {
			kb, err := strconv.Atoi(f[1])
			if err != nil {
				return 0
			}
			return kb / 1024
		}
	}
	return 0
}

// unitSlots is how many of the pool's slots a unit whose L1 has cpus
// vCPUs takes: one per base vCPUs (-cpus), rounded up, at most all of
// them. With -parallel 2 and -cpus 1, the test that needs a two-vCPU L1
// runs alone, so the host's CPUs are not oversubscribed.
func unitSlots(cpus, base, slots int) int {
	base = max(base, 1)
	return min(max((cpus+base-1)/base, 1), max(slots, 1))
}

// phases orders the units by test name: first the indices of the warm
// tests (warmPrefix), then the others, each in their given order. A phase
// with no unit is left out.
func phases(tests []string) [][]int {
	var warm, rest []int
	for i, name := range tests {
		if strings.HasPrefix(name, warmPrefix) {
			warm = append(warm, i)
		} else {
			rest = append(rest, i)
		}
	}
	var out [][]int
	for _, p := range [][]int{warm, rest} {
		if len(p) > 0 {
			out = append(out, p)
		}
	}
	return out
}

// runPool calls run(i) for each i of order, each on a goroutine of its own
// and started in that order, so that the weights of those running add up
// to at most slots (weight(i) is clamped to 1..slots). A unit waits for
// room even when a later, lighter one would fit, so the order holds. It
// starts no more once ctx is done, and returns when every started run has
// returned.
func runPool(ctx context.Context, order []int, slots int, weight func(int) int, run func(int)) {
	slots = max(slots, 1)
	sem := make(chan struct{}, slots)
	var wg sync.WaitGroup
	defer wg.Wait()
	for _, i := range order {
		w := min(max(weight(i), 1), slots)
		if !acquire(ctx, sem, w) {
			return
		}
		wg.Go(func() {
			defer release(sem, w)
			run(i)
		})
	}
}

// acquire takes n tokens of sem, or none when ctx is done first.
func acquire(ctx context.Context, sem chan struct{}, n int) bool {
	for k := range n {
		if ctx.Err() != nil {
			release(sem, k)
			return false
		}
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			release(sem, k)
			return false
		}
	}
	return true
}

// release gives n tokens back to sem.
func release(sem chan struct{}, n int) {
	for range n {
		<-sem
	}
}

// unitOrder is the order in which the pool starts the units named names
// (one pool: the warm tests start first and the others beside them; a
// phase of its own for the warm tests left the other places idle for
// minutes, and the tests that use a warm product are short, so they start
// long after it is made; one that asks before builds its own). A unit that
// takes more than one place goes before them all: it waits for an empty
// pool, which the start is. Within each group, longest first.
func unitOrder(names []string, weight func(int) int, expected map[string]time.Duration) []int {
	var multi []int
	for i := range names {
		if weight(i) > 1 {
			multi = append(multi, i)
		}
	}
	order := longestFirst(multi, names, weight, expected)
	for _, phase := range phases(names) {
		phase = slices.DeleteFunc(phase, func(i int) bool { return weight(i) > 1 })
		order = append(order, longestFirst(phase, names, weight, expected)...)
	}
	return order
}
