// Package ninep is a read-only 9P2000.L server over a rofs.FS, serving one
// message at a time so that a virtio-9p device can hand it the requests it
// takes from its queue, from several goroutines at once.
//
// Everything in a T-message is untrusted (it comes from the guest): every
// length, count, offset and fid is checked, a malformed message gets
// Rlerror EINVAL, and nothing the guest sends can make the server panic or
// allocate more than the negotiated msize. Files are named by the tree's
// stable inode numbers, so the fid table can be saved in a snapshot and
// restored against the same tree rebuilt in another process.
package ninep

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"strings"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/rofs"
)

// Message sizes.
const (
	// DefaultMsize is the largest msize the server accepts unless told
	// otherwise: what Linux 6.1's virtio transport allows (4096×125).
	DefaultMsize = 512000
	// MinMsize is the smallest msize a client may propose (Linux refuses
	// less too).
	MinMsize = 4096
	// MaxMsizeLimit bounds Options.MaxMsize.
	MaxMsizeLimit = 16 << 20
	// DefaultMaxFids bounds the fid table unless told otherwise.
	DefaultMaxFids = 1 << 16
	// maxXattrHeld bounds the bytes all xattr fids hold at once (each up
	// to 64 KiB): a guest cannot pin more of the host's memory with them.
	maxXattrHeld = 16 << 20
)

// Options configures a Server.
type Options struct {
	// MaxMsize is the largest msize the server agrees to; the client
	// proposes one in Tversion and gets the smaller of the two. Zero means
	// DefaultMsize; it is raised to MinMsize and cut to MaxMsizeLimit.
	MaxMsize uint32
	// MaxFids bounds how many fids the client may hold at once (a walk or
	// attach past it fails with EMFILE). Zero means DefaultMaxFids.
	MaxFids int
	// Logger receives the server's logs (guest errors at a limited rate);
	// slog.Default() when nil.
	Logger *slog.Logger
}

// Stats counts what a Server did.
type Stats struct {
	Requests  uint64 // T-messages handled
	Errors    uint64 // Rlerror replies
	BytesRead uint64 // file and xattr bytes returned by Tread
	Panics    uint64 // handler panics recovered (a bug: each is logged)
}

// NamedRoots is implemented by an FS that serves named trees besides its
// root: a Tattach whose aname is neither "" nor "/" attaches the tree of
// that name. The named trees' inode numbers are the FS's own (a fid of any
// tree is served by the same FS methods), distinct from every other tree's.
type NamedRoots interface {
	// AttachRoot returns the root directory's inode number of the tree
	// named aname: an error wrapping ENOENT when there is none.
	AttachRoot(aname string) (uint64, error)
	// IsRoot reports whether ino is the root of a named tree served now,
	// so that a restored fid may start there.
	IsRoot(ino uint64) bool
}

// Server is a 9P2000.L server over a read-only tree. Its methods are safe
// for concurrent use.
type Server struct {
	fs       rofs.FS
	maxMsize uint32
	maxFids  int
	log      *logLimiter
	bufs     sync.Pool // *[]byte of maxMsize bytes, for Handle
	dirs     *dirCache

	mu    sync.Mutex
	msize uint32 // negotiated by Tversion; 0 before
	fids  map[uint32]*fid
	held  int // bytes of xattr values the fids hold

	flightMu sync.Mutex
	inflight map[uint16]*call

	requests, errs, bytesRead, panics atomic.Uint64
}

// fid is one entry of the fid table. Its fields change only under
// Server.mu.
type fid struct {
	node *node
	mode uint32 // the file's mode, from the walk that made the fid
	open bool
	// flags are the Tlopen flags.
	flags uint32
	// xattr is set for a fid made by Txattrwalk: Tread reads its value.
	xattr *xattrValue
}

// heldBytes is what the fid holds of host memory beyond its entry.
func (f *fid) heldBytes() int {
	if f.xattr == nil {
		return 0
	}
	return len(f.xattr.value)
}

// node is a file and the directories above it, up to the root: ".." walks
// to the parent, which the tree itself does not give. Nodes are immutable
// and shared between fids.
type node struct {
	ino    uint64
	parent *node // nil at the root
}

func (n *node) parentOrSelf() *node {
	if n.parent == nil {
		return n
	}
	return n.parent
}

// path returns the inode numbers from the root down to n.
func (n *node) path() []uint64 {
	depth := 0
	for m := n; m != nil; m = m.parent {
		depth++
	}
	p := make([]uint64, depth)
	for m := n; m != nil; m = m.parent {
		depth--
		p[depth] = m.ino
	}
	return p
}

// xattrValue is what an xattr fid reads: one attribute's value, or the
// list of names.
type xattrValue struct {
	name  string // "" for the list
	value []byte
}

