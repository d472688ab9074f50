package acpi

import (
	"bytes"
	"encoding/binary"
	"errors"
	"strings"
	"testing"
)

// baseConfig is a machine like the one the lead builds: tables at 0xE0000,
// COM1, devices and registers in a window below the I/O APIC.
func baseConfig(cpus int) Config {
	return Config{
		Base:         0xE0000,
		CPUs:         cpus,
		Serial:       []SerialPort{{Port: 0x3F8, IRQ: 4}},
		SleepControl: 0xD0000000,
		SleepStatus:  0xD0000001,
		ResetReg:     0xD0000002,
		ResetValue:   0x42,
	}
}

// fullConfig adds every optional device.
func fullConfig(cpus int) Config {
	cfg := baseConfig(cpus)
	cfg.Serial = append(cfg.Serial, SerialPort{Port: 0x2F8, IRQ: 3})
	for i := range 4 {
		cfg.VirtioMMIO = append(cfg.VirtioMMIO, MMIODevice{Base: 0xD0001000 + uint64(i)*0x1000, Size: 0x1000, GSI: uint32(5 + i)})
	}
	cfg.GED = &GED{Base: 0xD0000100, GSI: 16}
	cfg.VMGenID = &VMGenID{Addr: 0x1_2345_6780}
	return cfg
}

// tables is an image split into its tables, each checked on the way.
type tables struct {
	rsdp, xsdt, fadt, madt, dsdt []byte
}

// parseImage follows RSDP -> XSDT -> FADT/MADT and FADT -> DSDT through
// img, as a guest would, checking signatures, lengths and checksums.
func parseImage(t *testing.T, img *Image) tables {
	t.Helper()
	at := func(addr uint64, n int, what string) []byte {
		t.Helper()
		if addr < img.Base || addr-img.Base+uint64(n) > uint64(img.Len()) {
			t.Fatalf("%s: %d bytes at %#x lie outside the image [%#x, %#x)", what, n, addr, img.Base, img.Base+uint64(img.Len()))
		}
		if addr%tableAlign != 0 {
			t.Errorf("%s at %#x is not 16-byte aligned", what, addr)
		}
		return img.Bytes[addr-img.Base : addr-img.Base+uint64(n)]
	}
	table := func(addr uint64, sig string) []byte {
		t.Helper()
		h := at(addr, headerSize, sig)
		if got := string(h[0:4]); got != sig {
			t.Fatalf("table at %#x has signature %q, want %q", addr, got, sig)
		}
		tb := at(addr, int(binary.LittleEndian.Uint32(h[4:8])), sig)
		checkSum(t, sig, tb)
		if got := string(tb[10:16]); got != "KILN  " {
			t.Errorf("%s OEM ID %q, want %q", sig, got, "KILN  ")
		}
		if got := string(tb[16:24]); got != "KILNVMM " {
			t.Errorf("%s OEM table ID %q, want %q", sig, got, "KILNVMM ")
		}
		if got := string(tb[28:32]); got != "KILN" {
			t.Errorf("%s creator ID %q, want %q", sig, got, "KILN")
		}
		return tb
	}

	if img.Len() != len(img.Bytes) {
		t.Fatalf("Len() = %d, want %d", img.Len(), len(img.Bytes))
	}
	var ts tables
	ts.rsdp = at(img.RSDP, rsdpSize, "RSDP")
	if string(ts.rsdp[0:8]) != "RSD PTR " {
		t.Fatalf("RSDP signature %q", ts.rsdp[0:8])
	}
	checkSum(t, "RSDP (first 20 bytes)", ts.rsdp[:20])
	checkSum(t, "RSDP (extended)", ts.rsdp)
	if ts.rsdp[15] != 2 {
		t.Errorf("RSDP revision %d, want 2", ts.rsdp[15])
	}
	if got := binary.LittleEndian.Uint32(ts.rsdp[20:24]); got != 36 {
		t.Errorf("RSDP length %d, want 36", got)
	}
	if got := string(ts.rsdp[9:15]); got != "KILN  " {
		t.Errorf("RSDP OEM ID %q", got)
	}
	ts.xsdt = table(binary.LittleEndian.Uint64(ts.rsdp[24:32]), "XSDT")
	entries := (len(ts.xsdt) - headerSize) / 8
	if entries != 2 || len(ts.xsdt) != headerSize+8*entries {
		t.Fatalf("XSDT of %d bytes, want 2 entries", len(ts.xsdt))
	}
	ts.fadt = table(binary.LittleEndian.Uint64(ts.xsdt[36:]), "FACP")
	ts.madt = table(binary.LittleEndian.Uint64(ts.xsdt[44:]), "APIC")
	ts.dsdt = table(binary.LittleEndian.Uint64(ts.fadt[fadtXDSDT:]), "DSDT")
	return ts
}

