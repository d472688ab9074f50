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
	"os/exec"
	"slices"
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

func (m *markerWriter) tail() string {
	m.mu.Lock()
	defer m.mu.Unlock()
	b := m.log.Bytes()
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return string(b)
}

// BootKiln measures VM creation to the marker on Kiln's serial console, then
// waits for the guest to power off.
func BootKiln(ctx context.Context, s BootSpec) (time.Duration, error) {
	w := newMarkerWriter()
	start := time.Now()
	vm, err := vmm.New(vmm.Config{
		Spec:    vmm.Spec{Kernel: s.Kernel, Initrd: s.Initrd, Cmdline: s.Cmdline, CPUs: s.CPUs, MemoryMiB: s.MemoryMiB},
		Console: w,
	})
	if err != nil {
		return 0, err
	}
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
	var d time.Duration
	select {
	case <-w.seen:
		d = time.Since(start)
	case r := <-ran:
		return 0, fmt.Errorf("kiln guest stopped before the marker (%v, %v): %s", r.exit, r.err, w.tail())
	}
	r := <-ran
	if r.err != nil {
		return d, r.err
	}
	if r.exit.Reason != vmm.ReasonPowerOff {
		return d, fmt.Errorf("kiln guest ended with %v", r.exit)
	}
	return d, nil
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
	w := newMarkerWriter()
	cmd := exec.CommandContext(ctx, qemu, QEMUArgs(s)...)
	cmd.Stdout = w
	cmd.Stderr = w
	cmd.Stdin = nil
	start := time.Now()
	if err := cmd.Start(); err != nil {
		return 0, fmt.Errorf("start %s: %w", qemu, err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	select {
	case <-w.seen:
		d := time.Since(start)
		if err := <-exited; err != nil {
			return d, fmt.Errorf("qemu: %w: %s", err, w.tail())
		}
		return d, nil
	case err := <-exited:
		return 0, fmt.Errorf("qemu exited before the marker (%v): %s", err, w.tail())
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

// CompareBoot boots the spec n times on each VMM, alternating so that both
// see the same machine conditions.
func CompareBoot(ctx context.Context, qemu string, s BootSpec, n int, progress io.Writer) (Comparison, error) {
	var c Comparison
	if n < 1 {
		return c, errors.New("need at least one run")
	}
	for i := 0; i < n; i++ {
		k, err := BootKiln(ctx, s)
		if err != nil {
			return c, fmt.Errorf("kiln run %d: %w", i+1, err)
		}
		q, err := BootQEMU(ctx, qemu, s)
		if err != nil {
			return c, fmt.Errorf("qemu run %d: %w", i+1, err)
		}
		c.Kiln, c.Peer = append(c.Kiln, k), append(c.Peer, q)
		if progress != nil {
			fmt.Fprintf(progress, "run %d: kiln %v, qemu microvm %v\n", i+1, k.Round(time.Millisecond), q.Round(time.Millisecond))
		}
	}
	return c, nil
}
