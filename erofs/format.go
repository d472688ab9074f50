package erofs

import (
	"encoding/binary"

	"github.com/kilnvm/kiln/stmode"
)

// The on-disk format, as Linux's fs/erofs/erofs_fs.h has it (the parts
// that Linux 6.1 reads without any feature_incompat bit). All integers are
// little-endian.

const (
	blockBits = 12 // log2(BlockSize): sb.blkszbits

	superMagic  = 0xE0F5E1E2
	superOffset = 1024 // the superblock's byte offset in block 0
	superSize   = 128  // sb_extslots = 0

	// slotSize is the unit of a nid: an inode's byte offset is
	// meta_blkaddr*BlockSize + nid*slotSize (meta_blkaddr is 0 here).
	slotSize = 32

	inodeSize  = 64 // struct erofs_inode_extended
	direntSize = 12 // struct erofs_dirent

	xattrHeaderSize = 12 // struct erofs_xattr_ibody_header
	xattrEntrySize  = 4  // struct erofs_xattr_entry, before its name and value

	// maxXattrArea is the most bytes of inline xattrs that i_xattr_icount
	// (le16) can describe: the header and 65534 4-byte slots.
	maxXattrArea = xattrHeaderSize + 4*(0xFFFF-1)

	maxNameLen    = 255  // EROFS_NAME_LEN
	maxLinkLen    = 4095 // a symlink target (PATH_MAX less the NUL)
	maxXattrValue = 0xFFFF
	maxXattrName  = 255 // XATTR_NAME_MAX: a whole name, prefix included
)

// i_format: bit 0 is the inode version (1: extended), bits 1-3 the data
// layout.
const (
	formatExtended   = 1
	layoutFlatPlain  = 0 // EROFS_INODE_FLAT_PLAIN: data in consecutive blocks
	layoutFlatInline = 2 // EROFS_INODE_FLAT_INLINE: full blocks, then the tail after the inode
)

// File types of a dirent (EROFS_FT_*).
const (
	ftUnknown = 0
	ftReg     = 1
	ftDir     = 2
	ftChr     = 3
	ftBlk     = 4
	ftFifo    = 5
	ftSock    = 6
	ftSymlink = 7
)

// Mode bits (S_IF*), as i_mode holds them.
const (
	sIFMT   = stmode.IFMT
	sIFSOCK = stmode.IFSOCK
	sIFLNK  = stmode.IFLNK
	sIFREG  = stmode.IFREG
	sIFBLK  = stmode.IFBLK
	sIFDIR  = stmode.IFDIR
	sIFCHR  = stmode.IFCHR
	sIFIFO  = stmode.IFIFO
	// modeBits are the bits i_mode keeps beside the type: permissions,
	// setuid, setgid and sticky.
	modeBits = 0o7777
)

// Name indexes of inline xattrs (EROFS_XATTR_INDEX_*).
const (
	xattrIndexUser       = 1
	xattrIndexACLAccess  = 2
	xattrIndexACLDefault = 3
	xattrIndexTrusted    = 4
	xattrIndexSecurity   = 6
)

// fileType maps a mode's S_IFMT bits to a dirent's file type (0 for a type
// EROFS cannot hold).
func fileType(mode uint16) uint8 {
	switch mode & sIFMT {
	case sIFREG:
		return ftReg
	case sIFDIR:
		return ftDir
	case sIFCHR:
		return ftChr
	case sIFBLK:
		return ftBlk
	case sIFIFO:
		return ftFifo
	case sIFSOCK:
		return ftSock
	case sIFLNK:
		return ftSymlink
	}
	return ftUnknown
}

// superblock is what putSuper writes at superOffset.
type superblock struct {
	rootNid    uint16
	inos       uint64
	buildTime  uint64
	buildNsec  uint32
	blocks     uint32
	uuid       [16]byte
	volumeName string // at most 15 bytes: Linux wants a NUL within the 16
}

// putSuper writes sb into b (superSize bytes, zeroed). Checksum and
// feature_compat stay 0 (no SB_CHKSUM), meta_blkaddr and xattr_blkaddr 0
// (inodes from block 0, no shared xattrs), feature_incompat 0.
func putSuper(b []byte, sb *superblock) {
	le := binary.LittleEndian
	le.PutUint32(b[0:], superMagic)
	// 4: checksum, 8: feature_compat
	b[12] = blockBits
	// 13: sb_extslots
	le.PutUint16(b[14:], sb.rootNid)
	le.PutUint64(b[16:], sb.inos)
	le.PutUint64(b[24:], sb.buildTime)
	le.PutUint32(b[32:], sb.buildNsec)
	le.PutUint32(b[36:], sb.blocks)
	// 40: meta_blkaddr, 44: xattr_blkaddr
	copy(b[48:64], sb.uuid[:])
	copy(b[64:80], sb.volumeName)
	// 80: feature_incompat, then compression, devices, packed_nid: none
}

// inode is what putInode writes: one struct erofs_inode_extended.
type inode struct {
	format     uint16
	xattrCount uint16 // i_xattr_icount
	mode       uint16
	size       uint64
	u          uint32 // i_u: raw_blkaddr, or rdev for devices
	ino        uint32 // i_ino: only for 32-bit stat
	uid, gid   uint32
	mtime      uint64
	mtimeNsec  uint32
	nlink      uint32
}

// putInode writes in into b (inodeSize bytes, zeroed).
func putInode(b []byte, in *inode) {
	le := binary.LittleEndian
	le.PutUint16(b[0:], in.format)
	le.PutUint16(b[2:], in.xattrCount)
	le.PutUint16(b[4:], in.mode)
	// 6: i_reserved
	le.PutUint64(b[8:], in.size)
	le.PutUint32(b[16:], in.u)
	le.PutUint32(b[20:], in.ino)
	le.PutUint32(b[24:], in.uid)
	le.PutUint32(b[28:], in.gid)
	le.PutUint64(b[32:], in.mtime)
	le.PutUint32(b[40:], in.mtimeNsec)
	le.PutUint32(b[44:], in.nlink)
	// 48: i_reserved2[16]
}

// putDirent writes one struct erofs_dirent into b (direntSize bytes).
func putDirent(b []byte, nid uint64, nameoff uint16, ftype uint8) {
	le := binary.LittleEndian
	le.PutUint64(b[0:], nid)
	le.PutUint16(b[8:], nameoff)
	b[10] = ftype
	b[11] = 0
}

// xattrCount is i_xattr_icount for an inline xattr area of n bytes (the
// header included): 0 for none, else one for the header and one per
// further 4 bytes.
func xattrCount(n int) uint16 {
	if n == 0 {
		return 0
	}
	return uint16((n-xattrHeaderSize)/4 + 1)
}

// encodeDev is Linux's new_encode_dev: the 32-bit device number that
// i_u holds for character and block devices (major < 4096, minor < 2^20).
func encodeDev(major, minor uint32) uint32 {
	return minor&0xff | major<<8 | (minor&^0xff)<<12
}

// blocksOf is the number of BlockSize blocks n bytes take (n >= 0).
func blocksOf(n int64) int64 {
	q := n / BlockSize
	if n%BlockSize != 0 {
		q++
	}
	return q
}

// alignUp rounds n up to a multiple of a (a power of two).
func alignUp(n, a int64) int64 {
	return (n + a - 1) &^ (a - 1)
}
