package virtio

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"regexp"

	"github.com/kilnvm/kiln/rofs"
)

// Kind names a type of device in a DeviceSpec.
type Kind string

// Device kinds.
const (
	KindBlock Kind = "blk"
	KindNet   Kind = "net"
	KindVsock Kind = "vsock"
	KindRNG   Kind = "rng"
	// KindFS is a read-only tree (FSSpec): over virtio-9p, or as an EROFS
	// filesystem on a read-only virtio-blk disk (FSSpec.Transport).
	KindFS Kind = "fs"
)

// DeviceSpec describes one virtio device as plain data: what a VM is built
// from, what crosses a process boundary, and what a snapshot keeps of each
// device beside its state. Exactly the field of its Kind is set.
type DeviceSpec struct {
	// ID names the device within its VM: 1 to 32 of [a-z0-9_-], unique.
	// A snapshot keys each device's state by it, and a restore's
	// overrides name the device they replace by it.
	ID    string     `json:"id"`
	Kind  Kind       `json:"kind"`
	Block *BlockSpec `json:"blk,omitempty"`
	Net   *NetSpec   `json:"net,omitempty"`
	Vsock *VsockSpec `json:"vsock,omitempty"`
	RNG   *RNGSpec   `json:"rng,omitempty"`
	FS    *FSSpec    `json:"fs,omitempty"`
}

// BlockSpec is a virtio-blk disk.
type BlockSpec struct {
	// Path is the image. With FD set it only names the image in messages
	// and in snapshots.
	Path string `json:"path,omitempty"`
	// FD, when positive, is an image already open in this process (a
	// jailer opened it): the device takes it over. It is never saved.
	FD       int  `json:"fd,omitempty"`
	ReadOnly bool `json:"read_only,omitempty"`
	// Serial is what the guest reads as the disk's ID (at most
	// BlockIDBytes); the device ID when empty.
	Serial string `json:"serial,omitempty"`
	// Queues is how many request queues the disk offers (0 or 1: one; at
	// most BlockMaxQueues). Give a VM of several vCPUs that do I/O at once
	// one per vCPU. A snapshot keeps it: a restore rebuilds the same.
	Queues int `json:"queues,omitempty"`
	// Slot makes the disk a volume slot: without Path or FD an empty one
	// (no image, capacity 0) that an image is inserted into while the
	// guest runs (Block.Insert); with them a filled one (a restore's).
	// A slot never offers VIRTIO_BLK_F_RO: ReadOnly opens its image
	// read-only and the device answers writes with an I/O error.
	Slot bool `json:"slot,omitempty"`
}

// EmptySlot reports whether the spec is an empty volume slot: a slot with
// no image.
func (b *BlockSpec) EmptySlot() bool {
	return b != nil && b.Slot && b.Path == "" && b.FD <= 0
}

// NetSpec is a virtio-net card on a host tap.
type NetSpec struct {
	// Tap is the tap's name; it is created when missing. With FD set it
	// only names the tap.
	Tap string `json:"tap,omitempty"`
	// FD, when positive, is a tap already open in this process
	// (IFF_TAP|IFF_NO_PI|IFF_VNET_HDR): the device takes it over.
	FD int `json:"fd,omitempty"`
	// MAC is the guest's address (aa:bb:cc:dd:ee:ff); a random locally
	// administered one when empty.
	MAC string `json:"mac,omitempty"`
	// Netns opens the tap inside this network namespace (a name under
	// /var/run/netns or a path).
	Netns string `json:"netns,omitempty"`
}

// VsockSpec is a virtio-vsock device whose host side is Unix sockets.
type VsockSpec struct {
	CID uint64 `json:"guest_cid"`
	// Path is the socket host processes connect to (created; it must
	// not exist); guest connections to port P dial Path_P.
	Path string `json:"path"`
	// FD, when positive, is a Unix socket already listening in this
	// process (a jailer made it at Path): the device takes it over.
	FD int `json:"fd,omitempty"`
}

// RNGSpec is a virtio-rng entropy device; it has no settings.
type RNGSpec struct{}

