package pid1

import (
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/guest/modprobe"
)

// Sys holds the system calls pid1 makes. Linux returns the real ones; tests
// fill in fakes. Every field must be set.
type Sys struct {
	// Mount is mount(2).
	Mount func(source, target, fstype string, flags uintptr, data string) error
	// Unmount is umount2(2).
	Unmount func(target string, flags int) error
	// MkdirAll is os.MkdirAll.
	MkdirAll func(path string, perm fs.FileMode) error
	// Symlink is os.Symlink.
	Symlink func(target, link string) error
	// Stat is os.Stat.
	Stat func(path string) (fs.FileInfo, error)
	// ReadFile is os.ReadFile.
	ReadFile func(path string) ([]byte, error)
	// ReadAt reads n bytes at offset off of the file path (a block
	// device's superblock).
	ReadAt func(path string, off int64, n int) ([]byte, error)
	// WriteFile writes data to the existing file path in one write(2),
	// neither creating nor truncating it (for cgroupfs and procfs files).
	WriteFile func(path string, data []byte) error
	// CreateFile creates path as an empty file with mode perm, leaving
	// one that exists as it is (a mount point for a file).
	CreateFile func(path string, perm fs.FileMode) error
	// Chdir is chdir(2).
	Chdir func(dir string) error
	// Chroot is chroot(2).
	Chroot func(dir string) error
	// Sethostname is sethostname(2).
	Sethostname func(name []byte) error
	// FinitModule loads the kernel module open as f: finit_module(2).
	FinitModule func(f *os.File, params string) error
	// Sync is sync(2).
	Sync func()
	// RebootSyscall is reboot(2) with the LINUX_REBOOT_CMD_* cmd.
	RebootSyscall func(cmd int) error
	// Sleep is time.Sleep.
	Sleep func(time.Duration)
	// LookupEnv is os.LookupEnv.
	LookupEnv func(key string) (string, bool)
	// Setenv is os.Setenv.
	Setenv func(key, value string) error
	// LinkUp sets the network interface name up (SIOCSIFFLAGS).
	LinkUp func(name string) error
	// Lstat is os.Lstat.
	Lstat func(path string) (fs.FileInfo, error)
}

// Linux returns the Sys of the running kernel.
func Linux() *Sys {
	return &Sys{
		Mount:         unix.Mount,
		Unmount:       unix.Unmount,
		MkdirAll:      os.MkdirAll,
		Symlink:       os.Symlink,
		Stat:          os.Stat,
		ReadFile:      os.ReadFile,
		ReadAt:        readAt,
		WriteFile:     writeExisting,
		CreateFile:    createFile,
		Chdir:         unix.Chdir,
		Chroot:        unix.Chroot,
		Sethostname:   unix.Sethostname,
		FinitModule:   finitModule,
		Sync:          unix.Sync,
		RebootSyscall: unix.Reboot,
		Sleep:         time.Sleep,
		LookupEnv:     os.LookupEnv,
		Setenv:        os.Setenv,
		LinkUp:        linkUp,
		Lstat:         os.Lstat,
	}
}

// linkUp sets a network interface's IFF_UP flag.
func linkUp(name string) error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("socket for %s: %w", name, err)
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq(name)
	if err != nil {
		return fmt.Errorf("interface %q: %w", name, err)
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("flags of %s: %w", name, err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("setting %s up: %w", name, err)
	}
	return nil
}

func writeExisting(path string, data []byte) error {
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return fmt.Errorf("writing %s: %w", path, err)
	}
	return f.Close()
}

func createFile(path string, perm fs.FileMode) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE, perm)
	if err != nil {
		return err
	}
	return f.Close()
}

func readAt(path string, off int64, n int) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b := make([]byte, n)
	if _, err := f.ReadAt(b, off); err != nil {
		return nil, fmt.Errorf("reading %s: %w", path, err)
	}
	return b, nil
}

// finitModule is finit_module(2) without flags: the one loader the agent
// has, shared with its modprobe.
func finitModule(f *os.File, params string) error { return modprobe.FinitModule(f, params, 0) }

// MountBase mounts the base filesystems with the running kernel's Sys; see
// Sys.MountBase.
func MountBase() error { return Linux().MountBase() }

// LoadModules loads the modules under dir with the running kernel's Sys; see
// Sys.LoadModules.
func LoadModules(dir string, log *slog.Logger) error { return Linux().LoadModules(dir, log) }

// SwitchRoot makes the filesystem on dev the root with the running kernel's
// Sys; see Sys.SwitchRoot.
func SwitchRoot(dev, fstype, flags string, readOnly bool) error {
	return Linux().SwitchRoot(dev, fstype, flags, readOnly)
}

// SetHostname sets the hostname with the running kernel's Sys; see
// Sys.SetHostname.
func SetHostname(name string) error { return Linux().SetHostname(name) }

// PowerOff syncs the filesystems and powers the machine off; it returns only
// on failure. It suits agent.Config.PowerOff.
func PowerOff() error { return Linux().PowerOff() }

// Reboot syncs the filesystems and restarts the machine; it returns only on
// failure.
func Reboot() error { return Linux().Reboot() }

// Setup does all of process 1's chores with the running kernel's Sys; see
// Sys.Setup.
func Setup(log *slog.Logger) (Options, error) { return Linux().Setup(log) }

// SetHostname sets the kernel's hostname (UTS namespace) to name, which must
// be 1 to 64 bytes long.
func (s *Sys) SetHostname(name string) error {
	if name == "" || len(name) > 64 {
		return fmt.Errorf("setting hostname %q: want 1 to 64 bytes", name)
	}
	if err := s.Sethostname([]byte(name)); err != nil {
		return fmt.Errorf("setting hostname %q: %w", name, err)
	}
	return nil
}

// PowerOff syncs the filesystems, then powers the machine off
// (LINUX_REBOOT_CMD_POWER_OFF). It returns only on failure.
func (s *Sys) PowerOff() error {
	s.Sync()
	if err := s.RebootSyscall(unix.LINUX_REBOOT_CMD_POWER_OFF); err != nil {
		return fmt.Errorf("powering off: %w", err)
	}
	return nil
}

// Reboot syncs the filesystems, then restarts the machine
// (LINUX_REBOOT_CMD_RESTART). It returns only on failure.
func (s *Sys) Reboot() error {
	s.Sync()
	if err := s.RebootSyscall(unix.LINUX_REBOOT_CMD_RESTART); err != nil {
		return fmt.Errorf("rebooting: %w", err)
	}
	return nil
}