// call is a request being served, for Tflush.
type call struct {
	cancel context.CancelFunc
	done   chan struct{}
}

// NewServer returns a server for fs.
func NewServer(fs rofs.FS, opts Options) *Server {
	maxMsize := opts.MaxMsize
	switch {
	case maxMsize == 0:
		maxMsize = DefaultMsize
	case maxMsize < MinMsize:
		maxMsize = MinMsize
	case maxMsize > MaxMsizeLimit:
		maxMsize = MaxMsizeLimit
	}
	maxFids := opts.MaxFids
	if maxFids <= 0 {
		maxFids = DefaultMaxFids
	}
	log := opts.Logger
	if log == nil {
		log = slog.Default()
	}
	s := &Server{
		fs:       fs,
		maxMsize: maxMsize,
		maxFids:  maxFids,
		log:      newLogLimiter(log.With("component", "9p"), 10, 20),
		fids:     make(map[uint32]*fid),
		dirs:     newDirCache(defaultDirCacheEntries),
		inflight: make(map[uint16]*call),
	}
	s.bufs.New = func() any { b := make([]byte, maxMsize); return &b }
	return s
}

// Msize returns the msize negotiated by the last Tversion, or 0 before one.
func (s *Server) Msize() uint32 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.msize
}

// MaxMsize returns the largest msize the server agrees to: a buffer of
// that size holds any reply.
func (s *Server) MaxMsize() uint32 { return s.maxMsize }

// Fids returns how many fids the client holds.
func (s *Server) Fids() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.fids)
}

// InFlight returns how many requests have begun and not yet finished.
func (s *Server) InFlight() int {
	s.flightMu.Lock()
	defer s.flightMu.Unlock()
	return len(s.inflight)
}

// Stats returns the server's counters.
func (s *Server) Stats() Stats {
	return Stats{Requests: s.requests.Load(), Errors: s.errs.Load(), BytesRead: s.bytesRead.Load(), Panics: s.panics.Load()}
}

// Handle serves one T-message (the whole message, size[4] included) and
// returns the R-message: Rlerror on any failure. ctx bounds blocking reads.
func (s *Server) Handle(ctx context.Context, req []byte) []byte {
	bp := s.bufs.Get().(*[]byte)
	defer s.bufs.Put(bp)
	n := s.Serve(ctx, req, *bp, nil)
	return append([]byte(nil), (*bp)[:n]...)
}

// HandleTo serves one T-message as Handle does, writing the R-message into
// resp, and returns its length. Replies are cut to fit resp: a Tread or
// Treaddir returns at most what fits, any other reply that does not fit is
// an Rlerror. A resp shorter than an Rlerror (11 bytes) gets no reply (0).
// resp of MaxMsize bytes holds any reply.
func (s *Server) HandleTo(ctx context.Context, req, resp []byte) int {
	return s.Serve(ctx, req, resp, nil)
}

// Serve is HandleTo that calls reply with the R-message before the request
// counts as finished: a Tflush of its tag is answered only after reply has
// returned. A device delivers the reply to the guest in reply, so that the
// guest sees the flushed request's reply before Rflush, as the protocol
// requires. reply may be nil.
func (s *Server) Serve(ctx context.Context, req, resp []byte, reply func([]byte)) int {
	tag := uint16(NoTag)
	if len(req) >= headerSize {
		tag = binary.LittleEndian.Uint16(req[5:])
	}
	return s.Begin(ctx, tag).Serve(req, resp, reply)
}

// Call is a request the server knows of before it serves it: Begin
// registers its tag, so that a Tflush that arrives meanwhile waits for it
// (and cancels it). A device begins requests in the order it takes them
// from its queue and serves them later, on its workers.
type Call struct {
	s          *Server
	tag        uint16
	ctx        context.Context
	c          *call
	registered bool
}

// Begin registers a request with tag, whose context is ctx; Serve it
// exactly once. A tag already in flight (a client error) is served but
// cannot be flushed.
func (s *Server) Begin(ctx context.Context, tag uint16) *Call {
	ctx, cancel := context.WithCancel(ctx)
	c := &call{cancel: cancel, done: make(chan struct{})}
	s.flightMu.Lock()
	_, busy := s.inflight[tag]
	if !busy {
		s.inflight[tag] = c
	}
	s.flightMu.Unlock()
	return &Call{s: s, tag: tag, ctx: ctx, c: c, registered: !busy}
}

