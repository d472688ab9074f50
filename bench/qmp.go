package bench

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"time"
)

// qmpTimeout bounds one QMP command.
const qmpTimeout = 2 * time.Minute

// qmpConn is a QMP connection past its capabilities negotiation.
type qmpConn struct {
	conn net.Conn
	r    *bufio.Reader
}

// dialQMP connects to QEMU's QMP socket and negotiates.
func dialQMP(ctx context.Context, path string) (*qmpConn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		return nil, fmt.Errorf("qmp: %w", err)
	}
	q := &qmpConn{conn: c, r: bufio.NewReader(c)}
	c.SetDeadline(time.Now().Add(qmpTimeout))
	if _, err := q.r.ReadBytes('\n'); err != nil { // the greeting
		c.Close()
		return nil, fmt.Errorf("qmp: greeting: %w", err)
	}
	if _, err := q.do("qmp_capabilities", nil); err != nil {
		c.Close()
		return nil, err
	}
	return q, nil
}

// do runs one QMP command and returns its "return" value, skipping events.
func (q *qmpConn) do(cmd string, args any) (json.RawMessage, error) {
	req := map[string]any{"execute": cmd}
	if args != nil {
		req["arguments"] = args
	}
	b, err := json.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("qmp: %s: %w", cmd, err)
	}
	q.conn.SetDeadline(time.Now().Add(qmpTimeout))
	if _, err := q.conn.Write(append(b, '\n')); err != nil {
		return nil, fmt.Errorf("qmp: %s: %w", cmd, err)
	}
	for {
		line, err := q.r.ReadBytes('\n')
		if err != nil {
			return nil, fmt.Errorf("qmp: %s: %w", cmd, err)
		}
		var resp struct {
			Return json.RawMessage `json:"return"`
			Error  *struct {
				Class string `json:"class"`
				Desc  string `json:"desc"`
			} `json:"error"`
			Event string `json:"event"`
		}
		if err := json.Unmarshal(line, &resp); err != nil {
			return nil, fmt.Errorf("qmp: %s: %w", cmd, err)
		}
		switch {
		case resp.Event != "":
			continue
		case resp.Error != nil:
			return nil, fmt.Errorf("qmp: %s: %s: %s", cmd, resp.Error.Class, resp.Error.Desc)
		}
		return resp.Return, nil
	}
}

// watchResume reports on out when the QEMU whose QMP socket is path
// resumes the guest (the RESUME event after an incoming migration), timed
// from start; it closes out without a value if it cannot tell. A guest
// already running when QMP answers is reported then (an upper bound).
func watchResume(ctx context.Context, path string, start time.Time, stopped <-chan struct{}, out chan<- time.Duration) {
	defer close(out)
	var q *qmpConn
	for {
		var err error
		if q, err = dialQMP(ctx, path); err == nil {
			break
		}
		select {
		case <-stopped:
			return
		case <-ctx.Done():
			return
		case <-time.After(5 * time.Millisecond):
		}
	}
	defer q.conn.Close()
	b, err := q.do("query-status", nil)
	if err != nil {
		return
	}
	var st struct {
		Running bool `json:"running"`
	}
	if json.Unmarshal(b, &st) == nil && st.Running {
		out <- time.Since(start)
		return
	}
	// Killing QEMU ends the read.
	q.conn.SetDeadline(time.Time{})
	for {
		line, err := q.r.ReadBytes('\n')
		if err != nil {
			return
		}
		var ev struct {
			Event string `json:"event"`
		}
		if json.Unmarshal(line, &ev) == nil && ev.Event == "RESUME" {
			out <- time.Since(start)
			return
		}
	}
}
