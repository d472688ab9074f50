package main

// kilnd's flags, and the flag types that validate as they parse, so that a
// bad value is refused with its flag's name whether it came from the
// command line or from the config file (configfile.go).

import (
	"errors"
	"flag"
	"fmt"
	"math"
	"net"
	"net/netip"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/kilnvm/kiln/cgroup"
	"github.com/kilnvm/kiln/hostnet"
	"github.com/kilnvm/kiln/jail"
	"github.com/kilnvm/kiln/sandbox"
)

// Defaults of the host-integration flags.
const (
	defaultMemoryOvercommit = 1.0
	defaultVMMOverheadMiB   = 64
	defaultPidsMax          = 1024
	// maxVMMOverheadMiB bounds --vmm-overhead: it is added to every
	// sandbox's memory.max, and a typo should not disable the limit.
	maxVMMOverheadMiB = 64 << 10
)

// Log formats (--log-format).
const (
	logText = "text"
	logJSON = "json"
)

// Egress defaults (--egress-default).
const (
	egressAllowAll = "allow-all"
	egressDenyAll  = "deny-all"
)

// cgroupNone is the --cgroup-root that turns per-sandbox cgroups off.
const cgroupNone = "none"

// newFlagSet binds every kilnd flag to cfg, with its default. The config
// file's keys are these flags' names (configfile.go), so every flag has a
// key by construction.
func newFlagSet(cfg *config, listens *listenFlag) *flag.FlagSet {
	fs := flag.NewFlagSet("kilnd", flag.ContinueOnError)
	fs.String("config", "", "TOML config `FILE` whose keys are these flags' names (default "+defaultConfigFile+" when it exists; \"\" for none); flags override it")
	fs.Var(listens, "listen", "`ADDR` to serve on: unix:PATH or tcp:HOST:PORT (repeatable; a unix:"+defaultSocket+" is added unless one is given or systemd passes sockets)")
	fs.StringVar(&cfg.tokenFile, "token-file", "", "`FILE` whose first line is the bearer token TCP callers must send (required with a TCP --listen)")
	fs.StringVar(&cfg.group, "socket-group", "", "`GROUP` (name or ID) given the Unix sockets, whose members may then call")
	fs.StringVar(&cfg.stateDir, "state-dir", "/var/lib/kiln", "`DIR` for the daemon's records, sandboxes, checkpoints and templates")
	fs.StringVar(&cfg.images, "images", "", "images `DIR` (default: <kernel cache>/images, as kiln image pull uses)")
	fs.StringVar(&cfg.kernel, "kernel", "", "kernel image; default: the cached Debian kernel, as kiln run")
	fs.StringVar(&cfg.agent, "agent", "", "static kiln-agent binary; default: $KILN_AGENT, or kiln-agent beside kiln")
	fs.StringVar(&cfg.vmm, "vmm", "", "the kiln-vmm binary, `PATH`, each sandbox's VMM process runs (default: $"+sandbox.VMMEnv+", else kiln-vmm beside kilnd, else on $PATH)")
	fs.StringVar(&cfg.kiln, "kiln", "", "deprecated, use --vmm: a kiln binary, `PATH`, whose hidden `kiln vmm` runs each sandbox's VMM process")
	fs.IntVar(&cfg.maxSandboxes, "max-sandboxes", 0, "most live sandboxes at once (0: 1024)")
	fs.Uint64Var(&cfg.maxMemoryMiB, "max-memory", 0, "most guest memory in `MiB` among the live sandboxes (0: the host's)")
	fs.DurationVar(&cfg.defaultLifetime, "default-lifetime", 0, "lifetime of a sandbox whose request gives none (0: unlimited)")
	fs.BoolVar(&cfg.debug, "debug", false, "log at debug level")
	cfg.jail = jail.ModeAuto
	fs.Var(&cfg.jail, "jail", "jail every sandbox's VMM process: namespaces of its own, a root holding only what it needs, a uid of its own, no capabilities (kilnd fetches image chunks for them). auto (the default): when kilnd runs as root and the kiln-vmm binary is built with CGO_ENABLED=0, else say why and run unjailed; true: refuse to start without; false: never")
	fs.StringVar(&cfg.jailIDs, "jail-ids", jail.DefaultIDsDir, "`DIR` whose jail-ids folder holds the locks of the jails' uids (shared with kiln run/fork --jail, so that no two jails share an id)")

	cfg.logFormat = logText
	fs.Var(&choiceValue{p: &cfg.logFormat, choices: []string{logText, logJSON}}, "log-format", "log `FORMAT`: text or json (one JSON object a line, for journald and log shippers)")
	fs.Var(&hostPortValue{p: &cfg.metricsListen}, "metrics-listen", "`HOST:PORT` to serve Prometheus /metrics on (\"\": off)")
	fs.Var(&prefixValue{p: &cfg.netPool}, "net-pool", "`CIDR` each sandbox's network address comes from, e.g. 10.200.0.0/16 (\"\": sandboxes get no network)")
	fs.Var(&ifaceValue{p: &cfg.netUplink}, "net-uplink", "host `IFACE` sandboxes' traffic leaves by, NATed (\"\": the default route's)")
	fs.Var(&dnsValue{p: &cfg.netDNS}, "net-dns", "upstream DNS servers `ADDR[,ADDR]` (IP or IP:PORT) kilnd's DNS proxy asks (\"\": /etc/resolv.conf's)")
	fs.Var(&refusedValue{p: &cfg.netRefused}, "net-refuse", "destinations no sandbox reaches unless its allow list names them, in every egress mode: `default` (link-local and the cloud metadata service, loopback, RFC 1918, CGNAT and the other special-purpose IPv4 ranges: docs/network.md), none, or CIDR[,CIDR] (IPv4)")
	cfg.egressDefault = egressAllowAll
	fs.Var(&choiceValue{p: &cfg.egressDefault, choices: []string{egressAllowAll, egressDenyAll}}, "egress-default", "egress `POLICY` of a sandbox whose request names none: allow-all or deny-all")
	fs.Var(&cgroupRootValue{p: &cfg.cgroupRoot}, "cgroup-root", "cgroup v2 `PATH` under which each sandbox gets a cgroup (\"\": kilnd's own cgroup, delegated by systemd; \"none\": no cgroups)")
	cfg.memoryOvercommit = defaultMemoryOvercommit
	fs.Var(&ratioValue{p: &cfg.memoryOvercommit}, "memory-overcommit", "`RATIO` of the host's memory the sandboxes' memory may add up to before creates are refused (> 0)")
	cfg.vmmOverheadMiB = defaultVMMOverheadMiB
	fs.Var(&boundedUintValue{p: &cfg.vmmOverheadMiB, min: 1, max: maxVMMOverheadMiB}, "vmm-overhead", "`MiB` a VMM process may use beyond its guest's memory (added to memory.max)")
	cfg.pidsMax = defaultPidsMax
	fs.Var(&boundedUintValue{p: &cfg.pidsMax, min: 1, max: math.MaxInt32}, "pids-max", "most processes and threads, `N`, in a sandbox's cgroup (pids.max)")
	addE2BFlags(fs, cfg)
	fs.Var(&ioLimitFlag{p: &cfg.sandboxIO}, "sandbox-io", "cap every sandbox's VMM process on a disk (io.max): `DEV,rbps=N,wbps=N,riops=N,wiops=N` (DEV a block device, a file on one, or MAJ:MIN; N with k/M/G; repeatable)")
	return fs
}

