package vmm

import (
	"context"
	"encoding/json"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/kilnvm/kiln/kvm"
	"github.com/kilnvm/kiln/memory"
	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmm/serial"
)

// testState returns a valid state of a VM with cpus vCPUs, memMiB of
// memory and one virtio device of each ID given, as SaveState would shape
// it, with no KVM.
func testState(cpus, memMiB int, devices ...uint32) *State {
	st := &State{
		Version:       StateVersion,
		VirtioVersion: virtio.StateVersion,
		CPUs:          cpus,
		MemoryMiB:     memMiB,
		Machine: MachineState{
			PICMaster: make([]byte, irqChipSize),
			PICSlave:  make([]byte, irqChipSize),
			IOAPIC:    make([]byte, irqChipSize),
			Clock:     kvm.ClockData{Clock: 123456789, Flags: kvm.ClockTSCStable},
		},
		Serial: SerialState{IER: 0x05, LCR: 0x03, MCR: 0x0b, DLL: 1},
	}
	var off uint64
	for _, r := range memoryLayout(memMiB) {
		st.Memory = append(st.Memory, MemoryRegion{GuestAddr: r.GuestAddr, Size: r.Size, Offset: off})
		off += r.Size
	}
	for i, id := range devices {
		st.Devices = append(st.Devices, DeviceState{Spec: testSpec(i, id), Transport: virtio.MMIOState{DeviceID: id, Queues: []virtio.QueueState{{Size: 256}}}})
	}
	for i := range cpus {
		vs := VCPUState{
			ID:      i,
			TSCKHz:  2_500_000,
			CPUID:   []kvm.CPUIDEntry{{Function: 1, EAX: 0x806f8, EBX: uint32(i) << 24}},
			MPState: kvm.MPStateRunnable,
			Regs:    kvm.Regs{RIP: 0xffffffff81000000 + uint64(i), RSP: 0x8000, RFLAGS: 2},
			Sregs:   kvm.Sregs{CR0: 0x80050033, CR4: 0x750, EFER: 0xd01, APICBase: 0xfee00900},
			XSave:   make([]byte, 4096),
			XCRs:    kvm.XCRs{NrXCRs: 1},
			LAPIC:   make([]byte, lapicStateSize),
			MSRs:    []MSR{{Index: msrIA32TSC, Data: 1 << 40}, {Index: msrLSTAR, Data: 0xffffffff81a00000}},
		}
		vs.XSave[0] = 0x7f
		vs.XCRs.XCRs[0].Value = 7
		vs.LAPIC[0x20] = byte(i)
		vs.Events.Interrupt.Shadow = 1
		vs.Events.Flags = kvm.VCPUEventValidShadow
		vs.DebugRegs.DR7 = 0x400
		st.VCPUs = append(st.VCPUs, vs)
	}
	return st
}

// testSpec returns a spec for device i of a test state, of virtio device
// ID id.
func testSpec(i int, id uint32) virtio.DeviceSpec {
	name := fmt.Sprintf("dev%d", i)
	switch id {
	case virtio.IDBlock:
		return virtio.DeviceSpec{ID: name, Kind: virtio.KindBlock, Block: &virtio.BlockSpec{Path: "/nonexistent/" + name + ".img"}}
	case virtio.IDNet:
		return virtio.DeviceSpec{ID: name, Kind: virtio.KindNet, Net: &virtio.NetSpec{Tap: "kilntest" + name}}
	case virtio.IDVsock:
		return virtio.DeviceSpec{ID: name, Kind: virtio.KindVsock, Vsock: &virtio.VsockSpec{CID: 3, Path: "/nonexistent/" + name + ".sock"}}
	}
	return virtio.DeviceSpec{ID: name, Kind: virtio.KindRNG, RNG: &virtio.RNGSpec{}}
}

