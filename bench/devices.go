package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"time"

	"github.com/kilnvm/kiln/bench/results"
	"github.com/kilnvm/kiln/guestkernel"
	"github.com/kilnvm/kiln/initramfs"
	"github.com/kilnvm/kiln/vmm"
)

// The device benchmarks (kiln bench devices, BenchmarkBlockRead,
// BenchmarkVsock): a guest reading a virtio-blk disk sequentially, and the
// host echoing through a guest's vsock echo program, on Kiln and on QEMU
// microvm booting the same kernel and initramfs.

// Modules the device guests load (Debian's kernel has them as modules).
var (
	BlkModules   = []string{"virtio_mmio", "virtio_blk"}
	VsockModules = []string{"virtio_mmio", "vmw_vsock_virtio_transport"}
)

// DefaultBlkMiB is the size of the disk the blk benchmark reads.
const DefaultBlkMiB = 64

// ModulesInitrd writes to path an uncompressed busybox initramfs that
// holds the named modules of k and their dependencies (uncompressed, in
// /lib/modules), and whose /init mounts proc, sysfs and devtmpfs, loads
// them in dependency order, then runs script. extra files (name in the
// initramfs → host path) are added executable. Modules built into the
// kernel are skipped.
func ModulesInitrd(k *guestkernel.Kernel, modules []string, script, path string, extra map[string]string) error {
	order, err := k.ModuleLoadOrder(modules...)
	if err != nil {
		return fmt.Errorf("bench: modules for the initramfs: %w", err)
	}
	init, err := guestkernel.InsmodScript(order, script, "bench")
	if err != nil {
		return err
	}
	b, err := initramfs.BusyboxInit(init)
	if err != nil {
		return err
	}
	if err := b.AddDir("lib", 0o755); err != nil {
		return err
	}
	if err := b.AddDir(guestkernel.InitrdModulesDir, 0o755); err != nil {
		return err
	}
	for _, m := range order {
		ko, err := guestkernel.ReadModule(m.Path)
		if err != nil {
			return err
		}
		if err := b.AddFile(guestkernel.InitrdModulesDir+"/"+m.Name+".ko", ko, 0o644); err != nil {
			return err
		}
	}
	for name, host := range extra {
		if err := b.AddHostFile(name, host, 0o755); err != nil {
			return fmt.Errorf("bench: %s in the initramfs: %w", name, err)
		}
	}
	return b.WriteFile(path, false)
}

