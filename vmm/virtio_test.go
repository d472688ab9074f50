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

// rngSpecs returns n specs of entropy devices.
func rngSpecs(n int) []virtio.DeviceSpec {
	var d []virtio.DeviceSpec
	for i := range n {
		d = append(d, testSpec(i, virtio.IDRNG))
	}
	return d
}

func TestConfigDevices(t *testing.T) {
	base := Config{Spec: Spec{Kernel: "k", CPUs: 1, MemoryMiB: 64}}
	tests := []struct {
		name    string
		devices []virtio.DeviceSpec
		wantErr string
	}{
		{"none", nil, ""},
		{"one", rngSpecs(1), ""},
		{"the most", rngSpecs(MaxVirtioDevices), ""},
		{"too many", rngSpecs(MaxVirtioDevices + 1), "virtio devices: a VM takes at most"},
		{"empty spec", []virtio.DeviceSpec{rngSpecs(1)[0], {}}, `device "": ID: want 1 to 32`},
		{"same ID", append(rngSpecs(1), rngSpecs(1)...), `device "dev0": ID used by two devices`},
		{"two vsocks", []virtio.DeviceSpec{testSpec(0, virtio.IDVsock), testSpec(1, virtio.IDVsock)}, "2 vsock devices: a VM takes at most one"},
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
	v := &VM{cfg: Config{Spec: Spec{CPUs: 1}}, specs: rngSpecs(MaxVirtioDevices)}
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
