package vmmproc

import (
	"bufio"
	"context"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// dialFixture serves a dial socket for a sandbox folder of its own whose
// vsock socket is vsock (nobody listens on vsock itself: only on the
// vsock_P a test makes).
func dialFixture(t *testing.T) (dir, sock, vsock string, s *DialServer) {
	t.Helper()
	dir = t.TempDir()
	sock = DialSocket(filepath.Join(dir, "vmm.sock"))
	vsock = filepath.Join(dir, "vsock.sock")
	s, err := ServeVsockDial(sock, os.Getuid(), os.Getgid(), vsock, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Error(err)
		}
	})
	return dir, sock, vsock, s
}

// TestVsockDial: a jailed VMM's dial through its parent reaches the
// sandbox's listener vsock_P and carries data both ways; what is not a
// listener there (nothing, a regular file, a link to another socket) is
// refused, naming the port; the socket is the jail uid's, mode 0600.
func TestVsockDial(t *testing.T) {
	dir, sock, vsock, _ := dialFixture(t)
	fi, err := os.Lstat(sock)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 || fi.Mode()&os.ModeSocket == 0 {
		t.Errorf("dial socket mode %v, want a socket, 0600", fi.Mode())
	}
	ln, err := net.Listen("unix", vsock+"_5000")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	uc, err := DialVsock(ctx, sock, 5000)
	if err != nil {
		t.Fatalf("DialVsock: %v", err)
	}
	defer uc.Close()
	hc, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer hc.Close()
	uc.Write([]byte("ping\n"))
	hc.SetDeadline(time.Now().Add(5 * time.Second))
	if line, err := bufio.NewReader(hc).ReadString('\n'); err != nil || line != "ping\n" {
		t.Fatalf("listener read %q, %v", line, err)
	}
	hc.Write([]byte("pong"))
	buf := make([]byte, 4)
	uc.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(uc, buf); err != nil || string(buf) != "pong" {
		t.Fatalf("dialled side read %q, %v", buf, err)
	}

	// Not listeners.
	if err := os.WriteFile(vsock+"_5001", nil, 0o600); err != nil {
		t.Fatal(err)
	}
	other, err := net.Listen("unix", filepath.Join(dir, "other.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if err := os.Symlink(filepath.Join(dir, "other.sock"), vsock+"_5002"); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		port uint32
		want string
	}{
		{4999, "host port 4999: no listener"},
		{5001, "host port 5001: " + vsock + "_5001 is not a socket"},
		{5002, "is not a socket"},
	} {
		uc, err := DialVsock(ctx, sock, c.port)
		if err == nil {
			uc.Close()
			t.Errorf("port %d: dialled, want %q", c.port, c.want)
			continue
		}
		if !strings.Contains(err.Error(), c.want) {
			t.Errorf("port %d: %v, want %q", c.port, err, c.want)
		}
	}
}

// TestVsockDialBadRequests: the server answers what is not a DIAL line
// with an error, drops an endless line, and serves on.
func TestVsockDialBadRequests(t *testing.T) {
	_, sock, vsock, _ := dialFixture(t)
	ln, err := net.Listen("unix", vsock+"_7")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	for _, req := range []string{
		"HELLO\n", "DIAL\n", "DIAL -1\n", "DIAL 4294967296\n", "DIAL 07\n", "DIAL 7 8\n", "DIAL 0x7\n",
		strings.Repeat("D", 4096), "DIAL 7", // no newline: the server waits, then the client closes
	} {
		c, err := net.Dial("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		c.SetDeadline(time.Now().Add(5 * time.Second))
		io.WriteString(c, req)
		if !strings.HasSuffix(req, "\n") {
			c.(*net.UnixConn).CloseWrite()
		}
		got, _ := io.ReadAll(c)
		c.Close()
		if !strings.HasPrefix(string(got), "ERR ") {
			t.Errorf("request %.40q: answer %q, want ERR", req, got)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	uc, err := DialVsock(ctx, sock, 7)
	if err != nil {
		t.Fatalf("after the bad requests: %v", err)
	}
	uc.Close()
}

// TestVsockDialInFlight: requests past maxDialsInFlight are refused at
// once, and Close waits for those being served.
func TestVsockDialInFlight(t *testing.T) {
	_, sock, _, s := dialFixture(t)
	var held []net.Conn
	for range maxDialsInFlight {
		c, err := net.Dial("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, c) // no request: each holds a place until its deadline
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		c, err := net.Dial("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		c.SetDeadline(time.Now().Add(2 * time.Second))
		got, _ := io.ReadAll(c)
		c.Close()
		if strings.Contains(string(got), "dials in flight already") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a request past %d in flight: answer %q, want refused", maxDialsInFlight, got)
		}
	}
	for _, c := range held {
		c.Close()
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(sock); !os.IsNotExist(err) {
		t.Errorf("Close left the socket: %v", err)
	}
}

func TestServeVsockDialErrors(t *testing.T) {
	dir := t.TempDir()
	if _, err := ServeVsockDial(filepath.Join(dir, "d"), 0, 0, "", nil); err == nil || !strings.Contains(err.Error(), "no vsock socket") {
		t.Errorf("no vsock path: %v", err)
	}
	file := filepath.Join(dir, "file")
	os.WriteFile(file, []byte("keep"), 0o600)
	if _, err := ServeVsockDial(file, os.Getuid(), os.Getgid(), filepath.Join(dir, "v"), nil); err == nil || !strings.Contains(err.Error(), "is not a socket") {
		t.Errorf("a file at the path: %v", err)
	}
	if b, _ := os.ReadFile(file); string(b) != "keep" {
		t.Errorf("the file at the path was changed: %q", b)
	}
	if _, err := DialVsock(context.Background(), filepath.Join(dir, "none"), 1); err == nil || !strings.Contains(err.Error(), "through the parent") {
		t.Errorf("no server: %v", err)
	}
}

func FuzzParseDialLine(f *testing.F) {
	for _, s := range []string{"DIAL 0", "DIAL 4294967295", "DIAL 4294967296", "DIAL -1", "DIAL +1", "DIAL 01", "dial 1", "DIAL  1", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, line string) {
		port, err := parseDialLine(line)
		if err != nil {
			return
		}
		if line != "DIAL "+strconv.FormatUint(uint64(port), 10) {
			t.Fatalf("%q parsed as port %d", line, port)
		}
	})
}
