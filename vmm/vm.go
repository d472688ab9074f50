package vmm

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kilnvm/kiln/internal/ratelog"
	"github.com/kilnvm/kiln/kvm"
	"github.com/kilnvm/kiln/limits"
	"github.com/kilnvm/kiln/memory"
	"github.com/kilnvm/kiln/seccomp"
	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmm/acpi"
	"github.com/kilnvm/kiln/vmm/linuxboot"
	"github.com/kilnvm/kiln/vmm/serial"
)

// Limits on a VM's shape: the maxima are package limits' (a sandbox's
// too); the floor is a bare VM's, below a sandbox's.
const (
	MaxCPUs      = limits.MaxCPUs
	MinMemoryMiB = 16
	MaxMemoryMiB = limits.MaxMemoryMiB // 1 TiB
)

// DefaultCmdline is the kernel command line when Config.Cmdline is empty.
const DefaultCmdline = "console=ttyS0 reboot=k panic=-1"

// Spec is a VM as plain data: what it boots and its devices. It crosses
// process boundaries (a VMM process is started from one) and, but for the
// boot files, is what a snapshot keeps of the machine.
type Spec struct {
	Kernel    string `json:"kernel,omitempty"`  // path to a bzImage or ELF vmlinux
	Initrd    string `json:"initrd,omitempty"`  // optional path to an initramfs
	Cmdline   string `json:"cmdline,omitempty"` // kernel command line; DefaultCmdline when empty
	CPUs      int    `json:"cpus"`              // vCPUs, 1..MaxCPUs
	MemoryMiB int    `json:"memory_mib"`        // guest RAM in MiB

	// Devices are the virtio devices, each behind a virtio-mmio transport
	// described in the ACPI DSDT, in this order; at most
	// MaxVirtioDevices. The VM opens them (virtio.Open) and closes them.
	Devices []virtio.DeviceSpec `json:"devices,omitempty"`
	// VirtioOnCmdline also names each transport on the kernel command line
	// (virtio_mmio.device=4K@ADDR:GSI), for custom kernels built with
	// CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES and without ACPI. Stock distro
	// kernels find the devices through ACPI and need not it.
	VirtioOnCmdline bool `json:"virtio_on_cmdline,omitempty"`
}

// Config describes a VM to build: its Spec, and what the running VM is
// connected to in this process.
type Config struct {
	Spec

	Console      io.Writer // serial console output; discarded when nil
	ConsoleInput io.Reader // optional serial console input; Close stops its reader (stopConsoleInput)

	KVMPath string       // /dev/kvm when empty
	Logger  *slog.Logger // slog.Default() when nil

	// OpenFS opens the trees of fs devices (image roots); nil refuses
	// them. Restored and forked VMs need it again (RestoreConfig.OpenFS;
	// a fork's children take the parent's).
	OpenFS virtio.FSOpener
	// VsockDial dials the host side of the vsock device's guest
	// connections (virtio.VsockConfig.Dial); nil: the device dials its
	// socket's Path_P. A jailed VMM process's asks its parent. Restored
	// VMs need it again (RestoreConfig.VsockDial); a fork's children,
	// each on a vsock socket of its own, do not take the parent's.
	VsockDial virtio.VsockDialer

	// HoldProcs makes each vCPU keep its P (its slot in Go's scheduler)
	// while in the guest (kvm.VCPU.SetHoldP): Go's monitor thread then
	// does not poll for the P and hand it on around every exit, which
	// on a host with few CPUs cost more than the exit (docs/bench.md,
	// the vsock round trip). Each vCPU then occupies a P while the VM
	// runs, so the process's GOMAXPROCS must exceed the vCPUs it holds,
	// with Ps to spare for the devices: ProcsFor gives the figure for a
	// process that runs one VM. A fork's children do not take it (they
	// share the parent's process and its GOMAXPROCS).
	HoldProcs bool

	// VCPUSeccomp is the mode of the seccomp filter each vCPU thread
	// loads before it first enters the guest: seccomp.VMM's allowlist on
	// that thread alone (Policy.InstallThread, no TSYNC), so that a guest
	// that took over what a vCPU thread does on its exits meets the
	// VMM's allowlist there, while the rest of the process (an embedding
	// program's) is left as it is. The thread stays locked to its
	// goroutine and ends with it, so it never serves another goroutine.
	// The zero value, seccomp.Kill, is the default; seccomp.Off loads
	// none: a VMM process, filtered whole, sets it. Where the thread
	// cannot take a filter (no seccomp in the kernel, one already there
	// that refuses it) the vCPU runs unfiltered, with a warning. A fork's
	// children take the parent's.
	VCPUSeccomp seccomp.Mode
}

