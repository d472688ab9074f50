// Command kilnd is Kiln's sandbox daemon: it serves the kiln.v1 gRPC API
// (package daemon) on a Unix socket and, with a bearer token, on TCP, and
// runs each sandbox in a VMM process of its own (this install's kiln-vmm).
//
//	kilnd [--config FILE] [--listen unix:PATH]... [--listen tcp:HOST:PORT --token-file FILE]
//	      [--state-dir DIR] [--images DIR] [--kernel K] [--agent A] [--vmm PATH]
//	      [--log-format text|json] [host flags: --cgroup-root, --net-pool, ...]
//
// Every flag is also a key of the TOML config file (--config, default
// /etc/kiln/kilnd.toml when it exists; see packaging/kilnd.toml); flags
// override the file. Callers on the Unix socket (mode 0660) are trusted;
// TCP callers must send "authorization: Bearer TOKEN". On SIGTERM or
// SIGINT kilnd stops serving and exits, leaving the sandboxes running: the
// next kilnd over the same state folder takes them over.
//
// Under systemd (packaging/kilnd.service, Type=notify) it serves on the
// sockets systemd passes (kilnd.socket) instead of the default one, says
// READY=1 once its API answers a health check over its own socket, sends
// STATUS= lines, pings the watchdog (WatchdogSec=) while those checks pass,
// and says STOPPING=1 when it stops.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/signal"
	"syscall"
	"time"

	sddaemon "github.com/coreos/go-systemd/v22/daemon"
	"github.com/kilnvm/kiln/cgroup"
	"github.com/kilnvm/kiln/daemon/e2b"
	"github.com/kilnvm/kiln/jail"
)

// defaultSocket is where kilnd listens unless told otherwise.
const defaultSocket = "/run/kiln/kilnd.sock"

// config is kilnd's command line, over its config file.
type config struct {
	configFile string // the config file read, "" for none
	listens    []listenSpec
	// implicitSocket: listens[0] is the default socket, added because no
	// unix: --listen was given (dropped when systemd passes sockets).
	implicitSocket bool
	tokenFile      string
	group          string // the Unix sockets' group, "" to leave it
	stateDir       string
	images         string
	kernel         string
	agent          string
	vmm            string // the kiln-vmm each VMM process runs ("": sandbox.FindVMM's)
	kiln           string // deprecated --kiln: a kiln whose `kiln vmm` runs each VM
	debug          bool
	// jail jails each VMM process (--jail); jailIDs holds its id locks
	// (--jail-ids).
	jail      jail.Mode
	jailIDs   string
	logFormat string // logText or logJSON

	maxSandboxes    int
	maxMemoryMiB    uint64
	defaultLifetime time.Duration

	// Host integration (issue 12), parsed and validated here.
	metricsListen    string           // "" = no /metrics
	netPool          netip.Prefix     // zero = no per-sandbox network
	netUplink        string           // "" = the default route's
	netDNS           []netip.AddrPort // nil = /etc/resolv.conf's
	netRefused       []netip.Prefix   // nil = hostnet.DefaultRefused; empty = none
	egressDefault    string           // egressAllowAll or egressDenyAll (with --net-pool)
	cgroupRoot       string           // "" = kilnd's own cgroup, cgroupNone = none
	memoryOvercommit float64          // × host memory that admission lets sandboxes commit
	vmmOverheadMiB   uint64           // each VMM process's share beyond guest memory
	pidsMax          uint64           // each sandbox cgroup's pids.max
	sandboxIO        []cgroup.IOLimit // io.max lines of every sandbox's cgroup

	// The E2B API (issue 13): off unless e2bListen is set.
	e2bListen   string   // HOST:PORT
	e2bKeysFile string   // "KEY TENANT" lines
	e2bKeys     []string // "KEY TENANT" values
	e2bDomain   string
	e2bTimeout  time.Duration
	// The E2B listener's connection limits (e2b.go).
	e2bIdleTimeout   time.Duration // a keep-alive connection's between requests
	e2bReadTimeout   time.Duration // a control-plane request's, headers and body
	e2bWriteTimeout  time.Duration // a control-plane request's, to its reply written
	e2bConnsPerAddr  uint64        // open connections of one client address
	e2bTenantDefault e2b.Quota     // every tenant's quota but what the keys file sets
}

// newServiceFunc makes the service kilnd serves from its configuration.
type newServiceFunc func(cfg config, log *slog.Logger) (service, error)

func main() {
	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()
	os.Exit(run(ctx, os.Args[1:], os.Stderr, newDaemon))
}

// parseFlags parses kilnd's command line over its config file: the
// --config one, else defaultConfigFile when it exists.
func parseFlags(args []string, stderr io.Writer) (config, error) {
	return parseFlagsWith(args, stderr, defaultConfigFile)
}

