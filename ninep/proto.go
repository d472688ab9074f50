package ninep

import (
	"encoding/binary"
	"errors"
	"fmt"

	"golang.org/x/sys/unix"
)

// Message types of 9P2000.L (Linux include/net/9p/9p.h). A T-message's
// reply is its type plus one.
const (
	tlerror      = 6
	rlerror      = 7
	tstatfs      = 8
	tlopen       = 12
	tlcreate     = 14
	tsymlink     = 16
	tmknod       = 18
	trename      = 20
	treadlink    = 22
	tgetattr     = 24
	tsetattr     = 26
	txattrwalk   = 30
	txattrcreate = 32
	treaddir     = 40
	tfsync       = 50
	tlock        = 52
	tgetlock     = 54
	tlink        = 70
	tmkdir       = 72
	trenameat    = 74
	tunlinkat    = 76
	tversion     = 100
	tauth        = 102
	tattach      = 104
	tflush       = 108
	twalk        = 110
	tread        = 116
	twrite       = 118
	tclunk       = 120
	tremove      = 122
)

// Protocol constants.
const (
	// NoTag is the tag of Tversion.
	NoTag = 0xffff
	// NoFid is the fid meaning "none" (Tattach's afid).
	NoFid = 0xffffffff

	// Version is the only protocol version the server speaks.
	Version = "9P2000.L"

	headerSize  = 7  // size[4] type[1] tag[2]
	rlerrorSize = 11 // header + ecode[4]
	rreadHeader = 11 // header + count[4]
	qidSize     = 13 // type[1] version[4] path[8]
	// ioHeader is what Linux (P9_IOHDRSZ) keeps out of msize for the
	// largest I/O message's fixed part: iounit is msize minus it.
	ioHeader = 24
	// maxWalkNames is P9_MAXWELEM: the most names in one Twalk.
	maxWalkNames = 16
	// maxNameLen bounds one path element (NAME_MAX).
	maxNameLen = 255
	// maxXattrName and maxXattrSize are Linux's XATTR_NAME_MAX and
	// XATTR_SIZE_MAX (also XATTR_LIST_MAX).
	maxXattrName = 255
	maxXattrSize = 64 << 10
)

// qid types.
const (
	qtDir     = 0x80
	qtSymlink = 0x02
	qtFile    = 0x00
)

// Linux open flags as 9P2000.L carries them (P9_DOTL_*, which equal the
// x86 O_* values).
const (
	openAccMode   = 0o3
	openCreate    = 0o100
	openExcl      = 0o200
	openTrunc     = 0o1000
	openDirectory = 0o200000
)

// getattrBasic is P9_GETATTR_BASIC: mode, nlink, uid, gid, rdev, atime,
// mtime, ctime, ino, size and blocks are valid.
const getattrBasic = 0x7ff

// V9FSMagic is the filesystem type Rstatfs reports (V9FS_MAGIC).
const V9FSMagic = 0x01021997

// Lock replies.
const (
	lockSuccess    = 0
	lockTypeUnlock = 2
)

// errMalformed is wrapped by every decoding error: the guest sent a message
// that does not follow the protocol. The guest sees EINVAL.
var errMalformed = errors.New("malformed 9P message")

// decoder reads a T-message's fields in order. A read past the end sets
// err and returns zeros, so a handler reads all its fields and checks err
// once.
type decoder struct {
	b   []byte
	off int
	err error
}

func (d *decoder) need(n int, what string) bool {
	if d.err != nil {
		return false
	}
	if n > len(d.b)-d.off {
		d.err = fmt.Errorf("%s: %d bytes needed at offset %d of a %d-byte message: %w", what, n, d.off+headerSize, len(d.b)+headerSize, errMalformed)
		return false
	}
	return true
}

func (d *decoder) u8(what string) uint8 {
	if !d.need(1, what) {
		return 0
	}
	v := d.b[d.off]
	d.off++
	return v
}

func (d *decoder) u16(what string) uint16 {
	if !d.need(2, what) {
		return 0
	}
	v := binary.LittleEndian.Uint16(d.b[d.off:])
	d.off += 2
	return v
}

func (d *decoder) u32(what string) uint32 {
	if !d.need(4, what) {
		return 0
	}
	v := binary.LittleEndian.Uint32(d.b[d.off:])
	d.off += 4
	return v
}

func (d *decoder) u64(what string) uint64 {
	if !d.need(8, what) {
		return 0
	}
	v := binary.LittleEndian.Uint64(d.b[d.off:])
	d.off += 8
	return v
}

// str reads a string (len[2] then bytes) of at most max bytes; it copies,
// so the result does not alias the request (which may be guest memory).
func (d *decoder) str(what string, max int) string {
	n := int(d.u16(what + " length"))
	if d.err != nil {
		return ""
	}
	if n > max {
		d.err = fmt.Errorf("%s is %d bytes, at most %d allowed: %w", what, n, max, errMalformed)
		return ""
	}
	if !d.need(n, what) {
		return ""
	}
	s := string(d.b[d.off : d.off+n])
	d.off += n
	return s
}

