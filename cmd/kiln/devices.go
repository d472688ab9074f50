package main

import (
	"flag"
	"fmt"
	"net"
	"strconv"
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
	fs.Var(&f.disks, "disk", "virtio-blk disk `PATH[,ro][,queues=N]` (repeatable; /dev/vda, /dev/vdb, ... in order; queues: request queues, e.g. one per vCPU)")
	fs.Var(&f.nets, "net", "virtio-net on a tap: `TAP[,mac=MAC][,netns=NAME]` (repeatable)")
	fs.StringVar(&f.vsock, "vsock", "", "virtio-vsock host Unix socket `PATH` (connect and write \"CONNECT <port>\\n\"; guest connections to port P reach PATH_P)")
	fs.Uint64Var(&f.cid, "cid", 3, "guest vsock CID (with --vsock)")
}

// parseDisk parses --disk PATH[,ro][,queues=N].
func parseDisk(s string) (virtio.BlockSpec, error) {
	path, opts, _ := strings.Cut(s, ",")
	if path == "" {
		return virtio.BlockSpec{}, fmt.Errorf("--disk %q: no path", s)
	}
	cfg := virtio.BlockSpec{Path: path}
	if opts != "" {
		for _, o := range strings.Split(opts, ",") {
			switch o {
			case "ro":
				cfg.ReadOnly = true
			case "rw":
				cfg.ReadOnly = false
			default:
				n, ok := strings.CutPrefix(o, "queues=")
				if !ok {
					return cfg, fmt.Errorf("--disk %q: unknown option %q (want ro, rw or queues=N)", s, o)
				}
				q, err := strconv.Atoi(n)
				if err != nil || q < 1 || q > virtio.BlockMaxQueues {
					return cfg, fmt.Errorf("--disk %q: queues=%s: want 1 to %d", s, n, virtio.BlockMaxQueues)
				}
				cfg.Queues = q
			}
		}
	}
	return cfg, nil
}

// parseNet parses --net TAP[,mac=MAC][,netns=NAME].
func parseNet(s string) (virtio.NetSpec, error) {
	tap, opts, _ := strings.Cut(s, ",")
	if tap == "" {
		return virtio.NetSpec{}, fmt.Errorf("--net %q: no tap name", s)
	}
	if len(tap) > 15 || strings.ContainsAny(tap, "/ \t\n") {
		return virtio.NetSpec{}, fmt.Errorf("--net %q: %q is not a valid interface name", s, tap)
	}
	cfg := virtio.NetSpec{Tap: tap}
	if opts != "" {
		for _, o := range strings.Split(opts, ",") {
			k, v, ok := strings.Cut(o, "=")
			switch {
			case ok && k == "mac":
				mac, err := net.ParseMAC(v)
				if err != nil || len(mac) != 6 {
					return cfg, fmt.Errorf("--net %q: bad MAC %q", s, v)
				}
				cfg.MAC = mac.String()
			case ok && k == "netns" && v != "":
				cfg.Netns = v
			default:
				return cfg, fmt.Errorf("--net %q: unknown option %q (want mac=MAC or netns=NAME)", s, o)
			}
		}
	}
	return cfg, nil
}

// specs returns the devices the flags name, plus an entropy device: disk0,
// disk1, ... net0, net1, ..., vsock, rng.
func (f *deviceFlags) specs() ([]virtio.DeviceSpec, error) {
	var devs []virtio.DeviceSpec
	for i, d := range f.disks {
		b, err := parseDisk(d)
		if err != nil {
			return nil, err
		}
		devs = append(devs, virtio.DeviceSpec{ID: fmt.Sprintf("disk%d", i), Kind: virtio.KindBlock, Block: &b})
	}
	for i, s := range f.nets {
		n, err := parseNet(s)
		if err != nil {
			return nil, err
		}
		devs = append(devs, virtio.DeviceSpec{ID: fmt.Sprintf("net%d", i), Kind: virtio.KindNet, Net: &n})
	}
	if f.vsock != "" {
		devs = append(devs, virtio.DeviceSpec{ID: "vsock", Kind: virtio.KindVsock, Vsock: &virtio.VsockSpec{CID: f.cid, Path: f.vsock}})
	}
	devs = append(devs, virtio.DeviceSpec{ID: "rng", Kind: virtio.KindRNG, RNG: &virtio.RNGSpec{}})
	if err := virtio.ValidateSpecs(devs); err != nil {
		return nil, err
	}
	return devs, nil
}
