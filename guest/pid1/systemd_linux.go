package pid1

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
)

// The values of kiln.init=: what process 1 becomes once the root is ready.
const (
	// InitAgent keeps the agent as process 1 (the default).
	InitAgent = "agent"
	// InitSystemd execs the root's /sbin/init (systemd) as process 1, with
	// the agent as one of its services (InstallAgentService).
	InitSystemd = "systemd"
)

// CheckInit reports whether v is a kiln.init= value Kiln knows: "" (the
// default), InitAgent or InitSystemd.
func CheckInit(v string) error {
	switch v {
	case "", InitAgent, InitSystemd:
		return nil
	}
	return fmt.Errorf("init %q: want %q or %q", v, InitAgent, InitSystemd)
}

// SystemInit is the init a root's systemd boots from.
const SystemInit = "/sbin/init"

// Where InstallAgentService puts the agent service in a root.
const (
	AgentServiceDir    = "/usr/lib/kiln"
	AgentServiceBinary = AgentServiceDir + "/kiln-agent"
	// AgentServiceConfig holds the image config (ImageConfig, JSON) that
	// the initramfs carried, for the service's exec defaults.
	AgentServiceConfig = AgentServiceDir + "/image.json"
	AgentServiceUnit   = "/etc/systemd/system/kiln-agent.service"
	// AgentServiceArg is the agent's argument that runs it as a service.
	AgentServiceArg = "--service"
)

// agentUnit is the agent's systemd unit. DefaultDependencies=no starts it
// in sysinit.target, before the rest of the boot, so that exec works while
// systemd is still starting units; Delegate=yes hands it its cgroup, where
// it makes its per-exec cgroups; KillMode=mixed stops its execs with it.
const agentUnit = `# Installed by Kiln's pid1: the guest agent, serving the host on vsock.
[Unit]
Description=Kiln guest agent
DefaultDependencies=no
Before=sysinit.target shutdown.target
Conflicts=shutdown.target

[Service]
Type=simple
ExecStart=` + AgentServiceBinary + ` ` + AgentServiceArg + `
Restart=always
RestartSec=100ms
Delegate=yes
KillMode=mixed
OOMScoreAdjust=-1000
StandardOutput=journal+console
StandardError=journal+console

[Install]
WantedBy=sysinit.target
`

// MaskedUnits are the units InstallAgentService masks in a systemd root
// because they cannot work in a Kiln microVM, each with why.
var MaskedUnits = map[string]string{
	// The serial console is the host's log of the guest, not a terminal
	// anyone logs in on: agetty would take it as its controlling
	// terminal and write login prompts into the log.
	"serial-getty@ttyS0.service": "the serial console is the host's log, not a login terminal",
	// A microVM has no display, so no virtual terminal to log in on.
	"getty@tty1.service": "there is no display, so no virtual terminal",
}

