// Package serial emulates a 16550A-compatible UART (the PC's COM1 at I/O port
// 0x3f8, IRQ 4): what the guest writes to THR goes to an io.Writer; bytes fed
// with Input become readable in RBR and raise the receive interrupt.
package serial

import (
	"io"
	"sync"
)

// Register offsets from the base port.
const (
	regData = 0 // RBR (read) / THR (write); DLL when DLAB
	regIER  = 1 // interrupt enable; DLM when DLAB
	regIIR  = 2 // interrupt identification (read) / FCR (write)
	regLCR  = 3
	regMCR  = 4
	regLSR  = 5
	regMSR  = 6
	regSCR  = 7
)

const (
	ierRDA  = 0x01 // received data available
	ierTHRE = 0x02 // transmitter holding register empty

	iirNone = 0x01
	iirTHRE = 0x02
	iirRDA  = 0x04
	iirFIFO = 0xc0 // FIFOs enabled

	lcrDLAB = 0x80

	lsrDR   = 0x01 // data ready
	lsrTHRE = 0x20
	lsrTEMT = 0x40

	mcrLoop = 0x10
	mcrOut2 = 0x08

	msrDCD = 0x80
	msrDSR = 0x20
	msrCTS = 0x10

	maxInput = 64 << 10
)

// Port is the number of I/O ports a UART decodes.
const Port = 8

// UART is one serial port. Its methods are safe for concurrent use: vCPU
// threads read and write registers while another goroutine feeds input.
type UART struct {
	mu          sync.Mutex
	out         io.Writer
	irq         func() // raises the interrupt line (edge)
	ier         uint8
	lcr         uint8
	mcr         uint8
	scr         uint8
	dll         uint8
	dlm         uint8
	threPending bool
	in          []byte
	outErr      error
}

// New returns a UART that writes guest output to out and signals its
// interrupt through irq (which may be nil).
func New(out io.Writer, irq func()) *UART {
	if out == nil {
		out = io.Discard
	}
	return &UART{out: out, irq: irq, dll: 12, mcr: mcrOut2}
}

// Input queues bytes for the guest to read. Bytes beyond an internal limit of
// 64 KiB unread (received or looped back) are dropped, as a real UART's FIFO
// overruns.
func (u *UART) Input(b []byte) {
	u.mu.Lock()
	room := maxInput - len(u.in)
	if room < len(b) {
		b = b[:max(room, 0)]
	}
	u.in = append(u.in, b...)
	fire := len(b) > 0 && u.ier&ierRDA != 0
	u.mu.Unlock()
	if fire {
		u.raise()
	}
}

func (u *UART) raise() {
	if u.irq != nil {
		u.irq()
	}
}

// Read handles a guest read of one register (offset 0..7).
func (u *UART) Read(offset uint64, data []byte) {
	if len(data) == 0 {
		return
	}
	u.mu.Lock()
	v, fire := u.read(offset)
	u.mu.Unlock()
	data[0] = v
	for i := 1; i < len(data); i++ {
		data[i] = 0
	}
	if fire {
		u.raise()
	}
}

func (u *UART) read(offset uint64) (v uint8, fire bool) {
	switch offset {
	case regData:
		if u.lcr&lcrDLAB != 0 {
			return u.dll, false
		}
		if len(u.in) == 0 {
			return 0, false
		}
		v = u.in[0]
		u.in = u.in[1:]
		if len(u.in) == 0 {
			u.in = nil
		}
		// More data waiting keeps the interrupt asserted.
		return v, len(u.in) > 0 && u.ier&ierRDA != 0
	case regIER:
		if u.lcr&lcrDLAB != 0 {
			return u.dlm, false
		}
		return u.ier, false
	case regIIR:
		switch {
		case u.ier&ierRDA != 0 && len(u.in) > 0:
			return iirFIFO | iirRDA, false
		case u.ier&ierTHRE != 0 && u.threPending:
			u.threPending = false // reading IIR clears THRE
			return iirFIFO | iirTHRE, false
		}
		return iirFIFO | iirNone, false
	case regLCR:
		return u.lcr, false
	case regMCR:
		return u.mcr, false
	case regLSR:
		v = lsrTHRE | lsrTEMT
		if len(u.in) > 0 {
			v |= lsrDR
		}
		return v, false
	case regMSR:
		if u.mcr&mcrLoop != 0 {
			// Loopback: modem outputs appear as inputs.
			return (u.mcr & 0x0f) << 4, false
		}
		return msrDCD | msrDSR | msrCTS, false
	case regSCR:
		return u.scr, false
	}
	return 0xff, false
}

// Write handles a guest write of one register (offset 0..7).
func (u *UART) Write(offset uint64, data []byte) {
	if len(data) == 0 {
		return
	}
	v := data[0]
	u.mu.Lock()
	var out []byte
	fire := false
	switch offset {
	case regData:
		if u.lcr&lcrDLAB != 0 {
			u.dll = v
			break
		}
		if u.mcr&mcrLoop != 0 {
			// Looped back into the receive FIFO, which overruns at the
			// same limit as Input: a guest cannot grow it without bound.
			if len(u.in) < maxInput {
				u.in = append(u.in, v)
			}
			fire = u.ier&ierRDA != 0
			break
		}
		out = []byte{v}
		u.threPending = true
		fire = u.ier&ierTHRE != 0
	case regIER:
		if u.lcr&lcrDLAB != 0 {
			u.dlm = v
			break
		}
		old := u.ier
		u.ier = v & 0x0f
		// Enabling THRE with an empty holding register interrupts at once.
		if u.ier&ierTHRE != 0 && old&ierTHRE == 0 {
			u.threPending = true
			fire = true
		}
		if u.ier&ierRDA != 0 && len(u.in) > 0 {
			fire = true
		}
	case regIIR: // FCR: FIFO control; FIFOs are always on
		if v&0x02 != 0 {
			u.in = nil
		}
	case regLCR:
		u.lcr = v
	case regMCR:
		u.mcr = v & 0x1f
	case regSCR:
		u.scr = v
	}
	w := u.out
	u.mu.Unlock()
	if out != nil {
		// A console writer that fails (a closed pipe) must not stop the
		// guest: its output is dropped, as a UART with no cable would.
		if _, err := w.Write(out); err != nil {
			u.mu.Lock()
			if u.outErr == nil {
				u.outErr = err
			}
			u.mu.Unlock()
		}
	}
	if fire {
		u.raise()
	}
}

// Err returns the first error the output writer returned, if any.
func (u *UART) Err() error {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.outErr
}
