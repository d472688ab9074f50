package kvm

import (
	"errors"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ExitReason is kvm_run.exit_reason.
type ExitReason uint32

// Exit reasons Kiln handles (KVM_EXIT_*).
const (
	ExitUnknown       ExitReason = 0
	ExitException     ExitReason = 1
	ExitIO            ExitReason = 2
	ExitHypercall     ExitReason = 3
	ExitDebug         ExitReason = 4
	ExitHLT           ExitReason = 5
	ExitMMIO          ExitReason = 6
	ExitIRQWindowOpen ExitReason = 7
	ExitShutdown      ExitReason = 8
	ExitFailEntry     ExitReason = 9
	ExitIntr          ExitReason = 10
	ExitInternalError ExitReason = 17
	ExitSystemEvent   ExitReason = 24
)

var exitNames = map[ExitReason]string{
	ExitUnknown: "UNKNOWN", ExitException: "EXCEPTION", ExitIO: "IO", ExitHypercall: "HYPERCALL",
	ExitDebug: "DEBUG", ExitHLT: "HLT", ExitMMIO: "MMIO", ExitIRQWindowOpen: "IRQ_WINDOW_OPEN",
	ExitShutdown: "SHUTDOWN", ExitFailEntry: "FAIL_ENTRY", ExitIntr: "INTR",
	ExitInternalError: "INTERNAL_ERROR", ExitSystemEvent: "SYSTEM_EVENT",
}

func (r ExitReason) String() string {
	if n, ok := exitNames[r]; ok {
		return n
	}
	return "EXIT_" + itoa(uint64(r))
}

func itoa(v uint64) string {
	var b [20]byte
	i := len(b)
	for {
		i--
		b[i] = byte('0' + v%10)
		v /= 10
		if v == 0 {
			return string(b[i:])
		}
	}
}

// System event types (kvm_run.system_event.type).
const (
	SystemEventShutdown = 1
	SystemEventReset    = 2
	SystemEventCrash    = 3
)

// runHeader is the fixed head of struct kvm_run.
type runHeader struct {
	RequestInterruptWindow     uint8
	ImmediateExit              uint8
	_                          [6]uint8
	ExitReason                 uint32
	ReadyForInterruptInjection uint8
	IFFlag                     uint8
	Flags                      uint16
	CR8                        uint64
	APICBase                   uint64
}

// runUnionOffset is where kvm_run's exit union starts.
const runUnionOffset = 32

type runIO struct {
	Direction  uint8
	Size       uint8
	Port       uint16
	Count      uint32
	DataOffset uint64
}

type runMMIO struct {
	PhysAddr uint64
	Data     [8]uint8
	Len      uint32
	IsWrite  uint8
}

type runEvent struct {
	Type  uint32
	NData uint32
	Data  [16]uint64
}

func (v *VCPU) header() *runHeader { return (*runHeader)(unsafe.Pointer(&v.run[0])) }

func (v *VCPU) union() unsafe.Pointer { return unsafe.Pointer(&v.run[runUnionOffset]) }

// IO directions.
const (
	IOIn  = 0
	IOOut = 1
)

// IO decodes a KVM_EXIT_IO: the port, the access size in bytes, whether the
// guest writes (out), and the data buffer (size*count bytes) inside the run
// page: for an out it holds what the guest wrote; for an in the caller fills it.
// ok is false when the kernel's offsets fall outside the page.
func (v *VCPU) IO() (port uint16, size int, out bool, data []byte, ok bool) {
	io := (*runIO)(v.union())
	n := uint64(io.Size) * uint64(io.Count)
	if io.DataOffset > uint64(len(v.run)) || n > uint64(len(v.run))-io.DataOffset {
		return io.Port, int(io.Size), io.Direction == IOOut, nil, false
	}
	return io.Port, int(io.Size), io.Direction == IOOut, v.run[io.DataOffset : io.DataOffset+n], true
}

// MMIO decodes a KVM_EXIT_MMIO: the guest-physical address, whether the guest
// writes, and the data (len bytes) in the run page: for a write it holds what
// the guest wrote; for a read the caller fills it.
func (v *VCPU) MMIO() (addr uint64, data []byte, write bool) {
	m := (*runMMIO)(v.union())
	n := m.Len
	if n > 8 {
		n = 8
	}
	return m.PhysAddr, m.Data[:n], m.IsWrite != 0
}

// SystemEvent decodes a KVM_EXIT_SYSTEM_EVENT.
func (v *VCPU) SystemEvent() (typ uint32, data []uint64) {
	e := (*runEvent)(v.union())
	n := e.NData
	if n > 16 {
		n = 16
	}
	return e.Type, append([]uint64(nil), e.Data[:n]...)
}

// InternalError decodes a KVM_EXIT_INTERNAL_ERROR.
func (v *VCPU) InternalError() (suberror uint32, data []uint64) {
	e := (*runEvent)(v.union())
	n := e.NData
	if n > 16 {
		n = 16
	}
	return e.Type, append([]uint64(nil), e.Data[:n]...)
}

// FailEntry decodes a KVM_EXIT_FAIL_ENTRY.
func (v *VCPU) FailEntry() (reason uint64, cpu uint32) {
	p := v.union()
	return *(*uint64)(p), *(*uint32)(unsafe.Add(p, 8))
}

// SetImmediateExit sets kvm_run.immediate_exit: while set, KVM_RUN returns
// EINTR at once instead of entering the guest.
func (v *VCPU) SetImmediateExit(on bool) {
	var b uint8
	if on {
		b = 1
	}
	h := v.header()
	// A plain store: the kernel reads it on entry to KVM_RUN, and the kick
	// that follows (a signal) orders it for a vCPU already in the guest.
	h.ImmediateExit = b
}

// ExitReasonRaw returns kvm_run.exit_reason as last written by KVM_RUN.
func (v *VCPU) ExitReasonRaw() ExitReason { return ExitReason(v.header().ExitReason) }

// Run enters the guest until the next exit. An EINTR (a signal, or
// immediate_exit set) is reported as ExitIntr with a nil error, and so is
// EAGAIN, which KVM returns when an application processor leaves its wait
// for INIT/SIPI: either way the caller simply enters again.
func (v *VCPU) Run() (ExitReason, error) {
	enter := ioctlPtrOnce
	held := v.nextHeld()
	if held {
		enter = ioctlRawOnce
	}
	err := enter(v.fd, reqRun, 0)
	v.afterEntry(held, err)
	if err != nil {
		if isEINTR(err) || errors.Is(err, unix.EAGAIN) {
			return ExitIntr, nil
		}
		return ExitUnknown, err
	}
	return ExitReason(v.header().ExitReason), nil
}
