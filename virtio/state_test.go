package virtio

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/memory"
)

// copyMemory returns a new memory with src's layout and contents, as a
// restore from a snapshot would have it.
func copyMemory(t *testing.T, src *memory.Memory) *memory.Memory {
	t.Helper()
	dst := vqMemory(t)
	for i := range src.Regions() {
		copy(dst.Host(i), src.Host(i))
	}
	return dst
}

func usedIdx(t *testing.T, mem *memory.Memory, queue int) uint16 {
	t.Helper()
	var b [2]byte
	if err := mem.ReadAt(b[:], mmioQueueBase(queue)+0x3000+2); err != nil {
		t.Fatal(err)
	}
	return uint16(b[0]) | uint16(b[1])<<8
}

// savedDriver runs a driver through initialization and one request on
// queue 0, then pauses and saves the transport.
func savedDriver(t *testing.T) (*mmioDriver, MMIOState) {
	t.Helper()
	dev := &mmioFake{sizes: []uint16{16, 8}, config: []byte{9, 8, 7, 6}}
	d := newMMIODriver(t, dev)
	feat := uint64(FeatureVersion1 | FeatureEventIdx)
	d.init(feat, 8)
	d.submit(0, 8, 0, 0, 0x1000)
	d.write(regQueueNotify, 0)
	if got := usedIdx(t, d.mem, 0); got != 1 {
		t.Fatalf("used index %d after one request", got)
	}
	d.m.ConfigChanged()
	if err := d.m.Pause(context.Background()); err != nil {
		t.Fatal(err)
	}
	st, err := d.m.SaveState()
	if err != nil {
		t.Fatal(err)
	}
	// Through JSON, as a snapshot stores it.
	b, err := json.Marshal(st)
	if err != nil {
		t.Fatal(err)
	}
	var back MMIOState
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	return d, back
}

func TestMMIOStateRoundTrip(t *testing.T) {
	d, st := savedDriver(t)
	if st.DeviceID != 42 || st.Status&StatusDriverOK == 0 || len(st.Queues) != 2 {
		t.Fatalf("saved state %+v", st)
	}
	if q := st.Queues[0]; !q.Active || q.LastAvail != 1 || q.UsedIdx != 1 || q.Size != 8 {
		t.Fatalf("queue 0 state %+v", q)
	}

	// A new transport and device over a copy of memory continue where
	// the old one stopped.
	dev2 := &mmioFake{sizes: []uint16{16, 8}, config: make([]byte, 4)}
	d2 := &mmioDriver{t: t, mem: copyMemory(t, d.mem), dev: dev2}
	d2.m = NewMMIO(dev2, d2.mem, func(level bool) { d2.level = level; d2.edges++ })
	if err := d2.m.RestoreState(st); err != nil {
		t.Fatal(err)
	}
	if dev2.activated != 1 || dev2.gotFeat != st.DriverFeatures || string(dev2.config) != "\x09\x08\x07\x06" {
		t.Fatalf("device after restore: %d activations, features %#x, config %v", dev2.activated, dev2.gotFeat, dev2.config)
	}
	for _, r := range []struct {
		reg  uint64
		want uint32
	}{
		{regStatus, st.Status},
		{regConfigGeneration, 1},
		{regInterruptStatus, st.InterruptStatus},
	} {
		if got := d2.read(r.reg); got != r.want {
			t.Errorf("register %#x = %#x after restore, want %#x", r.reg, got, r.want)
		}
	}
	if st.InterruptStatus != 0 && !d2.level {
		t.Error("pending interrupt not raised after restore")
	}
	d2.write(regQueueSel, 0)
	if d2.read(regQueueReady) != 1 {
		t.Fatal("queue 0 not ready after restore")
	}
	// The next request is the second entry of the rings.
	d2.submit(0, 8, 2, 1, 0x1800)
	d2.write(regQueueNotify, 0)
	if got := usedIdx(t, d2.mem, 0); got != 2 {
		t.Fatalf("used index %d after a request on the restored device, want 2", got)
	}
	if got := usedIdx(t, d.mem, 0); got != 1 {
		t.Fatalf("the original's memory changed: used index %d", got)
	}

	// The original resumes too, and serves on.
	d.m.Resume()
	d.submit(0, 8, 2, 1, 0x1800)
	d.write(regQueueNotify, 0)
	if got := usedIdx(t, d.mem, 0); got != 2 {
		t.Fatalf("used index %d after resume, want 2", got)
	}
}

