package pid1

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/guest/modprobe"
	"github.com/kilnvm/kiln/guestkernel"
)

// modulesDiskWait bounds the wait for the modules disk's device: its
// /sys/block entry and then its /dev node appear asynchronously.
const modulesDiskWait = 5 * time.Second

// maxVirtioDisks bounds the scan of /sys/block for the modules disk.
const maxVirtioDisks = 702 // vda .. vdzz

// MountModulesDisk mounts the kernel's modules disk read-only at
// /lib/modules/<release> of the current root (guestkernel's
// ModulesMountPoint), hiding whatever the root has there: the disk is the
// virtio disk whose serial (/sys/block/vd*/serial, the host's device ID)
// is serial, and its ext4 superblock must say it holds the modules of the
// running kernel (guestkernel.ParseModulesSuperblock). It waits up to 5 s
// for the device. A root that is read-only and lacks the mount point gets
// the disk at modprobe.RunModulesDir (on /run's tmpfs) instead, where
// Kiln's modprobe finds it; one that lacks /run too leaves the disk
// unmounted, with a warning.
func (s *Sys) MountModulesDisk(serial string, log *slog.Logger) error {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	rel, err := s.ReadFile("/proc/sys/kernel/osrelease")
	if err != nil {
		return fmt.Errorf("modules disk: reading the kernel release: %w", err)
	}
	release := strings.TrimSpace(string(rel))
	name, err := s.findDiskBySerial(serial)
	if err != nil {
		return fmt.Errorf("modules disk: %w", err)
	}
	dev := "/dev/" + name
	if err := s.waitForPath(dev, modulesDiskWait, rootPoll); err != nil {
		return fmt.Errorf("modules disk: %w", err)
	}
	sb, err := s.ReadAt(dev, 1024, 1024)
	if err != nil {
		return fmt.Errorf("modules disk %s: %w", dev, err)
	}
	info, err := guestkernel.ParseModulesSuperblock(sb)
	if err != nil {
		return fmt.Errorf("modules disk %s: %w", dev, err)
	}
	if info.Release != release {
		return fmt.Errorf("modules disk %s holds kernel %s's modules; this guest runs %s", dev, info.Release, release)
	}
	target := guestkernel.ModulesMountPoint(release)
	if err := s.MkdirAll(target, 0o755); err != nil {
		if !errors.Is(err, unix.EROFS) {
			return fmt.Errorf("modules disk: creating %s: %w", target, err)
		}
		// A read-only root without the folder (a minbase root has no
		// /lib/modules at all): /run, a tmpfs, takes the disk instead,
		// where Kiln's modprobe, the kernel's helper, looks next.
		log.Info("the read-only root has no modules folder: the modules disk goes to /run", "dir", target, "instead", modprobe.RunModulesDir)
		target = modprobe.RunModulesDir
		if err := s.MkdirAll(target, 0o755); err != nil {
			if errors.Is(err, unix.EROFS) {
				log.Warn("the read-only root has neither a modules folder nor /run: the kernel's modules disk stays unmounted", "dir", guestkernel.ModulesMountPoint(release))
				return nil
			}
			return fmt.Errorf("modules disk: creating %s: %w", target, err)
		}
	}
	if err := s.Mount(dev, target, "ext4", unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV, ""); err != nil {
		return fmt.Errorf("modules disk: mounting %s (ext4, read-only) on %s: %w", dev, target, err)
	}
	log.Info("mounted the kernel's modules", "device", dev, "dir", target)
	return nil
}

// findDiskBySerial returns the name of the virtio disk (vda, vdb, ...)
// whose serial is serial, waiting up to modulesDiskWait for it.
func (s *Sys) findDiskBySerial(serial string) (string, error) {
	return s.findDiskBySerialWithin(serial, modulesDiskWait)
}

// FindDiskBySerial returns the name of the virtio disk (vda, vdb, ...)
// whose serial is serial, waiting up to wait for it to appear.
func FindDiskBySerial(serial string, wait time.Duration) (string, error) {
	return Linux().findDiskBySerialWithin(serial, wait)
}

// findDiskBySerialWithin is findDiskBySerial waiting up to wait.
func (s *Sys) findDiskBySerialWithin(serial string, wait time.Duration) (string, error) {
	for waited := time.Duration(0); ; waited += rootPoll {
		for i := 0; i < maxVirtioDisks; i++ {
			name := virtioDiskName(i)
			b, err := s.ReadFile("/sys/block/" + name + "/serial")
			if errors.Is(err, fs.ErrNotExist) {
				break // names are given in order: no further disks
			}
			if err != nil {
				return "", fmt.Errorf("reading the serial of %s: %w", name, err)
			}
			if strings.TrimSpace(string(b)) == serial {
				return name, nil
			}
		}
		if waited >= wait {
			return "", fmt.Errorf("no virtio disk with serial %q appeared within %v", serial, wait)
		}
		s.Sleep(rootPoll)
	}
}

// virtioDiskName is the name virtio_blk gives its i-th disk: vda .. vdz,
// vdaa .. vdzz.
func virtioDiskName(i int) string {
	const letters = "abcdefghijklmnopqrstuvwxyz"
	if i < 26 {
		return "vd" + letters[i:i+1]
	}
	i -= 26
	return "vd" + letters[i/26:i/26+1] + letters[i%26:i%26+1]
}
