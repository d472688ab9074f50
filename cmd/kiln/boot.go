package main

import (
	"context"
	"flag"
	"fmt"
	"io"

	"github.com/kilnvm/kiln/vmm"
)

func cmdBoot(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("kiln boot", flag.ContinueOnError)
	fs.SetOutput(stderr)
	kernel := fs.String("kernel", "", "kernel image (bzImage or ELF vmlinux); default: the cached Debian kernel (make kernel), its vmlinux when present")
	initrd := fs.String("initrd", "", "initramfs (cpio, optionally compressed)")
	cmdline := fs.String("cmdline", vmm.DefaultCmdline, "kernel command line")
	cpus := fs.Int("cpus", 1, "number of vCPUs")
	mem := fs.Int("mem", 512, "guest memory in MiB")
	input := fs.Bool("stdin", false, "feed stdin to the serial console")
	debug := fs.Bool("debug", false, "log VMM events to stderr")
	timeout := fs.Duration("timeout", 0, "stop the VM after this long (0: no limit)")
	hold := fs.Bool("hold-procs", true, holdProcsUsage)
	virtioCmdline := fs.Bool("virtio-cmdline", false, "also name virtio devices on the command line (virtio_mmio.device=), for custom kernels without ACPI")
	var devFlags deviceFlags
	devFlags.register(fs)
	if err := fs.Parse(args); err != nil {
		return exitUsage
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "kiln boot: unexpected argument %q\n", fs.Arg(0))
		return exitUsage
	}
	if *kernel == "" {
		k, err := defaultKernel()
		if err != nil {
			fmt.Fprintf(stderr, "kiln boot: no --kernel given and %v\n", err)
			return exitFailed // the host lacks it: the command line is fine
		}
		*kernel = k
	}
	log := newLogger(stderr, *debug)
	devs, err := devFlags.specs()
	if err != nil {
		fmt.Fprintf(stderr, "kiln boot: %v\n", err)
		return exitUsage
	}
	cfg := vmm.Config{
		Spec:      vmm.Spec{Kernel: *kernel, Initrd: *initrd, Cmdline: *cmdline, CPUs: *cpus, MemoryMiB: *mem, Devices: devs, VirtioOnCmdline: *virtioCmdline},
		Console:   stdout,
		Logger:    log,
		HoldProcs: *hold,
	}
	if *input {
		cfg.ConsoleInput = stdin
	}
	vm, err := vmm.New(cfg)
	if err != nil {
		fmt.Fprintf(stderr, "kiln boot: %v\n", err)
		return bootExitCode(err)
	}
	procs := holdProcs(*hold, *cpus) // sizes GOMAXPROCS before Run
	log.Debug(procs)
	defer vm.Close()
	if *timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeoutCause(ctx, *timeout, fmt.Errorf("--timeout %v reached", *timeout))
		defer cancel()
	}
	exit, err := vm.Run(ctx)
	if err != nil {
		fmt.Fprintf(stderr, "kiln boot: %v\n", err)
		return exitFailed
	}
	if exit.Reason == vmm.ReasonPowerOff {
		return exitOK
	}
	fmt.Fprintf(stderr, "kiln boot: guest stopped: %s\n", exit)
	return exitGuest
}