func TestStateValidate(t *testing.T) {
	tests := []struct {
		name    string
		mutate  func(*State)
		wantErr string
	}{
		{"valid", func(*State) {}, ""},
		{"other version", func(s *State) { s.Version = 1 }, "state version 1, this kiln restores version 2"},
		{"other virtio version", func(s *State) { s.VirtioVersion = 9 }, "virtio state version 9"},
		{"no vCPUs", func(s *State) { s.CPUs = 0 }, "state has 0 vCPUs"},
		{"too little memory", func(s *State) { s.MemoryMiB = 1 }, "1 MiB of memory"},
		{"vCPU count", func(s *State) { s.VCPUs = s.VCPUs[:1] }, "state has 2 vCPUs but the state of 1"},
		{"nil vCPUs", func(s *State) { s.VCPUs = nil }, "but the state of 0"},
		{"vCPU ID", func(s *State) { s.VCPUs[1].ID = 0 }, "vCPU 1: state is of vCPU 0"},
		{"nil xsave", func(s *State) { s.VCPUs[0].XSave = nil }, "vCPU 0: XSAVE area of 0 bytes"},
		{"short xsave", func(s *State) { s.VCPUs[0].XSave = make([]byte, 512) }, "XSAVE area of 512 bytes"},
		{"odd xsave", func(s *State) { s.VCPUs[0].XSave = make([]byte, 4097) }, "XSAVE area of 4097 bytes"},
		{"huge xsave", func(s *State) { s.VCPUs[0].XSave = make([]byte, 2<<20) }, "XSAVE area of 2097152 bytes"},
		{"nil lapic", func(s *State) { s.VCPUs[1].LAPIC = nil }, "vCPU 1: LAPIC state is 0 bytes, want 1024"},
		{"xcrs", func(s *State) { s.VCPUs[0].XCRs.NrXCRs = 17 }, "17 XCRs"},
		{"msrs", func(s *State) { s.VCPUs[0].MSRs = make([]MSR, maxStateMSRs+1) }, "4097 MSRs"},
		{"cpuid", func(s *State) { s.VCPUs[0].CPUID = make([]kvm.CPUIDEntry, 300) }, "300 CPUID entries"},
		{"mp state", func(s *State) { s.VCPUs[0].MPState = 42 }, "unknown MP state 42"},
		{"no memory regions", func(s *State) { s.Memory = nil }, "state has 0 memory regions, a VM of 64 MiB has 1"},
		{"region size", func(s *State) { s.Memory[0].Size = 32 << 20 }, "memory region 0 is 0x0+0x2000000 at offset 0x0, a VM of 64 MiB has 0x0+0x4000000"},
		{"region offset", func(s *State) { s.Memory[0].Offset = 4096 }, "at offset 0x1000"},
		{"memory size and layout", func(s *State) { s.MemoryMiB = 128 }, "a VM of 128 MiB has 0x0+0x8000000"},
		{"nil PIC", func(s *State) { s.Machine.PICSlave = nil }, "PIC slave state is 0 bytes, want 512"},
		{"short IOAPIC", func(s *State) { s.Machine.IOAPIC = make([]byte, 10) }, "IOAPIC state is 10 bytes"},
		{"too many devices", func(s *State) {
			for range MaxVirtioDevices {
				s.Devices = append(s.Devices, DeviceState{Spec: testSpec(len(s.Devices), virtio.IDRNG), Transport: virtio.MMIOState{DeviceID: virtio.IDRNG}})
			}
		}, "virtio devices: a VM takes at most"},
		{"device ID twice", func(s *State) {
			s.Devices = append(s.Devices, s.Devices[0])
		}, `virtio device 1: ID "dev0" used twice`},
		{"spec and transport differ", func(s *State) { s.Devices[0].Transport.DeviceID = virtio.IDRNG }, `virtio device 0 ("dev0"): a "blk" spec over a transport of a rng device (ID 4)`},
		{"unknown kind", func(s *State) { s.Devices[0].Spec.Kind = "floppy" }, `a "floppy" spec over a transport of a block device`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			st := testState(2, 64, virtio.IDBlock)
			tt.mutate(st)
			checkErr(t, st.Validate(), tt.wantErr)
		})
	}
	t.Run("nil", func(t *testing.T) {
		var st *State
		checkErr(t, st.Validate(), "no state")
	})
}

func checkErr(t *testing.T, err error, want string) {
	t.Helper()
	switch {
	case want == "" && err != nil:
		t.Fatalf("unexpected error: %v", err)
	case want != "" && err == nil:
		t.Fatalf("no error, want one containing %q", want)
	case want != "" && !strings.Contains(err.Error(), want):
		t.Fatalf("error %q does not contain %q", err, want)
	}
}

