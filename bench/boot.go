// Package bench measures Kiln beside a peer VMM (QEMU's microvm machine) on the
// same kernel, initramfs and command line, in the same run, and reports
// medians and ratios. Figures are for docs/bench.md; nothing here asserts a
// time.
package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kilnvm/kiln/vmm"
)

// Marker is what a benchmark guest prints once userspace runs.
const Marker = "KILN-BENCH-READY"

// BootSpec is one guest to boot.
type BootSpec struct {
	Kernel, Initrd, Cmdline string
	CPUs, MemoryMiB         int
	// HoldProcs runs Kiln's vCPUs as a VMM process of kilnd's does
	// (vmm.Config.HoldProcs); the caller sizes GOMAXPROCS (vmm.ProcsFor).
	HoldProcs bool
}

// markerWriter closes seen the first time Marker appears in what it is given.
type markerWriter struct {
	mu   sync.Mutex
	buf  []byte
	seen chan struct{}
	done bool
	log  bytes.Buffer
}

func newMarkerWriter() *markerWriter { return &markerWriter{seen: make(chan struct{})} }

func (m *markerWriter) Write(p []byte) (int, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.log.Len() < 1<<20 {
		m.log.Write(p)
	}
	if m.done {
		return len(p), nil
	}
	m.buf = append(m.buf, p...)
	if bytes.Contains(m.buf, []byte(Marker)) {
		m.done = true
		close(m.seen)
	} else if len(m.buf) > len(Marker) {
		m.buf = append(m.buf[:0], m.buf[len(m.buf)-len(Marker):]...)
	}
	return len(p), nil
}

func (m *markerWriter) logString() string {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.log.String()
}

func (m *markerWriter) tail() string {
	m.mu.Lock()
	defer m.mu.Unlock()
	b := m.log.Bytes()
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return string(b)
}

// InitLine is what a benchmark guest's /init prints after Marker: the
// kernel's own log line of starting it, with the kernel's timestamp (seconds
// since the kernel's clock started, early in its setup).
const InitLine = "KILN-BENCH-INIT"

// BootScript is the /init a boot benchmark guest runs: the marker first (the
// clock stops there), then the kernel's "Run /init" log line for the phase
// breakdown, then power off.
const BootScript = "echo " + Marker + "\necho \"" + InitLine + " $(dmesg | grep -m1 'Run /init')\"\npoweroff -f\n"

// BootPhases is one boot, split where the host and the guest can tell:
// Total is VM creation (Kiln) or process start (QEMU) to the marker;
// Kernel is the guest kernel's own time from its clock starting to
// running /init (its log's timestamp); Setup is Kiln's vmm.New (memory,
// kernel and initramfs loaded, ACPI tables, vCPUs made), zero for QEMU,
// whose setup the host cannot see. Kernel is zero when the guest's log had
// no such line.
type BootPhases struct {
	Total, Setup, Kernel time.Duration
	// VMM is Kiln's Setup split by phase (vmm.VM.SetupTimes).
	VMM vmm.SetupTimes
}

// SetupPhases names the phases of vmm.SetupTimes, in New's order, with
// their values in t.
func SetupPhases(t vmm.SetupTimes) []struct {
	Name string
	D    time.Duration
} {
	return []struct {
		Name string
		D    time.Duration
	}{{"kernel", t.Kernel}, {"initrd", t.Initrd}, {"devices", t.Devices}, {"memory", t.Memory},
		{"machine", t.Machine}, {"load", t.Load}, {"vcpus", t.VCPUs}}
}

// BeforeKernel is the time outside the guest kernel's clock: the VMM's
// setup, firmware (QEMU's qboot), kernel entry and its earliest setup
// before its clock starts, and /init's first line. Zero when Kernel is
// unknown.
func (p BootPhases) BeforeKernel() time.Duration {
	if p.Kernel <= 0 || p.Kernel > p.Total {
		return 0
	}
	return p.Total - p.Kernel
}

// parseInitLine finds InitLine in a console log and returns the kernel
// timestamp on it ("KILN-BENCH-INIT [    0.812345] Run /init as init
// process"); false when there is none or it does not parse.
func parseInitLine(log string) (time.Duration, bool) {
	i := strings.Index(log, InitLine+" [")
	if i < 0 {
		return 0, false
	}
	rest := log[i+len(InitLine)+2:]
	j := strings.IndexByte(rest, ']')
	if j < 0 || j > 32 {
		return 0, false
	}
	secs, err := strconv.ParseFloat(strings.TrimSpace(rest[:j]), 64)
	if err != nil || secs < 0 || secs > 1e6 || math.IsNaN(secs) {
		return 0, false
	}
	return time.Duration(secs * float64(time.Second)), true
}

// BootKiln measures VM creation to the marker on Kiln's serial console, then
// waits for the guest to power off.
func BootKiln(ctx context.Context, s BootSpec) (time.Duration, error) {
	p, err := BootKilnPhases(ctx, s)
	return p.Total, err
}

// BootKilnPhases is BootKiln with the boot's phases.
func BootKilnPhases(ctx context.Context, s BootSpec) (BootPhases, error) {
	var p BootPhases
	w := newMarkerWriter()
	start := time.Now()
	vm, err := vmm.New(vmm.Config{
		Spec:      vmm.Spec{Kernel: s.Kernel, Initrd: s.Initrd, Cmdline: s.Cmdline, CPUs: s.CPUs, MemoryMiB: s.MemoryMiB},
		Console:   w,
		HoldProcs: s.HoldProcs,
	})
	if err != nil {
		return p, err
	}
	p.Setup = time.Since(start)
	p.VMM = vm.SetupTimes()
	defer vm.Close()
	type result struct {
		exit vmm.Exit
		err  error
	}
	ran := make(chan result, 1)
	go func() {
		e, err := vm.Run(ctx)
		ran <- result{e, err}
	}()
	select {
	case <-w.seen:
		p.Total = time.Since(start)
	case r := <-ran:
		return p, fmt.Errorf("kiln guest stopped before the marker (%v, %v): %s", r.exit, r.err, w.tail())
	}
	r := <-ran
	p.Kernel, _ = parseInitLine(w.logString())
	if r.err != nil {
		return p, r.err
	}
	if r.exit.Reason != vmm.ReasonPowerOff {
		return p, fmt.Errorf("kiln guest ended with %v", r.exit)
	}
	return p, nil
}

