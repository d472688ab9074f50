package snapshot

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"reflect"
	"time"

	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmm"
)

// FormatVersion is the version of the on-disk format this package writes
// and reads.
// Version 3 authenticated the manifest (MACFile), added the memory
// file's digest and stopped opening the disks a snapshot names.
const FormatVersion = 3

// The files of a snapshot directory.
const (
	ManifestFile = "manifest.json"
	StateFile    = "state.json"
	MemoryFile   = "memory"
	// MACFile holds the manifest's HMAC-SHA256 under the host key
	// (LoadKey), hex.
	MACFile = "manifest.mac"
)

// Limits on what a snapshot's files may make Load read.
const (
	maxManifestSize = 1 << 20
	maxStateSize    = 256 << 20
	// MaxLabels bounds a manifest's labels; each key is at most
	// maxLabelKey bytes and each value at most maxLabelValue.
	MaxLabels     = 64
	maxLabelKey   = 128
	maxLabelValue = 4096
	pageSize      = 4096
)

// Errors a caller may want to tell apart (with errors.Is).
var (
	// ErrFormatVersion: the snapshot was written in another format version.
	ErrFormatVersion = errors.New("unsupported snapshot format version")
	// ErrChecksum: the state or memory file is not what the manifest
	// says. Its message never says what the digest should have been.
	ErrChecksum = errors.New("checksum mismatch")
	// ErrCorrupt: a file is missing, truncated or malformed.
	ErrCorrupt = errors.New("corrupt snapshot")
	// ErrMismatch: the restore's overrides do not fit the snapshot's
	// devices.
	ErrMismatch = errors.New("snapshot does not match the config")
	// ErrExists: Save found a snapshot (or something else) at its target.
	ErrExists = errors.New("snapshot already exists")
)

// Manifest describes a snapshot: manifest.json.
type Manifest struct {
	// Format is FormatVersion when written.
	Format int `json:"format"`
	// Created is when the snapshot was written (UTC).
	Created time.Time `json:"created"`
	// CPUs and MemoryMiB are the VM's shape.
	CPUs      int `json:"cpus"`
	MemoryMiB int `json:"memory_mib"`
	// Devices are the specs of the VM's virtio devices, in its order, as
	// the state file has them: what a restore opens unless overridden.
	Devices []virtio.DeviceSpec `json:"devices"`
	// Labels are what the snapshot's maker recorded beside the VM
	// (WithLabels).
	Labels map[string]string `json:"labels,omitempty"`
	// StateVersion is the vmm.StateVersion of the state file.
	StateVersion int `json:"state_version"`
	// StateSize and StateSHA256 (hex) are the state file's.
	StateSize   int64  `json:"state_size"`
	StateSHA256 string `json:"state_sha256"`
	// MemorySize is the memory file's size in bytes; MemoryLayout says
	// where each guest-physical region lies in it.
	MemorySize   uint64             `json:"memory_size"`
	MemoryLayout []vmm.MemoryRegion `json:"memory_layout"`
	// MemorySHA256 is the memory file's digest (hex): SHA-256 over its
	// pages that are not all zeros, each as its offset (le64) and its
	// bytes, then the file's size (le64).
	MemorySHA256 string `json:"memory_sha256"`
	// MemoryVerity, when set, is the memory file's fs-verity digest
	// (hex; SHA-256, 4 KiB blocks, no salt): Save sealed the file with
	// fs-verity where its file system has it, and a restore whose memory
	// file measures so maps it as it is, the kernel checking each page
	// as it is read, instead of copying and hashing it first.
	MemoryVerity string `json:"memory_verity,omitempty"`
}

// Info reads and checks the manifest of the snapshot in dir. With a key
// (WithKey) or a pinned digest (WithManifestDigest) the manifest must be
// authenticated by it (ErrAuth otherwise); without either it is read as
// it is, unauthenticated: good for a message, not for a restore.
func Info(dir string, opts ...Option) (*Manifest, error) {
	c := newConfig(opts)
	d, err := openDir(dir)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("snapshot %s: no such directory: %w", dir, ErrCorrupt)
		}
		return nil, fmt.Errorf("snapshot %s: %w", dir, err)
	}
	defer d.Close()
	m, _, err := c.readManifest(d, c.key != nil || c.pin != nil)
	if err != nil {
		return nil, fmt.Errorf("snapshot %s: %w", dir, err)
	}
	return m, nil
}

