package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/guest/client"
	"github.com/kilnvm/kiln/image"
	"github.com/kilnvm/kiln/sandbox"
	"github.com/kilnvm/kiln/vmm"
)

// Exit codes of kiln run, as docker run has them: the command's own exit
// code (128+N after signal N), or one of these when the command could not
// run.
const (
	exitRunFailed    = 125 // kiln itself failed: the VM or the agent
	exitCannotInvoke = 126 // the command could not be started (bad cwd, not executable)
	exitNotFound     = 127 // no such command
)

func cmdRun(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("kiln run", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: kiln run [flags] [--image REF] [--save DIR | --from DIR] -- CMD [ARG...]")
		fmt.Fprintln(stderr, "       (with --image, CMD defaults to the image's entrypoint and command)")
		fs.PrintDefaults()
	}
	var o sandbox.Options
	kernel := fs.String("kernel", "", "kernel image; default: the cached Debian kernel, whose modules the agent loads")
	agent := fs.String("agent", "", "static kiln-agent binary; default: $KILN_AGENT, or kiln-agent beside kiln")
	fs.StringVar(&o.Disk, "disk", "", "root filesystem image (ext4) to run the command in; default: the agent's initramfs, with busybox")
	fs.BoolVar(&o.DiskReadOnly, "ro", false, "attach --disk read-only")
	fs.StringVar(&o.Image, "image", "", "run in this OCI image (`REF`, pulled when not stored; kiln image ls): its layers an EROFS disk, file data fetched on first read, writes in guest RAM")
	fs.StringVar(&o.Init, "init", "", "with --image, process 1: agent (default) or systemd (the image's /sbin/init boots, the agent runs as a service)")
	fs.StringVar(&o.Images, "images", "", "images `DIR` (default: <kernel cache>/images)")
	insecure := fs.Bool("insecure", false, "with --image: pull over plain HTTP from a registry that is not on loopback")
	fs.IntVar(&o.CPUs, "cpus", sandbox.DefaultCPUs, "number of vCPUs")
	fs.IntVar(&o.MemoryMiB, "mem", sandbox.DefaultMemoryMiB, "guest memory in MiB")
	fs.StringVar(&o.Hostname, "hostname", "kiln", "guest host name")
	var env repeated
	fs.Var(&env, "e", "environment variable `K=V` for the command (repeatable)")
	dir := fs.String("w", "", "working directory of the command in the guest")
	interactive := fs.Bool("i", false, "pass stdin to the command (else it reads /dev/null)")
	timeout := fs.Duration("timeout", 0, "kill the command after this long (0: no limit)")
	bootTimeout := fs.Duration("boot-timeout", 5*time.Minute, "how long to wait for the guest agent")
	console := fs.Bool("console", false, "copy the guest's serial console to stderr")
	timing := fs.Bool("time", false, "print boot and command times to stderr")
	debug := fs.Bool("debug", false, "log VMM events to stderr")
	vf := addVMMFlags(fs)
	save := fs.String("save", "", "after CMD, save a snapshot of the running sandbox to `DIR` (which must not exist)")
	from := fs.String("from", "", "restore the sandbox from the snapshot in `DIR` instead of booting one")
	netFlag := fs.String("net", "", "a network card on a host tap, created when missing: `TAP[,mac=MAC][,netns=NAME]` (with --from: the restored sandbox's own tap)")
	if err := fs.Parse(args); err != nil {
		return exitUsage
	}
	pl, err := vf.placement(fs)
	if err != nil {
		fmt.Fprintf(stderr, "kiln run: %v\n", err)
		return exitUsage
	}
	if *netFlag != "" {
		cfg, err := parseNet(*netFlag)
		if err != nil {
			fmt.Fprintf(stderr, "kiln run: %v\n", err)
			return exitUsage
		}
		o.Net = &cfg
	}
	if *from != "" {
		var clash []string
		fs.Visit(func(f *flag.Flag) {
			switch f.Name {
			case "kernel", "agent", "disk", "ro", "cpus", "mem", "init":
				clash = append(clash, "--"+f.Name)
			}
		})
		if len(clash) > 0 {
			fmt.Fprintf(stderr, "kiln run: %s: the snapshot given with --from fixes these\n", strings.Join(clash, ", "))
			return exitUsage
		}
	}
	if *from == "" {
		if err := checkShape(o.CPUs, o.MemoryMiB); err != nil {
			fmt.Fprintf(stderr, "kiln run: %v\n", err)
			return exitUsage
		}
	}
	argv := fs.Args()
	if err := sandbox.CheckInit(o.Init); err != nil {
		fmt.Fprintf(stderr, "kiln run: --init: %v\n", err)
		return exitUsage
	}
	if o.Init == sandbox.InitSystemd && o.Image == "" {
		fmt.Fprintln(stderr, "kiln run: --init systemd boots an image's /sbin/init: give --image")
		return exitUsage
	}
	if o.Image != "" && o.Disk != "" {
		fmt.Fprintln(stderr, "kiln run: --image and --disk both give the root: choose one")
		return exitUsage
	}
	if o.Image != "" && len(argv) == 0 {
		cmd, err := imageCommand(ctx, &o, *insecure, stderr)
		if err != nil {
			fmt.Fprintf(stderr, "kiln run: %v\n", err)
			return exitRunFailed
		}
		argv = cmd
	} else if o.Image != "" {
		if err := ensureImage(ctx, &o, *insecure, stderr); err != nil {
			fmt.Fprintf(stderr, "kiln run: %v\n", err)
			return exitRunFailed
		}
	}
	if len(argv) == 0 {
		fmt.Fprintln(stderr, "kiln run: no command given (kiln run [flags] -- CMD [ARG...])")
		return exitUsage
	}
	for _, kv := range env {
		if k, _, ok := strings.Cut(kv, "="); !ok || k == "" || strings.ContainsRune(kv, 0) {
			fmt.Fprintf(stderr, "kiln run: -e %q: want NAME=VALUE\n", kv)
			return exitUsage
		}
	}
	if *dir != "" && !strings.HasPrefix(*dir, "/") {
		fmt.Fprintf(stderr, "kiln run: -w %q: want an absolute path\n", *dir)
		return exitUsage
	}
	if err := sandbox.CheckHostname(o.Hostname); err != nil {
		fmt.Fprintf(stderr, "kiln run: --hostname: %v\n", err)
		return exitUsage
	}
	o.Logger = newLogger(stderr, *debug)
	o.BootTimeout = *bootTimeout
	if o.Process, err = vf.processOptions(pl, o.Logger); err != nil {
		fmt.Fprintf(stderr, "kiln run: %v\n", err)
		return exitRunFailed
	}
	if *console {
		o.Console = stderr
	}

	start := time.Now()
	var sb *sandbox.Sandbox
	if *from != "" {
		ro := sandbox.RestoreOptions{Console: o.Console, Logger: o.Logger, Timeout: *bootTimeout, Net: o.Net, Process: o.Process,
			Image: o.Image, Images: o.Images}
		fs.Visit(func(f *flag.Flag) {
			if f.Name == "hostname" {
				ro.Hostname = o.Hostname
			}
		})
		sb, err = sandbox.Restore(ctx, *from, ro)
	} else if o.Runtime, err = sandbox.FindRuntime(*kernel, *agent); err == nil {
		sb, err = sandbox.Start(ctx, o)
	}
	if err != nil {
		fmt.Fprintf(stderr, "kiln run: %v\n", err)
		return exitRunFailed
	}
	booted := time.Now()
	defer func() {
		if err := sb.Close(context.Background()); err != nil {
			fmt.Fprintf(stderr, "kiln run: %v\n", err)
		}
	}()
	eo := client.ExecOptions{Argv: argv, Dir: *dir, Timeout: *timeout, Stdout: stdout, Stderr: stderr}
	switch {
	case len(env) > 0 && o.Image != "":
		eo.Env = env // the guest merges them over the image's Env
	case len(env) > 0:
		eo.Env = withDefaults(env)
	}
	if *interactive {
		eo.Stdin = stdin
	}
	st, err := sb.Client().Exec(ctx, eo)
	done := time.Now()
	if *timing {
		fmt.Fprintf(stderr, "kiln run: agent ready in %v, command ran %v, total %v\n",
			booted.Sub(start).Round(time.Millisecond), done.Sub(booted).Round(time.Millisecond), done.Sub(start).Round(time.Millisecond))
	}
	if err != nil && poweredOff(sb) {
		// The command powered the guest off (poweroff, systemctl
		// poweroff) before its exit status came back: a clean end.
		fmt.Fprintln(stderr, "kiln run: the guest powered off")
		return 0
	}
	if err != nil {
		fmt.Fprintf(stderr, "kiln run: %v\n", err)
		switch status.Code(err) {
		case codes.NotFound:
			return exitNotFound
		case codes.InvalidArgument, codes.PermissionDenied:
			return exitCannotInvoke
		}
		return exitRunFailed
	}
	if st.TimedOut {
		fmt.Fprintf(stderr, "kiln run: %s killed after --timeout %v\n", argv[0], *timeout)
	}
	if *save != "" {
		saveStart := time.Now()
		if err := sb.Save(ctx, *save); err != nil {
			fmt.Fprintf(stderr, "kiln run: %v\n", err)
			return exitRunFailed
		}
		if *timing {
			fmt.Fprintf(stderr, "kiln run: saved to %s in %v\n", *save, time.Since(saveStart).Round(time.Millisecond))
		}
	}
	return st.ShellCode()
}

