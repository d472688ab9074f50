package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"

	"github.com/kilnvm/kiln/virtio"
)

// repeated is a flag that may be given several times.
type repeated []string

func (r *repeated) String() string     { return strings.Join(*r, " ") }
func (r *repeated) Set(s string) error { *r = append(*r, s); return nil }

// deviceFlags are the virtio device flags of kiln boot.
type deviceFlags struct {
	disks repeated
	nets  repeated
	vsock string
	cid   uint64
}

func (f *deviceFlags) register(fs *flag.FlagSet) {
	fs.Var(&f.disks, "disk", "virtio-blk disk `PATH[,ro]` (repeatable; /dev/vda, /dev/vdb, ... in order)")
	fs.Var(&f.nets, "net", "virtio-net on a tap: `TAP[,mac=MAC][,netns=NAME]` (repeatable)")
	fs.StringVar(&f.vsock, "vsock", "", "virtio-vsock host Unix socket `PATH` (connect and write \"CONNECT <port>\\n\"; guest connections to port P reach PATH_P)")
	fs.Uint64Var(&f.cid, "cid", 3, "guest vsock CID (with --vsock)")
}

// parseDisk parses --disk PATH[,ro].
func parseDisk(s string) (virtio.BlockConfig, error) {
	path, opts, _ := strings.Cut(s, ",")
	if path == "" {
		return virtio.BlockConfig{}, fmt.Errorf("--disk %q: no path", s)
	}
	cfg := virtio.BlockConfig{Path: path}
	if opts != "" {
		for _, o := range strings.Split(opts, ",") {
			switch o {
			case "ro":
				cfg.ReadOnly = true
			case "rw":
				cfg.ReadOnly = false
			default:
				return cfg, fmt.Errorf("--disk %q: unknown option %q (want ro or rw)", s, o)
			}
		}
	}
	return cfg, nil
}

// parseNet parses --net TAP[,mac=MAC][,netns=NAME].
func parseNet(s string) (virtio.NetConfig, error) {
	tap, opts, _ := strings.Cut(s, ",")
	if tap == "" {
		return virtio.NetConfig{}, fmt.Errorf("--net %q: no tap name", s)
	}
	if len(tap) > 15 || strings.ContainsAny(tap, "/ \t\n") {
		return virtio.NetConfig{}, fmt.Errorf("--net %q: %q is not a valid interface name", s, tap)
	}
	cfg := virtio.NetConfig{Tap: tap}
	if opts != "" {
		for _, o := range strings.Split(opts, ",") {
			k, v, ok := strings.Cut(o, "=")
			switch {
			case ok && k == "mac":
				mac, err := net.ParseMAC(v)
				if err != nil || len(mac) != 6 {
					return cfg, fmt.Errorf("--net %q: bad MAC %q", s, v)
				}
				cfg.MAC = mac
			case ok && k == "netns" && v != "":
				cfg.Netns = v
			default:
				return cfg, fmt.Errorf("--net %q: unknown option %q (want mac=MAC or netns=NAME)", s, o)
			}
		}
	}
	return cfg, nil
}

// open creates the devices the flags name, plus an entropy device, and
// returns them with a function that closes them all.
func (f *deviceFlags) open(log *slog.Logger) ([]virtio.Device, func() error, error) {
	var devs []virtio.Device
	var closers []io.Closer
	closeAll := func() error {
		var errs []error
		for _, c := range closers {
			errs = append(errs, c.Close())
		}
		return errors.Join(errs...)
	}
	fail := func(err error) ([]virtio.Device, func() error, error) {
		closeAll()
		return nil, nil, err
	}
	for _, d := range f.disks {
		cfg, err := parseDisk(d)
		if err != nil {
			return fail(err)
		}
		cfg.Logger = log
		b, err := virtio.NewBlock(cfg)
		if err != nil {
			return fail(err)
		}
		devs, closers = append(devs, b), append(closers, b)
	}
	for _, s := range f.nets {
		cfg, err := parseNet(s)
		if err != nil {
			return fail(err)
		}
		cfg.Logger = log
		n, err := virtio.NewNet(cfg)
		if err != nil {
			return fail(err)
		}
		devs, closers = append(devs, n), append(closers, n)
	}
	if f.vsock != "" {
		v, err := virtio.NewVsock(virtio.VsockConfig{CID: f.cid, Path: f.vsock}, log)
		if err != nil {
			return fail(err)
		}
		devs, closers = append(devs, v), append(closers, v)
	}
	devs = append(devs, virtio.NewRNG())
	return devs, closeAll, nil
}
