package vmm

import (
	"testing"
	"time"
)

func TestCMOSRTC(t *testing.T) {
	now := time.Date(2026, 11, 29, 21, 4, 5, 0, time.UTC)
	c := newCMOSRTC(func() time.Time { return now })
	read := func(r uint8) uint8 {
		c.Write(0, []byte{r})
		b := []byte{0}
		c.Read(1, b)
		return b[0]
	}
	tests := []struct {
		reg  uint8
		want uint8
	}{
		{rtcSeconds, 0x05}, {rtcMinutes, 0x04}, {rtcHours, 0x21}, {rtcDay, 0x29},
		{rtcMonth, 0x11}, {rtcYear, 0x26}, {rtcCentury, 0x20}, {rtcWeekday, 0x01},
		{rtcRegA, 0x26}, {rtcRegD, rtcRegDValid},
	}
	for _, tt := range tests {
		if got := read(tt.reg); got != tt.want {
			t.Errorf("register %#x = %#x, want %#x", tt.reg, got, tt.want)
		}
	}
	// Binary mode, and CMOS RAM keeps what the guest writes.
	c.Write(0, []byte{rtcRegB})
	c.Write(1, []byte{rtcRegB24h | rtcRegBBinary})
	if got := read(rtcMinutes); got != 4 {
		t.Errorf("binary minutes = %d", got)
	}
	c.Write(0, []byte{0x40 | 0x80}) // NMI-mask bit set
	c.Write(1, []byte{0x5a})
	if got := read(0x40); got != 0x5a {
		t.Errorf("CMOS RAM 0x40 = %#x", got)
	}
	c.Write(0, []byte{rtcRegA})
	c.Write(1, []byte{0xa6})
	if got := read(rtcRegA); got&0x80 != 0 {
		t.Errorf("guest set UIP: %#x", got)
	}
}