// poweredOff reports whether sb's VM stopped by powering off, waiting a
// little for it: an exec cut short by the guest's own power-off fails a
// moment before the VM's exit is seen.
func poweredOff(sb *sandbox.Sandbox) bool {
	select {
	case <-sb.Done():
	case <-time.After(5 * time.Second):
		return false
	}
	exit, err := sb.Exit()
	return err == nil && exit.Reason == vmm.ReasonPowerOff
}

// withDefaults returns env plus the agent's default environment for the
// names env does not set (an Exec with an environment gets only that).
func withDefaults(env []string) []string {
	out := append([]string(nil), env...)
	set := map[string]bool{}
	for _, kv := range env {
		k, _, _ := strings.Cut(kv, "=")
		set[k] = true
	}
	for _, kv := range []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root", "TERM=xterm"} {
		if k, _, _ := strings.Cut(kv, "="); !set[k] {
			out = append(out, kv)
		}
	}
	return out
}

// ensureImage makes sure o.Image is in o's images folder, pulling it when
// it is not (as docker run does), with progress on stderr.
func ensureImage(ctx context.Context, o *sandbox.Options, insecure bool, stderr io.Writer) error {
	_, err := imageDetails(ctx, o, insecure, stderr)
	return err
}

// imageCommand is ensureImage that also returns the image's default
// command: its entrypoint followed by its command.
func imageCommand(ctx context.Context, o *sandbox.Options, insecure bool, stderr io.Writer) ([]string, error) {
	d, err := imageDetails(ctx, o, insecure, stderr)
	if err != nil {
		return nil, err
	}
	argv := append(append([]string(nil), d.Config.Entrypoint...), d.Config.Cmd...)
	if len(argv) == 0 {
		return nil, fmt.Errorf("image %s has no entrypoint or command: give one (kiln run --image %s -- CMD)", o.Image, o.Image)
	}
	return argv, nil
}

func imageDetails(ctx context.Context, o *sandbox.Options, insecure bool, stderr io.Writer) (*image.Details, error) {
	if o.Images == "" {
		dir, err := sandbox.DefaultImagesDir()
		if err != nil {
			return nil, err
		}
		o.Images = dir
	}
	im, err := image.Open(o.Images, image.Options{Logger: o.Logger})
	if err != nil {
		return nil, err
	}
	d, err := im.Inspect(o.Image)
	if errors.Is(err, image.ErrNotFound) {
		if _, perr := im.Pull(ctx, o.Image, image.PullOptions{Insecure: insecure, Progress: image.NewProgress(stderr)}); perr != nil {
			return nil, perr
		}
		d, err = im.Inspect(o.Image)
	}
	return d, err
}
