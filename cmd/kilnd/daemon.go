package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/kilnvm/kiln/cgroup"
	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/daemon/vmmbackend"
	"github.com/kilnvm/kiln/hostnet"
	"github.com/kilnvm/kiln/jail"
	"github.com/kilnvm/kiln/sandbox"
)

// kilndService is the daemon with what kilnd made for it: the host's
// sandbox networks (hostnet), closed after it.
type kilndService struct {
	*daemon.Server
	net *hostnet.Manager
}

// Close closes the daemon, then lets go of the network manager's DNS
// proxies; sandboxes and their networks stay for the next kilnd.
func (k *kilndService) Close(ctx context.Context) error {
	err := k.Server.Close(ctx)
	if k.net != nil {
		err = errors.Join(err, k.net.Close())
	}
	return err
}

// vmmCommand is the command every sandbox's VMM process runs: [--vmm],
// else [sandbox.FindVMM's]; with the deprecated --kiln, [kiln, "vmm"]
// (kiln's hidden alias of kiln-vmm). Its binary must be an executable
// file.
func (c config) vmmCommand() ([]string, error) {
	cmd, flag := []string{c.vmm}, "--vmm"
	switch {
	case c.kiln != "":
		cmd, flag = []string{c.kiln, "vmm"}, "--kiln"
	case c.vmm == "":
		p, err := sandbox.FindVMM()
		if err != nil {
			return nil, fmt.Errorf("the VMM binary: %w (or use --vmm)", err)
		}
		cmd = []string{p}
	}
	fi, err := os.Stat(cmd[0])
	if err != nil {
		return nil, fmt.Errorf("the VMM binary (%s): %w", flag, err)
	}
	if fi.IsDir() || fi.Mode().Perm()&0o111 == 0 {
		return nil, fmt.Errorf("the VMM binary %s (%s) is not an executable file", cmd[0], flag)
	}
	return cmd, nil
}

// newDaemon is the real service: package daemon over VMM processes.
func newDaemon(cfg config, log *slog.Logger) (service, error) {
	vmmCmd, err := cfg.vmmCommand()
	if err != nil {
		return nil, err
	}
	if cfg.kiln != "" {
		log.Warn("--kiln is deprecated: give --vmm the kiln-vmm binary (make build and make install put it beside kilnd)", "kiln", cfg.kiln)
	}
	rt, err := sandbox.FindRuntime(cfg.kernel, cfg.agent)
	if err != nil {
		return nil, fmt.Errorf("finding the kernel and agent: %w", err)
	}
	images := cfg.images
	if images == "" {
		if images, err = sandbox.DefaultImagesDir(); err != nil {
			return nil, fmt.Errorf("the images folder: %w (use --images)", err)
		}
	}
	bopts := vmmbackend.Options{StateDir: cfg.stateDir, Runtime: rt, Images: images, Command: vmmCmd, Logger: log}
	dcfg := daemon.Config{
		StateDir:        cfg.stateDir,
		MaxSandboxes:    cfg.maxSandboxes,
		MaxMemoryMiB:    cfg.maxMemoryMiB,
		DefaultLifetime: cfg.defaultLifetime,
		Logger:          log,

		VMMOverheadMiB:   cfg.vmmOverheadMiB,
		PidsMax:          int(cfg.pidsMax),
		MemoryOvercommit: cfg.memoryOvercommit,
		SandboxIO:        cfg.sandboxIO,
	}
	jailed, why, err := resolveJail(cfg.jail, os.Geteuid(), vmmCmd[0])
	if err != nil {
		return nil, err
	}
	if !jailed && cfg.jail == jail.ModeAuto {
		log.Warn("VMM processes are not jailed", "why", why, "hint", "--jail=true requires the jail, --jail=false turns it off")
	}
	if jailed {
		ids, err := jail.NewIDs(cfg.jailIDs, jail.FirstID, jail.IDCount)
		if err != nil {
			return nil, fmt.Errorf("--jail: %w (use --jail-ids)", err)
		}
		bopts.Jail = &sandbox.JailOptions{IDs: ids}
		log.Info("VMM processes are jailed", "ids", fmt.Sprintf("%d-%d", jail.FirstID, jail.FirstID+jail.IDCount-1), "locks", ids.Dir())
	}
	// The daemon runs its sandboxes in VMM processes: the backend below
	// its seam.
	if dcfg.Backend, err = vmmbackend.New(bopts); err != nil {
		return nil, err
	}
	if cfg.cgroupRoot != cgroupNone {
		cg, err := cgroup.OpenOptions(cgroup.Options{Root: cfg.cgroupRoot, Logger: log})
		if err != nil {
			where := "kilnd's own cgroup"
			if cfg.cgroupRoot != "" {
				where = cfg.cgroupRoot
			}
			return nil, fmt.Errorf("per-sandbox cgroups under %s: %w (kilnd needs cgroup v2 with a delegated subtree: run it under systemd with Delegate=yes, give --cgroup-root, or --cgroup-root none to run without limits)", where, err)
		}
		dcfg.Cgroups = cg
	}
	svc := &kilndService{}
	if cfg.netPool.IsValid() {
		mode, err := daemon.ParseEgressMode(cfg.egressDefault)
		if err != nil {
			return nil, fmt.Errorf("--egress-default: %w", err)
		}
		dcfg.DefaultEgress = daemon.EgressPolicy{Mode: mode}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		svc.net, err = hostnet.New(ctx, hostnet.Config{
			Pool:    cfg.netPool,
			Uplink:  cfg.netUplink,
			DNS:     cfg.netDNS,
			Refused: cfg.netRefused,
			Dir:     filepath.Join(cfg.stateDir, "net"),
			Logger:  log,
		})
		cancel()
		if err != nil {
			return nil, fmt.Errorf("sandbox networks (--net-pool %s): %w", cfg.netPool, err)
		}
		dcfg.Network = daemon.HostNetwork(svc.net)
	}
	srv, err := daemon.New(dcfg)
	if err != nil {
		if svc.net != nil {
			svc.net.Close()
		}
		return nil, err
	}
	svc.Server = srv
	return svc, nil
}
