package bench

import (
	"bytes"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/bench/results"
	"github.com/kilnvm/kiln/guestkernel"
)

func TestModulesInitrd(t *testing.T) {
	k, err := guestkernel.Find()
	if err != nil {
		t.Skipf("no cached kernel: %v", err)
	}
	if _, err := os.Stat("/bin/busybox"); err != nil {
		t.Skip("busybox-static not installed")
	}
	dir := t.TempDir()
	extra := filepath.Join(dir, "echo")
	if err := os.WriteFile(extra, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, "initrd.cpio")
	if err := ModulesInitrd(k, VsockModules, VsockEchoScript, p, map[string]string{"vsockecho": extra}); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"lib/modules/virtio_mmio.ko", "lib/modules/vmw_vsock_virtio_transport.ko", "insmod /lib/modules/vmw_vsock_virtio_transport.ko", "vsockecho", "/vsockecho -listen 1234"} {
		if !bytes.Contains(b, []byte(want)) {
			t.Errorf("initrd lacks %q", want)
		}
	}
}

func TestWriteRandomDisk(t *testing.T) {
	p := filepath.Join(t.TempDir(), "disk.img")
	if err := WriteRandomDisk(p, 2); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	if len(b) != 2<<20 || bytes.Equal(b[:1<<20], b[1<<20:]) || bytes.Count(b[:4096], []byte{0}) > 100 {
		t.Errorf("disk of %d bytes, not pseudo-random", len(b))
	}
	if err := WriteRandomDisk(p, 0); err == nil {
		t.Error("a disk of 0 MiB was accepted")
	}
}

// fakeDevices is a comparison as RunDevices would return one.
func fakeDevices() DevicesComparison {
	ms := func(n ...int) []time.Duration {
		var ds []time.Duration
		for _, v := range n {
			ds = append(ds, time.Duration(v)*time.Millisecond)
		}
		return ds
	}
	return DevicesComparison{
		BlkMiB:  64,
		BlkKiln: ms(2000, 4000, 8000), BlkQEMU: ms(1000, 2000, 4000),
		VsockKiln: []VsockResult{{Echo: 8 * time.Second, RTTs: ms(40, 50)}, {Echo: 4 * time.Second, RTTs: ms(30)}},
		VsockQEMU: []VsockResult{{Echo: 2 * time.Second, RTTs: ms(20, 25)}, {Echo: 2 * time.Second, RTTs: ms(20)}},
	}
}

func TestDevicesResults(t *testing.T) {
	c := fakeDevices()
	r := &results.Run{Version: results.Version, KVMMode: results.KVMEmulated}
	params := DevicesSpec{CPUs: 1, MemoryMiB: 512, Kernel: &guestkernel.Kernel{Version: "6.1"}}.Params()
	if err := c.Results(r, params); err != nil {
		t.Fatal(err)
	}
	if err := r.Check(); err != nil {
		t.Fatal(err)
	}
	type key struct{ name, vmm string }
	got := map[key]results.Measure{}
	for _, m := range r.Measures {
		got[key{m.Name, m.VMM}] = m
	}
	if len(got) != 6 || len(r.Measures) != 6 {
		t.Fatalf("%d measures: %+v", len(r.Measures), r.Measures)
	}
	near := func(a, b float64) bool { return math.Abs(a-b) < 1e-9*math.Max(1, b) }
	blk := got[key{"blk-seq-read", results.VMMKiln}]
	if blk.Unit != results.UnitBytesPerSecond || len(blk.Samples) != 3 || !near(blk.Samples[0], 32<<20) ||
		blk.Params["blk_mib"] != "64" || blk.Params["kernel"] != "6.1" || blk.Params["cpus"] != "1" || blk.Params["memory_mib"] != "512" {
		t.Errorf("blk kiln %+v", blk)
	}
	if q := got[key{"blk-seq-read", results.VMMQEMU}]; len(q.Samples) != 3 || !near(q.Samples[2], 16<<20) {
		t.Errorf("blk qemu %+v", q)
	}
	echo := got[key{"vsock-echo", results.VMMKiln}]
	if echo.Unit != results.UnitBytesPerSecond || len(echo.Samples) != 2 || !near(echo.Samples[0], 1<<20) || !near(echo.Samples[1], 2<<20) {
		t.Errorf("echo kiln %+v", echo)
	}
	rtt := got[key{"vsock-rtt", results.VMMQEMU}]
	if rtt.Unit != results.UnitSeconds || len(rtt.Samples) != 3 || rtt.Samples[1] != 0.025 || rtt.Params["blk_mib"] != "" || rtt.Params["kernel"] != "6.1" {
		t.Errorf("rtt qemu %+v", rtt)
	}
	if len(params) != 3 {
		t.Errorf("Results changed its params: %v", params)
	}

	// Medians and ratios as kiln bench devices prints them.
	if got := BlkMiBps(64, Median(c.Blk().Kiln)); got != 16 {
		t.Errorf("kiln blk median %v MiB/s", got)
	}
	if got := c.Echo().Ratio(); got != 3 {
		t.Errorf("echo time ratio %v", got)
	}
	if got := Median(c.RTT().Kiln); got != 40*time.Millisecond {
		t.Errorf("kiln rtt median %v", got)
	}

	// A zero time (a guest's clock too coarse) is an error, not an Inf.
	c.BlkKiln[1] = 0
	if err := c.Results(&results.Run{}, nil); err == nil {
		t.Error("a zero read time gave no error")
	}
	// Nothing measured: no measures.
	r = &results.Run{}
	if err := (DevicesComparison{}).Results(r, nil); err != nil || len(r.Measures) != 0 {
		t.Errorf("empty comparison: %v, %d measures", err, len(r.Measures))
	}
}