// end reports a decoding error, or bytes left over after the last field.
func (d *decoder) end() error {
	if d.err != nil {
		return d.err
	}
	if d.off != len(d.b) {
		return fmt.Errorf("%d bytes after the last field: %w", len(d.b)-d.off, errMalformed)
	}
	return nil
}

// encoder writes an R-message's body into a buffer that already has room
// for the header. A write past the end sets full; the caller answers with
// an error instead.
type encoder struct {
	b    []byte
	n    int
	full bool
}

func (e *encoder) room(n int) bool {
	if e.full || n > len(e.b)-e.n {
		e.full = true
		return false
	}
	return true
}

func (e *encoder) u8(v uint8) {
	if e.room(1) {
		e.b[e.n] = v
		e.n++
	}
}

func (e *encoder) u16(v uint16) {
	if e.room(2) {
		binary.LittleEndian.PutUint16(e.b[e.n:], v)
		e.n += 2
	}
}

func (e *encoder) u32(v uint32) {
	if e.room(4) {
		binary.LittleEndian.PutUint32(e.b[e.n:], v)
		e.n += 4
	}
}

func (e *encoder) u64(v uint64) {
	if e.room(8) {
		binary.LittleEndian.PutUint64(e.b[e.n:], v)
		e.n += 8
	}
}

func (e *encoder) str(s string) {
	if len(s) > 0xffff {
		e.full = true
		return
	}
	if e.room(2 + len(s)) {
		binary.LittleEndian.PutUint16(e.b[e.n:], uint16(len(s)))
		copy(e.b[e.n+2:], s)
		e.n += 2 + len(s)
	}
}

func (e *encoder) qid(q qid) {
	if e.room(qidSize) {
		putQid(e.b[e.n:], q)
		e.n += qidSize
	}
}

// qid is a file's identity: its type, version 0 and its inode number.
type qid struct {
	typ  uint8
	path uint64
}

func putQid(b []byte, q qid) {
	b[0] = q.typ
	binary.LittleEndian.PutUint32(b[1:], 0)
	binary.LittleEndian.PutUint64(b[5:], q.path)
}

// qidOf returns the qid of inode ino of mode.
func qidOf(ino uint64, mode uint32) qid {
	switch mode & unix.S_IFMT {
	case unix.S_IFDIR:
		return qid{qtDir, ino}
	case unix.S_IFLNK:
		return qid{qtSymlink, ino}
	}
	return qid{qtFile, ino}
}

// direntType returns the DT_* value of a file type, as Linux's readdir
// expects in a 9P2000.L dirent.
func direntType(mode uint32) uint8 { return uint8((mode & unix.S_IFMT) >> 12) }

// putHeader writes size, type and tag at the start of b.
func putHeader(b []byte, size uint32, typ uint8, tag uint16) {
	binary.LittleEndian.PutUint32(b, size)
	b[4] = typ
	binary.LittleEndian.PutUint16(b[5:], tag)
}

// putRlerror writes an Rlerror into b (at least rlerrorSize bytes) and
// returns its length.
func putRlerror(b []byte, tag uint16, errno unix.Errno) int {
	putHeader(b, rlerrorSize, rlerror, tag)
	binary.LittleEndian.PutUint32(b[headerSize:], uint32(errno))
	return rlerrorSize
}

// msgName names a message type, for logs.
func msgName(t uint8) string {
	switch t {
	case tstatfs:
		return "Tstatfs"
	case tlopen:
		return "Tlopen"
	case tlcreate:
		return "Tlcreate"
	case tsymlink:
		return "Tsymlink"
	case tmknod:
		return "Tmknod"
	case trename:
		return "Trename"
	case treadlink:
		return "Treadlink"
	case tgetattr:
		return "Tgetattr"
	case tsetattr:
		return "Tsetattr"
	case txattrwalk:
		return "Txattrwalk"
	case txattrcreate:
		return "Txattrcreate"
	case treaddir:
		return "Treaddir"
	case tfsync:
		return "Tfsync"
	case tlock:
		return "Tlock"
	case tgetlock:
		return "Tgetlock"
	case tlink:
		return "Tlink"
	case tmkdir:
		return "Tmkdir"
	case trenameat:
		return "Trenameat"
	case tunlinkat:
		return "Tunlinkat"
	case tversion:
		return "Tversion"
	case tauth:
		return "Tauth"
	case tattach:
		return "Tattach"
	case tflush:
		return "Tflush"
	case twalk:
		return "Twalk"
	case tread:
		return "Tread"
	case twrite:
		return "Twrite"
	case tclunk:
		return "Tclunk"
	case tremove:
		return "Tremove"
	}
	return fmt.Sprintf("type %d", t)
}
