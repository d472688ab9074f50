package memory

import (
	"bytes"
	"testing"

	"golang.org/x/sys/unix"
)

func fileBytes(t *testing.T, fd int, off int64, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	if _, err := unix.Pread(fd, b, off); err != nil {
		t.Fatal(err)
	}
	return b
}

func TestFreeze(t *testing.T) {
	layout := testLayout()
	for _, tc := range []struct {
		name string
		make func() (*Memory, error)
	}{
		{"shared memfd", func() (*Memory, error) { return New("freeze-test", layout) }},
		{"anonymous", func() (*Memory, error) { return NewAnonymous(layout) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, err := tc.make()
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			addr := layout[0].GuestAddr + 0x1000
			if err := m.WriteAt([]byte("before"), addr); err != nil {
				t.Fatal(err)
			}
			base, err := m.Freeze()
			if err != nil {
				t.Fatal(err)
			}
			if !m.Private() {
				t.Fatal("frozen memory is not private")
			}
			// The parent writes on; the base keeps what was frozen.
			if err := m.WriteAt([]byte("parent"), addr); err != nil {
				t.Fatal(err)
			}
			if got := fileBytes(t, base, 0x1000, 6); string(got) != "before" {
				t.Fatalf("base holds %q after the parent wrote", got)
			}
			child, err := MapFile(base, layout, true)
			if err != nil {
				t.Fatal(err)
			}
			defer child.Close()
			got := make([]byte, 6)
			child.ReadAt(got, addr)
			if string(got) != "before" {
				t.Fatalf("child reads %q", got)
			}
			child.WriteAt([]byte("child!"), addr)
			m.ReadAt(got, addr)
			if string(got) != "parent" {
				t.Fatalf("parent reads %q after the child wrote", got)
			}
			// Freezing again (the memory is private now) copies what the
			// parent wrote into a new base.
			base2, err := m.Freeze()
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Close(base2)
			if got := fileBytes(t, base2, 0x1000, 6); string(got) != "parent" {
				t.Fatalf("second base holds %q", got)
			}
			if got := fileBytes(t, base2, 0x2000, 16); !bytes.Equal(got, make([]byte, 16)) {
				t.Fatalf("a zero page reads %x", got)
			}
		})
	}
}
