package shim

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/BurntSushi/toml"

	"github.com/kilnvm/kiln/guestkernel"
	"github.com/kilnvm/kiln/sandbox"
)

// ConfigEnv names the shim's configuration file; DefaultConfigPath is used
// when it is unset. containerd passes its own environment to the shims it
// starts.
const (
	ConfigEnv         = "KILN_SHIM_CONFIG"
	DefaultConfigPath = "/etc/kiln/shim.toml"
)

// Config is the shim's configuration file (TOML).
type Config struct {
	// Kernel is the guest kernel; empty: the cached Debian kernel (make
	// kernel).
	Kernel string `toml:"kernel"`
	// Agent is the static kiln-agent binary; empty: $KILN_AGENT, else
	// kiln-agent beside the shim's executable.
	Agent string `toml:"agent"`
	// Initrd is a prebuilt agent initramfs for Kernel, instead of Agent.
	Initrd string `toml:"initrd"`
	// Cache is Kiln's cache folder (as $KILN_CACHE is for the kiln
	// command): the current kernel is taken from its kernel/ when Kernel
	// is empty, and agent initramfs images are built into its
	// initramfs/. Empty: $KILN_CACHE, else ~/.cache/kiln. A node's
	// installer (packaging/kubernetes) sets /var/lib/kiln.
	Cache string `toml:"cache"`
	// CPUs and MemoryMiB size a VM whose container asks for nothing
	// (sandbox.DefaultCPUs and DefaultMemoryMiB, 1 and 512, when zero).
	CPUs      int `toml:"cpus"`
	MemoryMiB int `toml:"memory_mib"`
	// BootTimeout bounds a VM's boot ("2m"; 5 minutes when empty:
	// emulated KVM is slow).
	BootTimeout string `toml:"boot_timeout"`
}

const maxConfigBytes = 1 << 20

// LoadConfig reads the file $KILN_SHIM_CONFIG names, else
// DefaultConfigPath; a missing default file is the zero Config.
func LoadConfig() (Config, error) {
	p, explicit := os.LookupEnv(ConfigEnv)
	if !explicit || p == "" {
		p = DefaultConfigPath
	}
	b, err := os.ReadFile(p)
	if errors.Is(err, fs.ErrNotExist) && !explicit {
		return Config{}.withDefaults()
	}
	if err != nil {
		return Config{}, fmt.Errorf("shim config: %w", err)
	}
	return ParseConfig(p, b)
}

// ParseConfig parses a configuration file's bytes (name is for errors).
func ParseConfig(name string, b []byte) (Config, error) {
	if len(b) > maxConfigBytes {
		return Config{}, fmt.Errorf("shim config %s: %d bytes, more than %d", name, len(b), maxConfigBytes)
	}
	var c Config
	md, err := toml.NewDecoder(bytes.NewReader(b)).Decode(&c)
	if err != nil {
		return Config{}, fmt.Errorf("shim config %s: %w", name, err)
	}
	if und := md.Undecoded(); len(und) > 0 {
		return Config{}, fmt.Errorf("shim config %s: unknown key %q (want kernel, agent, initrd, cache, cpus, memory_mib, boot_timeout)", name, und[0].String())
	}
	c, err = c.withDefaults()
	if err != nil {
		return Config{}, fmt.Errorf("shim config %s: %w", name, err)
	}
	return c, nil
}

func (c Config) withDefaults() (Config, error) {
	if c.CPUs == 0 {
		c.CPUs = sandbox.DefaultCPUs
	}
	if c.MemoryMiB == 0 {
		c.MemoryMiB = sandbox.DefaultMemoryMiB
	}
	if err := sandbox.CheckCPUs(c.CPUs); err != nil {
		return c, fmt.Errorf("cpus: %w", err)
	}
	if err := sandbox.CheckMemory(c.MemoryMiB); err != nil {
		return c, fmt.Errorf("memory_mib: %w", err)
	}
	if c.Cache != "" && !filepath.IsAbs(c.Cache) {
		return c, fmt.Errorf("cache = %q: want an absolute path", c.Cache)
	}
	if c.BootTimeout != "" {
		d, err := time.ParseDuration(c.BootTimeout)
		if err != nil || d <= 0 {
			return c, fmt.Errorf("boot_timeout = %q: want a positive duration (\"2m\")", c.BootTimeout)
		}
	}
	return c, nil
}

func (c Config) bootTimeout() time.Duration {
	if d, err := time.ParseDuration(c.BootTimeout); err == nil && d > 0 {
		return d
	}
	return 5 * time.Minute
}

// Runtime resolves the kernel and agent initramfs VMs boot: as the kiln
// command does (sandbox.FindRuntime), or Initrd prebuilt.
func (c Config) Runtime() (sandbox.Runtime, error) {
	if c.Initrd == "" && c.Cache == "" {
		return sandbox.FindRuntime(c.Kernel, c.Agent)
	}
	rc := sandbox.RuntimeConfig{KernelPath: c.Kernel, Initrd: c.Initrd}
	if c.Kernel == "" {
		find := guestkernel.Find
		if c.Cache != "" {
			find = func() (*guestkernel.Kernel, error) { return guestkernel.FindIn(c.Cache) }
		}
		k, err := find()
		if err != nil {
			return sandbox.Runtime{}, fmt.Errorf("no kernel configured and %w", err)
		}
		rc.Kernel = k
	}
	if c.Initrd == "" {
		rc.Agent = c.Agent
		if rc.Agent == "" {
			var err error
			if rc.Agent, err = sandbox.FindAgent(); err != nil {
				return sandbox.Runtime{}, err
			}
		}
		rc.CacheDir = filepath.Join(c.Cache, "initramfs")
	}
	return sandbox.NewRuntime(rc)
}