func checkSum(t *testing.T, what string, b []byte) {
	t.Helper()
	var sum byte
	for _, c := range b {
		sum += c
	}
	if sum != 0 {
		t.Errorf("%s: bytes sum to %#x, want 0", what, sum)
	}
}

func TestBuildTables(t *testing.T) {
	tests := []struct {
		name string
		cfg  Config
	}{
		{"1 CPU, serial only", baseConfig(1)},
		{"2 CPUs, all devices", fullConfig(2)},
		{"8 CPUs, all devices", fullConfig(8)},
		{"254 CPUs", fullConfig(254)},
		{"no devices", func() Config { c := baseConfig(1); c.Serial = nil; return c }()},
		{"tables above 4 GiB", func() Config { c := fullConfig(3); c.Base = 0x2_0000_0000; return c }()},
		{"GED without VMGenID", func() Config { c := fullConfig(2); c.VMGenID = nil; return c }()},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			img, err := Build(tt.cfg)
			if err != nil {
				t.Fatalf("Build: %v", err)
			}
			if img.Base != tt.cfg.Base || img.RSDP != tt.cfg.Base {
				t.Errorf("Base %#x RSDP %#x, want both %#x", img.Base, img.RSDP, tt.cfg.Base)
			}
			ts := parseImage(t, img)
			if got := len(ts.rsdp); got != 36 {
				t.Errorf("RSDP is %d bytes, want 36", got)
			}
			if got := len(ts.fadt); got != 276 {
				t.Errorf("FADT is %d bytes, want 276", got)
			}
			wantMADT := 44 + 8*tt.cfg.CPUs + 12 + 6
			if len(ts.madt) != wantMADT {
				t.Errorf("MADT is %d bytes, want %d", len(ts.madt), wantMADT)
			}
			if ts.dsdt[8] != 2 {
				t.Errorf("DSDT revision %d, want 2", ts.dsdt[8])
			}
			for _, want := range dsdtNames(tt.cfg) {
				if !bytes.Contains(ts.dsdt, []byte(want)) {
					t.Errorf("DSDT lacks %q", want)
				}
			}
			if tt.cfg.GED == nil && bytes.Contains(ts.dsdt, []byte("ACPI0013")) {
				t.Error("DSDT has a GED that was not configured")
			}
		})
	}
}

// dsdtNames lists strings the DSDT of cfg must hold.
func dsdtNames(cfg Config) []string {
	names := []string{"_SB_", "_S5_"}
	for i := range cfg.Serial {
		names = append(names, "COM"+string(rune('1'+i)))
	}
	for range cfg.VirtioMMIO {
		names = append(names, "LNRO0005")
	}
	if cfg.GED != nil {
		names = append(names, "GED_", "ACPI0013", "PWRB", "_EVT", "ESEL")
	}
	if cfg.VMGenID != nil {
		names = append(names, "VGEN", "VM_Gen_Counter", "VMGENCTR", "ADDR")
	}
	return names
}