func TestStateLargeMemoryLayout(t *testing.T) {
	st := testState(1, 4096)
	if err := st.Validate(); err != nil {
		t.Fatal(err)
	}
	if len(st.Memory) != 2 || st.Memory[1].GuestAddr != mmioGapEnd || st.Memory[1].Offset != mmioGapStart {
		t.Fatalf("layout of 4 GiB: %+v", st.Memory)
	}
	if st.MemorySize() != 4<<30 {
		t.Fatalf("MemorySize = %d", st.MemorySize())
	}
	if l := st.Layout(); len(l) != 2 || l[1].Size != 1<<30 {
		t.Fatalf("Layout = %+v", l)
	}
}

func TestStateResolve(t *testing.T) {
	rng, blk, vsock := uint32(virtio.IDRNG), uint32(virtio.IDBlock), uint32(virtio.IDVsock)
	newDisk := virtio.DeviceSpec{ID: "dev1", Kind: virtio.KindBlock, Block: &virtio.BlockSpec{Path: "/other.img", ReadOnly: true}}
	newSock := virtio.DeviceSpec{ID: "dev2", Kind: virtio.KindVsock, Vsock: &virtio.VsockSpec{CID: 3, Path: "/new.sock"}}
	tests := []struct {
		name      string
		st        *State
		overrides []virtio.DeviceSpec
		want      []string // the resolved specs' paths or IDs, in order
		wantErr   string
	}{
		{"no overrides", testState(1, 64, rng, blk), nil, []string{"dev0", "/nonexistent/dev1.img"}, ""},
		{"overrides by ID", testState(1, 64, rng, blk, vsock), []virtio.DeviceSpec{newSock, newDisk}, []string{"dev0", "/other.img", "/new.sock"}, ""},
		{"unknown ID", testState(1, 64, rng), []virtio.DeviceSpec{newDisk}, nil, `snapshot devices: override of device "dev1": the snapshot has no such device (it has "dev0")`},
		{"no devices", testState(1, 64), []virtio.DeviceSpec{newDisk}, nil, "(it has none)"},
		{"other kind", testState(1, 64, rng, rng), []virtio.DeviceSpec{newDisk}, nil, `override of device "dev1": the snapshot's is a rng device, the override a blk one`},
		{"twice", testState(1, 64, rng, blk), []virtio.DeviceSpec{newDisk, newDisk}, nil, `override of device "dev1" given twice`},
		{"bad override", testState(1, 64, rng, blk), []virtio.DeviceSpec{{ID: "dev1", Kind: virtio.KindBlock, Block: &virtio.BlockSpec{}}}, nil, `device "dev1": blk: no image path or fd`},
		{"bad state", func() *State { s := testState(1, 64); s.Version = 0; return s }(), nil, nil, "snapshot state: state version 0"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			specs, err := tt.st.Check(&RestoreConfig{Devices: tt.overrides})
			checkErr(t, err, tt.wantErr)
			if err != nil {
				return
			}
			var got []string
			for _, s := range specs {
				switch {
				case s.Block != nil:
					got = append(got, s.Block.Path)
				case s.Vsock != nil:
					got = append(got, s.Vsock.Path)
				default:
					got = append(got, s.ID)
				}
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("resolved %q, want %q", got, tt.want)
			}
		})
	}
}