// ioLimitFlag is --sandbox-io, repeatable: one io.max line per disk.
type ioLimitFlag struct{ p *[]cgroup.IOLimit }

func (f *ioLimitFlag) String() string {
	if f.p == nil {
		return ""
	}
	return strings.Join(f.strings(), " ")
}

func (f *ioLimitFlag) strings() []string {
	out := make([]string, 0, len(*f.p))
	for _, l := range *f.p {
		s := l.Device
		for _, kv := range []struct {
			k string
			v uint64
		}{{"rbps", l.ReadBPS}, {"wbps", l.WriteBPS}, {"riops", l.ReadIOPS}, {"wiops", l.WriteIOPS}} {
			if kv.v != 0 {
				s += fmt.Sprintf(",%s=%d", kv.k, kv.v)
			}
		}
		out = append(out, s)
	}
	return out
}

// Get returns the limits as strings; a config file gives them as an
// array of strings.
func (f *ioLimitFlag) Get() any { return f.strings() }

func (f *ioLimitFlag) Set(v string) error {
	l, err := parseIOLimit(v)
	if err != nil {
		return err
	}
	*f.p = append(*f.p, l)
	return nil
}

// parseIOLimit parses DEV,key=N[,key=N...] with keys rbps, wbps, riops,
// wiops; N is a count with an optional k, M or G (powers of 1024).
func parseIOLimit(v string) (cgroup.IOLimit, error) {
	parts := strings.Split(v, ",")
	l := cgroup.IOLimit{Device: strings.TrimSpace(parts[0])}
	if l.Device == "" {
		return l, fmt.Errorf("%q: want DEV,rbps=N,wbps=N,riops=N,wiops=N with a device first", v)
	}
	if len(parts) == 1 {
		return l, fmt.Errorf("%q: no limit given (rbps, wbps, riops or wiops)", v)
	}
	seen := map[string]bool{}
	for _, kv := range parts[1:] {
		k, n, ok := strings.Cut(strings.TrimSpace(kv), "=")
		if !ok {
			return l, fmt.Errorf("%q: %q is not KEY=N", v, kv)
		}
		if seen[k] {
			return l, fmt.Errorf("%q: %s given twice", v, k)
		}
		seen[k] = true
		num, err := parseCount(n)
		if err != nil {
			return l, fmt.Errorf("%q: %s: %w", v, k, err)
		}
		switch k {
		case "rbps":
			l.ReadBPS = num
		case "wbps":
			l.WriteBPS = num
		case "riops":
			l.ReadIOPS = num
		case "wiops":
			l.WriteIOPS = num
		default:
			return l, fmt.Errorf("%q: unknown key %q (want rbps, wbps, riops or wiops)", v, k)
		}
	}
	return l, nil
}