// InstallAgentService makes the agent a systemd service of the root at
// root ("/" once the root is switched): it checks that the root has an
// executable SystemInit (resolving symbolic links inside root), copies
// the agent binary agent (e.g. /proc/self/exe) to AgentServiceBinary,
// writes cfg to AgentServiceConfig, the unit to AgentServiceUnit, enables
// it in sysinit.target, masks MaskedUnits and, when hostname is set,
// writes it to /etc/hostname (systemd sets the hostname from there). The
// writes land in the root's writable layer.
func InstallAgentService(root, agent string, cfg *ImageConfig, hostname string) error {
	init, err := resolveIn(root, SystemInit)
	if err != nil {
		return fmt.Errorf("init systemd: the image has no %s: %w", SystemInit, err)
	}
	fi, err := os.Stat(init)
	if err != nil {
		return fmt.Errorf("init systemd: the image has no %s: %w", SystemInit, err)
	}
	if !fi.Mode().IsRegular() || fi.Mode().Perm()&0o111 == 0 {
		return fmt.Errorf("init systemd: the image's %s is not an executable file (%v)", SystemInit, fi.Mode())
	}
	at := func(p string) string { return filepath.Join(root, p) }
	if err := os.MkdirAll(at(AgentServiceDir), 0o755); err != nil {
		return fmt.Errorf("init systemd: %w", err)
	}
	if err := copyFile(agent, at(AgentServiceBinary), 0o755); err != nil {
		return fmt.Errorf("init systemd: copying the agent: %w", err)
	}
	if cfg == nil {
		cfg = &ImageConfig{}
	}
	js, err := json.Marshal(cfg)
	if err != nil {
		return fmt.Errorf("init systemd: %w", err)
	}
	files := []struct {
		path string
		data string
	}{
		{AgentServiceConfig, string(js)},
		{AgentServiceUnit, agentUnit},
	}
	if hostname != "" {
		files = append(files, struct{ path, data string }{"/etc/hostname", hostname + "\n"})
	}
	for _, f := range files {
		if err := writeFileIn(root, f.path, []byte(f.data)); err != nil {
			return fmt.Errorf("init systemd: %w", err)
		}
	}
	links := [][2]string{{AgentServiceUnit, "/etc/systemd/system/sysinit.target.wants/kiln-agent.service"}}
	for unit := range MaskedUnits {
		links = append(links, [2]string{"/dev/null", "/etc/systemd/system/" + unit})
	}
	for _, l := range links {
		p := at(l[1])
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return fmt.Errorf("init systemd: %w", err)
		}
		if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("init systemd: %w", err)
		}
		if err := os.Symlink(l[0], p); err != nil {
			return fmt.Errorf("init systemd: %w", err)
		}
	}
	return nil
}

// ReadAgentServiceConfig reads the image config InstallAgentService wrote;
// a missing file is an empty config.
func ReadAgentServiceConfig() (*ImageConfig, error) {
	return Linux().readImageConfigAt(AgentServiceConfig)
}

// writeFileIn writes data to p inside root, creating its folder; a symbolic
// link in the way is replaced, not followed.
func writeFileIn(root, p string, data []byte) error {
	full := filepath.Join(root, p)
	if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
		return err
	}
	if fi, err := os.Lstat(full); err == nil && fi.Mode()&fs.ModeSymlink != 0 {
		if err := os.Remove(full); err != nil {
			return err
		}
	}
	return os.WriteFile(full, data, 0o644)
}

// copyFile copies src to dst (replaced) with mode perm.
func copyFile(src, dst string, perm fs.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	os.Remove(dst)
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, perm)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// maxLinks bounds the symbolic links resolveIn follows, as the kernel's
// ELOOP limit does.
const maxLinks = 40

// resolveIn resolves the absolute path p inside root as the kernel would
// after chroot(root): symbolic links, absolute or relative, stay inside
// root. It returns the host path of what p names (which may not exist in
// its last component).
func resolveIn(root, p string) (string, error) {
	rest := strings.Split(strings.TrimPrefix(path.Clean("/"+p), "/"), "/")
	cur := "/"
	links := 0
	for len(rest) > 0 {
		c := rest[0]
		rest = rest[1:]
		switch c {
		case "", ".":
			continue
		case "..":
			cur = path.Dir(cur)
			continue
		}
		next := path.Join(cur, c)
		fi, err := os.Lstat(filepath.Join(root, next))
		if err != nil {
			return "", err
		}
		if fi.Mode()&fs.ModeSymlink == 0 {
			cur = next
			continue
		}
		if links++; links > maxLinks {
			return "", fmt.Errorf("%s: too many levels of symbolic links", p)
		}
		target, err := os.Readlink(filepath.Join(root, next))
		if err != nil {
			return "", err
		}
		if strings.HasPrefix(target, "/") {
			cur = "/"
		}
		rest = append(strings.Split(target, "/"), rest...)
	}
	return filepath.Join(root, cur), nil
}
