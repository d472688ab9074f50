package kvm

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// DevicePath is where the KVM device node lives.
const DevicePath = "/dev/kvm"

// System is an open /dev/kvm: the system-level KVM handle.
type System struct {
	fd int
}

// Open opens /dev/kvm and checks the API version.
func Open() (*System, error) {
	return OpenPath(DevicePath)
}

// OpenPath opens a KVM device node at path and checks the API version.
func OpenPath(path string) (*System, error) {
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", path, err)
	}
	s := &System{fd: fd}
	v, err := ioctl(fd, reqGetAPIVersion, 0)
	if err != nil {
		s.Close()
		return nil, fmt.Errorf("%s: KVM_GET_API_VERSION: %w", path, err)
	}
	if v != APIVersion {
		s.Close()
		return nil, fmt.Errorf("%s: KVM API version %d, want %d", path, v, APIVersion)
	}
	return s, nil
}

// Close closes the device.
func (s *System) Close() error { return unix.Close(s.fd) }

// FD returns the file descriptor.
func (s *System) FD() int { return s.fd }

// CheckExtension returns KVM_CHECK_EXTENSION for a capability (0: absent).
func (s *System) CheckExtension(capability int) int {
	r, err := ioctl(s.fd, reqCheckExtension, uintptr(capability))
	if err != nil {
		return 0
	}
	return int(r)
}

// VCPUMmapSize returns the size of the kvm_run mapping of each vCPU.
func (s *System) VCPUMmapSize() (int, error) {
	r, err := ioctl(s.fd, reqGetVCPUMmapSize, 0)
	if err != nil {
		return 0, fmt.Errorf("KVM_GET_VCPU_MMAP_SIZE: %w", err)
	}
	return int(r), nil
}

// maxCPUIDEntries bounds KVM_GET_SUPPORTED_CPUID's answer.
const maxCPUIDEntries = 256

// SupportedCPUID returns the CPUID leaves KVM can expose to a guest.
func (s *System) SupportedCPUID() ([]CPUIDEntry, error) {
	buf := &cpuid2{Nent: maxCPUIDEntries}
	if _, err := ioctlRef(s.fd, reqGetSupportedCPUID, buf); err != nil {
		return nil, fmt.Errorf("KVM_GET_SUPPORTED_CPUID: %w", err)
	}
	if buf.Nent > maxCPUIDEntries {
		return nil, fmt.Errorf("KVM_GET_SUPPORTED_CPUID: %d entries, more than %d", buf.Nent, maxCPUIDEntries)
	}
	return append([]CPUIDEntry(nil), buf.Entries[:buf.Nent]...), nil
}

// MSRIndexList returns the MSRs KVM saves and restores for a vCPU.
func (s *System) MSRIndexList() ([]uint32, error) {
	const max = 1024
	buf := make([]uint32, 1+max)
	buf[0] = max
	if _, err := ioctlRef(s.fd, reqGetMSRIndexList, &buf[0]); err != nil {
		return nil, fmt.Errorf("KVM_GET_MSR_INDEX_LIST: %w", err)
	}
	n := buf[0]
	if n > max {
		return nil, fmt.Errorf("KVM_GET_MSR_INDEX_LIST: %d entries, more than %d", n, max)
	}
	return append([]uint32(nil), buf[1:1+n]...), nil
}

// CreateVM creates a VM (machine type 0, the default).
func (s *System) CreateVM() (*VM, error) {
	fd, err := ioctl(s.fd, reqCreateVM, 0)
	if err != nil {
		return nil, fmt.Errorf("KVM_CREATE_VM: %w", err)
	}
	size, err := s.VCPUMmapSize()
	if err != nil {
		unix.Close(int(fd))
		return nil, err
	}
	return &VM{fd: int(fd), runSize: size}, nil
}

// Usable reports whether KVM at path can be opened and speaks API version 12.
// It returns the reason when it cannot.
func Usable(path string) error {
	if _, err := os.Stat(path); err != nil {
		return fmt.Errorf("no KVM device: %w", err)
	}
	s, err := OpenPath(path)
	if err != nil {
		return err
	}
	return s.Close()
}