// Serve serves the request, as Server.Serve does; req's tag should be the
// one given to Begin (the reply carries req's).
func (c *Call) Serve(req, resp []byte, reply func([]byte)) int {
	s := c.s
	tag := uint16(NoTag)
	if len(req) >= headerSize {
		tag = binary.LittleEndian.Uint16(req[5:])
	}
	n := s.handleSafe(c.ctx, req, resp, tag)
	if reply != nil {
		reply(resp[:n])
	}
	if c.registered {
		s.flightMu.Lock()
		if s.inflight[c.tag] == c.c {
			delete(s.inflight, c.tag)
		}
		s.flightMu.Unlock()
	}
	c.c.cancel()
	close(c.c.done)
	return n
}

// handleSafe is handle with a last line of defence: a handler that panics
// (a bug) costs the guest an EIO, not the VMM.
func (s *Server) handleSafe(ctx context.Context, req, resp []byte, tag uint16) (n int) {
	defer func() {
		if r := recover(); r != nil {
			s.panics.Add(1)
			s.errs.Add(1)
			s.log.log.Error("9P handler panicked (a bug)", "panic", fmt.Sprint(r), "request_len", len(req))
			n = 0
			if len(resp) >= rlerrorSize {
				n = putRlerror(resp, tag, unix.EIO)
			}
		}
	}()
	return s.handle(ctx, req, resp, tag)
}

func (s *Server) handle(ctx context.Context, req, resp []byte, tag uint16) int {
	s.requests.Add(1)
	if len(resp) < rlerrorSize {
		s.errs.Add(1)
		return 0
	}
	typ, err := s.check(req)
	if err == nil {
		limit := len(resp)
		if m := s.Msize(); m != 0 && limit > int(m) {
			limit = int(m)
		} else if m == 0 && limit > int(s.maxMsize) {
			limit = int(s.maxMsize)
		}
		e := encoder{b: resp[headerSize:limit]}
		d := decoder{b: req[headerSize:]}
		err = s.dispatch(ctx, typ, tag, &d, &e)
		if err == nil && e.full {
			err = fmt.Errorf("the reply does not fit in %d bytes: %w", limit, unix.EMSGSIZE)
		}
		if err == nil {
			putHeader(resp, uint32(headerSize+e.n), typ+1, tag)
			return headerSize + e.n
		}
		err = fmt.Errorf("%s: %w", msgName(typ), err)
	}
	s.errs.Add(1)
	errno := errnoOf(err)
	s.logError(errno, err)
	return putRlerror(resp, tag, errno)
}

// check validates a message's header against its length and the session.
func (s *Server) check(req []byte) (uint8, error) {
	if len(req) < headerSize {
		return 0, fmt.Errorf("message of %d bytes is shorter than a header: %w", len(req), errMalformed)
	}
	size := binary.LittleEndian.Uint32(req)
	typ := req[4]
	if uint64(size) != uint64(len(req)) {
		return typ, fmt.Errorf("%s: size field %d but the message has %d bytes: %w", msgName(typ), size, len(req), errMalformed)
	}
	if typ == tversion {
		if len(req) > MaxMsizeLimit {
			return typ, fmt.Errorf("Tversion of %d bytes: %w", len(req), errMalformed)
		}
		return typ, nil
	}
	m := s.Msize()
	if m == 0 {
		return typ, fmt.Errorf("%s before Tversion: %w", msgName(typ), unix.EPROTO)
	}
	if uint64(len(req)) > uint64(m) {
		return typ, fmt.Errorf("%s of %d bytes is over msize %d: %w", msgName(typ), len(req), m, errMalformed)
	}
	return typ, nil
}

// errnoOf is the errno the guest sees for err.
func errnoOf(err error) unix.Errno {
	var errno unix.Errno
	switch {
	case errors.As(err, &errno) && errno != 0:
		return errno
	case errors.Is(err, errMalformed):
		return unix.EINVAL
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return unix.EINTR
	}
	return unix.EIO
}

// logError logs a failed request, at a limited rate. Misses the guest
// expects (no such file, no such xattr) and refused changes are not logged.
func (s *Server) logError(errno unix.Errno, err error) {
	switch errno {
	case unix.ENOENT, unix.ENODATA, unix.EROFS, unix.EOPNOTSUPP:
		return
	case unix.EINVAL, unix.EPROTO, unix.EMFILE, unix.EIO, unix.EMSGSIZE:
		s.log.logf(slog.LevelWarn, "9P request failed", "errno", errno.Error(), "err", err)
	default:
		s.log.logf(slog.LevelDebug, "9P request failed", "errno", errno.Error(), "err", err)
	}
}

