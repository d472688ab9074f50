package snapshot

import (
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmm"
)

func validManifest() Manifest {
	return Manifest{
		Format:    FormatVersion,
		Created:   time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC),
		CPUs:      2,
		MemoryMiB: 4096,
		Devices: []virtio.DeviceSpec{
			{ID: "disk", Kind: virtio.KindBlock, Block: &virtio.BlockSpec{Path: "/disk.img"}},
			{ID: "rng", Kind: virtio.KindRNG, RNG: &virtio.RNGSpec{}},
		},
		StateVersion: vmm.StateVersion,
		StateSize:    1234,
		StateSHA256:  strings.Repeat("ab", 32),
		MemorySHA256: strings.Repeat("cd", 32),
		MemorySize:   4096 << 20,
		MemoryLayout: []vmm.MemoryRegion{
			{GuestAddr: 0, Size: 3 << 30, Offset: 0},
			{GuestAddr: 4 << 30, Size: 1 << 30, Offset: 3 << 30},
		},
	}
}

func TestParseManifest(t *testing.T) {
	tests := []struct {
		name    string
		mutate  func(*Manifest)
		wantErr string
	}{
		{"valid", func(*Manifest) {}, ""},
		{"other state version", func(m *Manifest) { m.StateVersion = 3 }, "VM state version 3"},
		{"no time", func(m *Manifest) { m.Created = time.Time{} }, "no creation time"},
		{"no vCPUs", func(m *Manifest) { m.CPUs = 0 }, "0 vCPUs"},
		{"memory", func(m *Manifest) { m.MemoryMiB = 2 }, "2 MiB of memory"},
		{"memory size", func(m *Manifest) { m.MemorySize-- }, "memory file of 4294967295 bytes for 4096 MiB"},
		{"devices", func(m *Manifest) { m.Devices = make([]virtio.DeviceSpec, 40) }, "40 virtio devices"},
		{"state size", func(m *Manifest) { m.StateSize = 0 }, "state file of 0 bytes"},
		{"checksum length", func(m *Manifest) { m.StateSHA256 = "abcd" }, "not 64 lowercase hex digits"},
		{"checksum case", func(m *Manifest) { m.StateSHA256 = strings.Repeat("AB", 32) }, "not 64 lowercase hex digits"},
		{"no memory checksum", func(m *Manifest) { m.MemorySHA256 = "" }, "the memory file's checksum is not 64 lowercase hex digits"},
		{"fs-verity digest", func(m *Manifest) { m.MemoryVerity = strings.Repeat("ab", 32) }, ""},
		{"fs-verity digest length", func(m *Manifest) { m.MemoryVerity = "abcd" }, "fs-verity digest is not 64 lowercase hex digits"},
		{"fs-verity digest case", func(m *Manifest) { m.MemoryVerity = strings.Repeat("AB", 32) }, "fs-verity digest is not 64 lowercase hex digits"},
		{"no layout", func(m *Manifest) { m.MemoryLayout = nil }, "no memory layout"},
		{"unaligned region", func(m *Manifest) { m.MemoryLayout[1].GuestAddr++ }, "not page-aligned"},
		{"overlap", func(m *Manifest) { m.MemoryLayout[1].GuestAddr = 1 << 30 }, "overlaps"},
		{"offset", func(m *Manifest) { m.MemoryLayout[1].Offset = 0 }, "at offset 0x0 of the memory file, want 0xc0000000"},
		{"regions too big", func(m *Manifest) { m.MemoryLayout[1].Size = 2 << 30 }, "hold more than"},
		{"regions too small", func(m *Manifest) { m.MemoryLayout = m.MemoryLayout[:1] }, "memory regions hold 3221225472 bytes, the memory file 4294967296"},
		{"wraps", func(m *Manifest) { m.MemoryLayout[1].GuestAddr = ^uint64(0) &^ 4095 }, "wraps around"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := validManifest()
			tt.mutate(&m)
			b, err := json.Marshal(m)
			if err != nil {
				t.Fatal(err)
			}
			got, err := parseManifest(b)
			if tt.wantErr == "" {
				if err != nil {
					t.Fatal(err)
				}
				if !reflect.DeepEqual(*got, m) {
					t.Fatalf("parsed %+v, want %+v", *got, m)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("err = %v, want it to say %q", err, tt.wantErr)
			}
			if !errors.Is(err, ErrCorrupt) {
				t.Errorf("err = %v does not wrap ErrCorrupt", err)
			}
		})
	}
}

func TestParseManifestMalformed(t *testing.T) {
	tests := []struct {
		name, in, wantErr string
		is                error
	}{
		{"empty", "", "not JSON", ErrCorrupt},
		{"array", "[]", "not JSON", ErrCorrupt},
		{"no version", `{"cpus":1}`, "no format version", ErrCorrupt},
		{"newer version", `{"format":4,"something":"new"}`, "snapshot format version 4, this kiln reads format version 3", ErrFormatVersion},
		{"older version", `{"format":2,"state_sha256":"x"}`, "snapshot format version 2 was made by an older Kiln (this one reads version 3, authenticated): re-save it", ErrFormatVersion},
		{"version zero", `{"format":0}`, "snapshot format version 0", ErrFormatVersion},
		{"unknown field", `{"format":3,"surprise":1}`, "unknown field", ErrCorrupt},
		{"trailing data", func() string { b, _ := json.Marshal(validManifest()); return string(b) + "{}" }(), "not JSON", ErrCorrupt},
		{"created out of range", `{"format":3,"state_version":2,"created":"0000-01-01T00:00:00+01:00"}`, "out of range", ErrCorrupt},
		{"wrong type", `{"format":3,"cpus":"two"}`, "manifest:", ErrCorrupt},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := parseManifest([]byte(tt.in))
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("err = %v, want it to say %q", err, tt.wantErr)
			}
			if !errors.Is(err, tt.is) {
				t.Errorf("err = %v does not wrap %v", err, tt.is)
			}
		})
	}
}

// FuzzParseManifest checks that no input makes the parser panic, and that
// whatever it accepts survives a round trip and passes its own checks.
func FuzzParseManifest(f *testing.F) {
	b, err := json.Marshal(validManifest())
	if err != nil {
		f.Fatal(err)
	}
	f.Add(b)
	f.Add([]byte(`{"format":1}`))
	f.Add([]byte(`{"format":2}`))
	f.Add([]byte(`{"format":1,"cpus":1,"memory_mib":16,"memory_size":16777216,"memory_layout":[{"guest_addr":0,"size":16777216,"offset":0}]}`))
	f.Add([]byte(`null`))
	f.Fuzz(func(t *testing.T, in []byte) {
		m, err := parseManifest(in)
		if err != nil {
			if m != nil {
				t.Fatal("a manifest and an error")
			}
			return
		}
		if err := m.validate(); err != nil {
			t.Fatalf("accepted a manifest that fails validation: %v", err)
		}
		out, err := json.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		back, err := parseManifest(out)
		if err != nil {
			t.Fatalf("re-encoded manifest refused: %v\n%s", err, out)
		}
		if !reflect.DeepEqual(back, m) {
			t.Fatalf("round trip changed the manifest:\n%+v\n%+v", m, back)
		}
	})
}
