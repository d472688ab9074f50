// Command kiln starts Linux microVMs on KVM.
//
//	kiln boot --kernel K [--initrd I] [--cmdline C] [--cpus N] [--mem MiB]
//	kiln run [--disk rootfs.ext4] [--cpus N] [--mem MiB] [-e K=V] [-w DIR] -- CMD [ARG...]
//	kiln sandbox create|ls|exec|run|cp|checkpoint|rollback|fork|rm ...   (through kilnd)
//	kiln template create|ls|rm ...; kiln completion bash|zsh|fish
//	kiln doctor [--json]   (is this host ready for kilnd?)
//	kiln e2b key new [--keys FILE] TENANT   (an E2B API key into kilnd's keys file)
//
// boot streams the guest's serial console to stdout and exits 0 when the guest
// powers off, or with a one-line reason: 2 for bad input (flags, files), 1
// on panic, triple fault, reboot or any other failure. run boots a sandbox whose init is the guest agent, runs
// CMD in it with its stdout and stderr on kiln's, powers it off and exits
// with CMD's exit code (128+N after signal N; 125 when kiln failed, 126 when
// CMD could not be started, 127 when it was not found).
package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/kilnvm/kiln/guestkernel"
)

// Exit codes.
const (
	exitOK       = 0
	exitGuest    = 1 // the guest stopped other than by powering off
	exitUsage    = 2
	exitInternal = 3
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdin, os.Stdout, os.Stderr))
}

func run(args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		usage(stderr)
		return exitUsage
	}
	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()
	if cobraCommands[args[0]] {
		return cmdCobra(ctx, args, stdin, stdout, stderr)
	}
	switch args[0] {
	case "boot":
		return cmdBoot(ctx, args[1:], stdin, stdout, stderr)
	case "run":
		return cmdRun(ctx, args[1:], stdin, stdout, stderr)
	case "fork":
		return cmdFork(ctx, args[1:], stdout, stderr)
	case "bench":
		return cmdBench(ctx, args[1:], stdout, stderr)
	case "vmm":
		return cmdVMM(ctx, args[1:])
	case "image":
		return cmdImage(ctx, args[1:], stdout, stderr)
	case "e2b":
		return cmdE2B(args[1:], stdout, stderr)
	case "help", "-h", "--help":
		usage(stdout)
		return exitOK
	}
	fmt.Fprintf(stderr, "kiln: unknown command %q\n", args[0])
	usage(stderr)
	return exitUsage
}

func usage(w io.Writer) {
	fmt.Fprint(w, `usage: kiln <command> [flags]

commands:
  boot    boot a kernel and stream its serial console
  run     run a command in a new sandbox: kiln run [flags] -- CMD [ARG...]
          (--save DIR snapshots it afterwards; --from DIR restores one)
  fork    restore N clones of a snapshot and run a command in each:
          kiln fork --from DIR -n N -- CMD [ARG...]
  image   OCI images: kiln image pull|import|ls|rm|inspect [--dir DIR] ...
  e2b     kiln e2b key new [--keys FILE] TENANT: an API key in E2B's format
          (both E2B SDKs take it) added to kilnd's keys file, printed
  sandbox sandboxes run by kilnd (--host, $KILN_HOST):
          kiln sandbox create|ls|inspect|exec|run|cp|ps|kill|pause|resume|events|
                       checkpoint|checkpoints|rollback|fork|rm
  template  kilnd's templates: kiln template create|ls|rm
  volume  kilnd's volumes: kiln volume create|ls|rm (sandbox create -v NAME:/PATH[:ro])
  completion  shell completion: kiln completion bash|zsh|fish|powershell
  doctor  check this host for kilnd (KVM, cgroup v2, nftables, tun, disk, ...)
  bench   Kiln beside QEMU microvm, same guest, medians and ratios:
          boot (to a userspace marker), start (sandbox to first exec),
          snapshot (save, restore, fork, memory per clone)
`)
}

func newLogger(w io.Writer, debug bool) *slog.Logger {
	level := slog.LevelWarn
	if debug {
		level = slog.LevelDebug
	}
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: level}))
}

// defaultKernel is the cached Debian kernel: its ELF vmlinux when the cache
// has one (entered through PVH, it skips the decompressor), else the bzImage.
func defaultKernel() (string, error) {
	k, err := guestkernel.Find()
	if err != nil {
		return "", err
	}
	if k.Vmlinux != "" {
		return k.Vmlinux, nil
	}
	return k.Image, nil
}