// parseCount parses a positive count with an optional k, M or G suffix
// (powers of 1024).
func parseCount(s string) (uint64, error) {
	mult := uint64(1)
	switch {
	case strings.HasSuffix(s, "k"), strings.HasSuffix(s, "K"):
		mult, s = 1<<10, s[:len(s)-1]
	case strings.HasSuffix(s, "M"):
		mult, s = 1<<20, s[:len(s)-1]
	case strings.HasSuffix(s, "G"):
		mult, s = 1<<30, s[:len(s)-1]
	}
	n, err := strconv.ParseUint(s, 10, 64)
	if err != nil || n == 0 {
		return 0, fmt.Errorf("%q is not a positive count (e.g. 2000, 100M)", s)
	}
	if n > math.MaxUint64/mult {
		return 0, fmt.Errorf("%q%s is too large", s, "")
	}
	return n * mult, nil
}

// choiceValue is a string flag with a closed set of values.
type choiceValue struct {
	p       *string
	choices []string
}

func (v *choiceValue) String() string {
	if v.p == nil {
		return ""
	}
	return *v.p
}

func (v *choiceValue) Set(s string) error {
	for _, c := range v.choices {
		if s == c {
			*v.p = s
			return nil
		}
	}
	return fmt.Errorf("%q is not one of %s", s, strings.Join(v.choices, ", "))
}

// hostPortValue is a HOST:PORT flag; "" is allowed (off).
type hostPortValue struct{ p *string }

func (v *hostPortValue) String() string {
	if v.p == nil {
		return ""
	}
	return *v.p
}

func (v *hostPortValue) Set(s string) error {
	if s != "" {
		_, port, err := net.SplitHostPort(s)
		if err != nil {
			return fmt.Errorf("%q: want HOST:PORT: %w", s, err)
		}
		if n, err := strconv.ParseUint(port, 10, 16); err != nil || n == 0 && port != "0" {
			return fmt.Errorf("%q: port %q is not a number from 0 to 65535", s, port)
		}
	}
	*v.p = s
	return nil
}

