// Command kiln-agent is Kiln's guest agent. It runs as /init, process 1 of
// the sandbox VM: it mounts the base filesystems, loads the kernel modules
// its initramfs carries, applies Kiln's kernel command line parameters
// (hostname, root device) and then serves the agent API on vsock port
// agentpb.Port. As process 1 it never exits: when it fails or stops it
// powers the VM off. Run as any other process it only serves, and exits.
//
// With kiln.init=systemd on an image root, process 1 installs the agent as
// a systemd service of the root (pid1.InstallAgentService) and execs the
// root's /sbin/init; systemd then starts the agent with --service: it
// serves in the cgroup systemd delegates to it, reaps only its own
// children, and powers off by asking systemd to.
//
// It is a multi-call binary: invoked as modprobe (argv[0]'s base name,
// the way the kernel runs the helper pid1.InstallModprobeHelper binds
// it to at pid1.ModprobeHelper) it is Kiln's modprobe (guest/modprobe),
// which loads a module or alias from the kernel's modules disk and
// exits; nothing of the agent runs then.
//
// Build it static: CGO_ENABLED=0 go build ./cmd/kiln-agent.
package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/kilnvm/kiln/guest/agent"
	"github.com/kilnvm/kiln/guest/agentpb"
	"github.com/kilnvm/kiln/guest/modprobe"
	"github.com/kilnvm/kiln/guest/pid1"
	"github.com/mdlayher/vsock"
	"golang.org/x/sys/unix"
)

func main() {
	if modprobe.IsInvokedAs(os.Args) {
		os.Exit(modprobe.Main(os.Args[1:], os.Stdout, os.Stderr))
	}
	agent.MaybeRunTrampoline()

	isInit := os.Getpid() == 1
	service := !isInit && len(os.Args) == 2 && os.Args[1] == pid1.AgentServiceArg
	level := new(slog.LevelVar)
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()

	var err error
	if service {
		err = runService(ctx, log, level)
	} else {
		err = run(ctx, log, level, isInit)
	}
	if !isInit {
		if err != nil {
			fmt.Fprintf(os.Stderr, "kiln-agent: %v\n", err)
			os.Exit(1)
		}
		return
	}
	// Process 1 must not exit: the kernel panics when it does.
	if err == nil {
		err = errors.New("agent stopped")
	}
	fmt.Fprintf(os.Stderr, "kiln-agent: %v: powering off\n", err)
	if perr := pid1.PowerOff(); perr != nil {
		panic(fmt.Sprintf("kiln-agent: %v; %v", err, perr))
	}
	select {} // the power-off takes effect
}

// run does process 1's chores when isInit, then serves the agent API until
// ctx is done or serving fails.
func run(ctx context.Context, log *slog.Logger, level *slog.LevelVar, isInit bool) error {
	var defaults *agent.ExecDefaults
	if isInit {
		opts, err := pid1.Setup(log)
		consoleStdio()
		if err != nil {
			return fmt.Errorf("setting up the VM: %w", err)
		}
		if opts.Debug {
			level.Set(slog.LevelDebug)
		}
		if err := pid1.CheckInit(opts.Init); err != nil {
			return fmt.Errorf("kiln.init: %w", err)
		}
		if opts.Init == pid1.InitSystemd {
			return execSystemd(log, opts)
		}
		if c := opts.Image; c != nil {
			defaults = &agent.ExecDefaults{Env: c.Env, Cwd: c.WorkingDir, User: c.User}
			if err := defaults.Validate(); err != nil {
				return err
			}
		}
	}
	servePorts(ctx, log)
	ln, err := vsock.Listen(agentpb.Port, nil)
	if err != nil {
		return fmt.Errorf("listening on vsock port %d: %w", agentpb.Port, err)
	}
	srv := agent.NewServer(agent.Config{Logger: log, WritableDir: pid1.ImageRWView, PowerOff: pid1.PowerOff, CgroupRoot: pid1.CgroupRoot, Defaults: defaults})
	log.Info("kiln-agent serving", "vsock_port", agentpb.Port)
	if err := srv.Serve(ctx, ln); err != nil && ctx.Err() == nil {
		return fmt.Errorf("serving on vsock port %d: %w", agentpb.Port, err)
	}
	return nil
}

// consoleStdio makes /dev/console the standard input, output and error when
// the kernel could not give init a console (its initramfs had no
// /dev/console); MountBase's devtmpfs has one.
func consoleStdio() {
	if _, err := unix.FcntlInt(2, unix.F_GETFD, 0); err == nil {
		return
	}
	fd, err := unix.Open("/dev/console", unix.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		return
	}
	for target := range 3 {
		if fd != target {
			unix.Dup3(fd, target, 0)
		}
	}
	if fd > 2 {
		unix.Close(fd)
	}
}

// servePorts forwards connections to the guest's ports (vsock port
// agentpb.ForwardPort) while ctx lasts. A sandbox whose agent cannot
// listen there still serves the agent's API: its ports are unreachable,
// which the host's dial reports.
func servePorts(ctx context.Context, log *slog.Logger) {
	ln, err := vsock.Listen(agentpb.ForwardPort, nil)
	if err != nil {
		log.Error("not forwarding the guest's ports", "vsock_port", agentpb.ForwardPort, "err", err)
		return
	}
	go func() {
		if err := agent.ServePorts(ctx, ln, log); err != nil {
			log.Error("forwarding the guest's ports", "err", err)
		}
	}()
}
