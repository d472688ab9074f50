package vmmproc

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmm"
)

func TestCheckHoldID(t *testing.T) {
	for _, c := range []struct {
		id   string
		want string // a part of the error; "" for none
	}{
		{"a", ""},
		{"ck-0123456789abcdef", ""},
		{"A.b_c-9", ""},
		{strings.Repeat("x", MaxHoldID), ""},
		{"", "empty"},
		{strings.Repeat("x", MaxHoldID+1), "129 bytes"},
		{"a b", "byte 1"},
		{"../etc", "byte 2"},
		{"a/b", "byte 1"},
		{"é", "byte 0"},
		{"a\x00", "byte 1"},
	} {
		err := CheckHoldID(c.id)
		if c.want == "" && err != nil || c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)) {
			t.Errorf("CheckHoldID(%q) = %v, want %q", c.id, err, c.want)
		}
	}
}

func FuzzCheckHoldID(f *testing.F) {
	for _, s := range []string{"a", "ck-1", "", "a/b", strings.Repeat("z", 200), "\xff"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, id string) {
		err := CheckHoldID(id)
		ok := id != "" && len(id) <= MaxHoldID && strings.Trim(id, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-") == ""
		if ok != (err == nil) {
			t.Fatalf("CheckHoldID(%q) = %v", id, err)
		}
	})
}

func TestCheckHoldLabels(t *testing.T) {
	many := map[string]string{}
	for i := range maxHoldLabels + 1 {
		many[fmt.Sprint("k", i)] = "v"
	}
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   string
	}{
		{"none", nil, ""},
		{"some", map[string]string{"kiln.sandbox/hostname": "box", "empty": ""}, ""},
		{"too many", many, "17 labels"},
		{"empty key", map[string]string{"": "v"}, "label key"},
		{"long key", map[string]string{strings.Repeat("k", maxHoldLabelKey+1): "v"}, "label key"},
		{"long value", map[string]string{"k": strings.Repeat("v", maxHoldLabelValue+1)}, "1025 bytes"},
	} {
		err := checkHoldLabels(c.labels)
		if c.want == "" && err != nil || c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)) {
			t.Errorf("%s: %v, want %q", c.name, err, c.want)
		}
	}
}

// testMemfd returns a memfd of size bytes that starts with text.
func testMemfd(t testing.TB, size int64, text string) *os.File {
	t.Helper()
	fd, err := unix.MemfdCreate("vmmproc-test", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), "memfd")
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte(text), 0); err != nil {
		t.Fatal(err)
	}
	return f
}

func readStart(t *testing.T, f *os.File, n int) string {
	t.Helper()
	b := make([]byte, n)
	if _, err := f.ReadAt(b, 0); err != nil {
		t.Fatalf("read the base: %v", err)
	}
	return string(b)
}

