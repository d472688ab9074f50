package main

import (
	"fmt"
	"log/slog"
	"os"

	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/sandbox"
)

// newDaemon is the real service: package daemon over VMM processes.
func newDaemon(cfg config, log *slog.Logger) (service, error) {
	fi, err := os.Stat(cfg.kiln)
	if err != nil {
		return nil, fmt.Errorf("the kiln binary that runs VMM processes: %w (use --kiln)", err)
	}
	if fi.IsDir() || fi.Mode().Perm()&0o111 == 0 {
		return nil, fmt.Errorf("the kiln binary %s is not an executable file (use --kiln)", cfg.kiln)
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
	srv, err := daemon.New(daemon.Config{
		StateDir:        cfg.stateDir,
		Runtime:         rt,
		Images:          images,
		ProcessCommand:  []string{cfg.kiln, "vmm"},
		MaxSandboxes:    cfg.maxSandboxes,
		MaxMemoryMiB:    cfg.maxMemoryMiB,
		DefaultLifetime: cfg.defaultLifetime,
		Logger:          log,
	})
	if err != nil {
		return nil, err
	}
	return srv, nil
}
