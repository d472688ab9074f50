// Package client is the host side of kiln-agent's API (guest/agentpb): it
// dials the agent through the VM's host-side vsock Unix socket, using
// Firecracker's convention (write "CONNECT <port>\n", read "OK <hostport>\n",
// then the stream is the guest's), runs gRPC over that connection and wraps
// the calls in typed methods: Exec with streamed stdin, stdout and stderr,
// file transfer and management, guest information and the snapshot hooks.
//
// It has no guest-only dependencies and runs on any host OS.
package client

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/netip"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kilnvm/kiln/guest/agentpb"
	"github.com/kilnvm/kiln/stmode"
)

// Option configures Dial, New and WaitReady.
type Option func(*options)

type options struct {
	port             uint32
	handshakeTimeout time.Duration
	retryInterval    time.Duration
	attemptTimeout   time.Duration
	dialOptions      []grpc.DialOption
}

func newOptions(opts []Option) options {
	o := options{
		port:             agentpb.Port,
		handshakeTimeout: 5 * time.Second,
		retryInterval:    100 * time.Millisecond,
		attemptTimeout:   3 * time.Second,
	}
	for _, opt := range opts {
		opt(&o)
	}
	return o
}

// WithPort sets the guest vsock port to CONNECT to (default agentpb.Port).
func WithPort(port uint32) Option { return func(o *options) { o.port = port } }

// WithHandshakeTimeout bounds the CONNECT handshake when the context has no
// earlier deadline (default 5s).
func WithHandshakeTimeout(d time.Duration) Option {
	return func(o *options) { o.handshakeTimeout = d }
}

// WithRetryInterval sets how long WaitReady waits between attempts
// (default 100ms).
func WithRetryInterval(d time.Duration) Option { return func(o *options) { o.retryInterval = d } }

// WithAttemptTimeout bounds each of WaitReady's attempts (default 3s).
func WithAttemptTimeout(d time.Duration) Option { return func(o *options) { o.attemptTimeout = d } }

// WithDialOptions adds gRPC dial options.
func WithDialOptions(opts ...grpc.DialOption) Option {
	return func(o *options) { o.dialOptions = append(o.dialOptions, opts...) }
}

// DialFunc opens a fresh connection to the agent.
type DialFunc func(ctx context.Context) (net.Conn, error)

// Client is a connection to one agent. Its methods are safe for concurrent
// use. If the connection breaks, gRPC reconnects through the same dialer.
type Client struct {
	conn *grpc.ClientConn
	api  agentpb.AgentClient

	mu    sync.Mutex
	first net.Conn // the connection New opened, until gRPC takes it
}

// Dial connects to the agent behind the VM's host-side vsock Unix socket
// vsockUDS, performing the CONNECT handshake once to fail early if the agent
// does not answer.
func Dial(ctx context.Context, vsockUDS string, opts ...Option) (*Client, error) {
	o := newOptions(opts)
	return New(ctx, VsockDialer(vsockUDS, o.port, o.handshakeTimeout), opts...)
}

// New connects to the agent through dial, which is called once now (so that
// an unreachable agent is an error here) and again whenever gRPC needs a new
// connection.
func New(ctx context.Context, dial DialFunc, opts ...Option) (*Client, error) {
	o := newOptions(opts)
	first, err := dial(ctx)
	if err != nil {
		return nil, err
	}
	c := &Client{first: first}
	dialer := func(ctx context.Context, _ string) (net.Conn, error) {
		c.mu.Lock()
		conn := c.first
		c.first = nil
		c.mu.Unlock()
		if conn != nil {
			return conn, nil
		}
		return dial(ctx)
	}
	dopts := []grpc.DialOption{
		grpc.WithContextDialer(dialer),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff: backoff.Config{
				BaseDelay:  50 * time.Millisecond,
				Multiplier: 1.6,
				Jitter:     0.2,
				MaxDelay:   time.Second,
			},
			MinConnectTimeout: 5 * time.Second,
		}),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(2 * agentpb.MaxChunkSize)),
		grpc.WithWriteBufferSize(agentpb.BufferSize),
		grpc.WithReadBufferSize(agentpb.BufferSize),
		grpc.WithInitialWindowSize(agentpb.StreamWindow),
		grpc.WithInitialConnWindowSize(agentpb.ConnWindow),
	}
	cc, err := grpc.NewClient("passthrough:///kiln-agent", append(dopts, o.dialOptions...)...)
	if err != nil {
		first.Close()
		return nil, fmt.Errorf("client: %w", err)
	}
	cc.Connect()
	c.conn = cc
	c.api = agentpb.NewAgentClient(cc)
	return c, nil
}