func (s *Server) dispatch(ctx context.Context, typ uint8, tag uint16, d *decoder, e *encoder) error {
	switch typ {
	case tversion:
		return s.version(d, e)
	case tauth:
		d.u32("afid")
		d.str("uname", math.MaxUint16)
		d.str("aname", math.MaxUint16)
		d.u32("n_uname")
		if err := d.end(); err != nil {
			return err
		}
		return fmt.Errorf("no authentication is required: %w", unix.EOPNOTSUPP)
	case tattach:
		return s.attach(d, e)
	case tflush:
		return s.flush(ctx, tag, d)
	case twalk:
		return s.walk(d, e)
	case tgetattr:
		return s.getattr(d, e)
	case tlopen:
		return s.lopen(d, e)
	case tread:
		return s.read(ctx, d, e)
	case treaddir:
		return s.readdir(d, e)
	case treadlink:
		return s.readlink(d, e)
	case tstatfs:
		return s.statfs(d, e)
	case txattrwalk:
		return s.xattrwalk(d, e)
	case tclunk, tremove:
		f := d.u32("fid")
		if err := d.end(); err != nil {
			return err
		}
		if err := s.clunk(f); err != nil {
			return err
		}
		if typ == tremove {
			return fmt.Errorf("fid %d clunked, nothing removed: %w", f, unix.EROFS)
		}
		return nil
	case tfsync:
		f := d.u32("fid")
		if len(d.b)-d.off == 4 { // datasync[4], which older clients leave out
			d.u32("datasync")
		}
		if err := d.end(); err != nil {
			return err
		}
		_, err := s.getFid(f)
		return err
	case tlock:
		return s.lock(d, e)
	case tgetlock:
		return s.getlock(d, e)
	case tlcreate, tsymlink, tmknod, trename, tsetattr, txattrcreate, tlink, tmkdir, trenameat, tunlinkat, twrite:
		if err := decodeChange(typ, d); err != nil {
			return err
		}
		return fmt.Errorf("the file system is read-only: %w", unix.EROFS)
	}
	return fmt.Errorf("unsupported message: %w", unix.EOPNOTSUPP)
}

// decodeChange decodes a message that would change the tree, to tell a
// malformed one (EINVAL) from a well-formed one (EROFS).
func decodeChange(typ uint8, d *decoder) error {
	const s = math.MaxUint16
	switch typ {
	case tlcreate: // fid name flags mode gid
		d.u32("fid")
		d.str("name", s)
		d.u32("flags")
		d.u32("mode")
		d.u32("gid")
	case tsymlink: // fid name symtgt gid
		d.u32("fid")
		d.str("name", s)
		d.str("symtgt", s)
		d.u32("gid")
	case tmknod: // dfid name mode major minor gid
		d.u32("dfid")
		d.str("name", s)
		d.u32("mode")
		d.u32("major")
		d.u32("minor")
		d.u32("gid")
	case trename: // fid dfid name
		d.u32("fid")
		d.u32("dfid")
		d.str("name", s)
	case tsetattr: // fid valid mode uid gid size atime mtime
		d.u32("fid")
		d.u32("valid")
		d.u32("mode")
		d.u32("uid")
		d.u32("gid")
		for _, f := range []string{"size", "atime_sec", "atime_nsec", "mtime_sec", "mtime_nsec"} {
			d.u64(f)
		}
	case txattrcreate: // fid name attr_size flags
		d.u32("fid")
		d.str("name", s)
		d.u64("attr_size")
		d.u32("flags")
	case tlink: // dfid fid name
		d.u32("dfid")
		d.u32("fid")
		d.str("name", s)
	case tmkdir: // dfid name mode gid
		d.u32("dfid")
		d.str("name", s)
		d.u32("mode")
		d.u32("gid")
	case trenameat: // olddirfid oldname newdirfid newname
		d.u32("olddirfid")
		d.str("oldname", s)
		d.u32("newdirfid")
		d.str("newname", s)
	case tunlinkat: // dirfd name flags
		d.u32("dirfd")
		d.str("name", s)
		d.u32("flags")
	case twrite: // fid offset count data[count]
		d.u32("fid")
		d.u64("offset")
		n := d.u32("count")
		if d.err == nil && uint64(n) != uint64(len(d.b)-d.off) {
			return fmt.Errorf("Twrite count %d but %d data bytes: %w", n, len(d.b)-d.off, errMalformed)
		}
		d.off = len(d.b)
	}
	return d.end()
}

func (s *Server) version(d *decoder, e *encoder) error {
	msize := d.u32("msize")
	v := d.str("version", maxNameLen)
	if err := d.end(); err != nil {
		return err
	}
	if msize < MinMsize {
		return fmt.Errorf("msize %d is under the minimum %d: %w", msize, MinMsize, unix.EINVAL)
	}
	msize = min(msize, s.maxMsize)
	if v != Version && !strings.HasPrefix(v, Version+".") {
		e.u32(msize)
		e.str("unknown")
		return nil
	}
	// A new session: every fid of the old one is gone.
	s.mu.Lock()
	s.msize = msize
	clear(s.fids)
	s.held = 0
	s.mu.Unlock()
	e.u32(msize)
	e.str(Version)
	return nil
}

