package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/kilnvm/kiln/guestkernel"
)

// Runtime is what a host's sandboxes boot: a kernel and the agent's
// initramfs for it. It is resolved once, by the CLI or the daemon (with
// NewRuntime from paths it was given, or FindRuntime for this machine's
// defaults), and handed to every Start: the package itself reads no
// environment variable and searches no folder.
type Runtime struct {
	Kernel string `json:"kernel"` // an ELF vmlinux (PVH entry) or a bzImage
	Initrd string `json:"initrd"` // the agent's initramfs for that kernel
	// Modules is the kernel's modules disk (guestkernel's ModulesDisk: a
	// read-only ext4 image of its lib/modules/<release> tree), attached
	// read-only to every VM as device ModulesDevice and mounted by the
	// agent at /lib/modules/<release> of the guest's root; "" for none.
	Modules string `json:"modules,omitempty"`
}

// RuntimeConfig says what a Runtime is made of.
type RuntimeConfig struct {
	// Kernel is a kernel with its modules (guestkernel.Find): the
	// initramfs carries the agent's modules of it, and its vmlinux boots
	// when it has one. KernelPath is the alternative: a kernel with every
	// driver the agent needs built in.
	Kernel     *guestkernel.Kernel
	KernelPath string
	// Agent is the static kiln-agent binary. Initrd, when set, is a
	// prebuilt agent initramfs instead.
	Agent  string
	Initrd string
	// CacheDir keeps built initramfs images (AgentInitrd); a folder under
	// the temporary directory when empty.
	CacheDir string
	// NoModules leaves Kernel's modules disk out (Runtime.Modules): the
	// guest then has only the agent's modules. By default a Kernel with a
	// modules tree gets its disk, built once (ModulesCache).
	NoModules bool
	// ModulesCache keeps the built modules disk; empty: <the kernel's
	// cache>/modules (guestkernel's ModulesDisk), or a folder under the
	// temporary directory when that is read-only.
	ModulesCache string
}

// NewRuntime makes a Runtime from cfg, building (or finding cached) the
// agent's initramfs when cfg gives none.
func NewRuntime(cfg RuntimeConfig) (Runtime, error) {
	var rt Runtime
	switch {
	case cfg.Kernel != nil && cfg.KernelPath != "":
		return rt, errors.New("sandbox: runtime: a kernel and a kernel path: give one")
	case cfg.Kernel != nil:
		rt.Kernel = cfg.Kernel.Image
		if cfg.Kernel.Vmlinux != "" {
			rt.Kernel = cfg.Kernel.Vmlinux
		}
	case cfg.KernelPath != "":
		rt.Kernel = cfg.KernelPath
	default:
		return rt, errors.New("sandbox: runtime: no kernel")
	}
	if _, err := os.Stat(rt.Kernel); err != nil {
		return rt, fmt.Errorf("sandbox: runtime: kernel: %w", err)
	}
	if cfg.Kernel != nil && cfg.Kernel.ModulesDir != "" && !cfg.NoModules {
		var err error
		if rt.Modules, err = cfg.Kernel.ModulesDisk(context.Background(), cfg.ModulesCache); err != nil {
			return rt, fmt.Errorf("sandbox: runtime: %w (RuntimeConfig.NoModules goes without it)", err)
		}
	}
	if rt.Initrd = cfg.Initrd; rt.Initrd != "" {
		if _, err := os.Stat(rt.Initrd); err != nil {
			return rt, fmt.Errorf("sandbox: runtime: initramfs: %w", err)
		}
		return rt, nil
	}
	if cfg.Agent == "" {
		return rt, errors.New("sandbox: runtime: no agent binary and no initramfs")
	}
	var err error
	if rt.Initrd, err = AgentInitrd(cfg.Agent, cfg.Kernel, cfg.CacheDir); err != nil {
		return rt, err
	}
	return rt, nil
}

// FindRuntime resolves this machine's defaults, as the kiln command does:
// kernel, when not empty, else the cached Debian kernel (guestkernel.Find:
// make kernel); agent, when not empty, else FindAgent ($KILN_AGENT, or
// kiln-agent beside the running executable); initramfs images cached
// under the kernel cache, and the cached kernel's modules disk beside them
// (<cache>/modules).
func FindRuntime(kernel, agent string) (Runtime, error) {
	cfg := RuntimeConfig{KernelPath: kernel, Agent: agent}
	if cache, err := guestkernel.CacheDir(); err == nil {
		cfg.CacheDir = filepath.Join(cache, "initramfs")
	}
	if kernel == "" {
		k, err := guestkernel.Find()
		if err != nil {
			return Runtime{}, fmt.Errorf("sandbox: no kernel given and %w", err)
		}
		cfg.Kernel = k
	}
	if cfg.Agent == "" {
		var err error
		if cfg.Agent, err = FindAgent(); err != nil {
			return Runtime{}, err
		}
	}
	return NewRuntime(cfg)
}