// readManifest reads, authenticates (when auth is set) and checks the
// manifest of the snapshot directory d, and returns it and its bytes.
func (c *config) readManifest(d *os.File, auth bool) (*Manifest, []byte, error) {
	f, err := openIn(d, ManifestFile)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, nil, fmt.Errorf("no %s: not a snapshot, or an unfinished one: %w", ManifestFile, ErrCorrupt)
		}
		return nil, nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxManifestSize+1))
	if err != nil {
		return nil, nil, fmt.Errorf("read manifest: %w", err)
	}
	if len(b) > maxManifestSize {
		return nil, nil, fmt.Errorf("manifest is over %d bytes: %w", maxManifestSize, ErrCorrupt)
	}
	// The version first: an older snapshot has no MAC to check.
	if err := checkFormat(b); err != nil {
		return nil, nil, err
	}
	if auth {
		if err := c.authenticate(d, b); err != nil {
			return nil, nil, err
		}
	}
	m, err := parseManifest(b)
	if err != nil {
		return nil, nil, err
	}
	return m, b, nil
}

// checkFormat reads a manifest's format version, alone, so that a
// manifest of another version is named as such whatever else it holds.
func checkFormat(b []byte) error {
	var head struct {
		Format *int `json:"format"`
	}
	if err := json.Unmarshal(b, &head); err != nil {
		return fmt.Errorf("manifest is not JSON (%v): %w", err, ErrCorrupt)
	}
	switch {
	case head.Format == nil:
		return fmt.Errorf("manifest has no format version: %w", ErrCorrupt)
	case *head.Format < FormatVersion && *head.Format > 0:
		return fmt.Errorf("snapshot format version %d was made by an older Kiln (this one reads version %d, authenticated): re-save it: %w", *head.Format, FormatVersion, ErrFormatVersion)
	case *head.Format != FormatVersion:
		return fmt.Errorf("snapshot format version %d, this kiln reads format version %d: %w", *head.Format, FormatVersion, ErrFormatVersion)
	}
	return nil
}

// parseManifest decodes and checks a manifest. The format version is read
// first and alone, so that a manifest of another version is named as such
// whatever else it holds.
func parseManifest(b []byte) (*Manifest, error) {
	if err := checkFormat(b); err != nil {
		return nil, err
	}
	var m Manifest
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&m); err != nil {
		return nil, fmt.Errorf("manifest: %v: %w", err, ErrCorrupt)
	}
	m.Created = m.Created.UTC()
	if err := m.validate(); err != nil {
		return nil, fmt.Errorf("manifest: %w: %w", err, ErrCorrupt)
	}
	return &m, nil
}

