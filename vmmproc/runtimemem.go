package vmmproc

import (
	"os"
	"runtime/metrics"

	"github.com/kilnvm/kiln/vmmproc/vmmpb"
)

// runtimeSamples are the runtime/metrics a VMM process reports of its own
// memory (Describe), in RuntimeMemory's order.
var runtimeSamples = []string{
	"/memory/classes/heap/objects:bytes",
	"/memory/classes/heap/unused:bytes",
	"/memory/classes/heap/free:bytes",
	"/memory/classes/heap/released:bytes",
	"/memory/classes/heap/stacks:bytes",
	"/memory/classes/os-stacks:bytes",
	"/memory/classes/metadata/mcache/free:bytes",
	"/memory/classes/metadata/mcache/inuse:bytes",
	"/memory/classes/metadata/mspan/free:bytes",
	"/memory/classes/metadata/mspan/inuse:bytes",
	"/memory/classes/metadata/other:bytes",
	"/memory/classes/profiling/buckets:bytes",
	"/memory/classes/other:bytes",
	"/memory/classes/total:bytes",
	"/sched/goroutines:goroutines",
}

// runtimeMemory reads this process's Go runtime memory by class.
func runtimeMemory() *vmmpb.RuntimeMemory {
	s := make([]metrics.Sample, len(runtimeSamples))
	for i, name := range runtimeSamples {
		s[i].Name = name
	}
	metrics.Read(s)
	v := func(i int) uint64 {
		if s[i].Value.Kind() != metrics.KindUint64 {
			return 0
		}
		return s[i].Value.Uint64()
	}
	m := &vmmpb.RuntimeMemory{
		HeapObjects:  v(0),
		HeapUnused:   v(1),
		HeapFree:     v(2),
		HeapReleased: v(3),
		Stacks:       v(4),
		OsStacks:     v(5),
		Metadata:     v(6) + v(7) + v(8) + v(9) + v(10),
		Other:        v(11) + v(12),
		Total:        v(13),
		Goroutines:   v(14),
	}
	// A jailed process may have no /proc: then no thread count.
	if ts, err := os.ReadDir("/proc/self/task"); err == nil {
		m.Threads = uint64(len(ts))
	}
	return m
}
