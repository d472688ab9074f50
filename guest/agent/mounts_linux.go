package agent

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/guest/agentpb"
	"github.com/kilnvm/kiln/guest/pid1"
)

// VolumesDir holds the guest's own shared folders (AddMounts volume): a
// pod's emptyDir volumes, in guest RAM for the VM's life.
const VolumesDir = "/run/kiln/volumes"

// Limits of an AddMounts request.
const (
	maxMounts    = 128
	maxMountFile = 1 << 20
	maxMountPath = 4096
)

// systemDirs are what the guest provides in every root: no volume goes
// there (a file written into a root's /dev would land in the guest's).
var systemDirs = []string{"/proc", "/sys", "/dev"}

// AddMounts mounts volumes into a root; see agentpb.AgentServer.
func (s *Server) AddMounts(ctx context.Context, req *agentpb.AddMountsRequest) (*agentpb.AddMountsResponse, error) {
	root := "/"
	if name := req.GetRoot(); name != "" {
		r, err := s.rootFor(name)
		if err != nil {
			return nil, status.Errorf(status.Code(err), "add mounts: %s", status.Convert(err).Message())
		}
		root = r.path
	}
	if n := len(req.GetMounts()); n > maxMounts {
		return nil, invalidf("add mounts: %d mounts, at most %d", n, maxMounts)
	}
	for i, m := range req.GetMounts() {
		if err := s.addMount(root, req.GetRoot() == "", m); err != nil {
			return nil, status.Errorf(status.Code(err), "add mounts: mount %d (%s): %s", i, quoteShort(m.GetDestination()), status.Convert(err).Message())
		}
	}
	return &agentpb.AddMountsResponse{}, nil
}

// checkMountDestination checks a volume's destination (guest: in the
// guest's own root, where the agent's state under /run/kiln is too).
func checkMountDestination(dest string, guest bool) error {
	if dest == "" || len(dest) > maxMountPath || !filepath.IsAbs(dest) || strings.IndexByte(dest, 0) >= 0 {
		return invalidf("destination %s: want an absolute path of at most %d bytes", quoteShort(dest), maxMountPath)
	}
	dest = filepath.Clean(dest)
	if dest == "/" {
		return invalidf("destination /: a volume cannot replace the root")
	}
	reserved := systemDirs
	if guest {
		reserved = append(reserved[:len(reserved):len(reserved)], "/run/kiln")
	}
	for _, d := range reserved {
		if dest == d || strings.HasPrefix(dest, d+"/") {
			return invalidf("destination %s: %s is the guest's", dest, d)
		}
	}
	return nil
}

// addMount mounts m in root (guest: the guest's own root).
func (s *Server) addMount(root string, guest bool, m *agentpb.RootMount) error {
	dest := m.GetDestination()
	if err := checkMountDestination(dest, guest); err != nil {
		return err
	}
	dest = strings.TrimPrefix(filepath.Clean(dest), "/")
	rfd, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return status.Errorf(codes.Internal, "root %s: %v", root, err)
	}
	defer unix.Close(rfd)

	if f, ok := m.GetSource().(*agentpb.RootMount_File); ok {
		return writeMountFile(rfd, dest, f.File, m.GetMode())
	}
	if d, ok := m.GetSource().(*agentpb.RootMount_Disk); ok {
		if !guest {
			return invalidf("disk %s: a disk mounts in the guest's own root only", quoteShort(d.Disk))
		}
		return s.mountDisk(rfd, dest, d.Disk, m.GetReadonly())
	}
	var src, fstype, data string
	flags := uintptr(unix.MS_BIND)
	switch v := m.GetSource().(type) {
	case *agentpb.RootMount_Tree:
		if err := checkRootName(v.Tree); err != nil {
			return err
		}
		src = filepath.Join(s.treesDir, v.Tree)
		if fi, err := os.Stat(src); err != nil || !fi.IsDir() {
			return status.Errorf(codes.NotFound, "the host serves no tree %s", v.Tree)
		}
	case *agentpb.RootMount_Volume:
		if err := checkRootName(v.Volume); err != nil {
			return err
		}
		src = filepath.Join(s.volumesDir, v.Volume)
		if err := os.MkdirAll(src, 0o755); err != nil {
			return status.Errorf(codes.Internal, "volume %s: %v", v.Volume, err)
		}
		// An emptyDir is world-writable, as the kubelet makes it.
		if err := os.Chmod(src, 0o777); err != nil {
			return status.Errorf(codes.Internal, "volume %s: %v", v.Volume, err)
		}
	case *agentpb.RootMount_Tmpfs:
		src, fstype, flags = "tmpfs", "tmpfs", unix.MS_NOSUID|unix.MS_NODEV
		data = "mode=1777"
		if sz := m.GetSize(); sz > 0 {
			data += ",size=" + strconv.FormatUint(sz, 10)
		}
	default:
		return invalidf("no source: want a tree, a volume, a tmpfs, a file or a disk")
	}
	tfd, err := makeDirIn(rfd, dest)
	if err != nil {
		return err
	}
	defer unix.Close(tfd)
	target := "/proc/self/fd/" + strconv.Itoa(tfd)
	if err := unix.Mount(src, target, fstype, flags, data); err != nil {
		return status.Errorf(codes.Internal, "mounting %s on %s: %v", src, dest, err)
	}
	_, tree := m.GetSource().(*agentpb.RootMount_Tree)
	if (m.GetReadonly() || tree) && fstype == "" {
		// A bind takes its flags from a remount of the new mount: open it
		// again, the fd above names the folder beneath.
		mfd, err := unix.Openat2(rfd, dest, &unix.OpenHow{Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC, Resolve: unix.RESOLVE_IN_ROOT})
		if err != nil {
			return status.Errorf(codes.Internal, "reopening %s: %v", dest, err)
		}
		defer unix.Close(mfd)
		if err := unix.Mount("", "/proc/self/fd/"+strconv.Itoa(mfd), "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY, ""); err != nil {
			return status.Errorf(codes.Internal, "making %s read-only: %v", dest, err)
		}
	}
	return nil
}