// FSSpec is a read-only tree: an image's merged layers, or a host
// directory. The tree is opened through OpenOptions.FS: an image by its
// manifest digest from the images folder (package image knows how), so
// that a VMM process opens the same image from the same folder; a
// directory by its path (package hostfs). It reaches the guest over
// virtio-9p under mount tag Tag, or, for an image, as an EROFS filesystem
// on a read-only virtio-blk disk whose serial is Tag (Transport).
type FSSpec struct {
	Tag string `json:"tag"`
	// Transport is how the tree reaches the guest: Transport9P (also
	// "") or TransportEROFS (an image only).
	Transport string `json:"transport,omitempty"`
	// Image is the image's manifest digest (sha256:<64 hex>).
	Image string `json:"image,omitempty"`
	// Images is the images folder that holds it (absolute).
	Images string `json:"images,omitempty"`
	// Dir, instead of Image and Images, is a host directory (absolute),
	// served read-only: a container's root filesystem as containerd
	// mounted it.
	Dir string `json:"dir,omitempty"`
}

// The values of FSSpec.Transport.
const (
	// Transport9P serves the tree over virtio-9p: every lookup and
	// getattr is a round trip to the host, and a host directory can be
	// served live.
	Transport9P = "9p"
	// TransportEROFS lays an image's tree out as an EROFS filesystem
	// (package erofs) on a read-only virtio-blk disk: the guest's kernel
	// holds the metadata in its page cache; file data is read from the
	// image's chunks on first read.
	TransportEROFS = "erofs"
)

// EROFS reports whether the tree reaches the guest as an EROFS disk.
func (f FSSpec) EROFS() bool { return f.Transport == TransportEROFS }

// Key says what an fs device's tree is, for its snapshot state: the
// image's digest, or "dir" for any host directory (a restore may serve
// another directory, which its caller vouches holds the same tree: a
// container's rootfs mounted again from the same image).
func (f FSSpec) Key() string {
	if f.Dir != "" {
		return "dir"
	}
	return f.Image
}

// MaxTagLen is the longest mount tag: Linux's 9p transport copies at most
// this many bytes of it.
const MaxTagLen = 64

var (
	tagPattern    = regexp.MustCompile(`^[A-Za-z0-9_.-]+$`)
	digestPattern = regexp.MustCompile(`^sha256:[0-9a-f]{64}$`)
)

var specIDPattern = regexp.MustCompile(`^[a-z0-9_-]{1,32}$`)

// SpecError says what is wrong with a device spec.
type SpecError struct {
	ID  string // the device's ID, as given
	Err error
}

func (e *SpecError) Error() string {
	return fmt.Sprintf("device %q: %v", e.ID, e.Err)
}

func (e *SpecError) Unwrap() error { return e.Err }

// Validate checks the spec without opening anything.
func (s DeviceSpec) Validate() error {
	if err := s.validate(); err != nil {
		return &SpecError{ID: s.ID, Err: err}
	}
	return nil
}

