package kilnpb

import "io/fs"

// A FileInfo's mode is a Unix st_mode: its type bits and its permission
// bits. FileMode and StMode convert it to and from an fs.FileMode, for the
// server (which has the guest's fs.FileMode) and its clients (envd, kiln).

// The st_mode bits (as in Linux's <sys/stat.h>, written here so that the
// package builds on any host).
const (
	sIFMT   = 0o170000
	sIFSOCK = 0o140000
	sIFLNK  = 0o120000
	sIFREG  = 0o100000
	sIFBLK  = 0o060000
	sIFDIR  = 0o040000
	sIFCHR  = 0o020000
	sIFIFO  = 0o010000
	sISUID  = 0o4000
	sISGID  = 0o2000
	sISVTX  = 0o1000
)

// FileMode converts a Unix st_mode to an fs.FileMode.
func FileMode(st uint32) fs.FileMode {
	m := fs.FileMode(st & 0o777)
	switch st & sIFMT {
	case sIFDIR:
		m |= fs.ModeDir
	case sIFLNK:
		m |= fs.ModeSymlink
	case sIFSOCK:
		m |= fs.ModeSocket
	case sIFBLK:
		m |= fs.ModeDevice
	case sIFCHR:
		m |= fs.ModeDevice | fs.ModeCharDevice
	case sIFIFO:
		m |= fs.ModeNamedPipe
	case sIFREG:
	default:
		m |= fs.ModeIrregular
	}
	if st&sISUID != 0 {
		m |= fs.ModeSetuid
	}
	if st&sISGID != 0 {
		m |= fs.ModeSetgid
	}
	if st&sISVTX != 0 {
		m |= fs.ModeSticky
	}
	return m
}

// StMode converts an fs.FileMode to a Unix st_mode.
func StMode(m fs.FileMode) uint32 {
	st := uint32(m.Perm())
	switch {
	case m&fs.ModeDir != 0:
		st |= sIFDIR
	case m&fs.ModeSymlink != 0:
		st |= sIFLNK
	case m&fs.ModeSocket != 0:
		st |= sIFSOCK
	case m&fs.ModeNamedPipe != 0:
		st |= sIFIFO
	case m&fs.ModeCharDevice != 0:
		st |= sIFCHR
	case m&fs.ModeDevice != 0:
		st |= sIFBLK
	case m&fs.ModeIrregular == 0:
		st |= sIFREG
	}
	if m&fs.ModeSetuid != 0 {
		st |= sISUID
	}
	if m&fs.ModeSetgid != 0 {
		st |= sISGID
	}
	if m&fs.ModeSticky != 0 {
		st |= sISVTX
	}
	return st
}
