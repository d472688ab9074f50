package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/procfs"

	"github.com/kilnvm/kiln/sandbox"
)

// MemUsage is what /proc/self/smaps says of the mappings in a range of this
// process's address space (a VM's guest memory), in bytes.
type MemUsage struct {
	Rss, Pss                   uint64
	SharedClean, SharedDirty   uint64
	PrivateClean, PrivateDirty uint64
	// Anonymous is memory no file backs: in a copy-on-write guest mapping,
	// the pages the VM wrote after the fork or restore (its own copies).
	Anonymous uint64
	// Mappings is how many mappings (VMAs) the range held.
	Mappings int
}

// Add returns the sum of u and v.
func (u MemUsage) Add(v MemUsage) MemUsage {
	return MemUsage{
		Rss: u.Rss + v.Rss, Pss: u.Pss + v.Pss,
		SharedClean: u.SharedClean + v.SharedClean, SharedDirty: u.SharedDirty + v.SharedDirty,
		PrivateClean: u.PrivateClean + v.PrivateClean, PrivateDirty: u.PrivateDirty + v.PrivateDirty,
		Anonymous: u.Anonymous + v.Anonymous, Mappings: u.Mappings + v.Mappings,
	}
}

// String prints the main figures in MiB.
func (u MemUsage) String() string {
	return fmt.Sprintf("PSS %.1f MiB, RSS %.1f MiB, private %.1f MiB (anonymous %.1f MiB)",
		MiB(u.Pss), MiB(u.Rss), MiB(u.PrivateClean+u.PrivateDirty), MiB(u.Anonymous))
}

// MiB converts bytes to MiB.
func MiB(b uint64) float64 { return float64(b) / (1 << 20) }

// RangeUsage sums /proc/self/smaps over the mappings in [start,
// start+size), which must cover them whole.
func RangeUsage(start uintptr, size uint64) (MemUsage, error) {
	return PIDRangeUsage(os.Getpid(), start, size)
}

// PIDRangeUsage sums /proc/PID/smaps over the mappings in [start,
// start+size) of process pid, which must cover them whole.
func PIDRangeUsage(pid int, start uintptr, size uint64) (MemUsage, error) {
	p := fmt.Sprintf("/proc/%d/smaps", pid)
	f, err := os.Open(p)
	if err != nil {
		return MemUsage{}, fmt.Errorf("bench: %w", err)
	}
	defer f.Close()
	u, err := parseSmapsRange(f, uint64(start), uint64(start)+size)
	if err != nil {
		return u, fmt.Errorf("bench: %s: %w", p, err)
	}
	return u, nil
}

// parseSmapsRange sums the smaps entries of the mappings inside [start,
// end). A mapping that straddles an end of the range is an error: its
// figures cannot be split.
func parseSmapsRange(r io.Reader, start, end uint64) (MemUsage, error) {
	var u MemUsage
	in := false
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if lo, hi, ok := smapsHeader(line); ok {
			switch {
			case hi <= start || lo >= end:
				in = false
			case lo >= start && hi <= end:
				in = true
				u.Mappings++
			default:
				return u, fmt.Errorf("mapping %x-%x straddles the range %x-%x", lo, hi, start, end)
			}
			continue
		}
		if !in {
			continue
		}
		key, val, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		var field *uint64
		switch key {
		case "Rss":
			field = &u.Rss
		case "Pss":
			field = &u.Pss
		case "Shared_Clean":
			field = &u.SharedClean
		case "Shared_Dirty":
			field = &u.SharedDirty
		case "Private_Clean":
			field = &u.PrivateClean
		case "Private_Dirty":
			field = &u.PrivateDirty
		case "Anonymous":
			field = &u.Anonymous
		default:
			continue
		}
		kb, ok := strings.CutSuffix(strings.TrimSpace(val), " kB")
		if !ok {
			return u, fmt.Errorf("%s: %q is not in kB", key, val)
		}
		n, err := strconv.ParseUint(kb, 10, 64)
		if err != nil {
			return u, fmt.Errorf("%s: %w", key, err)
		}
		*field += n << 10
	}
	if err := sc.Err(); err != nil {
		return u, err
	}
	if u.Mappings == 0 {
		return u, fmt.Errorf("no mapping in %x-%x", start, end)
	}
	return u, nil
}

// smapsHeader parses the address range of a mapping's first line
// ("7f00-7f80 rw-p 00000000 00:01 12 /memfd:x").
func smapsHeader(line string) (lo, hi uint64, ok bool) {
	addrs, rest, ok := strings.Cut(line, " ")
	if !ok || !strings.Contains(rest, " ") {
		return 0, 0, false
	}
	a, b, ok := strings.Cut(addrs, "-")
	if !ok {
		return 0, 0, false
	}
	lo, err1 := strconv.ParseUint(a, 16, 64)
	hi, err2 := strconv.ParseUint(b, 16, 64)
	if err1 != nil || err2 != nil || hi < lo {
		return 0, 0, false
	}
	return lo, hi, true
}

// GuestUsage is the memory behind sb's guest RAM mapping, in this process
// or in the sandbox's VMM process.
func GuestUsage(sb *sandbox.Sandbox) (MemUsage, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pid, ranges, err := sb.GuestMemory(ctx)
	if err != nil {
		return MemUsage{}, fmt.Errorf("bench: %w", err)
	}
	if len(ranges) == 0 {
		return MemUsage{}, errors.New("bench: the sandbox has no guest memory")
	}
	// Regions that follow each other in the address space may be one
	// mapping: measure them as one range.
	merged := ranges[:1]
	for _, r := range ranges[1:] {
		last := &merged[len(merged)-1]
		if last.Addr+uintptr(last.Size) == r.Addr {
			last.Size += r.Size
			continue
		}
		merged = append(merged, r)
	}
	var u MemUsage
	for _, r := range merged {
		ru, err := PIDRangeUsage(pid, r.Addr, r.Size)
		if err != nil {
			return u, err
		}
		u = u.Add(ru)
	}
	return u, nil
}

// ProcessUsage is this process's smaps_rollup (procfs): every VM in it,
// the Go heap and the rest.
func ProcessUsage() (procfs.ProcSMapsRollup, error) {
	p, err := procfs.Self()
	if err != nil {
		return procfs.ProcSMapsRollup{}, fmt.Errorf("bench: %w", err)
	}
	r, err := p.ProcSMapsRollup()
	if err != nil {
		return r, fmt.Errorf("bench: smaps_rollup: %w", err)
	}
	return r, nil
}