func (s *Server) attach(d *decoder, e *encoder) error {
	f := d.u32("fid")
	afid := d.u32("afid")
	d.str("uname", math.MaxUint16)
	aname := d.str("aname", math.MaxUint16)
	d.u32("n_uname")
	if err := d.end(); err != nil {
		return err
	}
	if afid != NoFid {
		return fmt.Errorf("afid %d: no authentication is required, afid must be NOFID: %w", afid, unix.EINVAL)
	}
	root := s.fs.Root()
	if aname != "" && aname != "/" {
		named, ok := s.fs.(NamedRoots)
		if !ok {
			return fmt.Errorf("aname %q: only the root (\"\" or \"/\") can be attached: %w", aname, unix.ENOENT)
		}
		ino, err := named.AttachRoot(aname)
		if err != nil {
			return fmt.Errorf("aname %q: %w", aname, err)
		}
		root = ino
	}
	a, err := s.fs.Getattr(root)
	if err != nil {
		return fmt.Errorf("root inode %d: %w", root, err)
	}
	if a.Mode&unix.S_IFMT != unix.S_IFDIR {
		return fmt.Errorf("aname %q: root inode %d is not a directory: %w", aname, root, unix.ENOTDIR)
	}
	if err := s.addFid(f, &fid{node: &node{ino: root}, mode: a.Mode}); err != nil {
		return err
	}
	e.qid(qidOf(root, a.Mode))
	return nil
}

// getFid returns a copy of fid f's entry (EBADF when there is none).
func (s *Server) getFid(f uint32) (fid, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	p, ok := s.fids[f]
	if !ok {
		return fid{}, fmt.Errorf("fid %d: %w", f, unix.EBADF)
	}
	return *p, nil
}

// getFileFid is getFid for a fid that names a file (not an xattr fid).
func (s *Server) getFileFid(f uint32) (fid, error) {
	x, err := s.getFid(f)
	if err == nil && x.xattr != nil {
		err = fmt.Errorf("fid %d is an xattr fid: %w", f, unix.EINVAL)
	}
	return x, err
}

// addFid adds fid f, which must not be in use.
func (s *Server) addFid(f uint32, x *fid) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.fids[f]; ok {
		return fmt.Errorf("fid %d is already in use: %w", f, unix.EBADF)
	}
	if f == NoFid {
		return fmt.Errorf("fid NOFID cannot name a file: %w", unix.EBADF)
	}
	if len(s.fids) >= s.maxFids {
		return fmt.Errorf("fid table full (%d fids): %w", s.maxFids, unix.EMFILE)
	}
	if err := s.hold(x.heldBytes()); err != nil {
		return err
	}
	s.fids[f] = x
	return nil
}

// hold accounts for n more bytes held by fids. Called with s.mu.
func (s *Server) hold(n int) error {
	if s.held+n > maxXattrHeld {
		return fmt.Errorf("xattr fids would hold %d bytes, over %d: %w", s.held+n, maxXattrHeld, unix.ENOMEM)
	}
	s.held += n
	return nil
}

// setFid adds fid f (newfid) or, when f is the fid being walked from (old),
// replaces it.
func (s *Server) setFid(old, f uint32, x *fid) error {
	if old != f {
		return s.addFid(f, x)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	prev, ok := s.fids[f]
	if !ok {
		return fmt.Errorf("fid %d was clunked during the walk: %w", f, unix.EBADF)
	}
	if err := s.hold(x.heldBytes() - prev.heldBytes()); err != nil {
		return err
	}
	s.fids[f] = x
	return nil
}

func (s *Server) clunk(f uint32) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	x, ok := s.fids[f]
	if !ok {
		return fmt.Errorf("fid %d: %w", f, unix.EBADF)
	}
	s.held -= x.heldBytes()
	delete(s.fids, f)
	return nil
}

// checkName checks one path element of a walk.
func checkName(name string) error {
	switch {
	case name == "":
		return fmt.Errorf("empty name: %w", unix.EINVAL)
	case len(name) > maxNameLen:
		return fmt.Errorf("name of %d bytes: %w", len(name), unix.ENAMETOOLONG)
	case strings.ContainsAny(name, "/\x00"):
		return fmt.Errorf("name %q has a slash or NUL: %w", name, unix.EINVAL)
	}
	return nil
}