func TestDevicesOrder(t *testing.T) {
	if o := order(0); !o[0] || o[1] {
		t.Errorf("run 1: %v, want kiln first", o)
	}
	if o := order(1); o[0] || !o[1] {
		t.Errorf("run 2: %v, want qemu first", o)
	}
}

func TestRunDevicesRefuses(t *testing.T) {
	k := &guestkernel.Kernel{Vmlinux: "/vmlinux"}
	for _, s := range []DevicesSpec{
		{Runs: 1, CPUs: 1, MemoryMiB: 1, QEMU: "q", Dir: "d"},
		{Kernel: &guestkernel.Kernel{}, Runs: 1, CPUs: 1, MemoryMiB: 1, QEMU: "q", Dir: "d"},
		{Kernel: k, Runs: 0, CPUs: 1, MemoryMiB: 1, QEMU: "q", Dir: "d"},
		{Kernel: k, Runs: 1, CPUs: 1, MemoryMiB: 1, QEMU: "", Dir: "d"},
		{Kernel: k, Runs: 1, CPUs: 1, MemoryMiB: 1, QEMU: "q", BlkMiB: -1, Dir: "d"},
	} {
		if _, err := RunDevices(t.Context(), s, nil); err == nil {
			t.Errorf("RunDevices(%+v) ran", s)
		}
	}
}

