// Command kilnd is Kiln's sandbox daemon: it serves the kiln.v1 gRPC API
// (package daemon) on a Unix socket and, with a bearer token, on TCP, and
// runs each sandbox in a VMM process of its own (this install's kiln vmm).
//
//	kilnd [--listen unix:PATH]... [--listen tcp:HOST:PORT --token-file FILE]
//	      [--state-dir DIR] [--images DIR] [--kernel K] [--agent A] [--kiln PATH]
//
// Callers on the Unix socket (mode 0660) are trusted; TCP callers must send
// "authorization: Bearer TOKEN". On SIGTERM or SIGINT kilnd stops serving
// and exits, leaving the sandboxes running: the next kilnd over the same
// state folder takes them over. Under systemd (Type=notify) it reports
// READY=1 once it serves.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"
)

// defaultSocket is where kilnd listens unless told otherwise.
const defaultSocket = "/run/kiln/kilnd.sock"

// config is kilnd's command line.
type config struct {
	listens   []listenSpec
	tokenFile string
	group     string // the Unix sockets' group, "" to leave it
	stateDir  string
	images    string
	kernel    string
	agent     string
	kiln      string // the kiln binary whose vmm command runs each VM
	debug     bool

	maxSandboxes    int
	maxMemoryMiB    uint64
	defaultLifetime time.Duration
}

// newServiceFunc makes the service kilnd serves from its configuration.
type newServiceFunc func(cfg config, log *slog.Logger) (service, error)

func main() {
	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()
	os.Exit(run(ctx, os.Args[1:], os.Stderr, newDaemon))
}

func parseFlags(args []string, stderr io.Writer) (config, error) {
	var cfg config
	var listens listenFlag
	fs := flag.NewFlagSet("kilnd", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Var(&listens, "listen", "`ADDR` to serve on: unix:PATH or tcp:HOST:PORT (repeatable; a unix:"+defaultSocket+" is added unless one is given)")
	fs.StringVar(&cfg.tokenFile, "token-file", "", "`FILE` whose first line is the bearer token TCP callers must send (required with a TCP --listen)")
	fs.StringVar(&cfg.group, "socket-group", "", "`GROUP` (name or ID) given the Unix sockets, whose members may then call")
	fs.StringVar(&cfg.stateDir, "state-dir", "/var/lib/kiln", "`DIR` for the daemon's records, sandboxes, checkpoints and templates")
	fs.StringVar(&cfg.images, "images", "", "images `DIR` (default: <kernel cache>/images, as kiln image pull uses)")
	fs.StringVar(&cfg.kernel, "kernel", "", "kernel image; default: the cached Debian kernel, as kiln run")
	fs.StringVar(&cfg.agent, "agent", "", "static kiln-agent binary; default: $KILN_AGENT, or kiln-agent beside kiln")
	fs.StringVar(&cfg.kiln, "kiln", "", "the kiln binary whose `kiln vmm` runs each sandbox's VM (default: kiln beside kilnd)")
	fs.IntVar(&cfg.maxSandboxes, "max-sandboxes", 0, "most live sandboxes at once (0: 1024)")
	fs.Uint64Var(&cfg.maxMemoryMiB, "max-memory", 0, "most guest memory in `MiB` among the live sandboxes (0: the host's)")
	fs.DurationVar(&cfg.defaultLifetime, "default-lifetime", 0, "lifetime of a sandbox whose request gives none (0: unlimited)")
	fs.BoolVar(&cfg.debug, "debug", false, "log at debug level")
	if err := fs.Parse(args); err != nil {
		return config{}, err
	}
	if fs.NArg() > 0 {
		return config{}, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	cfg.listens = listens
	hasUnix := false
	for _, l := range listens {
		if l.network == "unix" {
			hasUnix = true
		}
		if l.network == "tcp" && cfg.tokenFile == "" {
			return config{}, errNoToken
		}
	}
	if !hasUnix {
		cfg.listens = append([]listenSpec{{network: "unix", addr: defaultSocket}}, cfg.listens...)
	}
	if cfg.stateDir == "" {
		return config{}, errors.New("--state-dir is empty")
	}
	if cfg.maxSandboxes < 0 {
		return config{}, fmt.Errorf("--max-sandboxes %d is negative", cfg.maxSandboxes)
	}
	if cfg.defaultLifetime < 0 {
		return config{}, fmt.Errorf("--default-lifetime %v is negative (0 means unlimited)", cfg.defaultLifetime)
	}
	if cfg.kiln == "" {
		self, err := os.Executable()
		if err != nil {
			return config{}, fmt.Errorf("finding kiln beside kilnd: %w (use --kiln)", err)
		}
		cfg.kiln = filepath.Join(filepath.Dir(self), "kiln")
	}
	return cfg, nil
}

// run is kilnd: 0 after a clean stop, 1 when serving failed, 2 for a bad
// command line.
func run(ctx context.Context, args []string, stderr io.Writer, newService newServiceFunc) int {
	cfg, err := parseFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintln(stderr, "kilnd:", err)
		return 2
	}
	level := slog.LevelInfo
	if cfg.debug {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level}))
	var a auth
	if cfg.tokenFile != "" {
		if a.token, err = readToken(cfg.tokenFile); err != nil {
			fmt.Fprintln(stderr, "kilnd:", err)
			return 2
		}
		if fi, err := os.Stat(cfg.tokenFile); err == nil && fi.Mode().Perm()&0o077 != 0 {
			log.Warn("kilnd: the token file is readable by others than its owner; chmod 600 it", "file", cfg.tokenFile, "mode", fi.Mode().Perm())
		}
	}
	for _, l := range cfg.listens {
		if l.network == "tcp" && !loopback(l.addr) {
			log.Warn("kilnd: TCP is plain: the bearer token and all traffic cross the network in the clear; prefer loopback or a tunnel", "listen", l.String())
		}
	}
	// Listen before taking the state folder over: a second kilnd on the
	// same socket stops here, before it adopts anyone's sandboxes.
	var lns []net.Listener
	closeAll := func() {
		for _, ln := range lns {
			ln.Close()
		}
	}
	gid := -1
	if cfg.group != "" {
		if gid, err = lookupGroup(cfg.group); err != nil {
			fmt.Fprintln(stderr, "kilnd:", err)
			return 2
		}
	}
	for _, l := range cfg.listens {
		ln, err := listen(l, gid)
		if err != nil {
			closeAll()
			fmt.Fprintln(stderr, "kilnd:", err)
			return 1
		}
		lns = append(lns, ln)
	}
	svc, err := newService(cfg, log)
	if err != nil {
		closeAll()
		fmt.Fprintln(stderr, "kilnd:", err)
		return 1
	}
	if err := serve(ctx, lns, a, svc, log); err != nil {
		fmt.Fprintln(stderr, "kilnd:", err)
		return 1
	}
	return 0
}

// loopback reports whether a TCP listen address stays on this host.
func loopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
