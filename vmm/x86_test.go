package vmm

import (
	"strings"
	"testing"

	"github.com/kilnvm/kiln/kvm"
)

func TestGDTEntryDecodes(t *testing.T) {
	tests := []struct {
		name string
		sel  uint16
		want kvm.Segment
	}{
		{"64-bit code", selCode64, kvm.Segment{Limit: 0xffffffff, Selector: selCode64, Type: 0xb, Present: 1, S: 1, L: 1, G: 1}},
		{"data", selData, kvm.Segment{Limit: 0xffffffff, Selector: selData, Type: 0x3, Present: 1, S: 1, DB: 1, G: 1}},
		{"32-bit code", selCode32, kvm.Segment{Limit: 0xffffffff, Selector: selCode32, Type: 0xb, Present: 1, S: 1, DB: 1, G: 1}},
		{"TSS", selTSS, kvm.Segment{Limit: 0xffffffff, Selector: selTSS, Type: 0xb, Present: 1, G: 1}},
	}
	for _, tt := range tests {
		if got := segmentFromGDT(bootGDT[tt.sel/8], tt.sel); got != tt.want {
			t.Errorf("%s: got %+v, want %+v", tt.name, got, tt.want)
		}
	}
}

func TestCPUIDTopology(t *testing.T) {
	supported := []kvm.CPUIDEntry{
		{Function: 1, EBX: 0x0800, ECX: 0},
		{Function: 0xb, Index: 0}, {Function: 0xb, Index: 1}, {Function: 0xb, Index: 2},
		{Function: 0x80000008, ECX: 0x3007},
		{Function: 0x8000001e},
	}
	out := cpuidFor(supported, 3, 4)
	if supported[0].EBX != 0x0800 {
		t.Fatal("cpuidFor modified its input")
	}
	want := map[[2]uint32][4]uint32{ // {fn, idx} -> eax, ebx, ecx, edx
		{1, 0}:          {0, 3<<24 | 4<<16 | 0x0800, 1 << 31, 1 << 28},
		{0xb, 0}:        {0, 1, 1 << 8, 3},
		{0xb, 1}:        {2, 4, 2<<8 | 1, 3},
		{0xb, 2}:        {0, 0, 2, 3},
		{0x80000008, 0}: {0, 0, 3, 0},
		{0x8000001e, 0}: {3, 3, 0, 0},
	}
	for _, e := range out {
		w := want[[2]uint32{e.Function, e.Index}]
		if got := [4]uint32{e.EAX, e.EBX, e.ECX, e.EDX}; got != w {
			t.Errorf("leaf %#x.%d = %x, want %x", e.Function, e.Index, got, w)
		}
	}
}

type recorder struct{ reads, writes []uint64 }

func (r *recorder) Read(off uint64, d []byte)  { r.reads = append(r.reads, off); d[0] = 7 }
func (r *recorder) Write(off uint64, d []byte) { r.writes = append(r.writes, off) }

func TestBus(t *testing.T) {
	var b Bus
	a, c := &recorder{}, &recorder{}
	if err := b.Add(0x100, 8, a); err != nil {
		t.Fatal(err)
	}
	if err := b.Add(0x200, 0x10, c); err != nil {
		t.Fatal(err)
	}
	for _, bad := range [][2]uint64{{0x104, 8}, {0xf8, 0x10}, {0x50, 0}, {^uint64(0), 2}} {
		if err := b.Add(bad[0], bad[1], &recorder{}); err == nil {
			t.Errorf("Add(%#x, %#x) accepted an overlapping or empty range", bad[0], bad[1])
		}
	}
	d := []byte{0, 0}
	if !b.Read(0x107, d) || d[0] != 7 {
		t.Errorf("read at the last port of a range: %v", d)
	}
	if b.Read(0x108, d) || d[0] != 0xff || d[1] != 0xff {
		t.Errorf("unclaimed read gave %v, want all ones", d)
	}
	b.Write(0x20f, d)
	if len(c.writes) != 1 || c.writes[0] != 0xf {
		t.Errorf("writes %v", c.writes)
	}
}

func TestPanicWatcher(t *testing.T) {
	var got string
	w := &panicWatcher{onPanic: func(m string) { got = m }}
	w.Write([]byte("[    1.0] Kernel panic - not syncing: Attempted to kill init! exitcode=0x00000100\r\n[    1.1] CPU: 0 PID: 1\n"))
	if got != "" {
		t.Fatal("fired before the end of the report")
	}
	w.Write([]byte("[    1.2] ---[ end Kernel panic - not syncing: Attempted to kill init! ]---\n"))
	if got != "Kernel panic - not syncing: Attempted to kill init! exitcode=0x00000100" {
		t.Fatalf("panic message %q", got)
	}
}

func TestConfigValidate(t *testing.T) {
	tests := []struct {
		name string
		cfg  Config
		want string
	}{
		{"no kernel", Config{Spec: Spec{CPUs: 1, MemoryMiB: 128}}, "no kernel"},
		{"zero cpus", Config{Spec: Spec{Kernel: "k", CPUs: 0, MemoryMiB: 128}}, "0 vCPUs"},
		{"too many cpus", Config{Spec: Spec{Kernel: "k", CPUs: 1000, MemoryMiB: 128}}, "1000 vCPUs"},
		{"tiny memory", Config{Spec: Spec{Kernel: "k", CPUs: 1, MemoryMiB: 1}}, "1 MiB"},
	}
	for _, tt := range tests {
		err := tt.cfg.Validate()
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: error %v, want one mentioning %q", tt.name, err, tt.want)
		}
	}
}