// DeviceProcs is the most Ps (GOMAXPROCS) a process that runs one VM
// keeps for its devices and its API beside its vCPUs' (ProcsFor). Device
// I/O waits in system calls, which hold no P; a P more costs memory in
// every VMM process (its caches, a GC worker and its stack).
const DeviceProcs = 2

// ProcsFor returns the GOMAXPROCS for a process that runs one VM of cpus
// vCPUs: the runtime's own figure (the host's CPUs or the cgroup's CPU
// limit), at most DeviceProcs, for the devices and the API, plus one P
// per vCPU, which with HoldProcs mostly waits in the guest's halt.
func ProcsFor(cpus int) int { return min(runtime.GOMAXPROCS(0), DeviceProcs) + cpus }

// Validate checks the parts of the config that need no files.
func (c *Config) Validate() error {
	if c.Kernel == "" {
		return errors.New("no kernel given")
	}
	return c.validateShape()
}

// validateShape checks what a booted and a restored VM share: vCPUs,
// memory and devices.
func (c *Config) validateShape() error {
	if c.CPUs < 1 || c.CPUs > MaxCPUs {
		return fmt.Errorf("%d vCPUs: want 1 to %d", c.CPUs, MaxCPUs)
	}
	if c.MemoryMiB < MinMemoryMiB || c.MemoryMiB > MaxMemoryMiB {
		return fmt.Errorf("%d MiB of memory: want %d to %d", c.MemoryMiB, MinMemoryMiB, MaxMemoryMiB)
	}
	return validateDevices(c.Devices)
}

// Reason says why a VM stopped.
type Reason int

// Reasons a VM stops.
const (
	ReasonPowerOff Reason = iota + 1
	ReasonReboot
	ReasonPanic
	ReasonTripleFault
	ReasonCancelled
	ReasonError
)

func (r Reason) String() string {
	switch r {
	case ReasonPowerOff:
		return "power-off"
	case ReasonReboot:
		return "reboot"
	case ReasonPanic:
		return "panic"
	case ReasonTripleFault:
		return "triple-fault"
	case ReasonCancelled:
		return "cancelled"
	case ReasonError:
		return "error"
	}
	return fmt.Sprintf("reason(%d)", int(r))
}

// Exit is how a VM's run ended.
type Exit struct {
	Reason  Reason
	Message string // one line, for people
}

func (e Exit) String() string { return e.Reason.String() + ": " + e.Message }

// VM is a booted-or-bootable virtual machine.
type VM struct {
	cfg     Config
	log     *slog.Logger // cfg.Logger through logLimit
	sys     *kvm.System
	vm      *kvm.VM
	mem     *memory.Memory
	vcpus   []*vcpu
	pio     Bus
	mmio    Bus
	uart    *serial.UART
	console *consoleBuffer // between the UART and cfg.Console; nil without one
	// setupTimes is how long New's phases took (a booted VM only).
	setupTimes SetupTimes
	// consoleMax bounds console's buffer (consoleBufferMax; tests set less).
	consoleMax int
	panics     *panicWatcher
	specs      []virtio.DeviceSpec // what devices holds, in order
	// specMu guards the devices' specs, which InsertDisk changes (a
	// slot's image) while the VM runs.
	specMu  sync.Mutex
	opened  []virtio.Device // opened from specs, not attached yet
	devices []*vdev
	ged     *gedDevice
	// logLimit rate-limits log: the VM and its devices log what a guest
	// can cause over and over (a device it breaks and resets, say), so
	// no message passes more than a few times a minute.
	logLimit *ratelog.Handler
	// inputStop and inputDone stop and wait for the goroutine that feeds
	// ConsoleInput to the UART (console.go); nil without one.
	inputStop, inputDone chan struct{}
	// irqResends counts virtio interrupts sent again because the guest
	// did not acknowledge them (see resendLostInterrupts).
	irqResends atomic.Uint64

	// lc is the VM's state (created, running, paused, saving, stopped)
	// and lets one lifecycle operation run at a time; see lifecycle.go.
	lc *lifecycle
	// ran is closed when Run's goroutines (vCPUs, interrupt resends)
	// have all returned.
	ran chan struct{}

	// The vCPUs' side of the lifecycle, under mu: what the vCPU loops
	// see at each exit (vcpu.checkpoint).
	mu       sync.Mutex
	cond     *sync.Cond
	exit     *Exit // set once, by the first stop
	paused   bool  // the vCPUs are asked to park (parkVCPUs)
	parked   int   // vCPUs parked
	stopping bool  // the VM stopped: every vCPU loop returns
	// devicesPaused: a state save paused the virtio transports;
	// unparkVCPUs resumes them.
	devicesPaused bool
}

