package vmmproc

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// The descriptor side channel. gRPC carries no file descriptors, so a
// fork's frozen memory crosses on a second Unix socket beside the API's
// (FDSocket): a client connects and writes one line, "GET <token>" to
// receive the descriptor the server holds under token (it then gives it
// up), or "PUT <token>" in a message that carries one descriptor with
// SCM_RIGHTS, which the server then holds under token. The server answers
// "OK" (with the descriptor, for GET) or "ERR <reason>".

// ChunkSocket returns the socket beside the API socket sock on which a
// jailed VMM process's parent fetches image chunks for it (package
// image/chunkrpc): in its jail the process can neither reach the registry
// nor write the image store.
func ChunkSocket(sock string) string { return sock + ".chunks" }

// FDSocket returns the descriptor socket beside the API socket sock.
func FDSocket(sock string) string { return sock + ".fd" }

const (
	maxFDLine    = 128
	fdTimeout    = 30 * time.Second
	maxHeldFDs   = 64
	tokenPattern = "0123456789abcdef"
)

// tokenTTL is how long a descriptor waits under its token: one that its
// client never fetched (it died between the RPC and the GET, say) is
// closed after it, so that it does not pin a frozen base's RAM.
const tokenTTL = 2 * time.Minute

// fdStore holds descriptors by token for the side channel's clients.
type fdStore struct {
	mu  sync.Mutex
	fds map[string]fdEntry
	ttl time.Duration
}

// fdEntry is a descriptor waiting under a token since at.
type fdEntry struct {
	f  *os.File
	at time.Time
}

func newFDStore() *fdStore { return &fdStore{fds: map[string]fdEntry{}, ttl: tokenTTL} }

// newToken returns a random token.
func newToken() (string, error) {
	b := make([]byte, 16)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return hex.EncodeToString(b), nil
}

func validToken(t string) bool {
	return len(t) == 32 && strings.Trim(t, tokenPattern) == ""
}

// put holds f under token (replacing nothing: a token is used once).
func (s *fdStore) put(token string, f *os.File) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now()
	for t, e := range s.fds {
		if now.Sub(e.at) > s.ttl {
			e.f.Close()
			delete(s.fds, t)
		}
	}
	if _, ok := s.fds[token]; ok {
		return fmt.Errorf("token %s is taken", token)
	}
	if len(s.fds) >= maxHeldFDs {
		return fmt.Errorf("%d descriptors held already", len(s.fds))
	}
	s.fds[token] = fdEntry{f: f, at: now}
	return nil
}

// take gives up the descriptor held under token.
func (s *fdStore) take(token string) (*os.File, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.fds[token]
	if !ok {
		return nil, fmt.Errorf("no descriptor under token %q", token)
	}
	delete(s.fds, token)
	return e.f, nil
}

func (s *fdStore) closeAll() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for t, e := range s.fds {
		e.f.Close()
		delete(s.fds, t)
	}
}

// listenUnix listens on a new Unix socket at path that only this user may
// connect to.
func listenUnix(path string) (*net.UnixListener, error) {
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, err
	}
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, err
	}
	return ln, nil
}

// serveFDs answers the side channel's clients on ln until it is closed.
func (s *fdStore) serveFDs(ln *net.UnixListener) {
	for {
		c, err := ln.AcceptUnix()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			c.SetDeadline(time.Now().Add(fdTimeout))
			s.handle(c)
		}()
	}
}

func (s *fdStore) handle(c *net.UnixConn) {
	buf := make([]byte, maxFDLine)
	oob := make([]byte, unix.CmsgSpace(4))
	n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
	if err != nil {
		return
	}
	var passed []int
	if oobn > 0 {
		if msgs, err := unix.ParseSocketControlMessage(oob[:oobn]); err == nil {
			for _, m := range msgs {
				if fds, err := unix.ParseUnixRights(&m); err == nil {
					passed = append(passed, fds...)
				}
			}
		}
	}
	// Descriptors nobody keeps are closed.
	keep := -1
	defer func() {
		for _, fd := range passed {
			if fd != keep {
				unix.Close(fd)
			}
		}
	}()
	line := strings.TrimSpace(string(buf[:n]))
	op, token, _ := strings.Cut(line, " ")
	if !validToken(token) {
		fmt.Fprintf(c, "ERR bad token\n")
		return
	}
	switch op {
	case "GET":
		f, err := s.take(token)
		if err != nil {
			fmt.Fprintf(c, "ERR %v\n", err)
			return
		}
		defer f.Close()
		if _, _, err := c.WriteMsgUnix([]byte("OK\n"), unix.UnixRights(int(f.Fd())), nil); err != nil {
			return
		}
	case "PUT":
		if len(passed) != 1 {
			fmt.Fprintf(c, "ERR PUT carries %d descriptors, want 1\n", len(passed))
			return
		}
		f := os.NewFile(uintptr(passed[0]), "vmmproc-"+token)
		keep = passed[0] // f owns it now: closed below or kept by put
		if err := s.put(token, f); err != nil {
			f.Close()
			fmt.Fprintf(c, "ERR %v\n", err)
			return
		}
		fmt.Fprintf(c, "OK\n")
	default:
		fmt.Fprintf(c, "ERR unknown request %.20q\n", op)
	}
}

// dialFD connects to the side channel at path.
func dialFD(ctx context.Context, path string) (*net.UnixConn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		return nil, err
	}
	uc := c.(*net.UnixConn)
	deadline := time.Now().Add(fdTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	uc.SetDeadline(deadline)
	return uc, nil
}

// getFD receives the descriptor held under token at the side channel path.
func getFD(ctx context.Context, path, token string) (*os.File, error) {
	c, err := dialFD(ctx, path)
	if err != nil {
		return nil, fmt.Errorf("descriptor socket: %w", err)
	}
	defer c.Close()
	if _, err := fmt.Fprintf(c, "GET %s\n", token); err != nil {
		return nil, fmt.Errorf("descriptor socket: %w", err)
	}
	buf := make([]byte, maxFDLine)
	oob := make([]byte, unix.CmsgSpace(4))
	n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
	if err != nil {
		return nil, fmt.Errorf("descriptor socket: %w", err)
	}
	var fds []int
	if msgs, err := unix.ParseSocketControlMessage(oob[:oobn]); err == nil {
		for _, m := range msgs {
			if got, err := unix.ParseUnixRights(&m); err == nil {
				fds = append(fds, got...)
			}
		}
	}
	reply := strings.TrimSpace(string(buf[:n]))
	if reply != "OK" || len(fds) != 1 {
		for _, fd := range fds {
			unix.Close(fd)
		}
		if reply == "OK" {
			reply = fmt.Sprintf("%d descriptors in the answer", len(fds))
		}
		return nil, fmt.Errorf("descriptor socket: GET: %s", reply)
	}
	return os.NewFile(uintptr(fds[0]), "vmmproc-"+token), nil
}

// putFD hands f to the side channel at path under token.
func putFD(ctx context.Context, path, token string, f *os.File) error {
	c, err := dialFD(ctx, path)
	if err != nil {
		return fmt.Errorf("descriptor socket: %w", err)
	}
	defer c.Close()
	if _, _, err := c.WriteMsgUnix([]byte("PUT "+token+"\n"), unix.UnixRights(int(f.Fd())), nil); err != nil {
		return fmt.Errorf("descriptor socket: %w", err)
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return fmt.Errorf("descriptor socket: PUT: %w", err)
	}
	if line = strings.TrimSpace(line); line != "OK" {
		return fmt.Errorf("descriptor socket: PUT: %s", line)
	}
	return nil
}
