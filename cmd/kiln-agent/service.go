package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/kilnvm/kiln/guest/agent"
	"github.com/kilnvm/kiln/guest/agentpb"
	"github.com/kilnvm/kiln/guest/pid1"
	"github.com/mdlayher/vsock"
	"golang.org/x/sys/unix"
)

// execSystemd makes process 1 the root's systemd: it installs the agent as
// a service of the root and execs /sbin/init, returning only on failure
// (an image without /sbin/init, among others): main then says why on the
// console and powers off, so the host's start fails at once with it.
func execSystemd(log *slog.Logger, opts pid1.Options) error {
	if opts.ImageTag() == "" {
		return errors.New("kiln.init=systemd needs an image root (kiln.root=erofs:SERIAL or 9p:TAG)")
	}
	if err := pid1.InstallAgentService("/", "/proc/self/exe", opts.Image, opts.Hostname); err != nil {
		return err
	}
	log.Info("handing process 1 to systemd", "init", pid1.SystemInit)
	if err := unix.Exec(pid1.SystemInit, []string{pid1.SystemInit}, os.Environ()); err != nil {
		return fmt.Errorf("init systemd: exec %s: %w", pid1.SystemInit, err)
	}
	return nil
}

// runService serves the agent API as the systemd service execSystemd
// installed, until ctx is done (systemd's SIGTERM) or serving fails.
func runService(ctx context.Context, log *slog.Logger, level *slog.LevelVar) error {
	if b, err := os.ReadFile("/proc/cmdline"); err == nil && pid1.ParseCmdline(string(b)).Debug {
		level.Set(slog.LevelDebug)
	}
	c, err := pid1.ReadAgentServiceConfig()
	if err != nil {
		return err
	}
	defaults := &agent.ExecDefaults{Env: c.Env, Cwd: c.WorkingDir, User: c.User}
	if err := defaults.Validate(); err != nil {
		return err
	}
	cgroupRoot, err := delegatedCgroup(pid1.CgroupRoot)
	if err != nil {
		// Execs still run, without the sandbox's limits.
		log.Warn("no delegated cgroup: execs run in the agent's", "err", err)
		cgroupRoot = ""
	}
	servePorts(ctx, log)
	ln, err := vsock.Listen(agentpb.Port, nil)
	if err != nil {
		return fmt.Errorf("listening on vsock port %d: %w", agentpb.Port, err)
	}
	srv := agent.NewServer(agent.Config{Logger: log, WritableDir: pid1.ImageRWView, PowerOff: systemdPowerOff, CgroupRoot: cgroupRoot,
		Defaults: defaults, ProtectFromOOM: true})
	log.Info("kiln-agent serving as a systemd service", "vsock_port", agentpb.Port, "cgroup", cgroupRoot)
	if err := srv.Serve(ctx, ln); err != nil && ctx.Err() == nil {
		return fmt.Errorf("serving on vsock port %d: %w", agentpb.Port, err)
	}
	return nil
}

// agentSubgroup is the cgroup, below the service's, the agent moves itself
// to: cgroup v2 lets a cgroup hand controllers to its children only when
// it holds no process itself.
const agentSubgroup = "agent"

// delegatedCgroup moves the agent into agentSubgroup of its own cgroup
// (the one systemd delegated to the service, Delegate=yes) and returns the
// service's cgroup, below which the agent makes its exec cgroups.
func delegatedCgroup(mount string) (string, error) {
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return "", fmt.Errorf("reading the agent's cgroup: %w", err)
	}
	own, err := unifiedCgroup(string(b))
	if err != nil {
		return "", err
	}
	dir := filepath.Join(mount, own)
	sub := filepath.Join(dir, agentSubgroup)
	if err := os.Mkdir(sub, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return "", fmt.Errorf("creating cgroup %s: %w", sub, err)
	}
	if err := os.WriteFile(filepath.Join(sub, "cgroup.procs"), []byte("0\n"), 0); err != nil {
		return "", fmt.Errorf("moving the agent to cgroup %s: %w", sub, err)
	}
	return dir, nil
}

// unifiedCgroup returns the cgroup v2 path in a /proc/self/cgroup file
// (its "0::PATH" line).
func unifiedCgroup(procCgroup string) (string, error) {
	for line := range strings.SplitSeq(procCgroup, "\n") {
		if p, ok := strings.CutPrefix(line, "0::"); ok && strings.HasPrefix(p, "/") {
			return filepath.Clean(p), nil
		}
	}
	return "", errors.New("the agent is in no cgroup v2 cgroup (no 0:: line in /proc/self/cgroup)")
}

// sigPowerOff is systemd's SIGRTMIN+4 (glibc's SIGRTMIN is 34): power off.
const sigPowerOff = syscall.Signal(34 + 4)

// systemdPowerOff asks systemd to power the machine off, stopping its
// units first: systemctl, or its signal when systemctl cannot run.
func systemdPowerOff() error {
	out, err := exec.Command("systemctl", "--no-block", "poweroff").CombinedOutput()
	if err == nil {
		return nil
	}
	if serr := unix.Kill(1, sigPowerOff); serr != nil {
		return fmt.Errorf("powering off: systemctl poweroff: %v (%s); signalling systemd: %w", err, strings.TrimSpace(string(out)), serr)
	}
	return nil
}
