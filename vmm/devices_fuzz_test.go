package vmm

import (
	"encoding/binary"
	"testing"
	"time"

	"github.com/kilnvm/kiln/vmm/acpi"
)

// fuzzAccessSizes are the access widths a guest's port or MMIO access has,
// and 0, which no access has but a device must shrug off.
var fuzzAccessSizes = [...]int{1, 2, 4, 8, 0, 3}

// FuzzCMOSRTC drives the RTC/CMOS ports with a guest's accesses: the first
// 4 bytes give the host's clock (seconds from 1970, so years up to 2106),
// then each access is an opcode (bit 0: which port, bit 1: read or write,
// bits 2-4: access size) and, for a write, its value. The time registers
// must always read the host clock in the encoding register B asks for,
// the flags (register C, D, UIP) their fixed values, every other CMOS byte
// what the guest last wrote there, and every byte of a wide read the same.
func FuzzCMOSRTC(f *testing.F) {
	f.Add([]byte{0x80, 0x1f, 0x5f, 0x69, 0, rtcSeconds, 1, 0, rtcMinutes, 1, 0, rtcRegB, 2, rtcRegB24h | rtcRegBBinary, 0, rtcHours, 1, 9})
	f.Add([]byte{0, 0, 0, 0, 0, 0xc0, 2, 0x5a, 1, 0, rtcRegA, 2, 0xff, 1, 0, rtcRegC, 2, 0xff, 1, 0x0d, 0x11})
	f.Add([]byte{0xff, 0xff, 0xff, 0xff, 0, rtcCentury, 0x0d, 0, rtcYear, 0x11})
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) < 4 {
			return
		}
		now := time.Unix(int64(binary.LittleEndian.Uint32(data)), 0).UTC()
		data = data[4:]
		c := newCMOSRTC(func() time.Time { return now })
		var index uint8
		ram := c.ram // the model of what the guest may read back
		for len(data) > 0 {
			op := data[0]
			data = data[1:]
			port := uint64(op & 1)
			size := fuzzAccessSizes[int(op>>2&7)%len(fuzzAccessSizes)]
			if op&2 != 0 { // write
				var v byte
				if len(data) > 0 {
					v, data = data[0], data[1:]
				}
				b := make([]byte, size)
				if size > 0 {
					b[0] = v
				}
				c.Write(port, b)
				if size == 0 {
					continue
				}
				switch port {
				case 0:
					index = v & 0x7f
				case 1:
					switch index {
					case rtcSeconds, rtcMinutes, rtcHours, rtcWeekday, rtcDay, rtcMonth, rtcYear, rtcCentury, rtcRegC, rtcRegD:
					case rtcRegA:
						ram[index] = v & 0x7f
					default:
						ram[index] = v
					}
				}
				continue
			}
			b := make([]byte, size)
			for i := range b {
				b[i] = 0xee
			}
			c.Read(port, b)
			for i := 1; i < len(b); i++ {
				if b[i] != b[0] {
					t.Fatalf("a %d-byte read of port %d gave % x", size, port, b)
				}
			}
			if size == 0 {
				continue
			}
			got := b[0]
			if port == 0 {
				if got != index {
					t.Fatalf("index port reads %#x, want %#x", got, index)
				}
				continue
			}
			enc := func(v int) uint8 {
				if ram[rtcRegB]&rtcRegBBinary != 0 {
					return uint8(v)
				}
				return uint8(v/10<<4 | v%10)
			}
			var want uint8
			switch index {
			case rtcSeconds:
				want = enc(now.Second())
			case rtcMinutes:
				want = enc(now.Minute())
			case rtcHours:
				want = enc(now.Hour())
			case rtcWeekday:
				want = enc(int(now.Weekday()) + 1)
			case rtcDay:
				want = enc(now.Day())
			case rtcMonth:
				want = enc(int(now.Month()))
			case rtcYear:
				want = enc(now.Year() % 100)
			case rtcCentury:
				want = enc(now.Year() / 100)
			case rtcRegC:
				want = 0
			case rtcRegD:
				want = rtcRegDValid
			default:
				want = ram[index]
			}
			if got != want {
				t.Fatalf("CMOS register %#x reads %#x, want %#x (clock %v, register B %#x)", index, got, want, now, ram[rtcRegB])
			}
			if index == rtcRegA && got&0x80 != 0 {
				t.Fatal("update in progress is set")
			}
		}
	})
}

