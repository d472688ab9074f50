package daemon

// This file is the server's configuration and its defaults.

import (
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"time"

	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/cgroup"
	"github.com/kilnvm/kiln/limits"
	"github.com/kilnvm/kiln/volume"
)

// Config configures a Server.
type Config struct {
	// StateDir holds the server's records and the sandboxes' folders
	// (required; kilnd uses /var/lib/kiln).
	StateDir string
	// Backend runs the sandboxes (required): kilnd's is a
	// vmmbackend.Backend, VMM processes over StateDir.
	Backend Backend

	// Defaults of a CreateSandboxRequest's zero fields (limits.DefaultCPUs
	// and DefaultMemoryMiB: 1 vCPU, 512 MiB when zero), and its lifetime
	// (no limit when zero).
	DefaultCPUs      uint32
	DefaultMemoryMiB uint32
	DefaultLifetime  time.Duration

	// Host limits: at most MaxSandboxes live sandboxes (0: 1024) with at
	// most MaxMemoryMiB of guest memory among them (0: the host's memory).
	// HostMemoryMiB is the host's memory (0: /proc/meminfo's MemTotal);
	// HostCPUs its CPUs (0: runtime.NumCPU).
	MaxSandboxes  int
	MaxMemoryMiB  uint64
	HostMemoryMiB uint64
	HostCPUs      int

	// MaxStarting is how many sandboxes start at once (boots, restores,
	// fork children, pool refills); more wait their turn, so that a burst
	// of creates does not thrash the host (0: 4 per host CPU).
	MaxStarting int
	// BootTimeout bounds a sandbox's start from when it has a start slot
	// (the wait for one does not count) (0: 5 minutes).
	BootTimeout time.Duration
	// TemplateTimeout bounds a template's build: its boot, setup and
	// snapshot (0: 30 minutes).
	TemplateTimeout time.Duration
	// KeepEnded is how many ended sandboxes GetSandbox still describes
	// (0: 4096); older ones are forgotten.
	KeepEnded int

	// Network, when set, gives every sandbox a network of its own (a
	// network namespace with a tap, an address, NAT and an egress policy:
	// package hostnet through HostNetwork); nil: sandboxes have no
	// network card, and a request's egress policy is refused.
	Network Network
	// DefaultEgress is the egress policy of a sandbox whose request gives
	// none (the zero value: allow-all).
	DefaultEgress EgressPolicy

	// Host cgroups and memory admission (daemon/cgroups.go). Cgroups,
	// when set, gives each sandbox's VMM process a cgroup of its own
	// with cpu.max from its vCPUs, memory.max from its memory plus
	// VMMOverheadMiB (0: 64) and pids.max PidsMax (0: 1024); nil: no
	// cgroups. The overhead is the VMM process's own memory beyond the
	// guest's RAM (counted in the guest's MiB, copy-on-write copies
	// included): its Go heap and stacks (~10 MiB in L1 once a boot's
	// kernel and initrd are freed), page tables and KVM's kernel memory
	// (~3 MiB), with slack; what sandboxes share (the kernel, initrd and
	// templates' memory files) the server reads into the page cache
	// first, charged to its own cgroup. Whether or not they are on, a create, fork or pool fill
	// that would commit more than MemoryOvercommit (0: 1.0) × the host's
	// memory, counting each sandbox's guest memory plus VMMOverheadMiB,
	// is refused (pools wait). SandboxIO, when set, caps each sandbox's
	// VMM process on those block devices (io.max: the disks of StateDir
	// and Images, say).
	Cgroups          Cgroups
	VMMOverheadMiB   uint64
	PidsMax          int
	MemoryOvercommit float64
	SandboxIO        []cgroup.IOLimit

	// Volumes (volumes.go): a CreateVolumeRequest without a size gets
	// DefaultVolumeMiB (0: 1024), one may have at most MaxVolumeMiB (0:
	// 64 GiB), and the host at most MaxVolumeCount volumes (0: 4096).
	// A volume's image is sparse: the host's disk pays for what guests
	// write.
	DefaultVolumeMiB uint32
	MaxVolumeMiB     uint32
	MaxVolumeCount   int

	// SampleInterval is how often each running sandbox's CPU, memory
	// and disk are sampled for GetSandboxMetrics (0: 5 s; negative:
	// never, only at the call).
	SampleInterval time.Duration

	Logger *slog.Logger
	// Clock is the server's time; nil: the real one.
	Clock Clock
}

// setDefaults checks cfg and fills its zero fields with their defaults.
func (cfg *Config) setDefaults() error {
	if cfg.StateDir == "" {
		return errors.New("daemon: no state folder (Config.StateDir)")
	}
	abs, err := filepath.Abs(cfg.StateDir)
	if err != nil {
		return fmt.Errorf("daemon: state folder: %w", err)
	}
	cfg.StateDir = abs
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Clock == nil {
		cfg.Clock = realClock{}
	}
	if cfg.DefaultCPUs == 0 {
		cfg.DefaultCPUs = limits.DefaultCPUs
	}
	if cfg.DefaultMemoryMiB == 0 {
		cfg.DefaultMemoryMiB = limits.DefaultMemoryMiB
	}
	if cfg.MaxSandboxes == 0 {
		cfg.MaxSandboxes = 1024
	}
	if cfg.HostMemoryMiB == 0 {
		if cfg.HostMemoryMiB = hostMemoryMiB(); cfg.HostMemoryMiB == 0 {
			cfg.HostMemoryMiB = 1 << 40 // unknown: no limit of its own
		}
	}
	if cfg.MaxMemoryMiB == 0 {
		cfg.MaxMemoryMiB = cfg.HostMemoryMiB
	}
	if cfg.HostCPUs == 0 {
		cfg.HostCPUs = hostCPUs()
	}
	if cfg.MaxStarting == 0 {
		cfg.MaxStarting = 4 * cfg.HostCPUs
	}
	if cfg.BootTimeout == 0 {
		cfg.BootTimeout = 5 * time.Minute
	}
	if cfg.SampleInterval == 0 {
		cfg.SampleInterval = defaultSampleInterval
	}
	if cfg.KeepEnded == 0 {
		cfg.KeepEnded = 4096
	}
	if cfg.MaxVolumeMiB == 0 {
		cfg.MaxVolumeMiB = 64 << 10
	}
	if cfg.DefaultVolumeMiB == 0 {
		cfg.DefaultVolumeMiB = min(1024, cfg.MaxVolumeMiB)
	}
	if cfg.MaxVolumeCount == 0 {
		cfg.MaxVolumeCount = 4096
	}
	if cfg.MaxVolumeMiB < volume.MinMiB || cfg.MaxVolumeMiB > volume.MaxMiB || cfg.DefaultVolumeMiB < volume.MinMiB || cfg.DefaultVolumeMiB > cfg.MaxVolumeMiB {
		return fmt.Errorf("daemon: volume sizes: default %d MiB, limit %d MiB: want %d <= default <= limit <= %d", cfg.DefaultVolumeMiB, cfg.MaxVolumeMiB, volume.MinMiB, volume.MaxMiB)
	}
	if err := cfg.setCgroupDefaults(); err != nil {
		return err
	}
	if cfg.Backend == nil {
		return errors.New("daemon: no backend (Config.Backend: kilnd's is a vmmbackend.Backend)")
	}
	if cfg.TemplateTimeout == 0 {
		cfg.TemplateTimeout = 30 * time.Minute
	}
	if err := checkEgress("default egress policy", cfg.DefaultEgress); err != nil {
		return fmt.Errorf("daemon: %s", status.Convert(err).Message())
	}
	return nil
}