// WaitReady dials the agent behind vsockUDS until it answers Health or ctx
// ends. The Unix socket appears before the guest's agent listens, and until
// then the CONNECT handshake fails; WaitReady retries through that.
func WaitReady(ctx context.Context, vsockUDS string, opts ...Option) (*Client, error) {
	o := newOptions(opts)
	return WaitReadyFunc(ctx, VsockDialer(vsockUDS, o.port, o.handshakeTimeout), opts...)
}

// WaitReadyFunc is WaitReady over any dialer.
func WaitReadyFunc(ctx context.Context, dial DialFunc, opts ...Option) (*Client, error) {
	o := newOptions(opts)
	var lastErr error
	for attempt := 1; ; attempt++ {
		c, err := tryReady(ctx, dial, o, opts)
		if err == nil {
			return c, nil
		}
		lastErr = err
		t := time.NewTimer(o.retryInterval)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, fmt.Errorf("client: agent not ready after %d attempts: %w (last error: %v)", attempt, ctx.Err(), lastErr)
		case <-t.C:
		}
	}
}

func tryReady(ctx context.Context, dial DialFunc, o options, opts []Option) (*Client, error) {
	actx, cancel := context.WithTimeout(ctx, o.attemptTimeout)
	defer cancel()
	c, err := New(actx, dial, opts...)
	if err != nil {
		return nil, err
	}
	if err := c.Health(actx); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// Close closes the connection.
func (c *Client) Close() error {
	c.mu.Lock()
	if c.first != nil {
		c.first.Close()
		c.first = nil
	}
	c.mu.Unlock()
	return c.conn.Close()
}

// API returns the raw gRPC client, for what the typed methods do not cover.
func (c *Client) API() agentpb.AgentClient { return c.api }

// Health returns nil if the agent answers that it is healthy.
func (c *Client) Health(ctx context.Context) error {
	resp, err := c.api.Health(ctx, &agentpb.HealthRequest{})
	if err != nil {
		return fmt.Errorf("client: health: %w", err)
	}
	if !resp.GetOk() {
		return errors.New("client: health: agent reports not ok")
	}
	return nil
}

// Info describes the guest.
type Info struct {
	KernelRelease string
	Hostname      string
	Uptime        time.Duration
	MemTotal      uint64 // bytes
	MemAvailable  uint64 // bytes
	NumCPU        int
	AgentVersion  string
	DiskTotal     uint64 // bytes: the root file system's size
	DiskUsed      uint64 // bytes
}

// Info asks the agent about the guest.
func (c *Client) Info(ctx context.Context) (Info, error) {
	r, err := c.api.Info(ctx, &agentpb.InfoRequest{})
	if err != nil {
		return Info{}, fmt.Errorf("client: info: %w", err)
	}
	return Info{
		KernelRelease: r.GetKernelRelease(),
		Hostname:      r.GetHostname(),
		Uptime:        time.Duration(min(r.GetUptimeNs(), 1<<63-1)),
		MemTotal:      r.GetMemTotalBytes(),
		MemAvailable:  r.GetMemAvailableBytes(),
		NumCPU:        int(r.GetNumCpu()),
		AgentVersion:  r.GetAgentVersion(),
		DiskTotal:     r.GetDiskTotalBytes(),
		DiskUsed:      r.GetDiskUsedBytes(),
	}, nil
}

// Quiesce makes the guest sync its filesystems (and drop its caches) before
// a snapshot.
func (c *Client) Quiesce(ctx context.Context, dropCaches bool) error {
	if _, err := c.api.Quiesce(ctx, &agentpb.QuiesceRequest{DropCaches: dropCaches}); err != nil {
		return fmt.Errorf("client: quiesce: %w", err)
	}
	return nil
}

// FreezeVolumes syncs the guest and freezes the file systems of the disks
// AddMounts mounted read-write, leaving their images clean, as an unmount
// would, for a guest about to be stopped for good (nothing thaws them).
func (c *Client) FreezeVolumes(ctx context.Context) error {
	if _, err := c.api.Quiesce(ctx, &agentpb.QuiesceRequest{FreezeVolumes: true}); err != nil {
		return fmt.Errorf("client: freeze volumes: %w", err)
	}
	return nil
}

// Reseed gives the guest's kernel fresh entropy (32 to 4096 bytes) after a
// restore; credited reports whether the kernel counted it.
func (c *Client) Reseed(ctx context.Context, entropy []byte) (credited bool, err error) {
	r, err := c.api.Reseed(ctx, &agentpb.ReseedRequest{Entropy: entropy})
	if err != nil {
		return false, fmt.Errorf("client: reseed: %w", err)
	}
	return r.GetCredited(), nil
}

// SetClock sets the guest's realtime clock.
func (c *Client) SetClock(ctx context.Context, t time.Time) error {
	if _, err := c.api.SetClock(ctx, &agentpb.SetClockRequest{UnixNanos: t.UnixNano()}); err != nil {
		return fmt.Errorf("client: set clock: %w", err)
	}
	return nil
}

// SetHostname sets the guest kernel's host name, as hostname(1) does. An
// agent older than the call answers codes.Unimplemented.
func (c *Client) SetHostname(ctx context.Context, name string) error {
	if _, err := c.api.SetHostname(ctx, &agentpb.SetHostnameRequest{Name: name}); err != nil {
		return fmt.Errorf("client: set hostname %q: %w", name, err)
	}
	return nil
}

// MountRoot mounts the tree name that the host serves beside the guest's
// image root (sandbox.Sandbox.ServeDir) as a container root in the guest
// (read-only under a writable tmpfs of writableMiB, 0: half the guest's
// memory), and returns its path in the guest. ExecOptions.Root then runs
// processes in it.
func (c *Client) MountRoot(ctx context.Context, name string, writableMiB uint32) (string, error) {
	resp, err := c.api.MountRoot(ctx, &agentpb.MountRootRequest{Name: name, WritableMib: writableMiB})
	if err != nil {
		return "", fmt.Errorf("client: mount root %q: %w", name, err)
	}
	return resp.GetPath(), nil
}

// UnmountRoot kills the processes of container root name and unmounts it.
func (c *Client) UnmountRoot(ctx context.Context, name string) error {
	if _, err := c.api.UnmountRoot(ctx, &agentpb.UnmountRootRequest{Name: name}); err != nil {
		return fmt.Errorf("client: unmount root %q: %w", name, err)
	}
	return nil
}

// MountKind is what a Mount mounts.
type MountKind int

const (
	// MountTree binds, read-only, a tree the host serves beside the
	// guest's image root (sandbox.Sandbox.ServeDir): Mount.Name.
	MountTree MountKind = iota + 1
	// MountVolume binds the guest's own folder Mount.Name, shared by every
	// root that names it (a pod's emptyDir).
	MountVolume
	// MountTmpfs mounts a fresh tmpfs (Mount.Size caps it).
	MountTmpfs
	// MountFile writes Mount.Data as a file (Mount.Mode; at most 1 MiB).
	MountFile
	// MountDisk mounts the ext4 filesystem of the virtio disk whose
	// serial is Mount.Name (a volume slot the host filled), nosuid and
	// nodev, read-only when Mount.ReadOnly; in the guest's own root only.
	MountDisk
)

// Mount is a volume AddMounts puts at Destination.
type Mount struct {
	Destination string
	Kind        MountKind
	Name        string
	Data        []byte
	ReadOnly    bool
	Size        uint64
	Mode        uint32
}

// AddMounts mounts ms, in order, into container root root (MountRoot),
// or into the guest's own root when root is "".
func (c *Client) AddMounts(ctx context.Context, root string, ms []Mount) error {
	req := &agentpb.AddMountsRequest{Root: root}
	for i, m := range ms {
		rm := &agentpb.RootMount{Destination: m.Destination, Readonly: m.ReadOnly, Size: m.Size, Mode: m.Mode}
		switch m.Kind {
		case MountTree:
			rm.Source = &agentpb.RootMount_Tree{Tree: m.Name}
		case MountVolume:
			rm.Source = &agentpb.RootMount_Volume{Volume: m.Name}
		case MountTmpfs:
			rm.Source = &agentpb.RootMount_Tmpfs{Tmpfs: true}
		case MountFile:
			rm.Source = &agentpb.RootMount_File{File: m.Data}
		case MountDisk:
			rm.Source = &agentpb.RootMount_Disk{Disk: m.Name}
		default:
			return fmt.Errorf("client: add mounts: mount %d (%s): unknown kind %d", i, m.Destination, m.Kind)
		}
		req.Mounts = append(req.Mounts, rm)
	}
	if _, err := c.api.AddMounts(ctx, req); err != nil {
		return fmt.Errorf("client: add mounts to root %q: %w", root, err)
	}
	return nil
}

// NetworkConfig is what ConfigureNetwork gives the guest's network card.
type NetworkConfig struct {
	// Interface names the card; empty: the guest's first non-loopback
	// ethernet card.
	Interface string
	// MAC is the card's new address (aa:bb:cc:dd:ee:ff); empty keeps its
	// own.
	MAC string
	// Addresses replace the card's (at least one).
	Addresses []netip.Prefix
	// Gateway is the default route's; the zero Addr: no default route.
	Gateway netip.Addr
	// MTU is the card's MTU; 0 keeps it.
	MTU int
	// Nameservers go to the guest's /etc/resolv.conf (at most 3); none
	// leaves it alone.
	Nameservers []netip.Addr
}

// ConfigureNetwork configures the guest's network card and resolver as
// cfg says, returning the interface's name. An agent older than the call
// answers codes.Unimplemented.
func (c *Client) ConfigureNetwork(ctx context.Context, cfg NetworkConfig) (string, error) {
	req := &agentpb.ConfigureNetworkRequest{Interface: cfg.Interface, Mac: cfg.MAC}
	if cfg.MTU < 0 || cfg.MTU > 65535 {
		return "", fmt.Errorf("client: configure network: MTU %d out of range", cfg.MTU)
	}
	req.Mtu = uint32(cfg.MTU)
	for _, a := range cfg.Addresses {
		req.Addresses = append(req.Addresses, a.String())
	}
	if cfg.Gateway.IsValid() {
		req.Gateway = cfg.Gateway.String()
	}
	for _, n := range cfg.Nameservers {
		req.Nameservers = append(req.Nameservers, n.String())
	}
	r, err := c.api.ConfigureNetwork(ctx, req)
	if err != nil {
		return "", fmt.Errorf("client: configure network: %w", err)
	}
	return r.GetInterface(), nil
}

// PowerOff asks the guest to power off; it does so shortly after answering.
func (c *Client) PowerOff(ctx context.Context) error {
	if _, err := c.api.PowerOff(ctx, &agentpb.PowerOffRequest{}); err != nil {
		return fmt.Errorf("client: power off: %w", err)
	}
	return nil
}

// FileInfo describes a file in the guest.
type FileInfo struct {
	Path    string
	Name    string
	Size    int64
	Mode    fs.FileMode
	ModTime time.Time
	IsDir   bool
	Symlink string // the target, for a symlink that was not followed
	UID     uint32
	GID     uint32
	// Owner and Group are the guest's names for UID and GID, or the
	// numbers when it has none (empty from an agent older than them).
	Owner string
	Group string
}

func fileInfoOf(p *agentpb.FileInfo) FileInfo {
	return FileInfo{
		Path:    p.GetPath(),
		Name:    p.GetName(),
		Size:    p.GetSize(),
		Mode:    FileModeOf(p.GetMode()),
		ModTime: time.Unix(0, p.GetMtimeUnixNanos()),
		IsDir:   p.GetIsDir(),
		Symlink: p.GetSymlink(),
		UID:     p.GetUid(),
		GID:     p.GetGid(),
		Owner:   p.GetOwner(),
		Group:   p.GetGroup(),
	}
}

// The st_mode bits the conversions here use.
const (
	sISUID = stmode.ISUID
	sISGID = stmode.ISGID
	sISVTX = stmode.ISVTX
)

// FileModeOf converts a Unix st_mode to an fs.FileMode.
func FileModeOf(st uint32) fs.FileMode { return stmode.FileMode(st) }

// unixPerm converts an fs.FileMode's permission bits to Unix ones (07777).
// The Unix setuid, setgid and sticky bits (04000, 02000, 01000) are taken
// as such too, so 0o4755 works like fs.ModeSetuid|0o755.
func unixPerm(m fs.FileMode) uint32 {
	p := uint32(m.Perm()) | uint32(m)&(sISUID|sISGID|sISVTX)
	if m&fs.ModeSetuid != 0 {
		p |= sISUID
	}
	if m&fs.ModeSetgid != 0 {
		p |= sISGID
	}
	if m&fs.ModeSticky != 0 {
		p |= sISVTX
	}
	return p
}

// WriteOption modifies a WriteFile.
type WriteOption func(*agentpb.WriteFileHeader)

// MakeParents makes WriteFile create missing parent directories.
func MakeParents() WriteOption {
	return func(h *agentpb.WriteFileHeader) { h.MakeParents = true }
}

// WriteOwner makes the written file (and the parents WriteFile creates)
// owned by user, a name in the guest's /etc/passwd, and its group.
func WriteOwner(user string) WriteOption {
	return func(h *agentpb.WriteFileHeader) { h.User = user }
}

// writeChunk is the size of WriteFile's data messages.
const writeChunk = 256 << 10

// WriteFile writes r's content to path in the guest with the permission
// bits of mode (0 means 0644). The guest renames the file into place only
// once all of it arrived; an error leaves no partial file.
func (c *Client) WriteFile(ctx context.Context, path string, r io.Reader, mode fs.FileMode, opts ...WriteOption) error {
	_, err := c.WriteFileInfo(ctx, path, r, mode, opts...)
	return err
}

// WriteFileInfo is WriteFile, returning the written file's description.
func (c *Client) WriteFileInfo(ctx context.Context, path string, r io.Reader, mode fs.FileMode, opts ...WriteOption) (FileInfo, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	h := &agentpb.WriteFileHeader{Path: path, Mode: unixPerm(mode)}
	for _, opt := range opts {
		opt(h)
	}
	stream, err := c.api.WriteFile(ctx)
	if err != nil {
		return FileInfo{}, fmt.Errorf("client: write %s: %w", path, err)
	}
	// An error from Send means the call failed; CloseAndRecv has the
	// reason.
	closeWith := func() (FileInfo, error) {
		fi, err := stream.CloseAndRecv()
		if err != nil {
			return FileInfo{}, fmt.Errorf("client: write %s: %w", path, err)
		}
		return fileInfoOf(fi), nil
	}
	if err := stream.Send(&agentpb.WriteFileRequest{Kind: &agentpb.WriteFileRequest_Header{Header: h}}); err != nil {
		return closeWith()
	}
	buf := make([]byte, writeChunk)
	for {
		n, rerr := io.ReadFull(r, buf)
		if n > 0 {
			if err := stream.Send(&agentpb.WriteFileRequest{Kind: &agentpb.WriteFileRequest_Data{Data: buf[:n]}}); err != nil {
				return closeWith()
			}
		}
		if rerr == io.EOF || rerr == io.ErrUnexpectedEOF {
			break
		}
		if rerr != nil {
			// Cancel so that the guest discards the partial file.
			cancel()
			return FileInfo{}, fmt.Errorf("client: write %s: reading the source: %w", path, rerr)
		}
	}
	return closeWith()
}

// ReadFile copies path's content in the guest to w and returns how many
// bytes it copied.
func (c *Client) ReadFile(ctx context.Context, path string, w io.Writer) (int64, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := c.api.ReadFile(ctx, &agentpb.ReadFileRequest{Path: path})
	if err != nil {
		return 0, fmt.Errorf("client: read %s: %w", path, err)
	}
	return copyChunks(w, stream.Recv, "read "+path)
}

// Stat describes path in the guest, following a final symlink.
func (c *Client) Stat(ctx context.Context, path string) (FileInfo, error) {
	return c.stat(ctx, path, false)
}

// Lstat describes path in the guest; a symlink is described itself.
func (c *Client) Lstat(ctx context.Context, path string) (FileInfo, error) {
	return c.stat(ctx, path, true)
}

func (c *Client) stat(ctx context.Context, path string, noFollow bool) (FileInfo, error) {
	fi, err := c.api.Stat(ctx, &agentpb.StatRequest{Path: path, NoFollow: noFollow})
	if err != nil {
		return FileInfo{}, fmt.Errorf("client: stat %s: %w", path, err)
	}
	return fileInfoOf(fi), nil
}

// List describes the entries of directory path, sorted by name.
func (c *Client) List(ctx context.Context, path string) ([]FileInfo, error) {
	return c.ListDepth(ctx, path, 1)
}

// ListDepth describes the entries of directory path and, depth levels
// down, of its subdirectories: each directory's entries sorted by name,
// each subdirectory followed by its own, with full paths (symlinks are
// not followed). More than agentpb.MaxListEntries entries is
// codes.ResourceExhausted.
func (c *Client) ListDepth(ctx context.Context, path string, depth int) ([]FileInfo, error) {
	if depth < 0 || depth > 1<<30 {
		return nil, fmt.Errorf("client: list %s: depth %d out of range", path, depth)
	}
	r, err := c.api.List(ctx, &agentpb.ListRequest{Path: path, Depth: uint32(depth)})
	if err != nil {
		return nil, fmt.Errorf("client: list %s: %w", path, err)
	}
	out := make([]FileInfo, 0, len(r.GetEntries()))
	for _, e := range r.GetEntries() {
		out = append(out, fileInfoOf(e))
	}
	return out, nil
}

// MkdirOption modifies a Mkdir.
type MkdirOption func(*agentpb.MkdirRequest)

// MkdirOwner makes the directories Mkdir creates owned by user, a name in
// the guest's /etc/passwd, and its group.
func MkdirOwner(user string) MkdirOption {
	return func(r *agentpb.MkdirRequest) { r.User = user }
}

// Mkdir creates directory path with mode's permission bits (0 means 0755);
// with parents it creates missing parents too and accepts an existing
// directory.
func (c *Client) Mkdir(ctx context.Context, path string, mode fs.FileMode, parents bool, opts ...MkdirOption) error {
	req := &agentpb.MkdirRequest{Path: path, Mode: unixPerm(mode), Parents: parents}
	for _, o := range opts {
		o(req)
	}
	if _, err := c.api.Mkdir(ctx, req); err != nil {
		return fmt.Errorf("client: mkdir %s: %w", path, err)
	}
	return nil
}

// Remove removes path; recursive removes a directory tree.
func (c *Client) Remove(ctx context.Context, path string, recursive bool) error {
	if _, err := c.api.Remove(ctx, &agentpb.RemoveRequest{Path: path, Recursive: recursive}); err != nil {
		return fmt.Errorf("client: remove %s: %w", path, err)
	}
	return nil
}

// Move renames source to destination in the guest (rename(2)) and
// describes the destination. Across file systems it is
// codes.FailedPrecondition.
func (c *Client) Move(ctx context.Context, source, destination string) (FileInfo, error) {
	fi, err := c.api.Move(ctx, &agentpb.MoveRequest{Source: source, Destination: destination})
	if err != nil {
		return FileInfo{}, fmt.Errorf("client: move %s to %s: %w", source, destination, err)
	}
	return fileInfoOf(fi), nil
}

// WatchOp is what happened to a watched entry.
type WatchOp int

// The operations a watch reports (agentpb.WatchEvent_Op).
const (
	WatchCreate WatchOp = WatchOp(agentpb.WatchEvent_OP_CREATE)
	WatchWrite  WatchOp = WatchOp(agentpb.WatchEvent_OP_WRITE)
	WatchRemove WatchOp = WatchOp(agentpb.WatchEvent_OP_REMOVE)
	WatchRename WatchOp = WatchOp(agentpb.WatchEvent_OP_RENAME)
	WatchChmod  WatchOp = WatchOp(agentpb.WatchEvent_OP_CHMOD)
)

func (o WatchOp) String() string {
	switch o {
	case WatchCreate:
		return "create"
	case WatchWrite:
		return "write"
	case WatchRemove:
		return "remove"
	case WatchRename:
		return "rename"
	case WatchChmod:
		return "chmod"
	}
	return fmt.Sprintf("op(%d)", int(o))
}

// WatchEvent is one event of Watch: the first has Started set (the watch
// is in place), each later one a change.
type WatchEvent struct {
	Started bool
	Op      WatchOp
	// Name is the entry's path relative to the watched directory.
	Name string
	// Entry describes it as it is now, when it exists (HasEntry).
	Entry    FileInfo
	HasEntry bool
}

// WatchEventOf converts the agent's event.
func WatchEventOf(e *agentpb.WatchEvent) WatchEvent {
	out := WatchEvent{Started: e.GetStarted(), Op: WatchOp(e.GetOp()), Name: e.GetName()}
	if e.GetEntry() != nil {
		out.Entry, out.HasEntry = fileInfoOf(e.GetEntry()), true
	}
	return out
}

// Watch watches directory path in the guest (recursive: its
// subdirectories too), calling fn with each event, the started one first,
// until ctx ends (nil), the directory goes away (nil), fn returns an
// error (that error) or the watch fails (codes.ResourceExhausted when the
// guest's event queue overflowed).
func (c *Client) Watch(ctx context.Context, path string, recursive bool, fn func(WatchEvent) error) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := c.api.Watch(ctx, &agentpb.WatchRequest{Path: path, Recursive: recursive})
	if err != nil {
		return fmt.Errorf("client: watch %s: %w", path, err)
	}
	for {
		ev, err := st.Recv()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("client: watch %s: %w", path, err)
		}
		if err := fn(WatchEventOf(ev)); err != nil {
			return err
		}
	}
}
