package vmm

import (
	"io"
	"os"
	"testing"

	"github.com/kilnvm/kiln/vmm/serial"
)

const (
	uartRBR = 0
	uartLSR = 5
	lsrDR   = 0x01
)

func uartByte(u *serial.UART, reg uint64) byte {
	b := []byte{0}
	u.Read(reg, b)
	return b[0]
}

// waitInput waits until the UART has a byte to read, and reads it.
func waitInput(t *testing.T, u *serial.UART, fed <-chan struct{}) byte {
	t.Helper()
	for uartByte(u, uartLSR)&lsrDR == 0 {
		select {
		case <-fed:
			t.Fatal("the input goroutine ended before the UART had the byte")
		default:
		}
	}
	return uartByte(u, uartRBR)
}

// TestConsoleInputStopsOnClose: Close ends the goroutine that feeds
// ConsoleInput to the UART (it ran forever once): at once for a reader
// with a read deadline, at its pending read's return for any other, and
// nothing read after Close reaches the guest.
func TestConsoleInputStopsOnClose(t *testing.T) {
	t.Run("reader with a deadline", func(t *testing.T) {
		r, w, err := os.Pipe()
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		defer w.Close()
		v := newVM(Config{ConsoleInput: r})
		v.uart = serial.New(nil, nil)
		v.startConsoleInput()
		w.Write([]byte("a"))
		if c := waitInput(t, v.uart, v.inputDone); c != 'a' {
			t.Fatalf("guest read %q", c)
		}
		// The goroutine is blocked in Read now; Close wakes it and waits.
		if err := v.Close(); err != nil {
			t.Fatal(err)
		}
		select {
		case <-v.inputDone:
		default:
			t.Fatal("Close returned with the input goroutine running")
		}
		w.Write([]byte("b"))
		if uartByte(v.uart, uartLSR)&lsrDR != 0 {
			t.Fatal("input after Close reached the UART")
		}
	})
	t.Run("reader without one", func(t *testing.T) {
		r, w := io.Pipe()
		defer w.Close()
		v := newVM(Config{ConsoleInput: r})
		v.uart = serial.New(nil, nil)
		v.startConsoleInput()
		if err := v.Close(); err != nil { // does not wait on the blocked Read
			t.Fatal(err)
		}
		go w.Write([]byte("late"))
		<-v.inputDone // ends at the Read's return
		if uartByte(v.uart, uartLSR)&lsrDR != 0 {
			t.Fatal("input read after Close reached the UART")
		}
	})
}