func TestMMIOPauseWaitsForHeldChains(t *testing.T) {
	dev := &mmioFake{sizes: []uint16{8}, config: []byte{}}
	d := newMMIODriver(t, dev)
	d.init(FeatureVersion1, 8)
	if _, err := d.m.SaveState(); !errors.Is(err, ErrNotPaused) {
		t.Fatalf("SaveState while running: %v, want ErrNotPaused", err)
	}
	d.submit(0, 8, 0, 0, 0x1000)
	q := dev.queues[0]
	c, ok, err := q.Pop() // the device holds a chain
	if !ok || err != nil {
		t.Fatalf("Pop: %v %v", ok, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if err := d.m.Pause(ctx); !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "1 chains still held") {
		t.Fatalf("Pause with a held chain: %v", err)
	}
	// Paused, the queue gives out nothing more.
	d.submit(0, 8, 2, 1, 0x1800)
	if _, ok, _ := q.Pop(); ok {
		t.Fatal("Pop on a paused queue gave a chain")
	}
	done := make(chan error, 1)
	go func() { done <- d.m.Pause(context.Background()) }()
	time.Sleep(5 * time.Millisecond)
	if err := q.Push(c, 0); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("Pause after the push: %v", err)
	}
	st, err := d.m.SaveState()
	if err != nil {
		t.Fatal(err)
	}
	if st.Queues[0].LastAvail != 1 || st.Queues[0].UsedIdx != 1 {
		t.Fatalf("queue state %+v", st.Queues[0])
	}
	// Resume tells the device to look: the request made while paused is
	// served.
	d.m.Resume()
	if got := usedIdx(t, d.mem, 0); got != 2 {
		t.Fatalf("used index %d after resume, want 2", got)
	}
}

func TestMMIORestoreStateBad(t *testing.T) {
	_, good := savedDriver(t)
	clone := func(f func(*MMIOState)) MMIOState {
		st := good
		st.Queues = append([]QueueState(nil), good.Queues...)
		f(&st)
		return st
	}
	for _, tc := range []struct {
		name string
		st   MMIOState
		want string
	}{
		{"other device", clone(func(s *MMIOState) { s.DeviceID = 2 }), "device type 2"},
		{"queue count", clone(func(s *MMIOState) { s.Queues = s.Queues[:1] }), "1 queues"},
		{"queue too big", clone(func(s *MMIOState) { s.Queues[1].Size = 64 }), "over the device's maximum"},
		{"status bits", clone(func(s *MMIOState) { s.Status |= 0x100 }), "unknown bits"},
		{"features", clone(func(s *MMIOState) { s.DriverFeatures |= 1 << 3 }), "does not offer"},
		{"active not ready", clone(func(s *MMIOState) { s.Queues[0].Ready = false }), "active but not ready"},
		{"used index", clone(func(s *MMIOState) { s.Queues[0].UsedIdx = 7 }), "memory and device state do not match"},
		{"rings outside memory", clone(func(s *MMIOState) { s.Queues[0].DescAddr = 1 << 40 }), "descriptor table"},
		{"bad size", clone(func(s *MMIOState) { s.Queues[0].Size = 6 }), "not a power of 2"},
		{"device state", clone(func(s *MMIOState) { s.Device = json.RawMessage(`"AQI="`) }), "config length"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d, _ := savedDriver(t)
			dev := &mmioFake{sizes: []uint16{16, 8}, config: make([]byte, 4)}
			m := NewMMIO(dev, d.mem, func(bool) {})
			err := m.RestoreState(tc.st)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("RestoreState: %v, want an error containing %q", err, tc.want)
			}
			var b [4]byte
			m.Read(regStatus, b[:])
			if b != [4]byte{} {
				t.Fatalf("status %v after a failed restore, want 0", b)
			}
		})
	}
}