// prefixValue is a CIDR flag naming a network (no host bits); "" is the
// zero prefix (off).
type prefixValue struct{ p *netip.Prefix }

func (v *prefixValue) String() string {
	if v.p == nil || !v.p.IsValid() {
		return ""
	}
	return v.p.String()
}

func (v *prefixValue) Set(s string) error {
	if s == "" {
		*v.p = netip.Prefix{}
		return nil
	}
	p, err := netip.ParsePrefix(s)
	if err != nil {
		return fmt.Errorf("%q is not a CIDR (want e.g. 10.200.0.0/16): %w", s, err)
	}
	if p.Masked() != p {
		return fmt.Errorf("%q has host bits set; the network is %s", s, p.Masked())
	}
	if !p.Addr().Is4() {
		return fmt.Errorf("%q: the pool must be IPv4", s)
	}
	// Each sandbox takes a /29 (its veth's /30 and its tap's): the pool
	// must hold at least one (hostnet.Config.Pool).
	if p.Bits() > 29 {
		return fmt.Errorf("%q is too small: each sandbox takes a /29, want a /29 or larger", s)
	}
	if p.Bits() < 8 {
		return fmt.Errorf("%q is too large: want a /8 or smaller", s)
	}
	*v.p = p
	return nil
}

// ifaceValue is a network interface name; "" is allowed (the default
// route's).
type ifaceValue struct{ p *string }

func (v *ifaceValue) String() string {
	if v.p == nil {
		return ""
	}
	return *v.p
}

// maxIfaceName is IFNAMSIZ less the terminating NUL.
const maxIfaceName = 15

func (v *ifaceValue) Set(s string) error {
	if s != "" {
		if len(s) > maxIfaceName {
			return fmt.Errorf("%q is longer than %d bytes, the most an interface name has", s, maxIfaceName)
		}
		if s == "." || s == ".." || strings.ContainsAny(s, "/: \t\n\x00") {
			return fmt.Errorf("%q is not an interface name", s)
		}
	}
	*v.p = s
	return nil
}

// refusedValue is --net-refuse: "default" (nil: hostnet.DefaultRefused),
// "none" (empty, not nil) or comma-separated IPv4 CIDRs.
type refusedValue struct{ p *[]netip.Prefix }

func (v *refusedValue) String() string {
	switch {
	case v.p == nil || *v.p == nil:
		return "default"
	case len(*v.p) == 0:
		return "none"
	}
	s := make([]string, len(*v.p))
	for i, p := range *v.p {
		s[i] = p.String()
	}
	return strings.Join(s, ",")
}

func (v *refusedValue) Set(s string) error {
	switch strings.TrimSpace(s) {
	case "default":
		*v.p = nil
		return nil
	case "none":
		*v.p = []netip.Prefix{}
		return nil
	case "":
		return errors.New(`want "default", "none" or CIDR[,CIDR]`)
	}
	out := []netip.Prefix{}
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		p, err := netip.ParsePrefix(f)
		if err != nil {
			return fmt.Errorf("%q is not a CIDR (want e.g. 169.254.0.0/16): %w", f, err)
		}
		if !p.Addr().Is4() {
			return fmt.Errorf("%q: sandboxes have IPv4 only, want an IPv4 CIDR", f)
		}
		out = append(out, p.Masked())
	}
	if len(out) > hostnet.MaxCIDRs {
		return fmt.Errorf("%d CIDRs; at most %d", len(out), hostnet.MaxCIDRs)
	}
	*v.p = out
	return nil
}

// dnsValue is a comma-separated list of DNS servers, each IP or IP:PORT
// (port 53 when absent); "" is nil (resolv.conf's).
type dnsValue struct{ p *[]netip.AddrPort }