func (s DeviceSpec) validate() error {
	if !specIDPattern.MatchString(s.ID) {
		return errors.New("ID: want 1 to 32 of a-z, 0-9, '_' and '-'")
	}
	set := 0
	for _, p := range []bool{s.Block != nil, s.Net != nil, s.Vsock != nil, s.RNG != nil, s.FS != nil} {
		if p {
			set++
		}
	}
	if set != 1 {
		return fmt.Errorf("kind %q with %d device settings: want exactly the one of its kind", s.Kind, set)
	}
	switch s.Kind {
	case KindBlock:
		if s.Block == nil {
			return errors.New("kind blk without blk settings")
		}
		if s.Block.Path == "" && s.Block.FD <= 0 && !s.Block.Slot {
			return errors.New("blk: no image path or fd")
		}
		if s.Block.Queues < 0 || s.Block.Queues > BlockMaxQueues {
			return fmt.Errorf("blk: %d queues, want 0 to %d", s.Block.Queues, BlockMaxQueues)
		}
		if len(s.Block.Serial) > BlockIDBytes {
			return fmt.Errorf("blk: serial %q is %d bytes, at most %d", s.Block.Serial, len(s.Block.Serial), BlockIDBytes)
		}
	case KindNet:
		if s.Net == nil {
			return errors.New("kind net without net settings")
		}
		if s.Net.MAC != "" {
			if _, err := parseMAC(s.Net.MAC); err != nil {
				return fmt.Errorf("net: %w", err)
			}
		}
	case KindVsock:
		if s.Vsock == nil {
			return errors.New("kind vsock without vsock settings")
		}
		if s.Vsock.CID < 3 || s.Vsock.CID > 0xffffffff {
			return fmt.Errorf("vsock: guest CID %d: want 3 to %d", s.Vsock.CID, uint64(0xffffffff))
		}
		if s.Vsock.Path == "" {
			return errors.New("vsock: no host socket path")
		}
	case KindRNG:
		if s.RNG == nil {
			return errors.New("kind rng without rng settings")
		}
	case KindFS:
		if s.FS == nil {
			return errors.New("kind fs without fs settings")
		}
		switch {
		case len(s.FS.Tag) == 0 || len(s.FS.Tag) > MaxTagLen || !tagPattern.MatchString(s.FS.Tag):
			return fmt.Errorf("fs: mount tag %q: want 1 to %d letters, digits, '.', '_' or '-'", s.FS.Tag, MaxTagLen)
		case s.FS.Transport != "" && s.FS.Transport != Transport9P && s.FS.Transport != TransportEROFS:
			return fmt.Errorf("fs: transport %q: want %q or %q", s.FS.Transport, Transport9P, TransportEROFS)
		case s.FS.EROFS() && len(s.FS.Tag) > BlockIDBytes:
			return fmt.Errorf("fs: an erofs disk's tag %q is its serial: at most %d bytes", s.FS.Tag, BlockIDBytes)
		case s.FS.EROFS() && s.FS.Dir != "":
			return fmt.Errorf("fs: directory %q: a host directory is served over 9p, not erofs (only an image is laid out as erofs)", s.FS.Dir)
		case s.FS.Dir != "":
			if s.FS.Image != "" || s.FS.Images != "" {
				return fmt.Errorf("fs: a directory (%q) and an image (%q in %q): give one", s.FS.Dir, s.FS.Image, s.FS.Images)
			}
			if !filepath.IsAbs(s.FS.Dir) || filepath.Clean(s.FS.Dir) != s.FS.Dir {
				return fmt.Errorf("fs: directory %q is not a clean absolute path", s.FS.Dir)
			}
		case !digestPattern.MatchString(s.FS.Image):
			return fmt.Errorf("fs: image %q is not a manifest digest (sha256:<64 hex digits>)", s.FS.Image)
		case !filepath.IsAbs(s.FS.Images):
			return fmt.Errorf("fs: images folder %q is not an absolute path", s.FS.Images)
		}
	default:
		return fmt.Errorf("unknown kind %q (want blk, net, vsock, rng or fs)", s.Kind)
	}
	return nil
}

// DeviceID returns the virtio device ID of the spec's kind, 0 for an
// unknown kind.
func (s DeviceSpec) DeviceID() uint32 {
	switch s.Kind {
	case KindBlock:
		return IDBlock
	case KindNet:
		return IDNet
	case KindVsock:
		return IDVsock
	case KindRNG:
		return IDRNG
	case KindFS:
		if s.FS != nil && s.FS.EROFS() {
			return IDBlock
		}
		return ID9P
	}
	return 0
}

// ID9P is the virtio device ID of a 9P transport.
const ID9P = 9

// ValidateSpecs checks a VM's device specs: each valid, IDs unique, at most
// one vsock device (the guest has one CID).
func ValidateSpecs(specs []DeviceSpec) error {
	seen := map[string]bool{}
	vsocks := 0
	for _, s := range specs {
		if err := s.Validate(); err != nil {
			return err
		}
		if seen[s.ID] {
			return &SpecError{ID: s.ID, Err: errors.New("ID used by two devices")}
		}
		seen[s.ID] = true
		if s.Kind == KindVsock {
			vsocks++
		}
	}
	if vsocks > 1 {
		return fmt.Errorf("%d vsock devices: a VM takes at most one", vsocks)
	}
	return nil
}

// Saved returns the spec as a snapshot keeps it: without descriptors,
// which mean nothing to another process.
func (s DeviceSpec) Saved() DeviceSpec {
	out := s
	if s.Block != nil {
		b := *s.Block
		b.FD = 0
		out.Block = &b
	}
	if s.Net != nil {
		n := *s.Net
		n.FD = 0
		out.Net = &n
	}
	if s.Vsock != nil {
		v := *s.Vsock
		v.FD = 0
		out.Vsock = &v
	}
	if s.FS != nil {
		f := *s.FS
		out.FS = &f
	}
	return out
}

// FSOpener opens the tree an fs device serves: package image opens an
// image by its manifest digest. The closer releases the tree (the device
// calls it when it is closed).
type FSOpener func(spec FSSpec) (rofs.FS, io.Closer, error)

// OpenOptions are what Open needs beyond the spec: live objects that do
// not cross a process boundary.
type OpenOptions struct {
	Logger *slog.Logger
	// FS opens the trees of fs devices; nil refuses them.
	FS FSOpener
	// VsockDial dials the host side of a vsock device's guest
	// connections (VsockConfig.Dial); nil: the device dials Path_P.
	VsockDial VsockDialer
}

