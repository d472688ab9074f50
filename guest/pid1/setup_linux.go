package pid1

import (
	"fmt"
	"log/slog"
	"strings"
)

// DefaultPath is the PATH Setup gives the process when the kernel gave it
// none (the kernel starts init with only HOME and TERM).
const DefaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// Setup does process 1's chores, in order: MountBase, PATH (DefaultPath
// when unset), LoadModules(ModulesDir), Kiln's options from /proc/cmdline,
// the hostname (kiln.hostname), SwitchRoot when kiln.root names a
// device or SwitchRootImage (with the image config read first, returned in
// Options.Image) when it names an image root, and then, in the final root,
// when kiln.modules names the modules disk, MountModulesDisk and
// InstallModprobeHelper (whose failure is only logged). It returns the
// options; on error, those read so far. A nil log discards.
func (s *Sys) Setup(log *slog.Logger) (Options, error) {
	return s.setup(log, ModulesDir)
}

// setup is Setup loading the modules in modulesDir.
func (s *Sys) setup(log *slog.Logger, modulesDir string) (Options, error) {
	return s.setupWith(log, modulesDir, ImageModulesDir)
}

// setupWith is setup loading an image root's modules from imageModulesDir.
func (s *Sys) setupWith(log *slog.Logger, modulesDir, imageModulesDir string) (Options, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if err := s.MountBase(); err != nil {
		return Options{}, err
	}
	if _, ok := s.LookupEnv("PATH"); !ok {
		if err := s.Setenv("PATH", DefaultPath); err != nil {
			return Options{}, fmt.Errorf("setting PATH: %w", err)
		}
	}
	if err := s.LoadModules(modulesDir, log); err != nil {
		return Options{}, err
	}
	cmdline, err := s.ReadFile("/proc/cmdline")
	if err != nil {
		return Options{}, fmt.Errorf("reading the kernel command line: %w", err)
	}
	opts := ParseCmdline(string(cmdline))
	log.Debug("kernel command line", "cmdline", strings.TrimSpace(string(cmdline)), "options", fmt.Sprintf("%+v", opts))
	if opts.Hostname != "" {
		if err := s.SetHostname(opts.Hostname); err != nil {
			return opts, err
		}
	}
	// Programs expect localhost to work.
	if err := s.LinkUp("lo"); err != nil {
		log.Warn("loopback interface", "err", err)
	}
	if transport, tag := opts.ImageRoot(); tag != "" {
		cfg, err := s.ReadImageConfig()
		if err != nil {
			return opts, err
		}
		opts.Image = cfg
		if err := s.SwitchRootImage(transport, tag, opts.RootFlags, opts.OverlayMiB, imageModulesDir, log); err != nil {
			return opts, err
		}
		if cfg.WorkingDir != "" {
			// runc creates a missing working directory; so does Kiln.
			if err := s.MkdirAll(cfg.WorkingDir, 0o755); err != nil {
				log.Warn("creating the image's working directory", "dir", cfg.WorkingDir, "err", err)
			}
		}
		log.Info("switched root", "image", tag, "transport", transport)
	} else if opts.Root != "" {
		if err := s.SwitchRoot(opts.Root, opts.RootFSType, opts.RootFlags, opts.ReadOnly); err != nil {
			return opts, err
		}
		log.Info("switched root", "device", opts.Root, "fstype", opts.RootFSType, "readonly", opts.ReadOnly)
	}
	if opts.Modules != "" {
		if err := s.MountModulesDisk(opts.Modules, log); err != nil {
			return opts, err
		}
		// Without it the guest still works, as it did before: no
		// reason to stop the VM.
		if err := s.InstallModprobeHelper(log); err != nil {
			log.Error("the kernel's module autoloading stays without a helper", "err", err)
		}
	}
	return opts, nil
}