// QEMUArgs is the peer's command line for a spec: the microvm machine with
// KVM, qboot as its firmware, no option ROMs, no default devices, COM1 on
// stdio.
func QEMUArgs(s BootSpec) []string {
	args := []string{
		// qboot loads the kernel itself: QEMU 10's default microvm
		// firmware (Debian: SeaBIOS's) boots nothing without option ROMs.
		"-M", "microvm,x-option-roms=off,isa-serial=on,rtc=off", "-bios", "qboot.rom", "-enable-kvm", "-cpu", "host",
		"-m", fmt.Sprint(s.MemoryMiB), "-smp", fmt.Sprint(s.CPUs),
		"-nodefaults", "-no-user-config", "-nographic", "-no-reboot", "-serial", "stdio",
		"-kernel", s.Kernel, "-append", s.Cmdline,
	}
	if s.Initrd != "" {
		args = append(args, "-initrd", s.Initrd)
	}
	return args
}

// BootQEMU measures process start to the marker on QEMU's serial console.
func BootQEMU(ctx context.Context, qemu string, s BootSpec) (time.Duration, error) {
	p, err := BootQEMUPhases(ctx, qemu, s)
	return p.Total, err
}

// BootQEMUPhases is BootQEMU with the boot's phases (no Setup: QEMU's is
// inside its process).
func BootQEMUPhases(ctx context.Context, qemu string, s BootSpec) (BootPhases, error) {
	var p BootPhases
	w := newMarkerWriter()
	cmd := exec.CommandContext(ctx, qemu, QEMUArgs(s)...)
	cmd.Stdout = w
	cmd.Stderr = w
	cmd.Stdin = nil
	start := time.Now()
	if err := cmd.Start(); err != nil {
		return p, fmt.Errorf("start %s: %w", qemu, err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	select {
	case <-w.seen:
		p.Total = time.Since(start)
		err := <-exited
		p.Kernel, _ = parseInitLine(w.logString())
		if err != nil {
			return p, fmt.Errorf("qemu: %w: %s", err, w.tail())
		}
		return p, nil
	case err := <-exited:
		return p, fmt.Errorf("qemu exited before the marker (%v): %s", err, w.tail())
	}
}

// Comparison holds both VMMs' samples of one measurement.
type Comparison struct {
	Kiln, Peer []time.Duration
}

// Median returns the median of ds (0 for none).
func Median(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// Ratio is Kiln's median over the peer's (below 1: Kiln is faster).
func (c Comparison) Ratio() float64 {
	p := Median(c.Peer)
	if p == 0 {
		return 0
	}
	return float64(Median(c.Kiln)) / float64(p)
}

// BootComparison is CompareBoot's result: the totals (Comparison) and
// each boot's phases, run by run.
type BootComparison struct {
	Comparison
	KilnPhases, PeerPhases []BootPhases
}

// PhaseMedians returns, for Kiln's boots or the peer's, the medians of
// each phase: setup, kernel, before the kernel's clock (each over the
// boots that have it).
func PhaseMedians(ps []BootPhases) (setup, kernel, before time.Duration) {
	var s, k, b []time.Duration
	for _, p := range ps {
		if p.Setup > 0 {
			s = append(s, p.Setup)
		}
		if p.BeforeKernel() > 0 {
			k = append(k, p.Kernel)
			b = append(b, p.BeforeKernel())
		}
	}
	return Median(s), Median(k), Median(b)
}

// CompareBoot boots the spec n times on each VMM, alternating which goes
// first run by run so that both see the same machine conditions.
func CompareBoot(ctx context.Context, qemu string, s BootSpec, n int, progress io.Writer) (BootComparison, error) {
	var c BootComparison
	if n < 1 {
		return c, errors.New("need at least one run")
	}
	for i := 0; i < n; i++ {
		var k, q BootPhases
		var err error
		kiln := func() error {
			if k, err = BootKilnPhases(ctx, s); err != nil {
				return fmt.Errorf("kiln run %d: %w", i+1, err)
			}
			return nil
		}
		peer := func() error {
			if q, err = BootQEMUPhases(ctx, qemu, s); err != nil {
				return fmt.Errorf("qemu run %d: %w", i+1, err)
			}
			return nil
		}
		first, second := kiln, peer
		if i%2 == 1 {
			first, second = peer, kiln
		}
		if err := first(); err != nil {
			return c, err
		}
		if err := second(); err != nil {
			return c, err
		}
		c.Kiln, c.Peer = append(c.Kiln, k.Total), append(c.Peer, q.Total)
		c.KilnPhases, c.PeerPhases = append(c.KilnPhases, k), append(c.PeerPhases, q)
		if progress != nil {
			fmt.Fprintf(progress, "run %d/%d: kiln %v (setup %v, kernel %v), qemu microvm %v (kernel %v)\n", i+1, n,
				k.Total.Round(time.Millisecond), k.Setup.Round(time.Millisecond), k.Kernel.Round(time.Millisecond),
				q.Total.Round(time.Millisecond), q.Kernel.Round(time.Millisecond))
		}
	}
	return c, nil
}