// TestDevicesRTTCPU: where the round trips' CPU went goes to the results
// file as vsock-rtt-cpu per party (one sample per boot that knew it; no
// vhost or separate client for Kiln), and to the progress line with what
// no CPU accounts for.
func TestDevicesRTTCPU(t *testing.T) {
	c := fakeDevices()
	us := func(n int) time.Duration { return time.Duration(n) * time.Microsecond }
	c.VsockKiln[0].RTTCPU, c.VsockKiln[0].RTTCPUKnown = VsockCPU{Guest: us(10000), VMM: us(5000)}, true
	c.VsockQEMU[0].RTTCPU, c.VsockQEMU[0].RTTCPUKnown = VsockCPU{Guest: us(8000), VMM: us(1000), Vhost: us(2000), Client: us(500)}, true
	c.VsockQEMU[1].RTTCPU, c.VsockQEMU[1].RTTCPUKnown = VsockCPU{Guest: us(9000), VMM: us(1000), Vhost: us(3000), Client: us(500)}, true
	c.VsockKiln[0].RTTExits = map[string]float64{"exits": 12, "mmio_exits": 4.5}
	r := &results.Run{Version: results.Version, KVMMode: results.KVMEmulated}
	if err := c.Results(r, map[string]string{"cpus": "1"}); err != nil {
		t.Fatal(err)
	}
	if err := r.Check(); err != nil {
		t.Fatal(err)
	}
	got := map[string][]float64{}
	kvm := 0
	for _, m := range r.Measures {
		if m.Name == "vsock-rtt-kvm" {
			if m.VMM != results.VMMKiln || m.Unit != results.UnitCount || len(m.Samples) != 1 ||
				!(m.Params["kind"] == "exits" && m.Samples[0] == 12 || m.Params["kind"] == "mmio_exits" && m.Samples[0] == 4.5) {
				t.Errorf("KVM counter measure %+v", m)
			}
			kvm++
		}
		if m.Name == "vsock-rtt-cpu" {
			if m.Unit != results.UnitSeconds || m.Params["cpus"] != "1" {
				t.Errorf("measure %+v", m)
			}
			got[m.VMM+" "+m.Params["where"]] = m.Samples
		}
	}
	want := map[string][]float64{
		"kiln guest": {0.010}, "kiln vmm": {0.005},
		"qemu-microvm guest": {0.008, 0.009}, "qemu-microvm vmm": {0.001, 0.001},
		"qemu-microvm vhost": {0.002, 0.003}, "qemu-microvm client": {0.0005, 0.0005},
	}
	if len(got) != len(want) {
		t.Errorf("vsock-rtt-cpu measures %v, want %v", got, want)
	}
	if kvm != 2 {
		t.Errorf("%d vsock-rtt-kvm measures, want 2", kvm)
	}
	for k, w := range want {
		if g := got[k]; len(g) != len(w) || math.Abs(g[0]-w[0]) > 1e-12 || math.Abs(g[len(g)-1]-w[len(w)-1]) > 1e-12 {
			t.Errorf("%s: %v, want %v", k, g, w)
		}
	}
	// Kiln's first boot: mean 45 ms, 15 ms on CPUs.
	if s := showCPU(c.VsockKiln[0]); s != "; per round trip (mean 45ms): cpu guest 10ms, vmm 5ms, not on these CPUs 30ms; KVM per round trip: exits 12.0 mmio_exits 4.5" {
		t.Errorf("showCPU kiln = %q", s)
	}
	if s := showCPU(c.VsockQEMU[0]); !strings.Contains(s, "vhost 2ms, client 500µs, not on these CPUs 11ms") {
		t.Errorf("showCPU qemu = %q", s)
	}
	if s := showCPU(c.VsockKiln[1]); s != "" {
		t.Errorf("showCPU without CPU figures = %q, want nothing", s)
	}
}

// TestPerRoundTrip: two samples n round trips apart give CPU and KVM
// counters per round trip; counters missing from either sample, or gone
// backwards (another VM), are left out.
func TestPerRoundTrip(t *testing.T) {
	before := rttSample{cpu: VsockCPU{Guest: time.Second, VMM: time.Second}, exits: map[string]uint64{"exits": 100, "mmio_exits": 50, "io_exits": 9}}
	after := rttSample{cpu: VsockCPU{Guest: 3 * time.Second, VMM: 2 * time.Second}, exits: map[string]uint64{"exits": 300, "mmio_exits": 90, "io_exits": 1, "irq_exits": 5}}
	var r VsockResult
	r.perRoundTrip(before, after, 100)
	if !r.RTTCPUKnown || r.RTTCPU.Guest != 20*time.Millisecond || r.RTTCPU.VMM != 10*time.Millisecond {
		t.Errorf("CPU per round trip %+v", r.RTTCPU)
	}
	if len(r.RTTExits) != 2 || r.RTTExits["exits"] != 2 || r.RTTExits["mmio_exits"] != 0.4 {
		t.Errorf("KVM per round trip %v, want exits 2 and mmio_exits 0.4 only", r.RTTExits)
	}
	var none VsockResult
	none.perRoundTrip(rttSample{}, after, 100)
	if none.RTTExits != nil {
		t.Errorf("counters without a first sample: %v", none.RTTExits)
	}
}
