package vmmproc

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/internal/ratelog"
)

// The vsock dial side channel. A guest's connection to the host's vsock
// port P is relayed to the Unix socket <vsock socket>_P (Firecracker's
// convention), which a jailed VMM process cannot reach: it sees only its
// binds, as a uid of its own, and the sandbox's folder is root's. So its
// parent dials for it: the process connects to DialSocket beside its API
// socket and writes one line, "DIAL <port>"; the parent dials
// <vsock socket>_<port> of that sandbox (a socket there, not a link) and
// answers "OK" with the connected socket's descriptor (SCM_RIGHTS), or
// "ERR <reason>". The process can thus reach its own sandbox's listeners
// only, as it could unjailed.

// DialSocket returns the socket beside the API socket sock on which a
// jailed VMM process's parent dials its guest's vsock connections.
func DialSocket(sock string) string { return sock + ".dial" }

const (
	// maxDialLine bounds a DIAL request: "DIAL 4294967295\n" is 16 bytes.
	maxDialLine = 32
	// dialTimeout bounds one request on the server: reading it, the
	// dial, and the answer (the device gives a guest connection 10 s).
	dialTimeout = 10 * time.Second
	// maxDialsInFlight bounds the requests one socket serves at once; a
	// request past it is refused at once (the guest retries).
	maxDialsInFlight = 16
)

// DialServer dials a jailed VMM process's guest vsock connections on its
// behalf (see DialSocket).
type DialServer struct {
	ln    *net.UnixListener
	path  string
	vsock string
	log   *slog.Logger
	sem   chan struct{}
	wg    sync.WaitGroup
}

// ServeVsockDial serves the dial socket at path for the jailed process of
// uid and gid whose vsock device's host socket is vsock: the socket is
// made owned by uid and gid, mode 0600, so that only that process can
// connect (its folder must let it search: 0711). A stale socket at path is
// replaced.
func ServeVsockDial(path string, uid, gid int, vsock string, log *slog.Logger) (*DialServer, error) {
	if vsock == "" {
		return nil, errors.New("vmmproc: vsock dial: no vsock socket")
	}
	if log == nil {
		log = slog.Default()
	}
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode()&os.ModeSocket == 0 {
			return nil, fmt.Errorf("vmmproc: vsock dial: %s exists and is not a socket", path)
		}
		os.Remove(path)
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("vmmproc: vsock dial: %w", err)
	}
	ln.SetUnlinkOnClose(true)
	if err := os.Chmod(path, 0o600); err == nil {
		err = os.Lchown(path, uid, gid)
		if err != nil {
			ln.Close()
			return nil, fmt.Errorf("vmmproc: vsock dial: give %s to the jail: %w", path, err)
		}
	} else {
		ln.Close()
		return nil, fmt.Errorf("vmmproc: vsock dial: %w", err)
	}
	s := &DialServer{ln: ln, path: path, vsock: vsock, sem: make(chan struct{}, maxDialsInFlight),
		// A guest decides how often its VMM asks: the log is rate-limited.
		log: ratelog.Wrap(log, ratelog.Options{}).With("vsock", vsock)}
	s.wg.Add(1)
	go s.accept()
	return s, nil
}

// Close stops serving and waits for the requests being served.
func (s *DialServer) Close() error {
	err := s.ln.Close()
	s.wg.Wait()
	if errors.Is(err, net.ErrClosed) {
		err = nil
	}
	return err
}

func (s *DialServer) accept() {
	defer s.wg.Done()
	for {
		c, err := s.ln.AcceptUnix()
		if err != nil {
			return
		}
		select {
		case s.sem <- struct{}{}:
		default:
			c.SetWriteDeadline(time.Now().Add(time.Second))
			fmt.Fprintf(c, "ERR %d dials in flight already\n", maxDialsInFlight)
			c.Close()
			continue
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			defer func() { <-s.sem }()
			defer c.Close()
			c.SetDeadline(time.Now().Add(dialTimeout))
			if err := s.serve(c); err != nil {
				s.log.Debug("guest vsock connection not dialled", "err", err)
				fmt.Fprintf(c, "ERR %s\n", oneLine(err.Error()))
			}
		}()
	}
}