// Waits of a disk mount (AddMounts disk).
const (
	// diskFindWait bounds the wait for a disk's serial to show: a volume
	// slot is there from boot.
	diskFindWait = 2 * time.Second
	diskPoll     = 50 * time.Millisecond
)

// diskSizeWait bounds the wait for a filled slot's capacity: the host's
// config-change interrupt reaches virtio_blk asynchronously (a variable
// for the tests).
var diskSizeWait = 5 * time.Second

// ext4 superblock: at 1024 bytes, its magic 0xEF53 (le16) at 0x38.
const (
	ext4MagicOffset = 1024 + 0x38
	ext4Magic       = 0xef53
)

// findVirtioDisk returns the device node and the size file (in 512-byte
// sectors) of the virtio disk whose serial is serial.
func findVirtioDisk(serial string) (dev, sizeFile string, err error) {
	name, err := pid1.FindDiskBySerial(serial, diskFindWait)
	if err != nil {
		return "", "", err
	}
	return "/dev/" + name, "/sys/block/" + name + "/size", nil
}

// mountDisk mounts the ext4 filesystem of the virtio disk of serial at p
// beneath the root rfd: nosuid, nodev, read-only when readOnly.
func (s *Server) mountDisk(rfd int, p, serial string, readOnly bool) error {
	if serial == "" || len(serial) > 20 || strings.ContainsAny(serial, "/\x00") {
		return invalidf("disk serial %s: want 1 to 20 bytes, no '/'", quoteShort(serial))
	}
	find := s.findDisk
	if find == nil {
		find = findVirtioDisk
	}
	dev, sizeFile, err := find(serial)
	if err != nil {
		return status.Errorf(codes.NotFound, "disk %s: %v", serial, err)
	}
	for waited := time.Duration(0); ; waited += diskPoll {
		b, err := os.ReadFile(sizeFile)
		if err != nil {
			return status.Errorf(codes.Internal, "disk %s: %v", serial, err)
		}
		if n, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64); err == nil && n > 0 {
			break
		}
		if waited >= diskSizeWait {
			return status.Errorf(codes.FailedPrecondition, "disk %s (%s) is still empty after %v: the host filled no volume into it", serial, dev, diskSizeWait)
		}
		time.Sleep(diskPoll)
	}
	if err := checkExt4(dev); err != nil {
		return status.Errorf(codes.InvalidArgument, "disk %s (%s): %v", serial, dev, err)
	}
	tfd, err := makeDirIn(rfd, p)
	if err != nil {
		return err
	}
	defer unix.Close(tfd)
	flags := uintptr(unix.MS_NOSUID | unix.MS_NODEV)
	if readOnly {
		flags |= unix.MS_RDONLY
	}
	if err := unix.Mount(dev, "/proc/self/fd/"+strconv.Itoa(tfd), "ext4", flags, ""); err != nil {
		return status.Errorf(codes.Internal, "mounting disk %s (%s, ext4) on /%s: %v", serial, dev, p, err)
	}
	s.log.Info("mounted a disk", "serial", serial, "device", dev, "destination", "/"+p, "read_only", readOnly)
	if !readOnly {
		s.diskMu.Lock()
		s.diskMounts = append(s.diskMounts, "/"+p)
		s.diskMu.Unlock()
	}
	return nil
}