// Open makes the device a spec describes: it opens the disk image, the tap
// or the vsock socket (or takes over the descriptor the spec names). The
// caller owns the device and closes it when it implements io.Closer. An fs
// device needs OpenWith.
func Open(s DeviceSpec, log *slog.Logger) (Device, error) {
	return OpenWith(s, OpenOptions{Logger: log})
}

// OpenWith is Open with the options an fs device needs.
func OpenWith(s DeviceSpec, opts OpenOptions) (Device, error) {
	log := opts.Logger
	if err := s.Validate(); err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.Default()
	}
	log = log.With("device_id", s.ID)
	switch s.Kind {
	case KindBlock:
		cfg := BlockConfig{Path: s.Block.Path, ReadOnly: s.Block.ReadOnly, ID: s.Block.Serial, Queues: s.Block.Queues, Logger: log, Slot: s.Block.Slot}
		if cfg.ID == "" {
			cfg.ID = s.ID
		}
		if s.Block.EmptySlot() {
			return NewBlockSlot(cfg)
		}
		if s.Block.FD > 0 {
			return NewBlockFromFile(os.NewFile(uintptr(s.Block.FD), s.Block.Path), cfg)
		}
		return NewBlock(cfg)
	case KindNet:
		cfg := NetConfig{Tap: s.Net.Tap, Netns: s.Net.Netns, Logger: log}
		if s.Net.MAC != "" {
			cfg.MAC, _ = parseMAC(s.Net.MAC) // checked by Validate
		}
		if s.Net.FD > 0 {
			return NewNetFromTap(os.NewFile(uintptr(s.Net.FD), "tap:"+s.Net.Tap), s.Net.Tap, cfg)
		}
		return NewNet(cfg)
	case KindVsock:
		cfg := VsockConfig{CID: s.Vsock.CID, Path: s.Vsock.Path, Dial: opts.VsockDial}
		if s.Vsock.FD > 0 {
			f := os.NewFile(uintptr(s.Vsock.FD), s.Vsock.Path)
			l, err := net.FileListener(f) // a duplicate: f is closed
			f.Close()
			if err != nil {
				return nil, &SpecError{ID: s.ID, Err: fmt.Errorf("vsock: descriptor %d: %w", s.Vsock.FD, err)}
			}
			ul, ok := l.(*net.UnixListener)
			if !ok {
				l.Close()
				return nil, &SpecError{ID: s.ID, Err: fmt.Errorf("vsock: descriptor %d is not a listening Unix socket", s.Vsock.FD)}
			}
			return NewVsockFromListener(ul, cfg, log)
		}
		return NewVsock(cfg, log)
	case KindRNG:
		return NewRNG(), nil
	case KindFS:
		if opts.FS == nil {
			return nil, &SpecError{ID: s.ID, Err: errors.New("fs: no way to open a tree here (OpenOptions.FS is nil)")}
		}
		tree, closer, err := opts.FS(*s.FS)
		if err != nil {
			return nil, &SpecError{ID: s.ID, Err: fmt.Errorf("fs: %s: %w", s.FS.Key(), err)}
		}
		if s.FS.EROFS() {
			dev, err := newEROFSDisk(*s.FS, tree, closer, log)
			if err != nil {
				if closer != nil {
					closer.Close()
				}
				return nil, &SpecError{ID: s.ID, Err: fmt.Errorf("fs: %w", err)}
			}
			return dev, nil
		}
		dev, err := newFSDevice(FSConfig{Tag: s.FS.Tag, FS: tree, Key: s.FS.Key(), Logger: log}, closer)
		if err != nil {
			if closer != nil {
				closer.Close()
			}
			return nil, &SpecError{ID: s.ID, Err: fmt.Errorf("fs: %w", err)}
		}
		return dev, nil
	}
	return nil, &SpecError{ID: s.ID, Err: fmt.Errorf("unknown kind %q", s.Kind)}
}

func parseMAC(s string) (net.HardwareAddr, error) {
	mac, err := net.ParseMAC(s)
	if err != nil || len(mac) != 6 {
		return nil, fmt.Errorf("MAC %q: want six bytes such as 02:00:00:00:00:01", s)
	}
	if mac[0]&1 != 0 {
		return nil, fmt.Errorf("MAC %q is a multicast address", s)
	}
	return mac, nil
}