func TestMMIORestoreFailedDevice(t *testing.T) {
	_, st := savedDriver(t)
	st.Status |= StatusNeedsReset
	st.Failed = "queue 0: malformed virtqueue"
	dev := &mmioFake{sizes: []uint16{16, 8}, config: make([]byte, 4)}
	d := newMMIODriver(t, dev)
	if err := d.m.RestoreState(st); err != nil {
		t.Fatal(err)
	}
	if dev.activated != 0 || d.m.Err() == nil || d.read(regStatus)&StatusNeedsReset == 0 {
		t.Fatalf("a device that needed reset: %d activations, err %v, status %#x", dev.activated, d.m.Err(), d.read(regStatus))
	}
	// The driver resets it and starts over.
	d.init(FeatureVersion1, 8)
	if dev.activated != 1 || d.m.Err() != nil {
		t.Fatalf("after reset: %d activations, err %v", dev.activated, d.m.Err())
	}
}

func TestDeviceStates(t *testing.T) {
	img := blkImage(t, "disk.img", 8*BlockSectorSize)
	blk := newTestBlock(t, BlockConfig{Path: img, ID: "root"})
	saved, err := blk.SaveState()
	if err != nil {
		t.Fatal(err)
	}
	if err := blk.RestoreState(saved); err != nil {
		t.Fatalf("block restore of its own state: %v", err)
	}
	rng := NewRNG()
	rs, _ := rng.SaveState()
	for _, tc := range []struct {
		name string
		dev  Device
		st   string
		want string
	}{
		{"blk size", blk, `{"capacity_sectors":16,"read_only":false,"id":"root"}`, "image has 8 sectors, the snapshot's disk had 16"},
		{"blk ro", blk, `{"capacity_sectors":8,"read_only":true,"id":"root"}`, "read-only is false"},
		{"blk id", blk, `{"capacity_sectors":8,"read_only":false,"id":"data"}`, `ID "root"`},
		{"blk unknown field", blk, `{"capacity_sectors":8,"mac":"x"}`, "unknown field"},
		{"blk empty", blk, ``, "no device state"},
		{"rng other", rng, `{"guest_cid":3}`, "unknown field"},
		{"rng ok", rng, string(rs), ""},
		{"rng garbage", rng, `[1,2`, "decoding"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.dev.RestoreState(json.RawMessage(tc.st))
			if tc.want == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("RestoreState(%s): %v, want %q", tc.st, err, tc.want)
			}
		})
	}
}

// FuzzMMIORestoreState feeds arbitrary snapshot state to a transport: it
// must be refused or taken, never panic.
func FuzzMMIORestoreState(f *testing.F) {
	f.Add([]byte(`{"device_id":42,"status":15,"driver_features":4294967296,"queues":[{"size":8,"ready":true,"desc_addr":131072,"driver_addr":139264,"device_addr":143360,"active":true},{"size":8}],"device":"AAAAAA=="}`))
	f.Add([]byte(`{"device_id":42,"queues":[{},{}]}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		var st MMIOState
		if json.Unmarshal(data, &st) != nil {
			return
		}
		dev := &mmioFake{sizes: []uint16{16, 8}, config: make([]byte, 4)}
		d := &mmioDriver{mem: vqMemory(t), dev: dev}
		d.m = NewMMIO(dev, d.mem, func(bool) {})
		if d.m.RestoreState(st) == nil {
			d.write(regQueueNotify, 0)
			d.write(regQueueNotify, 1)
			d.m.Reset()
		}
	})
}

// TestVsockRestoreSendsTransportReset: a vsock device restored from a
// snapshot tells the guest its connections are gone once it is active.
func TestVsockRestoreSendsTransportReset(t *testing.T) {
	g := newVsockTestGuest(t)
	st, err := g.v.SaveState()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(st), `"guest_cid":`) {
		t.Fatalf("vsock state %s", st)
	}
	g.ev.add(nil, true, 4)
	g.v.Reset()
	if err := g.v.RestoreState(st); err != nil {
		t.Fatal(err)
	}
	if err := g.v.Activate(g.rx.q.mem, FeatureVersion1, []*Queue{g.rx.q, g.tx.q, g.ev.q}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	var got []usedChain
	for len(got) == 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
		got = g.ev.poll()
	}
	if len(got) != 1 || string(got[0].data) != "\x00\x00\x00\x00" {
		t.Fatalf("event queue got %v, want one transport reset event", got)
	}
	if err := g.v.RestoreState(json.RawMessage(`{"guest_cid":2}`)); err == nil || !strings.Contains(err.Error(), "not a valid guest CID") {
		t.Fatalf("restore of CID 2: %v", err)
	}
}
