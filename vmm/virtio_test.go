package vmm

import (
	"slices"
	"strings"
	"testing"

	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmm/acpi"
)

func TestVirtioGSIs(t *testing.T) {
	gsis := virtioGSIs()
	if len(gsis) != MaxVirtioDevices {
		t.Fatalf("%d GSIs, MaxVirtioDevices is %d", len(gsis), MaxVirtioDevices)
	}
	if gsis[0] != 5 || gsis[len(gsis)-1] != acpi.IOAPICPins-1 {
		t.Fatalf("GSIs %v: want 5 up to %d", gsis, acpi.IOAPICPins-1)
	}
	if slices.Contains(gsis, rtcIRQ) || slices.Contains(gsis, com1IRQ) {
		t.Fatalf("GSIs %v include the RTC's or COM1's", gsis)
	}
	if end := virtioBase(MaxVirtioDevices); end > powerBase || virtioBase(0) < mmioGapStart {
		t.Fatalf("transports [%#x, %#x) leave the MMIO gap or overlap the power device", virtioBase(0), end)
	}
}

func TestConfigDevices(t *testing.T) {
	base := Config{Kernel: "k", CPUs: 1, MemoryMiB: 64}
	rngs := func(n int) []virtio.Device {
		var d []virtio.Device
		for range n {
			d = append(d, virtio.NewRNG())
		}
		return d
	}
	tests := []struct {
		name    string
		devices []virtio.Device
		wantErr string
	}{
		{"none", nil, ""},
		{"one", rngs(1), ""},
		{"the most", rngs(MaxVirtioDevices), ""},
		{"too many", rngs(MaxVirtioDevices + 1), "virtio devices: a VM takes at most"},
		{"nil device", []virtio.Device{virtio.NewRNG(), nil}, "virtio device 1 is nil"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := base
			cfg.Devices = tc.devices
			err := cfg.Validate()
			if tc.wantErr == "" && err != nil {
				t.Fatalf("Validate: %v", err)
			}
			if tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)) {
				t.Fatalf("Validate = %v, want %q", err, tc.wantErr)
			}
		})
	}
}

// TestVirtioACPI builds the tables with the most devices: the DSDT takes
// every transport, none overlapping anything else.
func TestVirtioACPI(t *testing.T) {
	v := &VM{cfg: Config{CPUs: 1, Devices: make([]virtio.Device, MaxVirtioDevices)}}
	cfg := v.acpiConfig()
	if len(cfg.VirtioMMIO) != MaxVirtioDevices {
		t.Fatalf("%d transports in the ACPI config", len(cfg.VirtioMMIO))
	}
	if _, err := acpi.Build(cfg); err != nil {
		t.Fatalf("acpi.Build: %v", err)
	}
	if d := cfg.VirtioMMIO[3]; d.Base != VirtioMMIOBase+3*virtio.MMIOSize || d.Size != virtio.MMIOSize || d.GSI != 9 {
		t.Fatalf("device 3: %+v", d)
	}
}

func TestVirtioCmdline(t *testing.T) {
	tests := []struct {
		n    int
		want string
	}{
		{0, ""},
		{1, " virtio_mmio.device=4K@0xd0000000:5"},
		{4, " virtio_mmio.device=4K@0xd0000000:5 virtio_mmio.device=4K@0xd0001000:6 virtio_mmio.device=4K@0xd0002000:7 virtio_mmio.device=4K@0xd0003000:9"},
	}
	for _, tt := range tests {
		if got := virtioCmdline(tt.n); got != tt.want {
			t.Errorf("virtioCmdline(%d) = %q, want %q", tt.n, got, tt.want)
		}
	}
}