func (s *Server) walk(d *decoder, e *encoder) error {
	f := d.u32("fid")
	newf := d.u32("newfid")
	nw := d.u16("nwname")
	if d.err == nil && nw > maxWalkNames {
		return fmt.Errorf("nwname %d is over %d: %w", nw, maxWalkNames, errMalformed)
	}
	var names [maxWalkNames]string
	for i := range int(nw) {
		names[i] = d.str("wname", math.MaxUint16)
	}
	if err := d.end(); err != nil {
		return err
	}
	from, err := s.getFileFid(f)
	if err != nil {
		return err
	}
	if nw == 0 && newf == f { // a clone onto itself changes nothing
		e.u16(0)
		return nil
	}
	if newf != f {
		s.mu.Lock()
		_, busy := s.fids[newf]
		s.mu.Unlock()
		if busy {
			return fmt.Errorf("newfid %d is already in use: %w", newf, unix.EBADF)
		}
	}
	cur, mode := from.node, from.mode
	var qids [maxWalkNames]qid
	n := 0
	for _, name := range names[:nw] {
		next, nextMode, err := s.step(cur, mode, name)
		if err != nil {
			if n == 0 {
				return err
			}
			break
		}
		cur, mode = next, nextMode
		qids[n] = qidOf(cur.ino, mode)
		n++
	}
	if n == int(nw) {
		if err := s.setFid(f, newf, &fid{node: cur, mode: mode}); err != nil {
			return err
		}
	}
	e.u16(uint16(n))
	for _, q := range qids[:n] {
		e.qid(q)
	}
	return nil
}

// step walks one name from directory cur.
func (s *Server) step(cur *node, mode uint32, name string) (*node, uint32, error) {
	if err := checkName(name); err != nil {
		return nil, 0, err
	}
	if mode&unix.S_IFMT != unix.S_IFDIR {
		return nil, 0, fmt.Errorf("walk of %q from inode %d: %w", name, cur.ino, unix.ENOTDIR)
	}
	var next *node
	switch name {
	case ".":
		return cur, mode, nil
	case "..":
		next = cur.parentOrSelf()
	default:
		ino, err := s.fs.Lookup(cur.ino, name)
		if err != nil {
			return nil, 0, fmt.Errorf("lookup of %q in inode %d: %w", name, cur.ino, err)
		}
		next = &node{ino: ino, parent: cur}
	}
	a, err := s.fs.Getattr(next.ino)
	if err != nil {
		return nil, 0, fmt.Errorf("inode %d: %w", next.ino, err)
	}
	return next, a.Mode, nil
}

func (s *Server) getattr(d *decoder, e *encoder) error {
	f := d.u32("fid")
	d.u64("request_mask")
	if err := d.end(); err != nil {
		return err
	}
	x, err := s.getFileFid(f)
	if err != nil {
		return err
	}
	a, err := s.fs.Getattr(x.node.ino)
	if err != nil {
		return fmt.Errorf("inode %d: %w", x.node.ino, err)
	}
	size := uint64(max(a.Size, 0))
	var sec, nsec uint64
	if !a.Mtime.IsZero() {
		sec, nsec = uint64(a.Mtime.Unix()), uint64(a.Mtime.Nanosecond())
	}
	e.u64(getattrBasic)
	e.qid(qidOf(x.node.ino, a.Mode))
	e.u32(a.Mode)
	e.u32(a.UID)
	e.u32(a.GID)
	e.u64(uint64(a.Nlink))
	e.u64(a.Rdev)
	e.u64(size)
	e.u64(4096)                        // blksize
	e.u64(size/512 + min(size%512, 1)) // blocks of 512 bytes
	for range 3 {                      // atime, mtime, ctime
		e.u64(sec)
		e.u64(nsec)
	}
	e.u64(0) // btime
	e.u64(0)
	e.u64(0) // gen
	e.u64(0) // data_version
	return nil
}

func (s *Server) lopen(d *decoder, e *encoder) error {
	f := d.u32("fid")
	flags := d.u32("flags")
	if err := d.end(); err != nil {
		return err
	}
	x, err := s.getFileFid(f)
	if err != nil {
		return err
	}
	if x.open {
		return fmt.Errorf("fid %d is already open: %w", f, unix.EINVAL)
	}
	if flags&openAccMode != unix.O_RDONLY || flags&(openCreate|openTrunc|openExcl) != 0 {
		return fmt.Errorf("open flags %#o ask to write: %w", flags, unix.EROFS)
	}
	switch x.mode & unix.S_IFMT {
	case unix.S_IFDIR:
	case unix.S_IFREG:
		if flags&openDirectory != 0 {
			return fmt.Errorf("O_DIRECTORY open of inode %d: %w", x.node.ino, unix.ENOTDIR)
		}
	case unix.S_IFLNK:
		return fmt.Errorf("open of symlink inode %d: %w", x.node.ino, unix.ELOOP)
	default:
		return fmt.Errorf("open of special file inode %d (mode %#o): the guest serves it: %w", x.node.ino, x.mode, unix.EINVAL)
	}
	s.mu.Lock()
	p, ok := s.fids[f]
	switch {
	case !ok:
		err = fmt.Errorf("fid %d was clunked during the open: %w", f, unix.EBADF)
	case p.open:
		err = fmt.Errorf("fid %d is already open: %w", f, unix.EINVAL)
	default:
		p.open, p.flags = true, flags
		s.mu.Unlock()
		e.qid(qidOf(x.node.ino, x.mode))
		e.u32(s.Msize() - ioHeader)
		return nil
	}
	s.mu.Unlock()
	return err
}