func TestHoldTable(t *testing.T) {
	tab := newHoldTable()
	code := func(err error) codes.Code { return status.Code(err) }
	if err := tab.reserve(""); code(err) != codes.InvalidArgument {
		t.Fatalf("reserve of an empty ID: %v", err)
	}
	if err := tab.reserve("b"); err != nil {
		t.Fatal(err)
	}
	if err := tab.reserve("b"); code(err) != codes.AlreadyExists {
		t.Fatalf("second reserve of b: %v", err)
	}
	// A reservation is not a hold yet.
	if _, _, err := tab.get("b"); code(err) != codes.NotFound {
		t.Fatalf("get of a reservation: %v", err)
	}
	if got := tab.ids(); len(got) != 0 {
		t.Fatalf("ids with a reservation only: %v", got)
	}
	bBase := testMemfd(t, 4096, "bee")
	tab.finish("b", &held{state: []byte(`{}`), base: bBase})
	if err := tab.reserve("a"); err != nil {
		t.Fatal(err)
	}
	tab.finish("a", &held{state: []byte(`{}`), base: testMemfd(t, 4096, "ay")})
	if err := tab.reserve("c"); err != nil {
		t.Fatal(err)
	}
	tab.cancel("c")
	if got := tab.ids(); !slices.Equal(got, []string{"a", "b"}) {
		t.Fatalf("ids %v, want [a b]", got)
	}
	// get hands out a duplicate: closing it leaves the hold's own.
	_, dup, err := tab.get("b")
	if err != nil {
		t.Fatal(err)
	}
	if got := readStart(t, dup, 3); got != "bee" {
		t.Fatalf("duplicate reads %q", got)
	}
	dup.Close()
	_, dup, err = tab.get("b")
	if err != nil {
		t.Fatalf("get after closing a duplicate: %v", err)
	}
	dup.Close()
	if err := tab.release("b"); err != nil {
		t.Fatal(err)
	}
	if _, err := bBase.Stat(); !errors.Is(err, os.ErrClosed) {
		t.Fatalf("release left the base open: %v", err)
	}
	if err := tab.release("b"); code(err) != codes.NotFound {
		t.Fatalf("second release: %v", err)
	}
	if err := tab.release("no/such"); code(err) != codes.InvalidArgument {
		t.Fatalf("release of a bad ID: %v", err)
	}
	// The limit counts holds and reservations.
	for i := len(tab.ids()); i < MaxHolds; i++ {
		if err := tab.reserve(fmt.Sprint("r", i)); err != nil {
			t.Fatalf("reserve %d: %v", i, err)
		}
	}
	if err := tab.reserve("over"); code(err) != codes.ResourceExhausted {
		t.Fatalf("reserve past %d: %v", MaxHolds, err)
	}
	aBase := tab.holds["a"].base
	tab.closeAll()
	if _, err := aBase.Stat(); !errors.Is(err, os.ErrClosed) {
		t.Fatalf("closeAll left a base open: %v", err)
	}
	if got := tab.ids(); len(got) != 0 {
		t.Fatalf("ids after closeAll: %v", got)
	}
}

// testState returns a valid state of a 1-vCPU 16 MiB VM with a vsock
// device, as Freeze shapes one, with no KVM.
func testState() *vmm.State {
	st := &vmm.State{
		Version: vmm.StateVersion, VirtioVersion: virtio.StateVersion, CPUs: 1, MemoryMiB: 16,
		Memory: []vmm.MemoryRegion{{GuestAddr: 0, Size: 16 << 20, Offset: 0}},
		Devices: []vmm.DeviceState{{
			Spec:      virtio.DeviceSpec{ID: "vsock", Kind: virtio.KindVsock, Vsock: &virtio.VsockSpec{CID: 3, Path: "/nonexistent/vsock.sock"}},
			Transport: virtio.MMIOState{DeviceID: virtio.IDVsock},
		}},
		VCPUs:   []vmm.VCPUState{{ID: 0, XSave: make([]byte, 4096), LAPIC: make([]byte, 1024)}},
		Machine: vmm.MachineState{PICMaster: make([]byte, 512), PICSlave: make([]byte, 512), IOAPIC: make([]byte, 512)},
	}
	return st
}

