package client

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// maxForwardWrite is the most bytes one request of a forwarded
// connection carries (the daemon's bound is 1 MiB).
const maxForwardWrite = 256 << 10

// DialPort connects to TCP port port on sandbox id's loopback through
// kilnd (kiln.v1 ForwardPort): the connection reaches what listens there
// in the guest without opening the sandbox's network. ctx bounds the dial
// and the connection's life. The connection is a net.Conn whose
// CloseWrite half-closes it toward the guest.
func (c *Client) DialPort(ctx context.Context, id string, port int) (net.Conn, error) {
	return DialPort(ctx, c.api, id, port)
}

// DialPort is Client.DialPort over any kiln.v1 client.
func DialPort(ctx context.Context, api kilnpb.KilnClient, id string, port int) (net.Conn, error) {
	op := "forward port " + strconv.Itoa(port) + " of " + id
	if port < 1 || port > 65535 {
		return nil, fmt.Errorf("kiln: %s: want a port from 1 to 65535", op)
	}
	sctx, cancel := context.WithCancel(ctx)
	stream, err := api.ForwardPort(sctx)
	if err != nil {
		cancel()
		return nil, callErr(op, err)
	}
	if err := stream.Send(&kilnpb.ForwardPortRequest{SandboxId: id, Port: uint32(port)}); err != nil {
		_, err = stream.Recv() // the status says why
		cancel()
		return nil, callErr(op, err)
	}
	first, err := stream.Recv()
	if err != nil {
		cancel()
		return nil, callErr(op, err)
	}
	pc := &portConn{stream: stream, cancel: cancel, op: op, id: id, port: port,
		incoming: make(chan []byte), closed: make(chan struct{}),
		rdl: newDeadline(), wdl: newDeadline()}
	if d := first.GetData(); len(d) > 0 {
		pc.pending = d
	}
	go pc.receive()
	return pc, nil
}

// portConn is a ForwardPort call as a net.Conn: a goroutine receives the
// guest's data (Read takes it, under its deadline); Write sends, and a
// write deadline that passes while a write waits on the call's flow
// control ends the connection.
type portConn struct {
	stream   kilnpb.Kiln_ForwardPortClient
	cancel   context.CancelFunc
	op, id   string
	port     int
	incoming chan []byte   // the guest's data, from receive
	closed   chan struct{} // closed by Close
	rdl, wdl *deadline

	readMu  sync.Mutex
	pending []byte // what the last Read left
	rerr    error  // receive's end: io.EOF or the call's error

	writeMu   sync.Mutex
	closeOnce sync.Once
	wclosed   bool // CloseWrite was called (under writeMu)

	endMu  sync.Mutex
	endErr error // how the call ended: io.EOF (the guest's side), or its error
}

// receive hands the guest's data to Read until the guest's side ends or
// the call fails.
func (c *portConn) receive() {
	defer close(c.incoming)
	for {
		m, err := c.stream.Recv()
		if err != nil {
			c.setEnd(err)
			return
		}
		if d := m.GetData(); len(d) > 0 {
			select {
			case c.incoming <- d:
			case <-c.closed:
				return
			}
		}
		if m.GetEof() {
			c.setEnd(io.EOF)
			return
		}
	}
}

// setEnd records how the call ended, once.
func (c *portConn) setEnd(err error) {
	c.endMu.Lock()
	defer c.endMu.Unlock()
	if c.endErr != nil {
		return
	}
	if err != io.EOF {
		err = callErr(c.op, err)
	}
	c.endErr = err
}

// end is how the call ended (nil: it has not).
func (c *portConn) end() error {
	c.endMu.Lock()
	defer c.endMu.Unlock()
	return c.endErr
}

func (c *portConn) Read(p []byte) (int, error) {
	c.readMu.Lock()
	defer c.readMu.Unlock()
	if len(c.pending) == 0 {
		select {
		case <-c.closed:
			return 0, net.ErrClosed
		default:
		}
		if c.rerr != nil {
			return 0, c.rerr
		}
		select {
		case d, ok := <-c.incoming:
			if !ok {
				select {
				case <-c.closed: // Close ended the call
					return 0, net.ErrClosed
				default:
				}
				c.setEnd(net.ErrClosed)
				c.rerr = c.end()
				if errors.Is(c.rerr, net.ErrClosed) {
					c.rerr = net.ErrClosed
				}
				return 0, c.rerr
			}
			c.pending = d
		case <-c.rdl.passed():
			return 0, os.ErrDeadlineExceeded
		case <-c.closed:
			return 0, net.ErrClosed
		}
	}
	n := copy(p, c.pending)
	c.pending = c.pending[n:]
	return n, nil
}

