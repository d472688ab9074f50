package bench

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"syscall"

	"github.com/kilnvm/kiln/sandbox"
	"github.com/kilnvm/kiln/vmmproc"
)

// VMMMemory is what a VMM process holds beside its guest's RAM, by kind
// of mapping (PSS, bytes; /proc/PID/smaps), and what its Go runtime says
// of its own memory (Describe). The kinds add up to SandboxMem.VMMPSS.
type VMMMemory struct {
	// Binary is the process's executable's pages (text, read-only data,
	// data): shared by every process that runs the same file.
	Binary uint64
	// GoHeap is the Go heap's arenas ("[anon: Go: heap]"); GoRuntime the
	// runtime's other named mappings (page summaries, scavenge index,
	// span and GC metadata, thread stacks).
	GoHeap, GoRuntime uint64
	// Anonymous is unnamed private memory: all of the runtime's when the
	// kernel cannot name mappings (CONFIG_ANON_VMA_NAME).
	Anonymous uint64
	// Stack is the main thread's stack; KVM the VM's and vCPUs' mappings
	// of KVM's own (kvm_run); Files other mapped files; Other the rest
	// (vdso, vvar, memfds that are not guest RAM).
	Stack, KVM, Files, Other uint64
	// Runtime is the Go runtime's own account (runtime/metrics).
	Runtime vmmproc.RuntimeMemory
}

// Total is the sum of the kinds.
func (m VMMMemory) Total() uint64 {
	return m.Binary + m.GoHeap + m.GoRuntime + m.Anonymous + m.Stack + m.KVM + m.Files + m.Other
}

// vmmMemory measures sb's VMM process beside the guest RAM at ranges.
func vmmMemory(ctx context.Context, sb *sandbox.Sandbox, pid int, ranges []vmmproc.MemoryRange) (VMMMemory, error) {
	var m VMMMemory
	d, err := sb.Describe(ctx)
	if err != nil {
		return m, fmt.Errorf("bench: %w", err)
	}
	m.Runtime = d.Runtime
	var exeIno uint64
	var st syscall.Stat_t
	if err := syscall.Stat(fmt.Sprintf("/proc/%d/exe", pid), &st); err == nil {
		exeIno = st.Ino
	}
	p := fmt.Sprintf("/proc/%d/smaps", pid)
	f, err := os.Open(p)
	if err != nil {
		return m, fmt.Errorf("bench: %w", err)
	}
	defer f.Close()
	kinds, err := parseVMMSmaps(f, ranges, exeIno)
	if err != nil {
		return m, fmt.Errorf("bench: %s: %w", p, err)
	}
	kinds.Runtime = m.Runtime
	return kinds, nil
}

// parseVMMSmaps sums the PSS of smaps' mappings by kind, leaving out
// those inside guest; exeIno is the executable's inode (0: unknown).
func parseVMMSmaps(r io.Reader, guest []vmmproc.MemoryRange, exeIno uint64) (VMMMemory, error) {
	var m VMMMemory
	var field *uint64
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if lo, hi, ok := smapsHeader(line); ok {
			field = m.kindOf(line, lo, hi, guest, exeIno)
			continue
		}
		if field == nil {
			continue
		}
		val, ok := strings.CutPrefix(line, "Pss:")
		if !ok {
			continue
		}
		kb, ok := strings.CutSuffix(strings.TrimSpace(val), " kB")
		if !ok {
			return m, fmt.Errorf("Pss: %q is not in kB", val)
		}
		n, err := strconv.ParseUint(kb, 10, 64)
		if err != nil {
			return m, fmt.Errorf("Pss: %w", err)
		}
		*field += n << 10
	}
	return m, sc.Err()
}

// kindOf is the field a mapping's PSS adds to (nil: guest RAM).
func (m *VMMMemory) kindOf(header string, lo, hi uint64, guest []vmmproc.MemoryRange, exeIno uint64) *uint64 {
	for _, g := range guest {
		if lo >= uint64(g.Addr) && hi <= uint64(g.Addr)+g.Size {
			return nil
		}
	}
	// addr perms offset dev inode [path]
	f := strings.Fields(header)
	if len(f) < 5 {
		return &m.Other
	}
	ino, _ := strconv.ParseUint(f[4], 10, 64)
	path := ""
	if len(f) > 5 {
		path = strings.Join(f[5:], " ")
	}
	switch {
	case exeIno != 0 && ino == exeIno && path != "":
		return &m.Binary
	case path == "[anon: Go: heap]":
		return &m.GoHeap
	case strings.HasPrefix(path, "[anon: Go:"):
		return &m.GoRuntime
	case path == "" || path == "[heap]" || strings.HasPrefix(path, "[anon:"):
		return &m.Anonymous
	case path == "[stack]":
		return &m.Stack
	case strings.HasPrefix(path, "anon_inode:kvm"):
		return &m.KVM
	case strings.HasPrefix(path, "/") && !strings.HasPrefix(path, "/memfd:"):
		return &m.Files
	}
	return &m.Other
}

// printVMMMemory writes the mean VMM process's memory of sandboxes by
// kind, and its Go runtime's account.
func printVMMMemory(w io.Writer, count int, sandboxes []SandboxMem) {
	var sum VMMMemory
	var vmmPSS uint64
	for _, s := range sandboxes {
		v := s.VMM
		sum.Binary += v.Binary
		sum.GoHeap += v.GoHeap
		sum.GoRuntime += v.GoRuntime
		sum.Anonymous += v.Anonymous
		sum.Stack += v.Stack
		sum.KVM += v.KVM
		sum.Files += v.Files
		sum.Other += v.Other
		r, t := v.Runtime, &sum.Runtime
		t.HeapObjects += r.HeapObjects
		t.HeapUnused += r.HeapUnused
		t.HeapFree += r.HeapFree
		t.HeapReleased += r.HeapReleased
		t.Stacks += r.Stacks
		t.OSStacks += r.OSStacks
		t.Metadata += r.Metadata
		t.Other += r.Other
		t.Total += r.Total
		t.Goroutines += r.Goroutines
		t.Threads += r.Threads
		vmmPSS += s.VMMPSS()
	}
	n := uint64(len(sandboxes))
	k := func(b uint64) float64 { return float64(b) / float64(n) / 1024 }
	fmt.Fprintf(w, "VMM process PSS by kind at %d, mean KiB: binary %.0f, Go heap %.0f, Go runtime %.0f, unnamed anonymous %.0f, stack %.0f, KVM %.0f, files %.0f, other %.0f (sum %.0f of %.0f)\n",
		count, k(sum.Binary), k(sum.GoHeap), k(sum.GoRuntime), k(sum.Anonymous), k(sum.Stack), k(sum.KVM), k(sum.Files), k(sum.Other), k(sum.Total()), k(vmmPSS))
	r := sum.Runtime
	fmt.Fprintf(w, "VMM Go runtime, mean KiB: heap objects %.0f, unused %.0f, free %.0f, released %.0f; goroutine stacks %.0f, OS stacks %.0f, metadata %.0f, other %.0f, mapped %.0f; %.1f goroutines, %.1f threads\n",
		k(r.HeapObjects), k(r.HeapUnused), k(r.HeapFree), k(r.HeapReleased), k(r.Stacks), k(r.OSStacks), k(r.Metadata), k(r.Other), k(r.Total),
		float64(r.Goroutines)/float64(n), float64(r.Threads)/float64(n))
}
