package kvm

import (
	"testing"

	"golang.org/x/sys/unix"
)

// TestHoldP walks the entries of a held vCPU: held until a signal ends a
// held entry, then one that blocks, then held again; never held when not
// asked; a signal ending a blocking entry or an exit of the guest's own
// changes nothing.
func TestHoldP(t *testing.T) {
	var v VCPU
	if v.nextHeld() {
		t.Fatal("held without SetHoldP")
	}
	v.afterEntry(false, unix.EINTR)
	v.SetHoldP(true)
	for i := range 3 {
		if !v.nextHeld() {
			t.Fatalf("entry %d not held", i)
		}
		v.afterEntry(true, nil) // the guest exited on its own
	}
	if !v.nextHeld() {
		t.Fatal("not held before the signal")
	}
	v.afterEntry(true, unix.EINTR) // the runtime preempted the held entry
	if v.nextHeld() {
		t.Fatal("the entry after a preempted held one is held, want it to block")
	}
	v.afterEntry(false, nil) // the idle guest's blocking entry ends with an exit of its own
	if !v.nextHeld() {
		t.Fatal("not held again after the blocking entry")
	}
	v.afterEntry(true, unix.EAGAIN)
	if !v.nextHeld() {
		t.Fatal("EAGAIN (an AP leaving INIT/SIPI) stopped holding")
	}
	v.afterEntry(true, unix.EINTR)
	v.afterEntry(false, unix.EINTR) // a signal ends the blocking entry too
	if !v.nextHeld() {
		t.Fatal("a signal ending a blocking entry kept the vCPU from holding again")
	}
	v.SetHoldP(false)
	if v.nextHeld() {
		t.Fatal("held after SetHoldP(false)")
	}
}