// serve answers one request on c.
func (s *DialServer) serve(c *net.UnixConn) error {
	port, err := readDialLine(c)
	if err != nil {
		return err
	}
	target := fmt.Sprintf("%s_%d", s.vsock, port)
	fi, err := os.Lstat(target)
	if err != nil {
		return fmt.Errorf("host port %d: no listener (%w)", port, errors.Unwrap(err))
	}
	if fi.Mode()&os.ModeSocket == 0 {
		return fmt.Errorf("host port %d: %s is not a socket", port, target)
	}
	ctx, cancel := context.WithTimeout(context.Background(), dialTimeout)
	defer cancel()
	var d net.Dialer
	nc, err := d.DialContext(ctx, "unix", target)
	if err != nil {
		return fmt.Errorf("host port %d: %w", port, err)
	}
	defer nc.Close()
	f, err := nc.(*net.UnixConn).File()
	if err != nil {
		return fmt.Errorf("host port %d: %w", port, err)
	}
	defer f.Close()
	_, _, err = c.WriteMsgUnix([]byte("OK\n"), unix.UnixRights(int(f.Fd())), nil)
	return err
}

// readDialLine reads "DIAL <port>\n" from c, byte by byte (nothing past
// the line is read), at most maxDialLine bytes.
func readDialLine(c net.Conn) (uint32, error) {
	var line []byte
	b := make([]byte, 1)
	for {
		if _, err := c.Read(b); err != nil {
			return 0, fmt.Errorf("reading the request: %w", err)
		}
		if b[0] == '\n' {
			break
		}
		if len(line) >= maxDialLine {
			return 0, fmt.Errorf("request over %d bytes", maxDialLine)
		}
		line = append(line, b[0])
	}
	return parseDialLine(string(line))
}

// parseDialLine parses a DIAL request's line (without its newline).
func parseDialLine(line string) (uint32, error) {
	arg, ok := strings.CutPrefix(line, "DIAL ")
	if !ok {
		return 0, fmt.Errorf("request %q: want DIAL <port>", line)
	}
	port, err := strconv.ParseUint(arg, 10, 32)
	if err != nil || arg != strconv.FormatUint(port, 10) {
		return 0, fmt.Errorf("request %q: the port is not a number from 0 to %d", line, uint32(1<<32-1))
	}
	return uint32(port), nil
}

// oneLine keeps an error's text on one line.
func oneLine(s string) string { return strings.ReplaceAll(s, "\n", " ") }

// DialVsock asks the parent serving the dial socket at path to dial the
// host's vsock port and returns the connected socket it hands over.
func DialVsock(ctx context.Context, path string, port uint32) (*net.UnixConn, error) {
	var d net.Dialer
	nc, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		return nil, fmt.Errorf("vsock dial through the parent: %w", err)
	}
	c := nc.(*net.UnixConn)
	defer c.Close()
	if dl, ok := ctx.Deadline(); ok {
		c.SetDeadline(dl)
	} else {
		c.SetDeadline(time.Now().Add(dialTimeout))
	}
	if _, err := fmt.Fprintf(c, "DIAL %d\n", port); err != nil {
		return nil, fmt.Errorf("vsock dial through the parent: %w", err)
	}
	buf := make([]byte, 512)
	oob := make([]byte, unix.CmsgSpace(4))
	n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
	if err != nil {
		return nil, fmt.Errorf("vsock dial through the parent: %w", err)
	}
	var fds []int
	if oobn > 0 {
		msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
		if err == nil {
			for _, m := range msgs {
				if got, err := unix.ParseUnixRights(&m); err == nil {
					fds = append(fds, got...)
				}
			}
		}
	}
	answer := strings.TrimSpace(string(buf[:n]))
	if answer != "OK" || len(fds) != 1 {
		for _, fd := range fds {
			unix.Close(fd)
		}
		if reason, ok := strings.CutPrefix(answer, "ERR "); ok {
			return nil, fmt.Errorf("vsock dial through the parent: %s", reason)
		}
		return nil, fmt.Errorf("vsock dial through the parent: answer %q with %d descriptors", answer, len(fds))
	}
	f := os.NewFile(uintptr(fds[0]), fmt.Sprintf("vsock-host-port-%d", port))
	defer f.Close()
	fc, err := net.FileConn(f)
	if err != nil {
		return nil, fmt.Errorf("vsock dial through the parent: %w", err)
	}
	uc, ok := fc.(*net.UnixConn)
	if !ok {
		fc.Close()
		return nil, errors.New("vsock dial through the parent: the descriptor is not a Unix socket")
	}
	return uc, nil
}
