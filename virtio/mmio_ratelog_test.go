package virtio

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/internal/ratelog"
)

// TestMMIOResetStormIsRateLimited: a driver that breaks its queue (a head
// past the ring) or configures it outside RAM, then resets the device,
// 10,000 times, through a transport logging as the VMM sets it up (a
// rate-limited logger): at most the limiter's burst of warnings, then one
// summary line with the count. It was one line per reset once.
func TestMMIOResetStormIsRateLimited(t *testing.T) {
	const resets = 10000
	var out bytes.Buffer
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	limit := ratelog.New(slog.NewTextHandler(&out, nil), ratelog.Options{Now: func() time.Time { return now }})
	dev := &mmioFake{sizes: []uint16{8}}
	d := &mmioDriver{t: t, mem: vqMemory(t), dev: dev}
	d.m = NewMMIO(dev, d.mem, nil)
	d.m.SetLogger(slog.New(limit).With("device_id", "fake0"))
	broken := 0
	for i := range resets {
		if i%2 == 0 {
			// A head of 9 in a queue of 8.
			d.init(FeatureVersion1, 8)
			r := d.ring(0, 8)
			r.put(mmioQueueBase(0)+0x2000+4, uint16(9))
			r.put(mmioQueueBase(0)+0x2000+2, uint16(1))
			d.write(regQueueNotify, 0)
		} else {
			// Rings outside guest RAM: activation fails.
			d.write(regStatus, 0)
			d.write(regStatus, StatusAcknowledge|StatusDriver)
			d.write(regDriverFeatSel, 1)
			d.write(regDriverFeatures, 1)
			d.write(regStatus, StatusAcknowledge|StatusDriver|StatusFeaturesOK)
			d.write(regQueueSel, 0)
			d.write(regQueueNum, 8)
			d.write(regQueueDescHigh, 0x10)
			d.write(regQueueReady, 1)
			d.write(regStatus, StatusAcknowledge|StatusDriver|StatusFeaturesOK|StatusDriverOK)
		}
		if d.read(regStatus)&StatusNeedsReset != 0 {
			broken++
		}
		d.write(regStatus, 0) // reset
	}
	if broken != resets {
		t.Fatalf("the device needed reset %d times of %d", broken, resets)
	}
	during := strings.Count(out.String(), "\n")
	limit.Flush(context.Background())
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	t.Logf("%d device resets after a broken queue: %d log lines, then %d summary line(s): %s", resets, during, len(lines)-during, lines[len(lines)-1])
	if during > ratelog.DefaultBurst {
		t.Fatalf("%d log lines for %d resets, want at most %d", during, resets, ratelog.DefaultBurst)
	}
	if len(lines) != during+1 {
		t.Fatalf("%d lines after the flush, want %d and one summary", len(lines), during)
	}
	sum := lines[len(lines)-1]
	for _, want := range []string{ratelog.SummaryMessage, "virtio device needs reset", "suppressed=9990", "device_id=fake0"} {
		if !strings.Contains(sum, want) {
			t.Errorf("summary %q lacks %q", sum, want)
		}
	}
}