func (c *portConn) Write(p []byte) (int, error) {
	c.writeMu.Lock()
	defer c.writeMu.Unlock()
	select {
	case <-c.closed:
		return 0, net.ErrClosed
	case <-c.wdl.passed():
		return 0, os.ErrDeadlineExceeded
	default:
	}
	if c.wclosed {
		return 0, fmt.Errorf("kiln: %s: write after CloseWrite", c.op)
	}
	// A deadline that passes mid-write ends the call (and the write).
	stop := context.AfterFunc(c.wdl.context(), c.cancel)
	defer stop()
	n := 0
	for n < len(p) {
		chunk := p[n:min(len(p), n+maxForwardWrite)]
		if err := c.stream.Send(&kilnpb.ForwardPortRequest{Data: chunk}); err != nil {
			if errors.Is(err, io.EOF) { // the call ended: receive has its status
				err = nil
			}
			return n, c.writeErr(err)
		}
		n += len(chunk)
	}
	return n, nil
}

func (c *portConn) writeErr(err error) error {
	select {
	case <-c.wdl.passed():
		return os.ErrDeadlineExceeded
	default:
	}
	if err != nil {
		return callErr(c.op, err)
	}
	if e := c.end(); e != nil && e != io.EOF {
		return e
	}
	return net.ErrClosed
}

// CloseWrite half-closes the connection: the guest reads EOF; its data
// still comes.
func (c *portConn) CloseWrite() error {
	c.writeMu.Lock()
	defer c.writeMu.Unlock()
	if c.wclosed {
		return nil
	}
	c.wclosed = true
	return c.stream.CloseSend()
}

// Close ends the call: both directions, at once.
func (c *portConn) Close() error {
	c.closeOnce.Do(func() {
		close(c.closed)
		c.cancel()
	})
	return nil
}

func (c *portConn) LocalAddr() net.Addr  { return portAddr("kiln") }
func (c *portConn) RemoteAddr() net.Addr { return portAddr(c.id + ":" + strconv.Itoa(c.port)) }

func (c *portConn) SetDeadline(t time.Time) error {
	c.rdl.set(t)
	c.wdl.set(t)
	return nil
}
func (c *portConn) SetReadDeadline(t time.Time) error  { c.rdl.set(t); return nil }
func (c *portConn) SetWriteDeadline(t time.Time) error { c.wdl.set(t); return nil }

// portAddr is a forwarded connection's address: the sandbox and port.
type portAddr string

func (a portAddr) Network() string { return "kiln" }
func (a portAddr) String() string  { return string(a) }

// deadline is a settable deadline: a channel closed once it passes.
type deadline struct {
	mu     sync.Mutex
	timer  *time.Timer
	ch     chan struct{}
	ctx    context.Context
	cancel context.CancelFunc
}

func newDeadline() *deadline {
	ctx, cancel := context.WithCancel(context.Background())
	return &deadline{ch: make(chan struct{}), ctx: ctx, cancel: cancel}
}

// set makes t the deadline (zero: none).
func (d *deadline) set(t time.Time) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.timer != nil {
		d.timer.Stop()
		d.timer = nil
	}
	select {
	case <-d.ch: // passed: a new one
		d.ch = make(chan struct{})
		d.ctx, d.cancel = context.WithCancel(context.Background())
	default:
	}
	if t.IsZero() {
		return
	}
	ch, cancel := d.ch, d.cancel
	fire := func() { close(ch); cancel() }
	if dur := time.Until(t); dur <= 0 {
		fire()
	} else {
		d.timer = time.AfterFunc(dur, func() {
			d.mu.Lock()
			defer d.mu.Unlock()
			select {
			case <-ch:
			default:
				if d.ch == ch {
					fire()
				}
			}
		})
	}
}

// passed is closed once the deadline passes.
func (d *deadline) passed() <-chan struct{} {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.ch
}

// context is cancelled once the deadline passes.
func (d *deadline) context() context.Context {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.ctx
}