// FuzzPowerRegisters drives the guest-facing power devices: the ACPI sleep
// control/status and reset registers, the i8042's reset command port and
// the GED's event selector. Each 3-byte access is (device and read/write,
// offset, value) with an access size from the first byte; a 0xff device
// byte has the host raise GED events (the value's bits). Only the three
// documented writes (SLP_TYP=S5 with SLP_EN, 0x42 to the reset register,
// 0xfe to i8042 port 4) may stop the VM, each with its reason; reads of
// the power registers and the i8042 are zero; the GED's selector reads,
// in a 4-byte read at offset 0 only, exactly the events raised since the
// last such read, and the GED pulses its line once per raise.
func FuzzPowerRegisters(f *testing.F) {
	f.Add([]byte{0x01, 0, acpi.S5SleepType<<2 | acpi.SleepEnable})
	f.Add([]byte{0x01, 2, resetValue, 0x03, 4, 0xfe})
	f.Add([]byte{0xff, 0, 5, 0x0a, 0, 0, 0x0a, 0, 0, 0x06, 1, 0})
	f.Add([]byte{0x01, 0, acpi.S5SleepType << 2, 0x01, 0, 3<<2 | acpi.SleepEnable, 0x11, 2, resetValue})
	f.Fuzz(func(t *testing.T, data []byte) {
		type stop struct {
			r   Reason
			msg string
		}
		var stops []stop
		stopFn := func(r Reason, msg string) { stops = append(stops, stop{r, msg}) }
		pulses := 0
		power := &powerDevice{stop: stopFn}
		kbd := &i8042{stop: stopFn}
		ged := &gedDevice{pulse: func() { pulses++ }}
		var wantStops []Reason
		var pending uint32
		wantPulses := 0
		for len(data) >= 3 {
			op, off, v := data[0], uint64(data[1]), data[2]
			data = data[3:]
			if op == 0xff {
				ged.raise(uint32(v))
				pending |= uint32(v)
				wantPulses++
				continue
			}
			size := fuzzAccessSizes[int(op>>4)%len(fuzzAccessSizes)]
			b := make([]byte, size)
			var dev Device
			switch op >> 2 & 3 {
			case 0:
				dev, off = power, off%powerSize
			case 1:
				dev, off = kbd, off%5
			default:
				dev, off = ged, off%gedSize
			}
			if op&1 != 0 {
				if size > 0 {
					b[0] = v
				}
				dev.Write(off, b)
				if size == 0 {
					continue
				}
				switch {
				case dev == Device(power) && off == powerSleepControl && v&acpi.SleepEnable != 0 && v>>2&7 == acpi.S5SleepType:
					wantStops = append(wantStops, ReasonPowerOff)
				case dev == Device(power) && off == powerReset && v == resetValue:
					wantStops = append(wantStops, ReasonReboot)
				case dev == Device(kbd) && off == 4 && v == 0xfe:
					wantStops = append(wantStops, ReasonReboot)
				}
				continue
			}
			for i := range b {
				b[i] = 0xee
			}
			dev.Read(off, b)
			want := make([]byte, size)
			if dev == Device(ged) && off == 0 && size == 4 {
				binary.LittleEndian.PutUint32(want, pending)
				pending = 0
			}
			if string(b) != string(want) {
				t.Fatalf("read of %d bytes at %#x of %T: % x, want % x", size, off, dev, b, want)
			}
		}
		if len(stops) != len(wantStops) {
			t.Fatalf("%d stops, want %d: %v", len(stops), len(wantStops), stops)
		}
		for i, s := range stops {
			if s.r != wantStops[i] || s.msg == "" {
				t.Fatalf("stop %d: %v %q, want reason %v", i, s.r, s.msg, wantStops[i])
			}
		}
		if pulses != wantPulses {
			t.Fatalf("%d GED pulses for %d raises", pulses, wantPulses)
		}
	})
}