// New builds a VM from cfg: memory, vCPUs, irqchip, devices, and the kernel,
// initrd, command line, boot parameters and ACPI tables in guest memory. The
// guest starts running with Run.
func New(cfg Config) (_ *VM, err error) {
	if err := cfg.Validate(); err != nil {
		return nil, &ConfigError{Err: fmt.Errorf("vm config: %w", err)}
	}
	if cfg.Cmdline == "" {
		cfg.Cmdline = DefaultCmdline
	}
	if cfg.VirtioOnCmdline {
		cfg.Cmdline += virtioCmdline(len(cfg.Devices))
	}
	if cfg.KVMPath == "" {
		cfg.KVMPath = kvm.DevicePath
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	var times SetupTimes
	mark := time.Now()
	lap := func(d *time.Duration) {
		now := time.Now()
		*d = now.Sub(mark)
		mark = now
	}
	// The kernel stays in its file until it is loaded: an ELF vmlinux's
	// segments are read straight into guest memory (loadKernel).
	kernel, kernelSize, err := openBootFile(cfg.Kernel, MaxKernelSize)
	if err != nil {
		return nil, &ConfigError{Err: fmt.Errorf("read kernel: %w", err)}
	}
	defer kernel.Close()
	img, err := linuxboot.ParseFile(kernel, kernelSize)
	if err != nil {
		return nil, &ConfigError{Err: fmt.Errorf("kernel %s: %w", cfg.Kernel, err)}
	}
	lap(&times.Kernel)
	// An initrd must fit in the memory below the MMIO gap.
	low := min(uint64(cfg.MemoryMiB)<<20, mmioGapStart)
	// The initrd, too, goes from its file straight into guest memory.
	var initrd *os.File
	var initrdSize int64
	if cfg.Initrd != "" {
		if initrd, initrdSize, err = openBootFile(cfg.Initrd, int64(low)); err != nil {
			return nil, &ConfigError{Err: fmt.Errorf("read initrd: %w", err)}
		}
		defer initrd.Close()
	}
	lap(&times.Initrd)

	// Check that kernel and initrd fit before any KVM work.
	if img.End > low {
		return nil, &ConfigError{Err: fmt.Errorf("kernel needs memory up to %d MiB but the VM has %d MiB below the MMIO gap; give it more memory", (img.End+(1<<20)-1)>>20, low>>20)}
	}
	initrdAddr, err := placeInitrd(low, img, uint64(initrdSize))
	if err != nil {
		return nil, &ConfigError{Err: err}
	}

	v := newVM(cfg)
	defer func() {
		if err != nil {
			v.Close()
		}
	}()
	if err = v.openDevices(); err != nil {
		return nil, err
	}
	lap(&times.Devices)
	if v.mem, err = memory.New("kiln-guest-ram", memoryLayout(cfg.MemoryMiB)); err != nil {
		return nil, err
	}
	lap(&times.Memory)
	if err = v.setupMachine(); err != nil {
		return nil, err
	}
	lap(&times.Machine)
	bi, err := v.loadKernel(img, kernel, initrd, uint64(initrdSize), initrdAddr)
	if err != nil {
		return nil, err
	}
	lap(&times.Load)
	if err = v.createVCPUs(); err != nil {
		return nil, err
	}
	if err = v.setupBootVCPUs(img, bi); err != nil {
		return nil, err
	}
	lap(&times.VCPUs)
	v.setupTimes = times
	return v, nil
}

// SetupTimes is where New spent its time booting a VM, in order: the
// benchmarks' breakdown of the VMM's share of a boot.
type SetupTimes struct {
	Kernel  time.Duration // open and parse the kernel image (an ELF's headers only)
	Initrd  time.Duration // read the initramfs
	Devices time.Duration // open the devices' backends (images, taps, sockets)
	Memory  time.Duration // map guest RAM
	Machine time.Duration // KVM VM, memory slots, irqchip, PIT, platform devices, virtio transports
	Load    time.Duration // kernel segments, command line, initramfs and ACPI tables into guest RAM
	VCPUs   time.Duration // create the vCPUs and set their boot registers
}

// Total is the sum of the phases.
func (t SetupTimes) Total() time.Duration {
	return t.Kernel + t.Initrd + t.Devices + t.Memory + t.Machine + t.Load + t.VCPUs
}

// SetupTimes returns how long New's phases took for a booted VM (zero for
// a restored one).
func (v *VM) SetupTimes() SetupTimes { return v.setupTimes }

// newVM returns an empty VM for cfg (defaults filled in).
func newVM(cfg Config) *VM {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	limit := ratelog.New(cfg.Logger.Handler(), ratelog.Options{})
	v := &VM{cfg: cfg, log: slog.New(limit), logLimit: limit, specs: cfg.Devices}
	v.cond = sync.NewCond(&v.mu)
	v.ran = make(chan struct{})
	v.consoleMax = consoleBufferMax
	v.lc = newLifecycle(lifecycleHooks{
		park:   v.parkVCPUs,
		unpark: v.unparkVCPUs,
		halt:   func() { v.stop(ReasonCancelled, "VM closed") },
	})
	return v
}

// setupMachine builds what every VM has, booted or restored, over the
// guest memory in v.mem: the KVM VM and its memory slots, the TSS and
// identity map, irqchip, PIT, the platform devices and the virtio
// transports.
func (v *VM) setupMachine() (err error) {
	if v.sys, err = kvm.OpenPath(v.cfg.KVMPath); err != nil {
		return err
	}
	if max := v.sys.CheckExtension(kvm.CapMaxVCPUs); max > 0 && v.cfg.CPUs > max {
		return fmt.Errorf("%d vCPUs: KVM allows at most %d", v.cfg.CPUs, max)
	}
	if v.vm, err = v.sys.CreateVM(); err != nil {
		return err
	}
	if err = v.setupMemory(); err != nil {
		return err
	}
	if err = v.vm.SetTSSAddr(tssAddr); err != nil {
		return err
	}
	if err = v.vm.SetIdentityMapAddr(identMap); err != nil {
		return err
	}
	if err = v.vm.CreateIRQChip(); err != nil {
		return err
	}
	if err = v.vm.CreatePIT2(&kvm.PITConfig{Flags: kvm.PITSpeakerDummy}); err != nil {
		return err
	}
	if err = v.setupDevices(); err != nil {
		return err
	}
	return v.setupVirtio()
}

// lowMemEnd returns where RAM below the MMIO gap ends.
func (v *VM) lowMemEnd() uint64 {
	return min(uint64(v.cfg.MemoryMiB)<<20, mmioGapStart)
}

// memoryLayout returns where a VM's RAM of memMiB lies: below the MMIO
// gap, and the rest above 4 GiB.
func memoryLayout(memMiB int) memory.Layout {
	total := uint64(memMiB) << 20
	low := min(total, mmioGapStart)
	layout := memory.Layout{{GuestAddr: 0, Size: low}}
	if total > mmioGapStart {
		layout = append(layout, struct{ GuestAddr, Size uint64 }{mmioGapEnd, total - mmioGapStart})
	}
	return layout
}

// setupMemory gives each region of v.mem a KVM memory slot.
func (v *VM) setupMemory() error {
	mem := v.mem
	for i, r := range mem.Regions() {
		if err := v.vm.SetUserMemoryRegion(&kvm.UserspaceMemoryRegion{
			Slot: uint32(i), GuestPhysAddr: r.GuestAddr, MemorySize: r.Size, UserspaceAddr: uint64(mem.HostAddr(i)),
		}); err != nil {
			return err
		}
	}
	return nil
}

func (v *VM) setupDevices() error {
	// The console writer is behind a bounded buffer: the UART writes on
	// a vCPU thread, which a blocked writer must never hold up.
	var out io.Writer
	if v.cfg.Console != nil {
		v.console = newConsoleBuffer(v.cfg.Console, v.consoleMax, func(n int) {
			v.log.Warn("console output dropped: the console writer is not keeping up", "bytes", n, "dropped", v.console.droppedBytes())
		})
		out = v.console
	}
	v.panics = &panicWatcher{out: out, onPanic: func(msg string) { v.stop(ReasonPanic, msg) }}
	v.uart = serial.New(v.panics, func() {
		// COM1's ISA interrupt is edge-triggered: pulse the line.
		v.vm.IRQLine(com1IRQ, true)
		v.vm.IRQLine(com1IRQ, false)
	})
	if err := v.pio.Add(com1Port, serial.Port, v.uart); err != nil {
		return err
	}
	if err := v.pio.Add(0x60, 5, &i8042{stop: v.stop}); err != nil {
		return err
	}
	if err := v.pio.Add(0x70, 2, newCMOSRTC(time.Now)); err != nil {
		return err
	}
	if err := v.mmio.Add(powerBase, powerSize, &powerDevice{stop: v.stop}); err != nil {
		return err
	}
	v.ged = &gedDevice{pulse: func() {
		// The GED's interrupt is edge-triggered: pulse the line.
		v.vm.IRQLine(gedGSI, true)
		v.vm.IRQLine(gedGSI, false)
	}}
	if err := v.mmio.Add(gedBase, gedSize, v.ged); err != nil {
		return err
	}
	v.startConsoleInput()
	return nil
}

// loadKernel lays the kernel, initrd, command line, ACPI tables and boot
// parameters into guest memory. The kernel's segments that are left in
// its file, and the initrd, go from their files into guest memory
// (memory.LoadFile): no copy on the VMM's heap, no zeroing of pages about
// to be overwritten, and no page at all for the file's holes (an extracted
// vmlinux's .bss: 27 of Debian's 57 MiB) until the guest writes it.
func (v *VM) loadKernel(img *linuxboot.Image, kernel *os.File, initrd *os.File, initrdSize, initrdAddr uint64) (linuxboot.BootInfo, error) {
	var bi linuxboot.BootInfo
	low := v.lowMemEnd()
	for _, s := range img.Segments {
		if s.Data != nil {
			if err := v.mem.Populate(s.Addr, uint64(len(s.Data))); err != nil {
				return bi, fmt.Errorf("load kernel segment at %#x: %w", s.Addr, err)
			}
			if err := v.mem.WriteAt(s.Data, s.Addr); err != nil {
				return bi, fmt.Errorf("load kernel segment at %#x: %w", s.Addr, err)
			}
			continue
		}
		if s.FileOff > math.MaxInt64 {
			return bi, fmt.Errorf("load kernel segment at %#x: file offset %#x", s.Addr, s.FileOff)
		}
		if err := v.mem.LoadFile(kernel, int64(s.FileOff), s.Addr, s.FileLen); err != nil {
			return bi, fmt.Errorf("load kernel segment at %#x: %w", s.Addr, err)
		}
	}
	if err := writeBootTables(v.mem); err != nil {
		return bi, err
	}

	cmdline := v.cfg.Cmdline
	limit := min(uint64(img.CmdlineSize), cmdlineMax-1)
	if uint64(len(cmdline)) > limit {
		return bi, fmt.Errorf("kernel command line is %d bytes; this kernel takes at most %d", len(cmdline), limit)
	}
	if err := v.mem.WriteAt(append([]byte(cmdline), 0), cmdlineAddr); err != nil {
		return bi, fmt.Errorf("write command line: %w", err)
	}
	bi.CmdlineAddr, bi.CmdlineLen = cmdlineAddr, uint64(len(cmdline))

	if initrd != nil && initrdSize > 0 {
		if err := v.mem.LoadFile(initrd, 0, initrdAddr, initrdSize); err != nil {
			return bi, fmt.Errorf("load initrd: %w", err)
		}
		bi.InitrdAddr, bi.InitrdSize = initrdAddr, initrdSize
	}

	tables, err := acpi.Build(v.acpiConfig())
	if err != nil {
		return bi, fmt.Errorf("build ACPI tables: %w", err)
	}
	if tables.Base+uint64(len(tables.Bytes)) > acpiEnd {
		return bi, fmt.Errorf("ACPI tables of %d bytes overflow the BIOS area", len(tables.Bytes))
	}
	if err := v.mem.WriteAt(tables.Bytes, tables.Base); err != nil {
		return bi, fmt.Errorf("write ACPI tables: %w", err)
	}
	bi.RSDPAddr = tables.RSDP
	if tables.Base+uint64(len(tables.Bytes)) > vmgenidAddr {
		return bi, fmt.Errorf("ACPI tables of %d bytes overlap the VM generation ID", len(tables.Bytes))
	}
	if err := v.writeGenerationID(); err != nil {
		return bi, err
	}

	bi.E820 = []linuxboot.E820Entry{
		{Addr: 0, Size: ebdaStart, Type: linuxboot.E820RAM},
		{Addr: ebdaStart, Size: 0xa0000 - ebdaStart, Type: linuxboot.E820Reserved},
		{Addr: acpiBase, Size: acpiEnd - acpiBase, Type: linuxboot.E820Reserved},
		{Addr: himemStart, Size: low - himemStart, Type: linuxboot.E820RAM},
	}
	if total := uint64(v.cfg.MemoryMiB) << 20; total > mmioGapStart {
		bi.E820 = append(bi.E820, linuxboot.E820Entry{Addr: mmioGapEnd, Size: total - mmioGapStart, Type: linuxboot.E820RAM})
	}

	if img.PVHEntry == 0 {
		zp, err := img.ZeroPage(bi)
		if err != nil {
			return bi, err
		}
		if err := v.mem.WriteAt(zp, zeroPageAddr); err != nil {
			return bi, fmt.Errorf("write zero page: %w", err)
		}
	} else {
		info, mm, err := linuxboot.PVHStartInfo(bi, pvhMemmap)
		if err != nil {
			return bi, err
		}
		if pvhMemmap+uint64(len(mm)) > zeroPageAddr {
			return bi, fmt.Errorf("PVH memory map of %d bytes overflows its page", len(mm))
		}
		if err := v.mem.WriteAt(info, pvhInfoAddr); err != nil {
			return bi, err
		}
		if err := v.mem.WriteAt(mm, pvhMemmap); err != nil {
			return bi, err
		}
	}
	return bi, nil
}

// placeInitrd returns where an initrd of size bytes goes: as high as the
// kernel allows below low, page-aligned, above the kernel.
func placeInitrd(low uint64, img *linuxboot.Image, size uint64) (uint64, error) {
	if size == 0 {
		return 0, nil
	}
	top := min(low, img.InitrdAddrMax+1)
	pageEnd := (img.End + 0xfff) &^ 0xfff
	if size > top || (top-size)&^0xfff < pageEnd {
		return 0, fmt.Errorf("initrd of %d MiB does not fit in %d MiB of memory beside a kernel that needs %d MiB", (size+(1<<20)-1)>>20, low>>20, (img.End+(1<<20)-1)>>20)
	}
	return (top - size) &^ 0xfff, nil
}

func (v *VM) acpiConfig() acpi.Config {
	return acpi.Config{
		Base:         acpiBase,
		CPUs:         v.cfg.CPUs,
		LAPICAddr:    lapicAddr,
		IOAPICAddr:   ioapicAddr,
		Serial:       []acpi.SerialPort{{Port: com1Port, IRQ: com1IRQ}},
		SleepControl: powerBase + powerSleepControl,
		SleepStatus:  powerBase + powerSleepStatus,
		ResetReg:     powerBase + powerReset,
		ResetValue:   resetValue,
		VirtioMMIO:   v.virtioACPI(),
		GED:          &acpi.GED{Base: gedBase, GSI: gedGSI},
		VMGenID:      &acpi.VMGenID{Addr: vmgenidAddr},
	}
}

// createVCPUs creates the vCPUs, each with its CPUID.
func (v *VM) createVCPUs() error {
	supported, err := v.sys.SupportedCPUID()
	if err != nil {
		return err
	}
	for i := 0; i < v.cfg.CPUs; i++ {
		kv, err := v.vm.CreateVCPU(i)
		if err != nil {
			return err
		}
		v.vcpus = append(v.vcpus, &vcpu{vm: v, kv: kv})
		if err := kv.SetCPUID(cpuidFor(supported, i, v.cfg.CPUs)); err != nil {
			return err
		}
	}
	return nil
}

// setupBootVCPUs gives the vCPUs their boot state: the BSP at the kernel's
// entry, the others waiting for INIT/SIPI.
func (v *VM) setupBootVCPUs(img *linuxboot.Image, bi linuxboot.BootInfo) (err error) {
	for i, c := range v.vcpus {
		kv := c.kv
		if err := kv.SetMSRs(bootMSRs()); err != nil {
			return err
		}
		if err := setupFPU(kv); err != nil {
			return err
		}
		if err := setupLAPIC(kv); err != nil {
			return err
		}
		if i != 0 {
			continue // APs wait for INIT/SIPI from the BSP in the in-kernel LAPIC
		}
		// An ELF kernel with a PVH note is entered there (no decompressor,
		// no zero page); anything else at its 64-bit entry.
		if img.PVHEntry != 0 {
			err = setupPVH(kv, img.PVHEntry)
		} else {
			err = setupLongMode(kv, img.Entry64)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// CPUs returns the number of vCPUs.
func (v *VM) CPUs() int { return len(v.vcpus) }

// Memory returns the guest's RAM.
func (v *VM) Memory() *memory.Memory { return v.mem }

// KVM returns the KVM VM handle (for devices that need irqfd or ioeventfd).
func (v *VM) KVM() *kvm.VM { return v.vm }

// AddMMIO claims a guest-physical range for a device.
func (v *VM) AddMMIO(base, size uint64, d Device) error { return v.mmio.Add(base, size, d) }

// AddPIO claims a range of I/O ports for a device.
func (v *VM) AddPIO(base, size uint64, d Device) error { return v.pio.Add(base, size, d) }

// stop records the first reason the VM stops, makes its state stopped and
// kicks every vCPU out. It never waits, so a vCPU can call it.
func (v *VM) stop(r Reason, msg string) {
	v.mu.Lock()
	if v.exit != nil {
		v.mu.Unlock()
		return
	}
	// A reboot or triple fault that follows a panic report is the panic.
	if r != ReasonPanic && r != ReasonCancelled {
		if pm := v.panics.panicMessage(); pm != "" {
			r, msg = ReasonPanic, pm
		}
	}
	v.exit = &Exit{Reason: r, Message: msg}
	v.stopping = true
	// Stopped before anything sees stopping: a Pause that finds the
	// vCPUs stopping then reports the stopped state.
	v.lc.ended()
	v.cond.Broadcast()
	v.kickAll()
	v.mu.Unlock()
}

// kickAll kicks every vCPU out of the guest; v.mu is held (Close takes
// the vCPUs away under it).
func (v *VM) kickAll() {
	for _, c := range v.vcpus {
		c.kick()
	}
}

// State returns where the VM is in its life: created, running, paused,
// saving (a SaveState, Checkpoint or Fork in progress) or stopped.
func (v *VM) State() VMState { return v.lc.State() }

// Run runs the guest until it powers off, reboots, panics, triple-faults or
// fails, or ctx is cancelled, and says which. A VM runs once: Run on a VM
// that is not in the created state returns a *StateError (ErrState). Run
// waits for a lifecycle operation in progress (one that began before it,
// such as a Close) while ctx allows.
func (v *VM) Run(ctx context.Context) (Exit, error) {
	if err := v.lc.start(ctx); err != nil {
		return Exit{}, err
	}
	defer close(v.ran)

	if procs := runtime.GOMAXPROCS(0); v.cfg.HoldProcs && procs <= len(v.vcpus) {
		v.log.Warn("vCPUs hold all of the process's Ps: devices run only when the runtime preempts a vCPU",
			"vcpus", len(v.vcpus), "gomaxprocs", procs)
	}
	var wg sync.WaitGroup
	for _, c := range v.vcpus {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c.loop()
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	resendDone := make(chan struct{})
	go func() { v.resendLostInterrupts(done); close(resendDone) }()
	defer func() { <-resendDone }()
	logsDone := make(chan struct{})
	go func() { v.reportSuppressedLogs(done); close(logsDone) }()
	defer func() { <-logsDone }()
	select {
	case <-ctx.Done():
		v.stop(ReasonCancelled, context.Cause(ctx).Error())
		<-done
	case <-done:
	}
	v.mu.Lock()
	exit := *v.exit
	v.mu.Unlock()
	v.log.Debug("vm stopped", "reason", exit.Reason.String(), "message", exit.Message)
	if exit.Reason == ReasonError {
		return exit, errors.New(exit.Message)
	}
	return exit, nil
}

// Pause moves a running VM to paused: it stops every vCPU at its next exit
// and returns when all are parked. The guest's state can then be read
// consistently. It waits for a lifecycle operation in progress while ctx
// allows; a VM that is not running when its turn comes is refused with a
// *StateError (ErrState). When ctx ends before every vCPU parked, the VM
// goes on running and Pause returns ctx's error. The console output the
// guest wrote before it stopped has reached Config.Console when Pause
// returns, unless that writer holds it up past consolePauseFlush.
func (v *VM) Pause(ctx context.Context) error {
	if err := v.lc.pause(ctx); err != nil {
		return err
	}
	if v.console != nil {
		v.console.flush(consolePauseFlush)
	}
	return nil
}

// Resume moves a paused VM to running: the vCPUs run again, with the
// virtio transports that SaveState paused. It waits for a lifecycle
// operation in progress, so a VM is never resumed in the middle of a
// SaveState, Checkpoint or Fork; a VM that is not paused then is refused
// with a *StateError (ErrState).
func (v *VM) Resume() error { return v.lc.resume() }

// Close stops the VM, first its vCPUs when it runs (Run returns, cancelled),
// waits for a lifecycle operation in progress and for Run's goroutines,
// and releases the VM's vCPUs, memory and file descriptors. The VM is then
// stopped. Closing it again does nothing.
func (v *VM) Close() error { return v.lc.close(v.release) }

// ConsoleDropped returns how many bytes of the guest's console output
// were dropped because Config.Console did not take them in time (its
// buffer was full, or Close found it still blocked).
func (v *VM) ConsoleDropped() uint64 {
	if v.console == nil {
		return 0
	}
	return v.console.droppedBytes()
}

// release frees what the VM holds; Close calls it once.
func (v *VM) release() error {
	if v.lc.hasStarted() {
		<-v.ran
	}
	v.stopConsoleInput()
	if v.console != nil {
		// The vCPUs are stopped: what they wrote goes to the console
		// writer now, unless it is stuck; Close does not wait on it.
		v.console.close(consoleFlushTimeout)
	}
	errs := []error{v.closeVirtio()}
	v.mu.Lock() // kickAll reads the vCPUs under it
	vcpus := v.vcpus
	v.vcpus = nil
	v.mu.Unlock()
	for _, c := range vcpus {
		errs = append(errs, c.kv.Close())
	}
	if v.vm != nil {
		errs = append(errs, v.vm.Close())
		v.vm = nil
	}
	if v.mem != nil {
		errs = append(errs, v.mem.Close())
		v.mem = nil
	}
	if v.sys != nil {
		errs = append(errs, v.sys.Close())
		v.sys = nil
	}
	// What the rate limit dropped since its last report, now that
	// nothing logs through it any more.
	v.logLimit.Flush(context.Background())
	return errors.Join(errs...)
}