func (s *Server) read(ctx context.Context, d *decoder, e *encoder) error {
	f := d.u32("fid")
	off := d.u64("offset")
	count := d.u32("count")
	if err := d.end(); err != nil {
		return err
	}
	x, err := s.getFid(f)
	if err != nil {
		return err
	}
	if off > math.MaxInt64 {
		return fmt.Errorf("offset %d: %w", off, unix.EINVAL)
	}
	// count is cut to what fits in the reply (msize, or the caller's
	// buffer).
	if !e.room(4) {
		return nil // e.full: EMSGSIZE
	}
	n := min(uint64(count), uint64(len(e.b)-e.n-4))
	buf := e.b[e.n+4 : e.n+4+int(n)]
	var got int
	switch {
	case x.xattr != nil:
		if off < uint64(len(x.xattr.value)) {
			got = copy(buf, x.xattr.value[off:])
		}
	case !x.open:
		return fmt.Errorf("fid %d is not open: %w", f, unix.EBADF)
	case x.mode&unix.S_IFMT == unix.S_IFDIR:
		return fmt.Errorf("Tread of directory inode %d: %w", x.node.ino, unix.EISDIR)
	default:
		got, err = s.fs.ReadAt(ctx, x.node.ino, buf, int64(off))
		got = max(0, min(got, len(buf)))
		if err != nil && !errors.Is(err, io.EOF) && got == 0 {
			return fmt.Errorf("read of inode %d at %d: %w", x.node.ino, off, err)
		}
	}
	e.u32(uint32(got))
	e.n += got
	s.bytesRead.Add(uint64(got))
	return nil
}

// direntSize is one Rreaddir entry's size: qid[13] offset[8] type[1]
// name[s].
func direntSize(name string) int { return qidSize + 8 + 1 + 2 + len(name) }

func (s *Server) readdir(d *decoder, e *encoder) error {
	f := d.u32("fid")
	off := d.u64("offset")
	count := d.u32("count")
	if err := d.end(); err != nil {
		return err
	}
	x, err := s.getFileFid(f)
	if err != nil {
		return err
	}
	if !x.open {
		return fmt.Errorf("fid %d is not open: %w", f, unix.EBADF)
	}
	if x.mode&unix.S_IFMT != unix.S_IFDIR {
		return fmt.Errorf("Treaddir of inode %d: %w", x.node.ino, unix.ENOTDIR)
	}
	ents, err := s.dirs.list(s.fs, x.node.ino)
	if err != nil {
		return fmt.Errorf("directory inode %d: %w", x.node.ino, err)
	}
	if !e.room(4) {
		return nil
	}
	limit := min(uint64(count), uint64(len(e.b)-e.n-4))
	countAt := e.n
	e.n += 4
	used := 0
	// Entry i is ".", "..", then the tree's entries; its offset, the cookie
	// to continue from, is i+1.
	total := uint64(len(ents)) + 2
	for i := off; i < total; i++ {
		var name string
		var q qid
		var typ uint8
		switch i {
		case 0:
			name, q, typ = ".", qidOf(x.node.ino, unix.S_IFDIR), direntType(unix.S_IFDIR)
		case 1:
			name, q, typ = "..", qidOf(x.node.parentOrSelf().ino, unix.S_IFDIR), direntType(unix.S_IFDIR)
		default:
			de := ents[i-2]
			name, q, typ = de.Name, qidOf(de.Ino, de.Mode), direntType(de.Mode)
		}
		sz := direntSize(name)
		if uint64(used+sz) > limit {
			if used == 0 {
				return fmt.Errorf("count %d is too small for the entry at offset %d (%d bytes): %w", count, i, sz, unix.EINVAL)
			}
			break
		}
		e.qid(q)
		e.u64(i + 1)
		e.u8(typ)
		e.str(name)
		used += sz
	}
	binary.LittleEndian.PutUint32(e.b[countAt:], uint32(used))
	return nil
}

