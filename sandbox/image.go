package sandbox

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/kilnvm/kiln/guestkernel"
	"github.com/kilnvm/kiln/initramfs"
)

// AgentEnv names the environment variable FindAgent (and so FindRuntime)
// reads first.
const AgentEnv = "KILN_AGENT"

// FindAgent returns the kiln-agent binary to put in sandboxes: $KILN_AGENT,
// else kiln-agent beside the running executable (make build puts both in
// bin/).
func FindAgent() (string, error) {
	if p := os.Getenv(AgentEnv); p != "" {
		if _, err := os.Stat(p); err != nil {
			return "", fmt.Errorf("sandbox: $%s: %w", AgentEnv, err)
		}
		return p, nil
	}
	exe, err := os.Executable()
	if err != nil {
		return "", fmt.Errorf("sandbox: finding kiln-agent: %w", err)
	}
	p := filepath.Join(filepath.Dir(exe), "kiln-agent")
	if _, err := os.Stat(p); err != nil {
		return "", fmt.Errorf("sandbox: no kiln-agent beside %s (run make build, or set $%s): %w", exe, AgentEnv, err)
	}
	return p, nil
}

// AgentInitrd returns the path of an agent initramfs for kernel k (nil: a
// kernel without modules to load): agent as /init, busybox, and k's
// default agent modules. Images are cached in cacheDir
// (<cacheDir>/<hash>.cpio; a folder under the temporary directory when
// empty or not writable), keyed by the agent's bytes, the kernel version
// and the module list, so the same inputs build once.
func AgentInitrd(agent string, k *guestkernel.Kernel, cacheDir string) (string, error) {
	img := initramfs.AgentImage{Agent: agent, Kernel: k, Busybox: true}
	key, err := imageKey(img)
	if err != nil {
		return "", err
	}
	// The kernel cache may be read-only (the test harness's L1 VM sees it
	// so): then a folder under the temporary directory serves.
	dirs := []string{filepath.Join(os.TempDir(), "kiln-initramfs")}
	if cacheDir != "" {
		dirs = append([]string{cacheDir}, dirs...)
	}
	for _, dir := range dirs {
		p := filepath.Join(dir, key+".cpio")
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() {
			return p, nil
		}
	}
	b, err := img.Build()
	if err != nil {
		return "", fmt.Errorf("sandbox: agent initramfs: %w", err)
	}
	var tmp *os.File
	var dir string
	for _, dir = range dirs {
		if err = os.MkdirAll(dir, 0o755); err == nil {
			if tmp, err = os.CreateTemp(dir, key+".tmp-*"); err == nil {
				break
			}
		}
	}
	if tmp == nil {
		return "", fmt.Errorf("sandbox: no folder to keep the agent initramfs in: %w", err)
	}
	p := filepath.Join(dir, key+".cpio")
	defer os.Remove(tmp.Name())
	if _, err := b.WriteTo(tmp); err != nil {
		tmp.Close()
		return "", fmt.Errorf("sandbox: writing the agent initramfs: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return "", fmt.Errorf("sandbox: writing the agent initramfs: %w", err)
	}
	if err := os.Rename(tmp.Name(), p); err != nil {
		return "", fmt.Errorf("sandbox: %w", err)
	}
	return p, nil
}

// imageKey hashes what an agent image is made of.
func imageKey(img initramfs.AgentImage) (string, error) {
	h := sha256.New()
	f, err := os.Open(img.Agent)
	if err != nil {
		return "", fmt.Errorf("sandbox: agent: %w", err)
	}
	defer f.Close()
	if _, err := io.Copy(h, f); err != nil {
		return "", fmt.Errorf("sandbox: agent: %w", err)
	}
	fmt.Fprintf(h, "\nbusybox=%v\n", img.Busybox)
	if img.Busybox {
		if fi, err := os.Stat(initramfs.HostBusybox); err == nil {
			fmt.Fprintf(h, "busybox %d %d\n", fi.Size(), fi.ModTime().UnixNano())
		}
	}
	if img.Kernel != nil {
		if img.Kernel.Version == "" {
			return "", errors.New("sandbox: kernel without a version")
		}
		mods := img.Modules
		if len(mods) == 0 {
			mods = initramfs.DefaultAgentModules()
		}
		fmt.Fprintf(h, "kernel %s modules %s\n", img.Kernel.Version, strings.Join(mods, ","))
	}
	return hex.EncodeToString(h.Sum(nil)[:12]), nil
}