// fifreeze is FIFREEZE, _IOWR('X', 119, int).
const fifreeze = 0xc0045877

// freezeDisks freezes the file system of every disk AddMounts mounted
// read-write: the kernel flushes its journal, marks it clean on its image
// and holds every later write (ext4_freeze), so the host may stop the
// guest and leave the image as an unmount would. One frozen already
// (EBUSY) is fine.
func (s *Server) freezeDisks() error {
	s.diskMu.Lock()
	mounts := slices.Clone(s.diskMounts)
	s.diskMu.Unlock()
	var errs []error
	for _, m := range mounts {
		fd, err := unix.Open(m, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			errs = append(errs, fmt.Errorf("freezing the volume at %s: %w", m, err))
			continue
		}
		_, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), fifreeze, 0)
		unix.Close(fd)
		if e != 0 && e != unix.EBUSY {
			errs = append(errs, fmt.Errorf("freezing the volume at %s: %w", m, e))
			continue
		}
		s.log.Info("froze a volume's file system", "destination", m)
	}
	return errors.Join(errs...)
}

// checkExt4 checks that dev holds an ext4 (or ext2/3) superblock.
func checkExt4(dev string) error {
	f, err := os.Open(dev)
	if err != nil {
		return err
	}
	defer f.Close()
	var b [2]byte
	if _, err := f.ReadAt(b[:], ext4MagicOffset); err != nil {
		return fmt.Errorf("reading its superblock: %w", err)
	}
	if binary.LittleEndian.Uint16(b[:]) != ext4Magic {
		return errors.New("not an ext4 filesystem")
	}
	return nil
}

// makeDirIn opens (O_PATH) the folder p beneath the root rfd, making what
// is missing (0755); symbolic links are resolved in the root.
func makeDirIn(rfd int, p string) (int, error) {
	open := func(q string) (int, error) {
		return unix.Openat2(rfd, q, &unix.OpenHow{Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC, Resolve: unix.RESOLVE_IN_ROOT})
	}
	if fd, err := open(p); err == nil {
		return fd, nil
	}
	parts := strings.Split(p, "/")
	for i := range parts {
		q := strings.Join(parts[:i+1], "/")
		fd, err := open(q)
		if err == nil {
			unix.Close(fd)
			continue
		}
		if !errors.Is(err, unix.ENOENT) {
			return -1, status.Errorf(codes.InvalidArgument, "%s: %v", q, err)
		}
		parent := "."
		if i > 0 {
			parent = strings.Join(parts[:i], "/")
		}
		pfd, err := open(parent)
		if err != nil {
			return -1, status.Errorf(codes.InvalidArgument, "%s: %v", parent, err)
		}
		err = unix.Mkdirat(pfd, parts[i], 0o755)
		unix.Close(pfd)
		if err != nil && !errors.Is(err, unix.EEXIST) {
			return -1, status.Errorf(codes.InvalidArgument, "making %s: %v", q, err)
		}
	}
	fd, err := open(p)
	if err != nil {
		return -1, status.Errorf(codes.InvalidArgument, "%s: %v", p, err)
	}
	return fd, nil
}

// writeMountFile writes b as the file p beneath the root rfd (replacing
// what is there, a symbolic link included, never following it).
func writeMountFile(rfd int, p string, b []byte, mode uint32) error {
	if len(b) > maxMountFile {
		return invalidf("file of %d bytes, at most %d", len(b), maxMountFile)
	}
	if mode == 0 {
		mode = 0o644
	}
	if mode&^0o7777 != 0 {
		return invalidf("file mode %#o: only permission bits", mode)
	}
	dfd, err := makeDirIn(rfd, filepath.Dir(p))
	if err != nil {
		return err
	}
	defer unix.Close(dfd)
	// The O_PATH fd names the folder; a real one writes into it.
	dir, err := unix.Openat(dfd, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return status.Errorf(codes.Internal, "%s: %v", filepath.Dir(p), err)
	}
	defer unix.Close(dir)
	name := filepath.Base(p)
	if err := unix.Unlinkat(dir, name, 0); err != nil && !errors.Is(err, unix.ENOENT) {
		return status.Errorf(codes.InvalidArgument, "replacing %s: %v", p, err)
	}
	fd, err := unix.Openat(dir, name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, mode)
	if err != nil {
		return status.Errorf(codes.Internal, "creating %s: %v", p, err)
	}
	f := os.NewFile(uintptr(fd), p)
	_, werr := f.Write(b)
	cerr := unix.Fchmod(fd, mode) // past the umask
	if err := errors.Join(werr, cerr, f.Close()); err != nil {
		return status.Errorf(codes.Internal, "writing %s: %v", p, err)
	}
	return nil
}