func TestFADTFields(t *testing.T) {
	cfg := fullConfig(2)
	img, err := Build(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ts := parseImage(t, img)
	f := ts.fadt
	u8 := func(off int) uint64 { return uint64(f[off]) }
	u16 := func(off int) uint64 { return uint64(binary.LittleEndian.Uint16(f[off:])) }
	u32 := func(off int) uint64 { return uint64(binary.LittleEndian.Uint32(f[off:])) }
	u64 := func(off int) uint64 { return binary.LittleEndian.Uint64(f[off:]) }
	dsdtAddr := img.Base + uint64(bytes.Index(img.Bytes, ts.dsdt))

	// Offsets from ACPI 6.5, table 5.9.
	tests := []struct {
		field string
		got   uint64
		want  uint64
	}{
		{"Revision", u8(8), 6},
		{"FIRMWARE_CTRL", u32(36), 0},
		{"DSDT", u32(40), 0},
		{"SCI_INT", u16(46), 0},
		{"SMI_CMD", u32(48), 0},
		{"PM1a_EVT_BLK", u32(56), 0},
		{"PM1a_CNT_BLK", u32(64), 0},
		{"PM_TMR_BLK", u32(76), 0},
		{"IAPC_BOOT_ARCH", u16(109), 1<<2 | 1<<3},
		{"Flags", u32(112), 1<<20 | 1<<10},
		{"RESET_REG.SpaceID", u8(116), 0},
		{"RESET_REG.BitWidth", u8(117), 8},
		{"RESET_REG.BitOffset", u8(118), 0},
		{"RESET_REG.AccessSize", u8(119), 1},
		{"RESET_REG.Address", u64(120), cfg.ResetReg},
		{"RESET_VALUE", u8(128), 0x42},
		{"FADT Minor Version", u8(131), 5},
		{"X_FIRMWARE_CTRL", u64(132), 0},
		{"X_DSDT", u64(140), dsdtAddr},
		{"X_PM1a_EVT_BLK.Address", u64(152), 0},
		{"SLEEP_CONTROL_REG.SpaceID", u8(244), 0},
		{"SLEEP_CONTROL_REG.BitWidth", u8(245), 8},
		{"SLEEP_CONTROL_REG.AccessSize", u8(247), 1},
		{"SLEEP_CONTROL_REG.Address", u64(248), cfg.SleepControl},
		{"SLEEP_STATUS_REG.SpaceID", u8(256), 0},
		{"SLEEP_STATUS_REG.BitWidth", u8(257), 8},
		{"SLEEP_STATUS_REG.AccessSize", u8(259), 1},
		{"SLEEP_STATUS_REG.Address", u64(260), cfg.SleepStatus},
	}
	for _, tt := range tests {
		if tt.got != tt.want {
			t.Errorf("FADT %s = %#x, want %#x", tt.field, tt.got, tt.want)
		}
	}
	if got := string(f[268:276]); got != "KILNVMM\x00" {
		t.Errorf("FADT hypervisor vendor identity %q, want %q", got, "KILNVMM\x00")
	}
}

func TestMADTEntries(t *testing.T) {
	for _, cpus := range []int{1, 2, 8, 254} {
		cfg := baseConfig(cpus)
		cfg.LAPICAddr = 0xFEE00000
		cfg.IOAPICAddr = 0 // default
		img, err := Build(cfg)
		if err != nil {
			t.Fatalf("%d CPUs: %v", cpus, err)
		}
		m := parseImage(t, img).madt
		if got := binary.LittleEndian.Uint32(m[36:]); got != 0xFEE00000 {
			t.Errorf("%d CPUs: local APIC address %#x", cpus, got)
		}
		if got := binary.LittleEndian.Uint32(m[40:]); got != 1 {
			t.Errorf("%d CPUs: MADT flags %#x, want PCAT_COMPAT", cpus, got)
		}
		count := map[byte]int{}
		for p := m[44:]; len(p) > 0; {
			if len(p) < 2 || int(p[1]) < 2 || int(p[1]) > len(p) {
				t.Fatalf("%d CPUs: truncated MADT entry % x", cpus, p)
			}
			e := p[:p[1]]
			p = p[p[1]:]
			switch e[0] {
			case 0: // Processor Local APIC
				i := count[0]
				if len(e) != 8 || e[2] != byte(i) || e[3] != byte(i) || binary.LittleEndian.Uint32(e[4:]) != 1 {
					t.Errorf("%d CPUs: local APIC entry %d = % x, want UID = APIC ID = %d, enabled", cpus, i, e, i)
				}
			case 1: // I/O APIC
				if len(e) != 12 || e[2] != 0 || binary.LittleEndian.Uint32(e[4:]) != DefaultIOAPICAddr || binary.LittleEndian.Uint32(e[8:]) != 0 {
					t.Errorf("%d CPUs: I/O APIC entry % x", cpus, e)
				}
			case 4: // Local APIC NMI
				if len(e) != 6 || e[2] != 0xFF || binary.LittleEndian.Uint16(e[3:]) != 0 || e[5] != 1 {
					t.Errorf("%d CPUs: local APIC NMI entry % x, want all processors, LINT1", cpus, e)
				}
			default:
				t.Errorf("%d CPUs: unexpected MADT entry type %d", cpus, e[0])
			}
			count[e[0]]++
		}
		if count[0] != cpus || count[1] != 1 || count[4] != 1 {
			t.Errorf("%d CPUs: MADT has %d local APICs, %d I/O APICs, %d NMIs; want %d, 1, 1", cpus, count[0], count[1], count[4], cpus)
		}
	}
}

func TestBuildDeterministic(t *testing.T) {
	a, err := Build(fullConfig(4))
	if err != nil {
		t.Fatal(err)
	}
	b, err := Build(fullConfig(4))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a.Bytes, b.Bytes) {
		t.Error("two builds of one config differ")
	}
}

