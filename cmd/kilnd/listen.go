package main

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/coreos/go-systemd/v22/activation"
)

// listenSpec is one --listen value: unix:PATH or tcp:HOST:PORT.
type listenSpec struct {
	network string // "unix" or "tcp"
	addr    string
}

func (l listenSpec) String() string { return l.network + ":" + l.addr }

func parseListen(s string) (listenSpec, error) {
	network, addr, ok := strings.Cut(s, ":")
	if !ok || addr == "" {
		return listenSpec{}, fmt.Errorf("--listen %q: want unix:PATH or tcp:HOST:PORT", s)
	}
	switch network {
	case "unix":
		addr = strings.TrimPrefix(addr, "//") // unix:///path too
		if !filepath.IsAbs(addr) {
			return listenSpec{}, fmt.Errorf("--listen %q: the socket path must be absolute", s)
		}
		return listenSpec{network: "unix", addr: filepath.Clean(addr)}, nil
	case "tcp":
		addr = strings.TrimPrefix(addr, "//") // tcp://host:port too
		if _, port, err := net.SplitHostPort(addr); err != nil || port == "" {
			return listenSpec{}, fmt.Errorf("--listen %q: want tcp:HOST:PORT", s)
		}
		return listenSpec{network: "tcp", addr: addr}, nil
	}
	return listenSpec{}, fmt.Errorf("--listen %q: unknown network %q (want unix or tcp)", s, network)
}

// listenFlag collects repeated --listen flags.
type listenFlag []listenSpec

func (f *listenFlag) String() string {
	s := make([]string, len(*f))
	for i, l := range *f {
		s[i] = l.String()
	}
	return strings.Join(s, ",")
}

// Get returns the addresses; a config file gives them as an array of
// strings.
func (f *listenFlag) Get() any {
	s := make([]string, len(*f))
	for i, l := range *f {
		s[i] = l.String()
	}
	return s
}

func (f *listenFlag) Set(v string) error {
	l, err := parseListen(v)
	if err != nil {
		return err
	}
	*f = append(*f, l)
	return nil
}

// socketMode is the Unix socket's mode: its owner and group may call, and
// the daemon trusts whoever can open it.
const socketMode = 0o660

// listen opens l. A Unix socket's folder is made when missing (0755), a
// stale socket left by a daemon that died is replaced (a live one is an
// error: another kilnd serves there), and the socket gets socketMode and,
// unless gid is -1, that group.
func listen(l listenSpec, gid int) (net.Listener, error) {
	if l.network == "tcp" {
		ln, err := net.Listen("tcp", l.addr)
		if err != nil {
			return nil, fmt.Errorf("listen on %s: %w", l, err)
		}
		return ln, nil
	}
	if err := os.MkdirAll(filepath.Dir(l.addr), 0o755); err != nil {
		return nil, fmt.Errorf("listen on %s: %w", l, err)
	}
	if err := removeStaleSocket(l.addr); err != nil {
		return nil, fmt.Errorf("listen on %s: %w", l, err)
	}
	// The socket is made with the process's umask; tighten it before
	// chmod so that it is never more open than socketMode.
	old := syscall.Umask(0o117)
	ln, err := net.Listen("unix", l.addr)
	syscall.Umask(old)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", l, err)
	}
	if err := os.Chmod(l.addr, socketMode); err != nil {
		ln.Close()
		return nil, fmt.Errorf("listen on %s: %w", l, err)
	}
	if gid != -1 {
		if err := os.Lchown(l.addr, -1, gid); err != nil {
			ln.Close()
			return nil, fmt.Errorf("listen on %s: giving the socket group %d: %w", l, gid, err)
		}
	}
	return ln, nil
}

// lookupGroup resolves a group name or numeric ID.
func lookupGroup(name string) (int, error) {
	if id, err := strconv.Atoi(name); err == nil && id >= 0 {
		return id, nil
	}
	g, err := user.LookupGroup(name)
	if err != nil {
		return 0, fmt.Errorf("--socket-group: %w", err)
	}
	id, err := strconv.Atoi(g.Gid)
	if err != nil {
		return 0, fmt.Errorf("--socket-group %s: group ID %q is not a number", name, g.Gid)
	}
	return id, nil
}

// removeStaleSocket removes path when it is a socket nobody answers on.
func removeStaleSocket(path string) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if fi.Mode()&os.ModeSocket == 0 {
		return fmt.Errorf("%s exists and is not a socket", path)
	}
	c, err := net.DialTimeout("unix", path, time.Second)
	if err == nil {
		c.Close()
		return fmt.Errorf("another daemon is serving on %s", path)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("removing the stale socket: %w", err)
	}
	return nil
}

// activatedListeners returns the sockets systemd passed (socket
// activation: LISTEN_FDS, LISTEN_PID), in order, or none. Their variables
// are unset and their descriptors close on exec, so VMM processes inherit
// neither. They are never unlinked: the socket unit owns them, and keeps
// them while kilnd restarts.
func activatedListeners() ([]net.Listener, error) {
	files := activation.Files(true)
	lns := make([]net.Listener, 0, len(files))
	fail := func(err error) ([]net.Listener, error) {
		for _, ln := range lns {
			ln.Close()
		}
		for _, f := range files {
			f.Close()
		}
		return nil, err
	}
	for i, f := range files {
		ln, err := net.FileListener(f)
		if err != nil {
			return fail(fmt.Errorf("the socket systemd passed as descriptor %d (%s) is not a listening stream socket: %w", 3+i, f.Name(), err))
		}
		f.Close()
		files[i] = nil
		if ul, ok := ln.(*net.UnixListener); ok {
			ul.SetUnlinkOnClose(false)
		}
		lns = append(lns, ln)
	}
	return lns, nil
}

// activatedAt reports whether one of the activated listeners lns is l's
// Unix socket already (the config names the socket kilnd.socket passes).
func activatedAt(lns []net.Listener, l listenSpec) bool {
	if l.network != "unix" {
		return false
	}
	for _, ln := range lns {
		if a, ok := ln.Addr().(*net.UnixAddr); ok && filepath.Clean(a.Name) == l.addr {
			return true
		}
	}
	return false
}
