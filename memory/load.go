package memory

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"

	"golang.org/x/sys/unix"
)

// LoadFile fills guest range [addr, addr+n) with the n bytes of f at
// offset off. The range must lie inside one region.
//
// Where the memory is its memfd's shared mapping in 4 KiB pages, the
// kernel moves the bytes from f's page cache into the memfd (sendfile
// into a second open file of the memfd, whose position is its own): each
// guest page is made
// by the write, so it is not zeroed first and then overwritten, and the
// VMM's page tables are not filled for a range only the guest reads. A
// loader of a 60 MiB kernel saves a zeroing of 60 MiB and 15,000 page
// faults. Elsewhere (memory in huge pages, where populating a 60 MiB
// kernel takes 30 faults and the guest's nested page faults on it go
// from 15,000 to 30; anonymous or copy-on-write memory; a kernel that
// refuses) it populates the range and reads f into the mapping.
//
// A short file is an error naming how much was read: the range is then
// partly filled.
func (m *Memory) LoadFile(f *os.File, off int64, addr, n uint64) error {
	return m.loadFile(f, off, addr, n, true)
}

// loadFile is LoadFile; send false takes the mapping path (for tests and
// benchmarks).
func (m *Memory) loadFile(f *os.File, off int64, addr, n uint64, send bool) error {
	dst, err := m.Slice(addr, n)
	if err != nil {
		return err
	}
	if n == 0 {
		return nil
	}
	if off < 0 {
		return fmt.Errorf("load at guest %#x: file offset %d", addr, off)
	}
	// Where pages made through the mapping are huge, the mapping path
	// makes them so (and KVM maps the kernel 2 MiB at a time); sendfile
	// would make 4 KiB pages, a nested page fault each when the guest
	// first runs or reads them.
	if send && m.fd >= 0 && !m.private && !m.huge {
		r := m.find(addr)
		done, err := sendToMemfd(m.fd, int64(r.Offset+addr-r.GuestAddr), f, off, int64(n))
		switch {
		case err == nil && done == int64(n):
			return nil
		case errors.Is(err, io.ErrUnexpectedEOF):
			return fmt.Errorf("load at guest %#x: %d of %d bytes at file offset %#x (did the file change?): %w", addr, done, n, off, err)
		}
		// Fall through: the kernel would not splice these files. The
		// mapping path below rewrites what was sent, which is harmless.
	}
	if err := m.Populate(addr, n); err != nil {
		return err
	}
	got, err := f.ReadAt(dst, off)
	if got < len(dst) {
		if err == nil || err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return fmt.Errorf("load at guest %#x: %d of %d bytes at file offset %#x (did the file change?): %w", addr, got, n, off, err)
	}
	return nil
}

// sendToMemfd copies n bytes of f at off into memfd at dstOff with
// sendfile, through a file of its own on the memfd (/proc/self/fd), so
// that no other user of memfd sees its position move. Holes of f (where
// its file system reports them: SEEK_HOLE) are not copied: the memfd's
// range there is punched instead, which reads as zeros and allocates
// nothing until the guest writes it. A kernel's .bss and scratch space
// are holes in an extracted vmlinux, nearly half of Debian's. It returns
// how much of the range it filled; io.ErrUnexpectedEOF when f ends first.
func sendToMemfd(memfd int, dstOff int64, f *os.File, off, n int64) (int64, error) {
	out, err := os.OpenFile("/proc/self/fd/"+strconv.Itoa(memfd), os.O_WRONLY, 0)
	if err != nil {
		return 0, err
	}
	defer out.Close()
	rc, err := f.SyscallConn()
	if err != nil {
		return 0, err
	}
	var done int64
	var serr error
	if err := rc.Read(func(in uintptr) bool {
		// Past the file's end SEEK_DATA finds no data, which is no hole:
		// fill what the file has, then report it short.
		var st unix.Stat_t
		if serr = unix.Fstat(int(in), &st); serr != nil {
			return true
		}
		have := min(n, max(st.Size-off, 0))
		// The data extents of [off, off+have) (extents, as Freeze walks
		// a memory file's); everything between them is a hole.
		e := extents{fd: int(in), size: off + have}
		for done < have && serr == nil {
			start, stop, err := e.within(off+done, off+have)
			if err != nil {
				serr = err
				break
			}
			if stop <= start {
				start, stop = off+have, off+have // no data left in the range
			}
			if k := start - (off + done); k > 0 {
				if err := unix.Fallocate(int(out.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, dstOff+done, k); err != nil {
					serr = err
					break
				}
				done += k
			}
			if stop > start {
				done, serr = sendRange(int(out.Fd()), dstOff, int(in), off, done, stop-off)
			}
		}
		if serr == nil && have < n {
			serr = io.ErrUnexpectedEOF
		}
		return true
	}); err != nil {
		return done, err
	}
	return done, serr
}

// sendRange sendfiles [off+done, off+upto) of in into out at dstOff+done
// and returns the new done.
func sendRange(out int, dstOff int64, in int, off, done, upto int64) (int64, error) {
	if _, err := unix.Seek(out, dstOff+done, io.SeekStart); err != nil {
		return done, err
	}
	for done < upto {
		pos := off + done
		k, err := unix.Sendfile(out, in, &pos, int(min(upto-done, 1<<30)))
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return done, err
		}
		if k == 0 {
			return done, io.ErrUnexpectedEOF
		}
		done += int64(k)
	}
	return done, nil
}