// TestRestoreRefusesBeforeKVM checks that Restore names what does not
// match, before it opens KVM (the KVM path here does not exist), and
// closes the memory it was given.
func TestRestoreRefusesBeforeKVM(t *testing.T) {
	noKVM := "/nonexistent/kvm"
	tests := []struct {
		name    string
		st      *State
		cfg     RestoreConfig
		layout  memory.Layout
		wantErr string
	}{
		{"unknown override", testState(1, 16), RestoreConfig{Devices: []virtio.DeviceSpec{testSpec(0, virtio.IDRNG)}}, memoryLayout(16), `restore: snapshot devices: override of device "dev0": the snapshot has no such device`},
		{"nil state", nil, RestoreConfig{}, memoryLayout(16), "restore: snapshot state: no state"},
		{"memory layout", testState(1, 16), RestoreConfig{}, memory.Layout{{GuestAddr: 0, Size: 8 << 20}}, "restore: memory region 0 is 0x0+0x800000"},
		{"memory regions", testState(1, 16), RestoreConfig{}, memory.Layout{{GuestAddr: 0, Size: 8 << 20}, {GuestAddr: 16 << 20, Size: 8 << 20}}, "restore: memory has 2 regions, the snapshot 1"},
		{"no memory", testState(1, 16), RestoreConfig{}, nil, "restore: no memory given"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var mem *memory.Memory
			if tt.layout != nil {
				var err error
				if mem, err = memory.NewAnonymous(tt.layout); err != nil {
					t.Fatal(err)
				}
			}
			tt.cfg.KVMPath = noKVM
			vm, err := Restore(tt.cfg, tt.st, mem)
			if vm != nil {
				t.Fatal("Restore returned a VM")
			}
			checkErr(t, err, tt.wantErr)
			if mem != nil && len(mem.Regions()) != 0 {
				t.Error("Restore left the memory it was given open")
			}
		})
	}
	t.Run("checks pass, then KVM", func(t *testing.T) {
		mem, err := memory.NewAnonymous(memoryLayout(16))
		if err != nil {
			t.Fatal(err)
		}
		_, err = Restore(RestoreConfig{KVMPath: noKVM}, testState(1, 16), mem)
		checkErr(t, err, "restore: open "+noKVM)
	})
}

func TestStateJSONRoundTrip(t *testing.T) {
	st := testState(2, 4096, virtio.IDBlock, virtio.IDVsock)
	st.Devices[0].Transport.Device = json.RawMessage(`{"capacity_sectors":2048,"read_only":false,"id":"disk"}`)
	st.Machine.PIT.Channels[0].Count = 0x10000
	st.Machine.PIT.Channels[2].CountLoadTime = -5
	st.Machine.PICMaster[3] = 0xff
	st.VCPUs[1].Sregs.CS = kvm.Segment{Base: 0, Limit: 0xffffffff, Selector: 0x10, Type: 11, Present: 1, L: 1, S: 1, G: 1}
	st.VCPUs[1].Sregs.InterruptBitmap[2] = 1 << 63
	st.VCPUs[0].Events.Exception.ErrorCode = 0xdead
	st.VCPUs[0].Events.NMI.Masked = 1
	st.VCPUs[0].MSRs = append(st.VCPUs[0].MSRs, MSR{Index: 0x4b564d01, Data: ^uint64(0)})
	b, err := json.Marshal(st)
	if err != nil {
		t.Fatal(err)
	}
	var back State
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(st, &back) {
		t.Fatalf("state changed through JSON:\n%+v\n%+v", st, &back)
	}
	if err := back.Validate(); err != nil {
		t.Fatal(err)
	}
	// Byte areas are base64, not arrays of numbers.
	if !strings.Contains(string(b), `"xsave":"fw`) {
		t.Errorf("XSAVE area is not base64 in %.200s", b)
	}
}

func TestOrderMSRs(t *testing.T) {
	msrs := []MSR{{msrLSTAR, 1}, {msrTSCDeadline, 0}, {msrIA32TSC, 500}, {msrSTAR, 2}}
	got := orderMSRs(msrs)
	want := [][]kvm.MSREntry{
		{{Index: msrIA32TSC, Data: 500}},
		{{Index: msrLSTAR, Data: 1}, {Index: msrSTAR, Data: 2}},
		{{Index: msrTSCDeadline, Data: 500}}, // zero deadline: the TSC
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("orderMSRs = %+v, want %+v", got, want)
	}
	got = orderMSRs([]MSR{{msrTSCDeadline, 900}, {msrIA32TSC, 500}})
	if got[1][0].Data != 900 {
		t.Errorf("a set deadline changed: %+v", got)
	}
	if got := orderMSRs([]MSR{{msrLSTAR, 1}}); len(got) != 1 {
		t.Errorf("empty batches kept: %+v", got)
	}
}

func TestExtraStateMSRs(t *testing.T) {
	extra := extraStateMSRs()
	if len(extra) != 28 || extra[0] != msrMTRRDefType {
		t.Fatalf("extra MSRs %#x", extra)
	}
}