func (s *Server) readlink(d *decoder, e *encoder) error {
	f := d.u32("fid")
	if err := d.end(); err != nil {
		return err
	}
	x, err := s.getFileFid(f)
	if err != nil {
		return err
	}
	target, err := s.fs.Readlink(x.node.ino)
	if err != nil {
		return fmt.Errorf("readlink of inode %d: %w", x.node.ino, err)
	}
	e.str(target)
	return nil
}

func (s *Server) statfs(d *decoder, e *encoder) error {
	f := d.u32("fid")
	if err := d.end(); err != nil {
		return err
	}
	if _, err := s.getFid(f); err != nil {
		return err
	}
	st := s.fs.StatFS()
	bsize, namelen := st.BlockSize, st.NameLen
	if bsize == 0 {
		bsize = 4096
	}
	if namelen == 0 {
		namelen = maxNameLen
	}
	e.u32(V9FSMagic)
	e.u32(bsize)
	e.u64(st.Blocks)
	e.u64(0) // bfree
	e.u64(0) // bavail
	e.u64(st.Files)
	e.u64(0) // ffree
	e.u64(0) // fsid
	e.u32(namelen)
	return nil
}

func (s *Server) xattrwalk(d *decoder, e *encoder) error {
	f := d.u32("fid")
	newf := d.u32("newfid")
	name := d.str("name", math.MaxUint16)
	if err := d.end(); err != nil {
		return err
	}
	if len(name) > maxXattrName {
		return fmt.Errorf("xattr name of %d bytes: %w", len(name), unix.ERANGE)
	}
	x, err := s.getFileFid(f)
	if err != nil {
		return err
	}
	var val []byte
	if name == "" {
		names, err := s.fs.Listxattr(x.node.ino)
		if err != nil {
			return fmt.Errorf("listxattr of inode %d: %w", x.node.ino, err)
		}
		for _, n := range names {
			if len(val)+len(n)+1 > maxXattrSize {
				return fmt.Errorf("xattr list of inode %d is over %d bytes: %w", x.node.ino, maxXattrSize, unix.E2BIG)
			}
			val = append(append(val, n...), 0)
		}
	} else {
		if val, err = s.fs.Getxattr(x.node.ino, name); err != nil {
			return fmt.Errorf("xattr %q of inode %d: %w", name, x.node.ino, err)
		}
		if len(val) > maxXattrSize {
			return fmt.Errorf("xattr %q of inode %d is %d bytes, over %d: %w", name, x.node.ino, len(val), maxXattrSize, unix.E2BIG)
		}
	}
	if val == nil {
		val = []byte{}
	}
	if err := s.setFid(f, newf, &fid{node: x.node, mode: x.mode, xattr: &xattrValue{name: name, value: val}}); err != nil {
		return err
	}
	e.u64(uint64(len(val)))
	return nil
}

func (s *Server) lock(d *decoder, e *encoder) error {
	f := d.u32("fid")
	d.u8("type")
	d.u32("flags")
	d.u64("start")
	d.u64("length")
	d.u32("proc_id")
	d.str("client_id", math.MaxUint16)
	if err := d.end(); err != nil {
		return err
	}
	// The tree cannot change, and the guest is its only client: every lock
	// is granted (the guest's own lock manager orders its processes).
	if _, err := s.getFileFid(f); err != nil {
		return err
	}
	e.u8(lockSuccess)
	return nil
}

func (s *Server) getlock(d *decoder, e *encoder) error {
	f := d.u32("fid")
	d.u8("type")
	start := d.u64("start")
	length := d.u64("length")
	pid := d.u32("proc_id")
	client := d.str("client_id", math.MaxUint16)
	if err := d.end(); err != nil {
		return err
	}
	if _, err := s.getFileFid(f); err != nil {
		return err
	}
	// No other client holds a lock: the range is free.
	e.u8(lockTypeUnlock)
	e.u64(start)
	e.u64(length)
	e.u32(pid)
	e.str(client)
	return nil
}

// flush answers Tflush once the request with oldtag, if one is in flight,
// has been answered. The flushed request's context is cancelled, so that a
// read blocked on a fetch gives up.
func (s *Server) flush(ctx context.Context, tag uint16, d *decoder) error {
	old := d.u16("oldtag")
	if err := d.end(); err != nil {
		return err
	}
	if old == tag {
		return nil
	}
	s.flightMu.Lock()
	c := s.inflight[old]
	s.flightMu.Unlock()
	if c == nil {
		return nil
	}
	c.cancel()
	select {
	case <-c.done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("waiting for tag %d to finish: %w", old, ctx.Err())
	}
}