// WriteRandomDisk writes a disk image of mib MiB of pseudo-random bytes
// (nothing a VMM or the host could compress or skip) to path.
func WriteRandomDisk(path string, mib int) error {
	if mib < 1 {
		return fmt.Errorf("bench: a disk of %d MiB", mib)
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	rng := rand.NewChaCha8([32]byte{'d', 'i', 's', 'k'})
	buf := make([]byte, 1<<20)
	for range mib {
		rng.Read(buf)
		if _, err := f.Write(buf); err != nil {
			f.Close()
			return err
		}
	}
	return f.Close()
}

// DevicesSpec is what RunDevices measures.
type DevicesSpec struct {
	// Kernel is the guest kernel: its Vmlinux boots, its modules go into
	// the initramfs.
	Kernel *guestkernel.Kernel
	// VsockEcho is a static build of internal/testguest/vsockecho; ""
	// skips the vsock benchmark.
	VsockEcho string
	// QEMU is the peer's binary.
	QEMU string
	// Runs is how many boots each VMM gets per benchmark.
	Runs int
	// BlkMiB is the disk's size (0: no blk benchmark).
	BlkMiB int
	// CPUs and MemoryMiB size the guests.
	CPUs, MemoryMiB int
	// Dir is a scratch folder for the disk, the initramfs and sockets.
	Dir string
	// HoldProcs is as BootSpec.HoldProcs.
	HoldProcs bool
}

// Params are the results' params of s.
func (s DevicesSpec) Params() map[string]string {
	p := map[string]string{"cpus": fmt.Sprint(s.CPUs), "memory_mib": fmt.Sprint(s.MemoryMiB)}
	if s.Kernel != nil {
		p["kernel"] = s.Kernel.Version
	}
	return p
}

// DevicesComparison is what RunDevices measured, run by run.
type DevicesComparison struct {
	// BlkMiB is the disk's size; BlkKiln and BlkQEMU the guest-measured
	// times to read it all.
	BlkMiB           int
	BlkKiln, BlkQEMU []time.Duration
	// VsockKiln and VsockQEMU are each boot's vsock figures.
	VsockKiln, VsockQEMU []VsockResult
}

// BlkMiBps is the throughput of reading mib MiB in d, in MiB/s.
func BlkMiBps(mib int, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(mib) / d.Seconds()
}

// Results adds c's measures to r: "blk-seq-read" and "vsock-echo" in B/s
// (one sample per boot), "vsock-rtt" in seconds (every round trip of every
// boot), each with params and, for the disk, blk_mib.
func (c DevicesComparison) Results(r *results.Run, params map[string]string) error {
	with := func(k, v string) map[string]string {
		p := make(map[string]string, len(params)+1)
		for a, b := range params {
			p[a] = b
		}
		if k != "" {
			p[k] = v
		}
		return p
	}
	if len(c.BlkKiln) > 0 || len(c.BlkQEMU) > 0 {
		p := with("blk_mib", fmt.Sprint(c.BlkMiB))
		for _, s := range []struct {
			vmm string
			ds  []time.Duration
		}{{results.VMMKiln, c.BlkKiln}, {results.VMMQEMU, c.BlkQEMU}} {
			if len(s.ds) == 0 {
				continue
			}
			if err := r.AddThroughput("blk-seq-read", s.vmm, p, int64(c.BlkMiB)<<20, s.ds); err != nil {
				return err
			}
		}
	}
	for _, s := range []struct {
		vmm string
		rs  []VsockResult
	}{{results.VMMKiln, c.VsockKiln}, {results.VMMQEMU, c.VsockQEMU}} {
		if len(s.rs) == 0 {
			continue
		}
		var echo, rtts []time.Duration
		for _, v := range s.rs {
			echo = append(echo, v.Echo)
			rtts = append(rtts, v.RTTs...)
		}
		if err := r.AddThroughput("vsock-echo", s.vmm, with("bytes", fmt.Sprint(VsockEchoBytes)), VsockEchoBytes, echo); err != nil {
			return err
		}
		if len(rtts) > 0 {
			r.AddDurations("vsock-rtt", s.vmm, with("", ""), rtts)
		}
		// Where the round trips' CPU went, one sample per boot and party.
		var cpu [4][]time.Duration
		for _, v := range s.rs {
			if v.RTTCPUKnown {
				for i, d := range []time.Duration{v.RTTCPU.Guest, v.RTTCPU.VMM, v.RTTCPU.Vhost, v.RTTCPU.Client} {
					cpu[i] = append(cpu[i], d)
				}
			}
		}
		for i, where := range []string{"guest", "vmm", "vhost", "client"} {
			if len(cpu[i]) > 0 && !(s.vmm == results.VMMKiln && (where == "vhost" || where == "client")) {
				r.AddDurations("vsock-rtt-cpu", s.vmm, with("where", where), cpu[i])
			}
		}
		for _, kind := range KVMExitKinds {
			var n []float64
			for _, v := range s.rs {
				if x, ok := v.RTTExits[kind]; ok {
					n = append(n, x)
				}
			}
			if len(n) > 0 {
				r.Measures = append(r.Measures, results.Measure{Name: "vsock-rtt-kvm", VMM: s.vmm, Unit: results.UnitCount, Params: with("kind", kind), Samples: n})
			}
		}
	}
	return nil
}

// showCPU says where a boot's round trips spent CPU, per round trip, and
// what of their mean time no party's CPU accounts for (waits: wake-ups,
// interrupts, other tasks).
func showCPU(r VsockResult) string {
	if !r.RTTCPUKnown || len(r.RTTs) == 0 {
		return ""
	}
	var total time.Duration
	for _, d := range r.RTTs {
		total += d
	}
	mean := total / time.Duration(len(r.RTTs))
	c := r.RTTCPU
	us := func(d time.Duration) string { return d.Round(time.Microsecond).String() }
	s := fmt.Sprintf("; per round trip (mean %s): cpu guest %s, vmm %s", us(mean), us(c.Guest), us(c.VMM))
	if c.Vhost != 0 || c.Client != 0 {
		s += fmt.Sprintf(", vhost %s, client %s", us(c.Vhost), us(c.Client))
	}
	s += fmt.Sprintf(", not on these CPUs %s", us(mean-c.Sum()))
	if len(r.RTTExits) > 0 {
		s += "; KVM per round trip:"
		for _, k := range KVMExitKinds {
			if v, ok := r.RTTExits[k]; ok {
				s += fmt.Sprintf(" %s %.1f", k, v)
			}
		}
	}
	return s
}

// Blk is the disk comparison.
func (c DevicesComparison) Blk() Comparison { return Comparison{Kiln: c.BlkKiln, Peer: c.BlkQEMU} }

// Echo is the vsock echo time comparison, one sample per boot.
func (c DevicesComparison) Echo() Comparison {
	var e Comparison
	for _, r := range c.VsockKiln {
		e.Kiln = append(e.Kiln, r.Echo)
	}
	for _, r := range c.VsockQEMU {
		e.Peer = append(e.Peer, r.Echo)
	}
	return e
}

// RTT is the vsock round trip comparison, every round trip of every boot.
func (c DevicesComparison) RTT() Comparison {
	var e Comparison
	for _, r := range c.VsockKiln {
		e.Kiln = append(e.Kiln, r.RTTs...)
	}
	for _, r := range c.VsockQEMU {
		e.Peer = append(e.Peer, r.RTTs...)
	}
	return e
}

// RunDevices runs the blk and the vsock benchmarks spec.Runs times each,
// alternating Kiln and QEMU microvm boot by boot (who goes first swaps
// every run), and prints each run's figures to progress. On an error it
// returns what it measured so far.
func RunDevices(ctx context.Context, spec DevicesSpec, progress io.Writer) (DevicesComparison, error) {
	c := DevicesComparison{BlkMiB: spec.BlkMiB}
	if progress == nil {
		progress = io.Discard
	}
	if spec.Kernel == nil || spec.Kernel.Vmlinux == "" {
		return c, errors.New("bench: devices: the kernel cache has no vmlinux (make kernel extracts it)")
	}
	if spec.Runs < 1 || spec.CPUs < 1 || spec.MemoryMiB < 1 || spec.BlkMiB < 0 || spec.QEMU == "" || spec.Dir == "" {
		return c, fmt.Errorf("bench: devices: bad spec (%d runs, %d vCPUs, %d MiB, disk %d MiB, qemu %q, dir %q)",
			spec.Runs, spec.CPUs, spec.MemoryMiB, spec.BlkMiB, spec.QEMU, spec.Dir)
	}
	boot := BootSpec{Kernel: spec.Kernel.Vmlinux, Cmdline: vmm.DefaultCmdline + " quiet", CPUs: spec.CPUs, MemoryMiB: spec.MemoryMiB, HoldProcs: spec.HoldProcs}
	if spec.BlkMiB > 0 {
		disk := filepath.Join(spec.Dir, "disk.img")
		if err := WriteRandomDisk(disk, spec.BlkMiB); err != nil {
			return c, err
		}
		s := boot
		s.Initrd = filepath.Join(spec.Dir, "blk.cpio")
		if err := ModulesInitrd(spec.Kernel, BlkModules, BlkReadScript, s.Initrd, nil); err != nil {
			return c, err
		}
		mibps := func(d time.Duration) string {
			return fmt.Sprintf("%.1f MiB/s (%v)", BlkMiBps(spec.BlkMiB, d), d.Round(time.Millisecond))
		}
		for i := range spec.Runs {
			for _, kilnFirst := range order(i) {
				if kilnFirst {
					d, err := BlkReadKiln(ctx, s, disk)
					if err != nil {
						return c, fmt.Errorf("blk run %d: kiln: %w", i+1, err)
					}
					c.BlkKiln = append(c.BlkKiln, d)
					fmt.Fprintf(progress, "blk run %d/%d: kiln %s\n", i+1, spec.Runs, mibps(d))
				} else {
					d, err := BlkReadQEMU(ctx, spec.QEMU, s, disk)
					if err != nil {
						return c, fmt.Errorf("blk run %d: qemu: %w", i+1, err)
					}
					c.BlkQEMU = append(c.BlkQEMU, d)
					fmt.Fprintf(progress, "blk run %d/%d: qemu microvm %s\n", i+1, spec.Runs, mibps(d))
				}
			}
		}
		os.Remove(disk)
	}
	if spec.VsockEcho != "" {
		s := boot
		s.Initrd = filepath.Join(spec.Dir, "vsock.cpio")
		if err := ModulesInitrd(spec.Kernel, VsockModules, VsockEchoScript, s.Initrd, map[string]string{"vsockecho": spec.VsockEcho}); err != nil {
			return c, err
		}
		show := func(r VsockResult) string {
			return fmt.Sprintf("echo %.2f MiB/s, round trip median %v (ready after %v)%s", r.MiBps(), roundRTT(Median(r.RTTs)), r.Ready.Round(time.Millisecond), showCPU(r))
		}
		for i := range spec.Runs {
			for _, kilnFirst := range order(i) {
				if kilnFirst {
					sock, err := os.MkdirTemp(spec.Dir, "vsock-")
					if err != nil {
						return c, err
					}
					r, err := VsockKiln(ctx, s, sock)
					os.RemoveAll(sock)
					if err != nil {
						return c, fmt.Errorf("vsock run %d: kiln: %w", i+1, err)
					}
					c.VsockKiln = append(c.VsockKiln, r)
					fmt.Fprintf(progress, "vsock run %d/%d: kiln %s\n", i+1, spec.Runs, show(r))
				} else {
					r, err := VsockQEMU(ctx, spec.QEMU, s)
					if err != nil {
						return c, fmt.Errorf("vsock run %d: qemu: %w", i+1, err)
					}
					c.VsockQEMU = append(c.VsockQEMU, r)
					fmt.Fprintf(progress, "vsock run %d/%d: qemu microvm %s\n", i+1, spec.Runs, show(r))
				}
			}
		}
	}
	return c, nil
}

// order is who boots first in run i (from 0): Kiln in even runs, QEMU in
// odd ones, so that neither always gets the warmer or the colder machine.
func order(i int) []bool {
	if i%2 == 0 {
		return []bool{true, false}
	}
	return []bool{false, true}
}

// roundRTT rounds a round trip for printing.
func roundRTT(d time.Duration) time.Duration { return d.Round(10 * time.Microsecond) }
