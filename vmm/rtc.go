package vmm

import (
	"sync"
	"time"
)

// cmosRTC is the PC's MC146818 real-time clock and CMOS RAM at ports
// 0x70-0x71. The clock reads the host's UTC time (the guest's writes to the
// time registers are ignored); the rest of the 128 bytes of CMOS RAM keep
// what the guest writes. The update-in-progress bit is never set, so a
// kernel's RTC probe neither waits nor fails.
type cmosRTC struct {
	mu    sync.Mutex
	index uint8
	ram   [128]uint8
	now   func() time.Time
}

// CMOS registers.
const (
	rtcSeconds = 0x00
	rtcMinutes = 0x02
	rtcHours   = 0x04
	rtcWeekday = 0x06
	rtcDay     = 0x07
	rtcMonth   = 0x08
	rtcYear    = 0x09
	rtcRegA    = 0x0a
	rtcRegB    = 0x0b
	rtcRegC    = 0x0c
	rtcRegD    = 0x0d
	rtcCentury = 0x32

	rtcRegBBinary = 0x04
	rtcRegB24h    = 0x02
	rtcRegDValid  = 0x80
)

func newCMOSRTC(now func() time.Time) *cmosRTC {
	c := &cmosRTC{now: now}
	c.ram[rtcRegA] = 0x26 // 32.768 kHz time base, 1.024 kHz rate, no update in progress
	c.ram[rtcRegB] = rtcRegB24h
	c.ram[rtcRegD] = rtcRegDValid
	return c
}

func bcd(v int) uint8 { return uint8(v/10<<4 | v%10) }

func (c *cmosRTC) Read(offset uint64, data []byte) {
	c.mu.Lock()
	defer c.mu.Unlock()
	v := uint8(0xff)
	switch offset {
	case 0:
		v = c.index
	case 1:
		v = c.register(c.index & 0x7f)
	}
	for i := range data {
		data[i] = v
	}
}

func (c *cmosRTC) register(r uint8) uint8 {
	t := c.now().UTC()
	enc := bcd
	if c.ram[rtcRegB]&rtcRegBBinary != 0 {
		enc = func(v int) uint8 { return uint8(v) }
	}
	switch r {
	case rtcSeconds:
		return enc(t.Second())
	case rtcMinutes:
		return enc(t.Minute())
	case rtcHours:
		return enc(t.Hour())
	case rtcWeekday:
		return enc(int(t.Weekday()) + 1)
	case rtcDay:
		return enc(t.Day())
	case rtcMonth:
		return enc(int(t.Month()))
	case rtcYear:
		return enc(t.Year() % 100)
	case rtcCentury:
		return enc(t.Year() / 100)
	case rtcRegC:
		return 0 // no interrupt flags pending
	}
	return c.ram[r]
}

func (c *cmosRTC) Write(offset uint64, data []byte) {
	if len(data) == 0 {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	switch offset {
	case 0:
		c.index = data[0] & 0x7f // bit 7 is the NMI mask
	case 1:
		switch r := c.index; r {
		case rtcSeconds, rtcMinutes, rtcHours, rtcWeekday, rtcDay, rtcMonth, rtcYear, rtcCentury, rtcRegC, rtcRegD:
			// The clock follows the host; flags are read-only.
		case rtcRegA:
			c.ram[r] = data[0] & 0x7f // UIP is read-only
		default:
			c.ram[r] = data[0]
		}
	}
}