func (v *dnsValue) String() string {
	if v.p == nil {
		return ""
	}
	s := make([]string, len(*v.p))
	for i, a := range *v.p {
		s[i] = a.String()
	}
	return strings.Join(s, ",")
}

// maxDNSServers bounds --net-dns.
const maxDNSServers = 8

func (v *dnsValue) Set(s string) error {
	if strings.TrimSpace(s) == "" {
		*v.p = nil
		return nil
	}
	var out []netip.AddrPort
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		a, err := parseDNSServer(f)
		if err != nil {
			return err
		}
		out = append(out, a)
	}
	if len(out) > maxDNSServers {
		return fmt.Errorf("%d servers; at most %d", len(out), maxDNSServers)
	}
	*v.p = out
	return nil
}

func parseDNSServer(s string) (netip.AddrPort, error) {
	if a, err := netip.ParseAddr(s); err == nil {
		if a.Zone() != "" {
			return netip.AddrPort{}, fmt.Errorf("%q: zoned addresses are not supported", s)
		}
		return netip.AddrPortFrom(a, 53), nil
	}
	ap, err := netip.ParseAddrPort(s)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("%q is not an IP address or IP:PORT", s)
	}
	if ap.Port() == 0 || ap.Addr().Zone() != "" {
		return netip.AddrPort{}, fmt.Errorf("%q: want a non-zero port and no zone", s)
	}
	return ap, nil
}

// cgroupRootValue is "", "none" or an absolute path.
type cgroupRootValue struct{ p *string }

func (v *cgroupRootValue) String() string {
	if v.p == nil {
		return ""
	}
	return *v.p
}

func (v *cgroupRootValue) Set(s string) error {
	if s != "" && s != cgroupNone {
		if !filepath.IsAbs(s) {
			return fmt.Errorf("%q: want an absolute path (under the cgroup2 mount), \"\" or %q", s, cgroupNone)
		}
		s = filepath.Clean(s)
	}
	*v.p = s
	return nil
}

// ratioValue is a finite float > 0.
type ratioValue struct{ p *float64 }

func (v *ratioValue) String() string {
	if v.p == nil {
		return ""
	}
	return strconv.FormatFloat(*v.p, 'g', -1, 64)
}

func (v *ratioValue) Set(s string) error {
	f, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
	if err != nil {
		return fmt.Errorf("%q is not a number", s)
	}
	if math.IsNaN(f) || math.IsInf(f, 0) || f <= 0 {
		return fmt.Errorf("%s: want a ratio > 0 (1.0: no overcommit)", s)
	}
	if f > 100 {
		return fmt.Errorf("%s: a ratio above 100 disables admission; want at most 100", s)
	}
	*v.p = f
	return nil
}

// boundedUintValue is an integer in [min, max].
type boundedUintValue struct {
	p        *uint64
	min, max uint64
}

func (v *boundedUintValue) String() string {
	if v.p == nil {
		return ""
	}
	return strconv.FormatUint(*v.p, 10)
}

func (v *boundedUintValue) Set(s string) error {
	n, err := strconv.ParseUint(strings.TrimSpace(s), 10, 64)
	if err != nil {
		if errors.Is(err, strconv.ErrRange) {
			return fmt.Errorf("%s is out of range: want %d to %d", s, v.min, v.max)
		}
		return fmt.Errorf("%q is not a whole number", s)
	}
	if n < v.min || n > v.max {
		return fmt.Errorf("%d is out of range: want %d to %d", n, v.min, v.max)
	}
	*v.p = n
	return nil
}

// Get methods (flag.Getter) tell the config file which TOML type a flag
// takes (configfile.go): a string unless said otherwise.

func (v *choiceValue) Get() any      { return v.String() }
func (v *hostPortValue) Get() any    { return v.String() }
func (v *prefixValue) Get() any      { return v.String() }
func (v *ifaceValue) Get() any       { return v.String() }
func (v *dnsValue) Get() any         { return v.String() }
func (v *cgroupRootValue) Get() any  { return v.String() }
func (v *ratioValue) Get() any       { return *v.p }
func (v *boundedUintValue) Get() any { return *v.p }
