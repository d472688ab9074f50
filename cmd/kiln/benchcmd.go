package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"github.com/kilnvm/kiln/bench"
	"github.com/kilnvm/kiln/initramfs"
	"github.com/kilnvm/kiln/vmm"
)

// cmdBench runs `kiln bench boot`: Kiln beside QEMU microvm, same guest.
func cmdBench(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] != "boot" {
		fmt.Fprintln(stderr, "usage: kiln bench boot [-n RUNS] [--kernel K] [--cpus N] [--mem MiB]")
		return exitUsage
	}
	fs := flag.NewFlagSet("kiln bench boot", flag.ContinueOnError)
	fs.SetOutput(stderr)
	n := fs.Int("n", 5, "boots on each VMM")
	kernel := fs.String("kernel", "", "kernel image; default: the cached Debian kernel")
	cpus := fs.Int("cpus", 1, "vCPUs")
	mem := fs.Int("mem", 256, "memory in MiB")
	qemu := fs.String("qemu", "qemu-system-x86_64", "the peer VMM binary")
	if err := fs.Parse(args[1:]); err != nil {
		return exitUsage
	}
	if *kernel == "" {
		k, err := defaultKernel()
		if err != nil {
			fmt.Fprintf(stderr, "kiln bench: %v\n", err)
			return exitUsage
		}
		*kernel = k
	}
	qpath, err := exec.LookPath(*qemu)
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench: peer VMM: %v (make deps installs qemu-system-x86)\n", err)
		return exitUsage
	}
	dir, err := os.MkdirTemp("", "kiln-bench-")
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench: %v\n", err)
		return exitInternal
	}
	defer os.RemoveAll(dir)
	initrd := filepath.Join(dir, "initrd.cpio")
	if err := writeBusyboxInitrd(initrd, "echo "+bench.Marker+"\npoweroff -f\n"); err != nil {
		fmt.Fprintf(stderr, "kiln bench: %v\n", err)
		return exitInternal
	}
	s := bench.BootSpec{Kernel: *kernel, Initrd: initrd, Cmdline: vmm.DefaultCmdline + " quiet", CPUs: *cpus, MemoryMiB: *mem}
	fmt.Fprintf(stdout, "boot to userspace marker: kernel %s, %d vCPU, %d MiB, %d runs each\n", *kernel, *cpus, *mem, *n)
	c, err := bench.CompareBoot(ctx, qpath, s, *n, stdout)
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench: %v\n", err)
		return exitInternal
	}
	fmt.Fprintf(stdout, "median: kiln %v, qemu microvm %v, ratio kiln/qemu %.2f\n",
		bench.Median(c.Kiln).Round(time.Millisecond), bench.Median(c.Peer).Round(time.Millisecond), c.Ratio())
	return exitOK
}

// writeBusyboxInitrd writes an initramfs whose /init runs script under busybox sh.
func writeBusyboxInitrd(path, script string) error {
	b, err := initramfs.BusyboxInit(script)
	if err != nil {
		return err
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := b.WriteTo(f); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	return f.Close()
}