// TestProcessHolds adopts, hands out and releases holds in a VMM process
// without a VM (Hold itself freezes a VM: the KVM tests of package sandbox
// make holds of real ones).
func TestProcessHolds(t *testing.T) {
	p := startSelf(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	st := testState()
	if err := st.Validate(); err != nil {
		t.Fatalf("the test state: %v", err)
	}
	if err := p.Hold(ctx, "a", nil); err == nil || !strings.Contains(err.Error(), "no VM yet") {
		t.Fatalf("Hold without a VM: %v", err)
	}
	if err := p.Hold(ctx, "a b", nil); err == nil || !strings.Contains(err.Error(), "byte 1") {
		t.Fatalf("Hold of a bad ID: %v", err)
	}
	if ids, err := p.Held(ctx); err != nil || len(ids) != 0 {
		t.Fatalf("Held at first: %v %v", ids, err)
	}

	base := testMemfd(t, 16<<20, "frozen guest RAM")
	defer base.Close()
	labels := map[string]string{"kiln.sandbox/hostname": "box"}
	for _, id := range []string{"b", "a"} {
		if err := p.GiveHeld(ctx, id, st, base, labels); err != nil {
			t.Fatalf("GiveHeld %s: %v", id, err)
		}
	}
	if err := p.GiveHeld(ctx, "a", st, base, nil); !errors.Is(err, ErrHoldExists) {
		t.Fatalf("GiveHeld of a held ID: %v", err)
	}
	small := testMemfd(t, 1<<20, "")
	defer small.Close()
	if err := p.GiveHeld(ctx, "small", st, small, nil); err == nil || !strings.Contains(err.Error(), "needs 16777216") {
		t.Fatalf("GiveHeld of a base too small: %v", err)
	}
	bad := *st
	bad.CPUs = 0
	if err := p.GiveHeld(ctx, "bad", &bad, base, nil); err == nil || !strings.Contains(err.Error(), "0 vCPUs") {
		t.Fatalf("GiveHeld of a bad state: %v", err)
	}
	if err := p.GiveHeld(ctx, "l", st, base, map[string]string{"": "x"}); err == nil || !strings.Contains(err.Error(), "label key") {
		t.Fatalf("GiveHeld with a bad label: %v", err)
	}
	if ids, err := p.Held(ctx); err != nil || !slices.Equal(ids, []string{"a", "b"}) {
		t.Fatalf("Held: %v %v, want [a b]", ids, err)
	}

	// The hold stays: it is handed out as often as asked.
	want, _ := json.Marshal(st)
	for range 2 {
		gst, gbase, glabels, err := p.TakeHeld(ctx, "a")
		if err != nil {
			t.Fatalf("TakeHeld: %v", err)
		}
		got, _ := json.Marshal(gst)
		if string(got) != string(want) {
			t.Fatalf("TakeHeld's state differs:\n%s\nwant\n%s", got, want)
		}
		if glabels["kiln.sandbox/hostname"] != "box" || len(glabels) != 1 {
			t.Fatalf("TakeHeld's labels %v", glabels)
		}
		if s := readStart(t, gbase, 16); s != "frozen guest RAM" {
			t.Fatalf("TakeHeld's base reads %q", s)
		}
		gbase.Close()
	}
	if _, _, _, err := p.TakeHeld(ctx, "zz"); !errors.Is(err, ErrNotHeld) {
		t.Fatalf("TakeHeld of an unknown ID: %v", err)
	}
	if err := p.Release(ctx, "a"); err != nil {
		t.Fatalf("Release: %v", err)
	}
	if err := p.Release(ctx, "a"); !errors.Is(err, ErrNotHeld) {
		t.Fatalf("second Release: %v", err)
	}
	if ids, err := p.Held(ctx); err != nil || !slices.Equal(ids, []string{"b"}) {
		t.Fatalf("Held after Release: %v %v, want [b]", ids, err)
	}
	// Another parent attached to the process finds the hold.
	q, err := Attach(ctx, p.Socket(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close(ctx)
	if ids, err := q.Held(ctx); err != nil || !slices.Equal(ids, []string{"b"}) {
		t.Fatalf("Held from an attached parent: %v %v", ids, err)
	}
	if _, b, _, err := q.TakeHeld(ctx, "b"); err != nil {
		t.Fatalf("TakeHeld from an attached parent: %v", err)
	} else {
		b.Close()
	}
}

// TestFDStoreExpiry: a descriptor nobody fetched is closed after the
// store's TTL, at the next PUT.
func TestFDStoreExpiry(t *testing.T) {
	store := newFDStore()
	store.ttl = 10 * time.Millisecond
	defer store.closeAll()
	old := testMemfd(t, 4096, "")
	t1, _ := newToken()
	if err := store.put(t1, old); err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond)
	t2, _ := newToken()
	if err := store.put(t2, testMemfd(t, 4096, "")); err != nil {
		t.Fatal(err)
	}
	if _, err := old.Stat(); !errors.Is(err, os.ErrClosed) {
		t.Fatalf("an expired descriptor is open: %v", err)
	}
	if _, err := store.take(t1); err == nil {
		t.Fatal("an expired token was taken")
	}
	f, err := store.take(t2)
	if err != nil {
		t.Fatalf("the fresh token: %v", err)
	}
	f.Close()
}