func TestCPUIDDiff(t *testing.T) {
	a := []kvm.CPUIDEntry{{Function: 1, EAX: 1}, {Function: 7, Index: 0, EBX: 5}}
	if d := cpuidDiff(a, a); d != "" {
		t.Errorf("equal CPUIDs differ: %s", d)
	}
	b := []kvm.CPUIDEntry{{Function: 1, EAX: 1}, {Function: 7, Index: 0, EBX: 4}}
	if d := cpuidDiff(a, b); d != "leaf 0x7.0 is 0x0 0x5 0x0 0x0 in the snapshot, 0x0 0x4 0x0 0x0 here" {
		t.Errorf("diff = %q", d)
	}
	if d := cpuidDiff(a, a[:1]); d != "leaf 0x7.0 is missing" {
		t.Errorf("diff = %q", d)
	}
	if d := cpuidDiff(a[:1], a); d == "" {
		t.Error("an extra leaf went unnoticed")
	}
	// Empty entries after the real ones (KVM_GET_CPUID2 on some kernels).
	padded := append(slices.Clone(a), make([]kvm.CPUIDEntry, 5)...)
	if d := cpuidDiff(a, padded); d != "" {
		t.Errorf("padding counted as a difference: %s", d)
	}
	if got := trimCPUID(padded); len(got) != 2 {
		t.Errorf("trimCPUID kept %d entries", len(got))
	}
}

func TestSaveStateNeedsPause(t *testing.T) {
	v := newVM(Config{Spec: Spec{CPUs: 1, MemoryMiB: 16}})
	_, err := v.SaveState(context.Background())
	checkErr(t, err, "save state: the VM is not paused")
	v.stop(ReasonCancelled, "test")
	_, err = v.SaveState(context.Background())
	checkErr(t, err, "save state: the VM has stopped")
}

func TestSerialStateRoundTrip(t *testing.T) {
	for _, lcr := range []uint8{0x03, 0x83} { // DLAB clear, and left set by the guest
		u := serial.New(nil, nil)
		w := func(off uint64, v uint8) { u.Write(off, []byte{v}) }
		w(uartLCR, 0x80)
		w(uartData, 0x01)
		w(uartIER, 0x02)
		w(uartLCR, 0x03)
		w(uartIER, 0x07)
		w(uartMCR, 0x0b)
		w(uartSCR, 0x42)
		w(uartLCR, lcr)
		want := SerialState{IER: 0x07, LCR: lcr, MCR: 0x0b, SCR: 0x42, DLL: 0x01, DLM: 0x02}
		if got := saveSerial(u); got != want {
			t.Fatalf("LCR %#x: saved %+v, want %+v", lcr, got, want)
		}
		if got := saveSerial(u); got != want {
			t.Fatalf("LCR %#x: saving changed the UART: %+v", lcr, got)
		}
		fired := 0
		fresh := serial.New(nil, func() { fired++ })
		restoreSerial(fresh, want)
		if got := saveSerial(fresh); got != want {
			t.Fatalf("LCR %#x: restored %+v, want %+v", lcr, got, want)
		}
		if fired == 0 {
			t.Errorf("LCR %#x: restoring IER with THRE enabled raised no interrupt", lcr)
		}
	}
}

// FuzzStateCheck feeds the device part of snapshot state files (hostile
// input: each device's spec and transport state) to the checks a restore
// runs before KVM: decoding, Validate and Check with and without an
// override. None may panic, and what they pass resolves to device specs
// that validate. (The rest of a state is checked field by field in
// TestStateValidate; inputs stay small so that the fuzzer stays fast.)
func FuzzStateCheck(f *testing.F) {
	for _, st := range []*State{
		testState(1, 16, virtio.IDBlock, virtio.IDVsock, virtio.IDRNG),
		testState(1, 16, virtio.IDNet),
		testState(1, 16),
	} {
		b, err := json.Marshal(st.Devices)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	override := []virtio.DeviceSpec{{ID: "dev0", Kind: virtio.KindBlock, Block: &virtio.BlockSpec{Path: "/other.img"}}}
	f.Fuzz(func(t *testing.T, b []byte) {
		var devs []DeviceState
		if json.Unmarshal(b, &devs) != nil {
			return
		}
		st := testState(1, 16)
		st.Devices = devs
		if st.Validate() != nil {
			return
		}
		for _, o := range [][]virtio.DeviceSpec{nil, override} {
			specs, err := st.Check(&RestoreConfig{Devices: o})
			if err != nil {
				continue
			}
			if err := virtio.ValidateSpecs(specs); err != nil {
				t.Fatalf("Check passed specs that do not validate: %v", err)
			}
		}
	})
}
