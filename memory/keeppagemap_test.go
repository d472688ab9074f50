package memory

import "testing"

// TestKeepPagemap: a kept pagemap serves openPagemap (a duplicate each
// time, so closing one leaves it kept) and tells a written page present.
func TestKeepPagemap(t *testing.T) {
	if err := KeepPagemap(); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 2*pageSize)
	for i := range 2 {
		pm, err := openPagemap(addrOf(buf))
		if err != nil {
			t.Fatalf("open %d: %v", i, err)
		}
		pm.close()
	}
	keptPagemap.Lock()
	kept := keptPagemap.f
	keptPagemap.Unlock()
	if kept == nil || kept.Fd() == ^uintptr(0) {
		t.Fatal("the kept pagemap was closed by a user")
	}
}
