package serial

import (
	"bytes"
	"encoding/binary"
	"testing"
)

// FuzzUART plays a guest (and the host's console input) against a UART: the
// input is a sequence of operations, each an opcode byte and its operands:
//
//	0x00-0x07 reg, value: write value to register reg
//	0x08-0x0f reg: read register reg
//	0x10 n, bytes: host Input of the next n bytes
//	0x11 lo, hi, value: write value to THR (lo|hi<<8)*4 times (loopback floods)
//
// A model of the FIFO and of the output follows along: the UART must never
// panic, never hold more than maxInput unread bytes (received or looped
// back), hand the guest its bytes in order, send exactly the bytes written
// to THR outside loopback and DLAB, and keep LSR, IIR, IER and MCR
// consistent with its state.
func FuzzUART(f *testing.F) {
	f.Add([]byte{regIER, ierRDA | ierTHRE, 0x08 | regIIR, 0x10, 3, 'a', 'b', 'c', 0x08 | regLSR, 0x08 | regData, 0x08 | regIIR})
	f.Add([]byte{regLCR, lcrDLAB, regData, 3, regIER, 0, regLCR, 3, regData, 'x', 0x08 | regData})
	f.Add([]byte{regMCR, mcrLoop | 0x0f, regData, 'l', 0x08 | regMSR, 0x08 | regLSR, 0x08 | regData, 0x11, 0, 0x41, 'z'})
	f.Add([]byte{regIIR, 0x07, 0x10, 2, 1, 2, regIIR, 0x02, 0x08 | regLSR})
	f.Fuzz(func(t *testing.T, ops []byte) {
		var out bytes.Buffer
		u := New(&out, func() {})
		var wantOut []byte
		var fifo []byte // the model's unread bytes
		push := func(b []byte) {
			room := maxInput - len(fifo)
			fifo = append(fifo, b[:min(len(b), max(room, 0))]...)
		}
		var lcr, mcr uint8 = 0, mcrOut2
		for len(ops) > 0 {
			op := ops[0]
			ops = ops[1:]
			arg := func() byte {
				if len(ops) == 0 {
					return 0
				}
				b := ops[0]
				ops = ops[1:]
				return b
			}
			switch {
			case op < 0x08:
				v := arg()
				u.Write(uint64(op), []byte{v})
				switch uint64(op) {
				case regData:
					switch {
					case lcr&lcrDLAB != 0:
					case mcr&mcrLoop != 0:
						push([]byte{v})
					default:
						wantOut = append(wantOut, v)
					}
				case regIIR:
					if v&0x02 != 0 {
						fifo = nil
					}
				case regLCR:
					lcr = v
				case regMCR:
					mcr = v & 0x1f
				}
			case op < 0x10:
				reg := uint64(op & 7)
				b := []byte{0, 0xee, 0xee, 0xee} // a 4-byte access: the rest reads 0
				u.Read(reg, b)
				if b[1] != 0 || b[2] != 0 || b[3] != 0 {
					t.Fatalf("read of %d: bytes past the first % x", reg, b)
				}
				v := b[0]
				switch reg {
				case regData:
					if lcr&lcrDLAB != 0 {
						break
					}
					want := byte(0)
					if len(fifo) > 0 {
						want, fifo = fifo[0], fifo[1:]
					}
					if v != want {
						t.Fatalf("RBR %#x, want %#x", v, want)
					}
				case regIER:
					if lcr&lcrDLAB == 0 && v&^0x0f != 0 {
						t.Fatalf("IER %#x has reserved bits", v)
					}
				case regIIR:
					switch v {
					case iirFIFO | iirNone, iirFIFO | iirTHRE:
					case iirFIFO | iirRDA:
						if len(fifo) == 0 {
							t.Fatal("IIR says data available with none")
						}
					default:
						t.Fatalf("IIR %#x", v)
					}
				case regLCR:
					if v != lcr {
						t.Fatalf("LCR %#x, want %#x", v, lcr)
					}
				case regMCR:
					if v != mcr {
						t.Fatalf("MCR %#x, want %#x", v, mcr)
					}
				case regLSR:
					want := byte(lsrTHRE | lsrTEMT)
					if len(fifo) > 0 {
						want |= lsrDR
					}
					if v != want {
						t.Fatalf("LSR %#x, want %#x (%d bytes unread)", v, want, len(fifo))
					}
				}
			case op == 0x10:
				n := min(int(arg()), len(ops))
				u.Input(ops[:n])
				push(ops[:n])
				ops = ops[n:]
			case op == 0x11:
				lo, hi, v := arg(), arg(), arg()
				for range int(binary.LittleEndian.Uint16([]byte{lo, hi})) * 4 {
					u.Write(regData, []byte{v})
					switch {
					case lcr&lcrDLAB != 0:
					case mcr&mcrLoop != 0:
						push([]byte{v})
					default:
						wantOut = append(wantOut, v)
					}
				}
			}
			u.Read(regData, nil) // an empty access does nothing
			u.Write(regData, nil)
			if n := len(u.in); n > maxInput {
				t.Fatalf("%d bytes buffered, over the %d-byte limit", n, maxInput)
			}
			if !bytes.Equal(u.in, fifo) {
				t.Fatalf("UART holds %d bytes, the model %d", len(u.in), len(fifo))
			}
		}
		if !bytes.Equal(out.Bytes(), wantOut) {
			t.Fatalf("output %d bytes, want %d", out.Len(), len(wantOut))
		}
		if err := u.Err(); err != nil {
			t.Fatal(err)
		}
	})
}
