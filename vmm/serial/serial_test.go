package serial

import (
	"bytes"
	"testing"
)

func TestOutputAndTHREInterrupt(t *testing.T) {
	var out bytes.Buffer
	irqs := 0
	u := New(&out, func() { irqs++ })
	for _, c := range []byte("hi\n") {
		u.Write(regData, []byte{c})
	}
	if out.String() != "hi\n" {
		t.Fatalf("output %q", out.String())
	}
	if irqs != 0 {
		t.Fatalf("%d interrupts with IER=0", irqs)
	}
	u.Write(regIER, []byte{ierTHRE})
	if irqs != 1 {
		t.Fatalf("enabling THRE gave %d interrupts, want 1", irqs)
	}
	b := []byte{0}
	u.Read(regIIR, b)
	if b[0]&0x0f != iirTHRE {
		t.Fatalf("IIR = %#x, want THRE", b[0])
	}
	u.Read(regIIR, b)
	if b[0]&0x0f != iirNone {
		t.Fatalf("IIR after read = %#x, want none pending", b[0])
	}
}

func TestInput(t *testing.T) {
	irqs := 0
	u := New(nil, func() { irqs++ })
	u.Write(regIER, []byte{ierRDA})
	u.Input([]byte("ab"))
	if irqs != 1 {
		t.Fatalf("%d interrupts after input", irqs)
	}
	tests := []struct {
		reg  uint64
		want uint8
	}{
		{regLSR, lsrTHRE | lsrTEMT | lsrDR},
		{regIIR, iirFIFO | iirRDA},
		{regData, 'a'},
		{regData, 'b'},
		{regLSR, lsrTHRE | lsrTEMT},
		{regData, 0},
	}
	for i, tt := range tests {
		b := []byte{0}
		u.Read(tt.reg, b)
		if b[0] != tt.want {
			t.Errorf("step %d: reg %d = %#x, want %#x", i, tt.reg, b[0], tt.want)
		}
	}
}

func TestDivisorLatchAndScratch(t *testing.T) {
	var out bytes.Buffer
	u := New(&out, nil)
	u.Write(regLCR, []byte{lcrDLAB})
	u.Write(regData, []byte{3})
	u.Write(regIER, []byte{0})
	u.Write(regLCR, []byte{0x03})
	u.Write(regSCR, []byte{0x5a})
	b := []byte{0}
	u.Read(regSCR, b)
	if b[0] != 0x5a || out.Len() != 0 {
		t.Fatalf("scratch %#x, output %q", b[0], out.String())
	}
}

func TestInputOverrunIsBounded(t *testing.T) {
	u := New(nil, nil)
	u.Input(make([]byte, maxInput+100))
	if len(u.in) != maxInput {
		t.Fatalf("queued %d bytes, limit %d", len(u.in), maxInput)
	}
}

// TestLoopbackIsBounded: a guest that puts the UART in loopback mode and
// writes THR without reading RBR fills the receive side to its cap and no
// further (it grew without limit once: 4 MiB accepted).
func TestLoopbackIsBounded(t *testing.T) {
	var out bytes.Buffer
	irqs := 0
	u := New(&out, func() { irqs++ })
	u.Write(regMCR, []byte{mcrLoop})
	u.Write(regIER, []byte{ierRDA})
	const writes = 4 << 20
	for i := range writes {
		u.Write(regData, []byte{byte(i)})
	}
	buffered := len(u.in)
	t.Logf("%d loopback writes: %d bytes buffered (cap %d), %d interrupts", writes, buffered, maxInput, irqs)
	if buffered > maxInput {
		t.Fatalf("%d bytes buffered after %d loopback writes, cap %d", buffered, writes, maxInput)
	}
	if buffered != maxInput || irqs != maxInput {
		t.Fatalf("%d bytes buffered and %d interrupts, want the first %d", buffered, irqs, maxInput)
	}
	if out.Len() != 0 {
		t.Fatalf("loopback wrote %d bytes to the console", out.Len())
	}
	// The first bytes are what the guest reads back, in order.
	b := []byte{0}
	for i := range 3 {
		u.Read(regData, b)
		if b[0] != byte(i) {
			t.Fatalf("byte %d read back as %#x", i, b[0])
		}
	}
	// Room again: the next loopback byte is queued.
	u.Write(regData, []byte{0xaa})
	if len(u.in) != maxInput-2 {
		t.Fatalf("%d bytes buffered after reading 3 and writing 1, want %d", len(u.in), maxInput-2)
	}
}