// validate checks a manifest's fields on their own and against each other.
func (m *Manifest) validate() error {
	switch {
	case m.StateVersion != vmm.StateVersion:
		return fmt.Errorf("VM state version %d, this kiln reads version %d", m.StateVersion, vmm.StateVersion)
	case m.Created.IsZero():
		return errors.New("no creation time")
	case m.Created.Year() < 1 || m.Created.Year() > 9999:
		return fmt.Errorf("creation time %v is out of range", m.Created)
	case m.CPUs < 1 || m.CPUs > vmm.MaxCPUs:
		return fmt.Errorf("%d vCPUs: want 1 to %d", m.CPUs, vmm.MaxCPUs)
	case m.MemoryMiB < vmm.MinMemoryMiB || m.MemoryMiB > vmm.MaxMemoryMiB:
		return fmt.Errorf("%d MiB of memory: want %d to %d", m.MemoryMiB, vmm.MinMemoryMiB, vmm.MaxMemoryMiB)
	case m.MemorySize != uint64(m.MemoryMiB)<<20:
		return fmt.Errorf("memory file of %d bytes for %d MiB of memory", m.MemorySize, m.MemoryMiB)
	case len(m.Devices) > vmm.MaxVirtioDevices:
		return fmt.Errorf("%d virtio devices: at most %d", len(m.Devices), vmm.MaxVirtioDevices)
	case m.StateSize < 1 || m.StateSize > maxStateSize:
		return fmt.Errorf("state file of %d bytes: want 1 to %d", m.StateSize, maxStateSize)
	}
	if err := checkLabels(m.Labels); err != nil {
		return err
	}
	if !isDigest(m.StateSHA256) {
		return errors.New("the state file's checksum is not 64 lowercase hex digits")
	}
	if !isDigest(m.MemorySHA256) {
		return errors.New("the memory file's checksum is not 64 lowercase hex digits")
	}
	if m.MemoryVerity != "" && !isDigest(m.MemoryVerity) {
		return errors.New("the memory file's fs-verity digest is not 64 lowercase hex digits")
	}
	if len(m.MemoryLayout) == 0 {
		return errors.New("no memory layout")
	}
	var off, end uint64
	for i, r := range m.MemoryLayout {
		switch {
		case r.Size == 0 || r.Size%pageSize != 0 || r.GuestAddr%pageSize != 0:
			return fmt.Errorf("memory region %d (%#x+%#x) is empty or not page-aligned", i, r.GuestAddr, r.Size)
		case r.GuestAddr+r.Size < r.GuestAddr:
			return fmt.Errorf("memory region %d (%#x+%#x) wraps around", i, r.GuestAddr, r.Size)
		case i > 0 && r.GuestAddr < end:
			return fmt.Errorf("memory region %d (%#x) overlaps or precedes region %d", i, r.GuestAddr, i-1)
		case r.Offset != off:
			return fmt.Errorf("memory region %d at offset %#x of the memory file, want %#x", i, r.Offset, off)
		case r.Size > m.MemorySize-off:
			return fmt.Errorf("memory regions hold more than the %d bytes of the memory file", m.MemorySize)
		}
		off += r.Size
		end = r.GuestAddr + r.Size
	}
	if off != m.MemorySize {
		return fmt.Errorf("memory regions hold %d bytes, the memory file %d", off, m.MemorySize)
	}
	return nil
}

// isDigest reports whether s is a SHA-256 digest in lowercase hex.
func isDigest(s string) bool {
	sum, err := hex.DecodeString(s)
	return err == nil && len(sum) == sha256.Size && hex.EncodeToString(sum) == s
}

// checkLabels checks a manifest's labels against the limits.
func checkLabels(labels map[string]string) error {
	if len(labels) > MaxLabels {
		return fmt.Errorf("%d labels: at most %d", len(labels), MaxLabels)
	}
	for k, v := range labels {
		switch {
		case k == "" || len(k) > maxLabelKey:
			return fmt.Errorf("label key %.40q: want 1 to %d bytes", k, maxLabelKey)
		case len(v) > maxLabelValue:
			return fmt.Errorf("label %q: value of %d bytes, at most %d", k, len(v), maxLabelValue)
		}
	}
	return nil
}

// checkState checks that the state file describes the VM the manifest
// does.
func (m *Manifest) checkState(st *vmm.State) error {
	if st.CPUs != m.CPUs || st.MemoryMiB != m.MemoryMiB || len(st.Devices) != len(m.Devices) || len(st.Memory) != len(m.MemoryLayout) {
		return fmt.Errorf("state (%d vCPUs, %d MiB, %d devices) and manifest (%d vCPUs, %d MiB, %d devices) disagree: %w",
			st.CPUs, st.MemoryMiB, len(st.Devices), m.CPUs, m.MemoryMiB, len(m.Devices), ErrCorrupt)
	}
	for i, r := range st.Memory {
		if r != m.MemoryLayout[i] {
			return fmt.Errorf("state and manifest disagree on memory region %d: %w", i, ErrCorrupt)
		}
	}
	for i, d := range st.Devices {
		if !reflect.DeepEqual(d.Spec, m.Devices[i]) {
			return fmt.Errorf("state and manifest disagree on virtio device %d: %w", i, ErrCorrupt)
		}
	}
	return nil
}