// parseFlagsWith is parseFlags with the config file read when --config is
// not given ("" for none).
func parseFlagsWith(args []string, stderr io.Writer, defaultConfig string) (config, error) {
	// The command line alone first: for --config, and for which flags it
	// sets, which the file's keys do not override.
	var probe config
	var probeListens listenFlag
	fs := newFlagSet(&probe, &probeListens)
	fs.SetOutput(stderr)
	if err := fs.Parse(args); err != nil {
		return config{}, err
	}
	if fs.NArg() > 0 {
		return config{}, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	path := defaultConfig
	if given["config"] {
		path = fs.Lookup("config").Value.String()
	} else if path != "" {
		if _, err := os.Stat(path); errors.Is(err, os.ErrNotExist) {
			path = ""
		}
	}

	var cfg config
	var listens listenFlag
	fs = newFlagSet(&cfg, &listens)
	fs.SetOutput(io.Discard) // parsed once already: its errors are the file's
	if path != "" {
		if err := applyConfigFile(path, fs, given); err != nil {
			return config{}, err
		}
		cfg.configFile = path
	}
	if err := fs.Parse(args); err != nil {
		return config{}, err
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
		cfg.implicitSocket = true
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
	if err := checkE2BConfig(cfg); err != nil {
		return config{}, err
	}
	if cfg.vmm != "" && cfg.kiln != "" {
		return config{}, errors.New("--vmm and --kiln (deprecated: a kiln whose hidden `kiln vmm` runs each VM) both name the VMM binary: give --vmm")
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
	log := newLogger(stderr, cfg)
	if cfg.configFile != "" {
		log.Debug("kilnd: read the config file", "file", cfg.configFile)
	}
	// systemd's watchdog: its variables are unset, so that VMM processes
	// do not inherit them.
	watchdog, err := sddaemon.SdWatchdogEnabled(true)
	if err != nil {
		log.Warn("kilnd: systemd's watchdog variables are unusable; not pinging", "err", err)
		watchdog = 0
	}
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
	gid := -1
	if cfg.group != "" {
		if gid, err = lookupGroup(cfg.group); err != nil {
			fmt.Fprintln(stderr, "kilnd:", err)
			return 2
		}
	}
	// Sockets systemd passes (kilnd.socket) come first and stand in for
	// the default socket.
	lns, err := activatedListeners()
	if err != nil {
		fmt.Fprintln(stderr, "kilnd:", err)
		return 1
	}
	closeAll := func() {
		for _, ln := range lns {
			ln.Close()
		}
	}
	listens := cfg.listens
	if len(lns) > 0 && cfg.implicitSocket {
		listens = listens[1:]
	}
	for _, l := range listens {
		if l.network == "tcp" && !loopback(l.addr) {
			log.Warn("kilnd: TCP is plain: the bearer token and all traffic cross the network in the clear; prefer loopback or a tunnel", "listen", l.String())
		}
	}
	// Listen before taking the state folder over: a second kilnd on the
	// same socket stops here, before it adopts anyone's sandboxes.
	for _, l := range listens {
		if activatedAt(lns, l) {
			log.Debug("kilnd: systemd passed this socket already", "listen", l.String())
			continue
		}
		ln, err := listen(l, gid)
		if err != nil {
			closeAll()
			fmt.Fprintln(stderr, "kilnd:", err)
			return 1
		}
		lns = append(lns, ln)
	}
	var e2bl *e2bListener
	if cfg.e2bListen != "" {
		if e2bl, err = listenE2B(cfg, log); err != nil {
			closeAll()
			fmt.Fprintln(stderr, "kilnd:", err)
			return 1
		}
		defer e2bl.ln.Close()
	}
	var metrics *metricsServer
	if cfg.metricsListen != "" {
		if metrics, err = listenMetrics(cfg.metricsListen, log); err != nil {
			closeAll()
			fmt.Fprintln(stderr, "kilnd:", err)
			return 1
		}
		defer metrics.stop()
	}
	notify(log, "STATUS=adopting sandboxes")
	svc, err := newService(cfg, log)
	if err != nil {
		closeAll()
		fmt.Fprintln(stderr, "kilnd:", err)
		return 1
	}
	if metrics != nil {
		if err := metrics.start(svc); err != nil {
			closeAll()
			svc.Close(context.Background())
			fmt.Fprintln(stderr, "kilnd:", err)
			return 1
		}
	}
	opts := serveOptions{watchdog: watchdog}
	if e2bl != nil {
		stop, err := e2bl.start(cfg, log)
		if err != nil {
			closeAll()
			svc.Close(context.Background())
			fmt.Fprintln(stderr, "kilnd:", err)
			return 1
		}
		lns = append(lns, e2bl.mem)
		opts.beforeStop = stop
	}
	if err := serve(ctx, lns, a, svc, log, opts); err != nil {
		fmt.Fprintln(stderr, "kilnd:", err)
		return 1
	}
	return 0
}

// newLogger makes kilnd's logger: text or JSON (--log-format) on stderr,
// at debug level with --debug.
func newLogger(w io.Writer, cfg config) *slog.Logger {
	opts := &slog.HandlerOptions{Level: slog.LevelInfo}
	if cfg.debug {
		opts.Level = slog.LevelDebug
	}
	if cfg.logFormat == logJSON {
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
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