func TestBuildErrors(t *testing.T) {
	tests := []struct {
		name  string
		edit  func(*Config)
		field string
	}{
		{"no CPUs", func(c *Config) { c.CPUs = 0 }, "CPUs"},
		{"negative CPUs", func(c *Config) { c.CPUs = -1 }, "CPUs"},
		{"255 CPUs", func(c *Config) { c.CPUs = 255 }, "CPUs"},
		{"zero base", func(c *Config) { c.Base = 0 }, "Base"},
		{"unaligned base", func(c *Config) { c.Base = 0xE0008 }, "Base"},
		{"tables wrap", func(c *Config) { c.Base = 1<<64 - 0x100 }, "Base"},
		{"tables over MMIO", func(c *Config) { c.Base = 0xD0001000 - 0x40 }, "Base"},
		{"unaligned LAPIC", func(c *Config) { c.LAPICAddr = 0xFEE00010 }, "LAPICAddr"},
		{"unaligned IOAPIC", func(c *Config) { c.IOAPICAddr = 0xFEC00100 }, "IOAPICAddr"},
		{"serial port 0", func(c *Config) { c.Serial[0].Port = 0 }, "Serial[0].Port"},
		{"serial port past 0xFFFF", func(c *Config) { c.Serial[0].Port = 0xFFFC }, "Serial[0].Port"},
		{"serial ports overlap", func(c *Config) { c.Serial[1].Port = 0x3FC }, "Serial[1].Port"},
		{"serial IRQ 24", func(c *Config) { c.Serial[0].IRQ = 24 }, "Serial[0].IRQ"},
		{"too many serial ports", func(c *Config) {
			for i := range 8 {
				c.Serial = append(c.Serial, SerialPort{Port: uint16(0x100 + 8*i), IRQ: uint32(17 + i%7)})
			}
		}, "Serial"},
		{"virtio base 0", func(c *Config) { c.VirtioMMIO[0].Base = 0 }, "VirtioMMIO[0].Base"},
		{"virtio base unaligned", func(c *Config) { c.VirtioMMIO[1].Base++ }, "VirtioMMIO[1].Base"},
		{"virtio size 0", func(c *Config) { c.VirtioMMIO[2].Size = 0 }, "VirtioMMIO[2].Size"},
		{"virtio above 4 GiB", func(c *Config) { c.VirtioMMIO[3].Base = 0xFFFFFF00; c.VirtioMMIO[3].Size = 0x200 }, "VirtioMMIO[3].Base"},
		{"virtio size wraps", func(c *Config) { c.VirtioMMIO[3].Size = 1<<64 - 0x100 }, "VirtioMMIO[3].Base"},
		{"virtio overlap", func(c *Config) { c.VirtioMMIO[1].Base = 0xD0001800 }, "VirtioMMIO[1]"},
		{"virtio over IOAPIC", func(c *Config) { c.VirtioMMIO[0].Base = 0xFEC00000 }, "VirtioMMIO[0]"},
		{"virtio over LAPIC", func(c *Config) { c.VirtioMMIO[0].Base = 0xFEDFF000; c.VirtioMMIO[0].Size = 0x2000 }, "LAPICAddr"},
		{"virtio GSI 24", func(c *Config) { c.VirtioMMIO[0].GSI = 24 }, "VirtioMMIO[0].GSI"},
		{"virtio GSI shared with serial", func(c *Config) { c.VirtioMMIO[2].GSI = 4 }, "VirtioMMIO[2].GSI"},
		{"virtio GSIs shared", func(c *Config) { c.VirtioMMIO[3].GSI = c.VirtioMMIO[0].GSI }, "VirtioMMIO[3].GSI"},
		{"sleep control 0", func(c *Config) { c.SleepControl = 0 }, "SleepControl"},
		{"sleep status 0", func(c *Config) { c.SleepStatus = 0 }, "SleepStatus"},
		{"reset 0", func(c *Config) { c.ResetReg = 0 }, "ResetReg"},
		{"sleep registers equal", func(c *Config) { c.SleepStatus = c.SleepControl }, "Sleep"},
		{"reset in virtio window", func(c *Config) { c.ResetReg = 0xD0001004 }, "ResetReg"},
		{"reset at top of memory", func(c *Config) { c.ResetReg = 1<<64 - 1 }, "ResetReg"},
		{"GED base 0", func(c *Config) { c.GED.Base = 0 }, "GED.Base"},
		{"GED base unaligned", func(c *Config) { c.GED.Base = 0xD0000102 }, "GED.Base"},
		{"GED over sleep registers", func(c *Config) { c.GED.Base = 0xD0000000 }, "GED.Base"},
		{"GED GSI 24", func(c *Config) { c.GED.GSI = 24 }, "GED.GSI"},
		{"GED GSI shared", func(c *Config) { c.GED.GSI = 5 }, "GED.GSI"},
		{"VMGenID 0", func(c *Config) { c.VMGenID.Addr = 0 }, "VMGenID.Addr"},
		{"VMGenID unaligned", func(c *Config) { c.VMGenID.Addr = 0x1004 }, "VMGenID.Addr"},
		{"VMGenID over tables", func(c *Config) { c.VMGenID.Addr = 0xE0040 }, "VMGenID.Addr"},
		{"VMGenID wraps", func(c *Config) { c.VMGenID.Addr = 1<<64 - 8 }, "VMGenID.Addr"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := fullConfig(2)
			tt.edit(&cfg)
			img, err := Build(cfg)
			if err == nil {
				t.Fatalf("Build succeeded (%d bytes), want an error naming %s", img.Len(), tt.field)
			}
			var ce *ConfigError
			if !errors.As(err, &ce) {
				t.Fatalf("Build error %q is not a *ConfigError", err)
			}
			if !strings.Contains(err.Error(), tt.field) {
				t.Errorf("Build error %q does not name %s", err, tt.field)
			}
		})
	}
}

// TestVirtioInterruptTrigger checks that MMIODevice.Edge flips the Extended
// Interrupt descriptor's trigger bit (bit 1: 1 edge, 0 level) and nothing
// else about it.
func TestVirtioInterruptTrigger(t *testing.T) {
	flags := func(edge bool) byte {
		cfg := baseConfig(1)
		cfg.VirtioMMIO = []MMIODevice{{Base: 0xD0001000, Size: 0x1000, GSI: 5, Edge: edge}}
		img, err := Build(cfg)
		if err != nil {
			t.Fatal(err)
		}
		// Extended Interrupt: 0x89, length (2 bytes), flags, count 1, GSI 5.
		i := bytes.Index(img.Bytes, []byte{0x89, 0x06, 0x00})
		if i < 0 || img.Bytes[i+4] != 1 || img.Bytes[i+5] != 5 {
			t.Fatalf("no Extended Interrupt descriptor for GSI 5 in the tables")
		}
		return img.Bytes[i+3]
	}
	level, edge := flags(false), flags(true)
	if level&0x02 != 0 || edge&0x02 == 0 || level|0x02 != edge {
		t.Errorf("flags level %#x, edge %#x", level, edge)
	}
}
