package bench

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// fakeQMP answers QMP on a Unix socket the way QEMU does: a greeting,
// events between answers, and query-migrate going from active to status.
func fakeQMP(t *testing.T, path, status string) <-chan []string {
	t.Helper()
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	cmds := make(chan []string, 1)
	go func() {
		defer ln.Close()
		var seen []string
		defer func() { cmds <- seen }()
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		fmt.Fprintln(c, `{"QMP": {"version": {"qemu": {"micro": 22, "minor": 2, "major": 7}}, "capabilities": []}}`)
		r := bufio.NewReader(c)
		polls := 0
		for {
			line, err := r.ReadBytes('\n')
			if err != nil {
				return
			}
			var req struct {
				Execute   string         `json:"execute"`
				Arguments map[string]any `json:"arguments"`
			}
			if err := json.Unmarshal(line, &req); err != nil {
				fmt.Fprintln(c, `{"error": {"class": "GenericError", "desc": "bad json"}}`)
				continue
			}
			seen = append(seen, req.Execute)
			switch req.Execute {
			case "migrate":
				if !strings.HasPrefix(fmt.Sprint(req.Arguments["uri"]), "exec:cat > '") {
					fmt.Fprintln(c, `{"error": {"class": "GenericError", "desc": "bad uri"}}`)
					continue
				}
				fmt.Fprintln(c, `{"event": "STOP", "timestamp": {"seconds": 1, "microseconds": 2}}`)
				fmt.Fprintln(c, `{"return": {}}`)
			case "query-migrate":
				polls++
				if polls < 3 {
					fmt.Fprintln(c, `{"return": {"status": "active"}}`)
				} else {
					fmt.Fprintf(c, `{"return": {"status": %q, "error-desc": "no space"}}`+"\n", status)
				}
			case "query-status":
				fmt.Fprintln(c, `{"return": {"status": "inmigrate", "running": false}}`)
				fmt.Fprintln(c, `{"event": "MIGRATION", "data": {"status": "completed"}}`)
				fmt.Fprintln(c, `{"event": "RESUME", "timestamp": {"seconds": 1, "microseconds": 2}}`)
			case "nonsense":
				fmt.Fprintln(c, `{"error": {"class": "CommandNotFound", "desc": "The command nonsense has not been found"}}`)
			default:
				fmt.Fprintln(c, `{"return": {}}`)
			}
		}
	}()
	return cmds
}

func TestQEMUPeerSave(t *testing.T) {
	dir := t.TempDir()
	p := &qemuPeer{qmpPath: filepath.Join(dir, "qmp.sock"), state: filepath.Join(dir, "state")}
	cmds := fakeQMP(t, p.qmpPath, "completed")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := p.save(ctx); err != nil {
		t.Fatal(err)
	}
	got := strings.Join(<-cmds, " ")
	if want := "qmp_capabilities migrate-set-parameters migrate query-migrate query-migrate query-migrate"; got != want {
		t.Errorf("commands %q, want %q", got, want)
	}

	p.qmpPath = filepath.Join(dir, "qmp2.sock")
	fakeQMP(t, p.qmpPath, "failed")
	if _, err := p.save(ctx); err == nil || !strings.Contains(err.Error(), "failed: no space") {
		t.Errorf("a failed migration: %v", err)
	}

	p.qmpPath = filepath.Join(dir, "qmp3.sock")
	fakeQMP(t, p.qmpPath, "completed")
	q, err := dialQMP(ctx, p.qmpPath)
	if err != nil {
		t.Fatal(err)
	}
	defer q.conn.Close()
	if _, err := q.do("nonsense", nil); err == nil || !strings.Contains(err.Error(), "CommandNotFound") {
		t.Errorf("an unknown command: %v", err)
	}
}

func TestWatchResume(t *testing.T) {
	path := filepath.Join(t.TempDir(), "qmp.sock")
	out := make(chan time.Duration, 1)
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// The socket appears a little later, as QEMU's does.
	go watchResume(ctx, path, start, make(chan struct{}), out)
	time.Sleep(50 * time.Millisecond)
	fakeQMP(t, path, "completed")
	d, ok := <-out
	if !ok || d < 50*time.Millisecond {
		t.Errorf("watchResume: %v, %v", d, ok)
	}

	// A QEMU that exits before its socket appears: nothing to report.
	stopped := make(chan struct{})
	close(stopped)
	out = make(chan time.Duration, 1)
	watchResume(ctx, filepath.Join(t.TempDir(), "none.sock"), start, stopped, out)
	if d, ok := <-out; ok {
		t.Errorf("watchResume without QEMU reported %v", d)
	}
}
