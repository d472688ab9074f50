package memory

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// freezeWindow is how much of the mapping the freeze copy classifies at a
// time; it also bounds every read, write and copy_file_range it issues.
const freezeWindow = 4 << 20

// Bits of a /proc/self/pagemap entry (Documentation/admin-guide/mm/pagemap.rst).
const (
	pmFile    = 1 << 61 // file page or shared anonymous page
	pmSwapped = 1 << 62
	pmPresent = 1 << 63
)

// pageSource is where a page of the base file comes from.
type pageSource uint8

const (
	fromNothing pageSource = iota // a hole: the page reads as zeros
	fromFile                      // the backing file holds the page's contents
	fromMemory                    // only the mapping holds them
)

// freezeOptions turn off the fast paths, so that tests can check them
// against the paths they fall back to.
type freezeOptions struct {
	noPagemap       bool // scan every page of the mapping
	noCopyFileRange bool // copy file data with pread and pwrite
}

// freezeStats tells what one copy into a base file did.
type freezeStats struct {
	pagemap    bool  // pagemap told written pages from untouched ones
	spliced    bool  // copy_file_range moved file data in the kernel
	scanned    int64 // bytes of the mapping read to find non-zero pages
	fromMemory int64 // bytes written from the mapping
	fromFile   int64 // bytes copied from the backing file
}

// copyToBase sizes the empty file dst to the memory's size and fills it with
// the memory's current contents, leaving holes where they are zero. Memory
// mapped copy-on-write over a file holds two kinds of pages: ones the guest
// never wrote, which read as the file does, and anonymous ones the guest
// wrote. /proc/self/pagemap tells them apart, so the file's data extents are
// copied file to file (never faulting the mapping in) and only the
// anonymous pages are read from the mapping. Anonymous memory is read only
// where pages exist. Without a usable pagemap every page is read.
func (m *Memory) copyToBase(dst int, opts freezeOptions) (freezeStats, error) {
	var st freezeStats
	size := int64(len(m.host))
	if err := unix.Ftruncate(dst, size); err != nil {
		return st, fmt.Errorf("size the base file to %d bytes: %w", size, err)
	}
	var pm *pagemap
	if !opts.noPagemap {
		// An unreadable pagemap (an older or confined kernel) only costs speed.
		pm, _ = openPagemap(m.hostStart())
	}
	if pm != nil {
		defer pm.close()
		st.pagemap = true
	}
	var ext *extents
	var cp *fileCopier
	if m.fd >= 0 {
		ext = &extents{fd: m.fd, size: size}
		cp = &fileCopier{src: m.fd, dst: dst, noSplice: opts.noCopyFileRange}
	}
	flags := make([]uint64, freezeWindow/pageSize)
	for w := int64(0); w < size; w += freezeWindow {
		end := min(w+freezeWindow, size)
		if pm != nil {
			if err := pm.read(flags[:(end-w)/pageSize], w); err != nil {
				// Safe to carry on without it: everything from here on is
				// read from the mapping, which always holds the truth.
				pm.close()
				pm = nil
			}
		}
		if pm == nil {
			if err := m.writeNonZero(dst, w, end, &st); err != nil {
				return st, err
			}
			continue
		}
		src, run := fromNothing, w
		for p := w; p < end; p += pageSize {
			s, err := classify(flags[(p-w)/pageSize], ext, p)
			if err != nil {
				return st, err
			}
			if s != src {
				if err := m.copyRun(src, dst, run, p, cp, &st); err != nil {
					return st, err
				}
				src, run = s, p
			}
		}
		if err := m.copyRun(src, dst, run, end, cp, &st); err != nil {
			return st, err
		}
	}
	if cp != nil {
		st.spliced = cp.spliced
	}
	return st, nil
}

// classify tells where the base's page at off comes from, given its pagemap
// entry and, for memory over a file, the file's data extents.
func classify(entry uint64, ext *extents, off int64) (pageSource, error) {
	// A present or swapped page that is not the file's is one the guest
	// wrote. (A swapped file page is one being migrated.)
	if entry&(pmPresent|pmSwapped) != 0 && entry&pmFile == 0 {
		return fromMemory, nil
	}
	if ext == nil {
		// Anonymous memory: a page never touched reads as zeros.
		return fromNothing, nil
	}
	// Never touched, only read, or written and then dropped: the page reads
	// as the file does.
	data, err := ext.data(off)
	if err != nil {
		return 0, err
	}
	if data {
		return fromFile, nil
	}
	return fromNothing, nil
}

// copyRun copies the base's bytes [start, end), all from src.
func (m *Memory) copyRun(src pageSource, dst int, start, end int64, cp *fileCopier, st *freezeStats) error {
	if start == end {
		return nil
	}
	switch src {
	case fromMemory:
		return m.writeNonZero(dst, start, end, st)
	case fromFile:
		n, err := cp.copy(start, end)
		st.fromFile += n
		return err
	}
	return nil
}

// writeNonZero writes the mapping's pages in [start, end) that are not all
// zeros to dst at the same offsets, one write per run of them.
func (m *Memory) writeNonZero(dst int, start, end int64, st *freezeStats) error {
	st.scanned += end - start
	n, err := writeNonZero(dst, m.host[start:end], start)
	st.fromMemory += n
	if err != nil {
		return fmt.Errorf("copy guest memory at %#x into the base file: %w", start, err)
	}
	return nil
}

var zeroPage [pageSize]byte

// writeNonZero writes the pages of b that are not all zeros to fd at off,
// one write per run of consecutive such pages, and returns the bytes
// written.
func writeNonZero(fd int, b []byte, off int64) (int64, error) {
	var written int64
	run := 0 // start of the pending run of non-zero pages
	for p := 0; p <= len(b); p += pageSize {
		if p < len(b) && !bytes.Equal(b[p:min(p+pageSize, len(b))], zeroPage[:min(pageSize, len(b)-p)]) {
			continue
		}
		if p > run {
			if err := pwriteAll(fd, b[run:p], off+int64(run)); err != nil {
				return written, err
			}
			written += int64(p - run)
		}
		run = p + pageSize
	}
	return written, nil
}

func pwriteAll(fd int, b []byte, off int64) error {
	for len(b) > 0 {
		n, err := unix.Pwrite(fd, b, off)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		b, off = b[n:], off+int64(n)
	}
	return nil
}

// extents walks a file's data extents (SEEK_DATA/SEEK_HOLE) in ascending
// order, widened to whole pages.
type extents struct {
	fd         int
	size       int64 // the part of the file that matters
	start, end int64 // the extent data last looked at; [0, 0) before
}

// data reports whether the page at off holds file data rather than a hole.
// Calls must come with ascending offsets.
func (e *extents) data(off int64) (bool, error) {
	if off >= e.end {
		if err := e.next(off); err != nil {
			return false, err
		}
	}
	return off >= e.start, nil
}

// next finds the first data extent that ends after off.
func (e *extents) next(off int64) error {
	start, err := unix.Seek(e.fd, off, unix.SEEK_DATA)
	switch {
	case err == unix.ENXIO: // no data from off on
		e.start, e.end = e.size, e.size
		return nil
	case err == unix.EINVAL || err == unix.EOPNOTSUPP:
		// The file system cannot tell holes: take it all for data.
		e.start, e.end = off, e.size
		return nil
	case err != nil:
		return fmt.Errorf("find data in the memory file from %#x: %w", off, err)
	}
	end, err := unix.Seek(e.fd, start, unix.SEEK_HOLE)
	if err != nil {
		return fmt.Errorf("find the end of the memory file's data at %#x: %w", start, err)
	}
	e.start = min(start&^(pageSize-1), e.size)
	e.end = min((end+pageSize-1)&^(pageSize-1), e.size)
	if e.end <= off {
		// Cannot be (the extent holds start >= off), but never spin on it.
		e.start, e.end = off, e.size
	}
	return nil
}

// fileCopier copies byte ranges from one file to the same offsets of
// another: with copy_file_range while that works between the two, else
// through a buffer, leaving zero pages as holes.
type fileCopier struct {
	src, dst int
	noSplice bool // copy_file_range is off or failed
	spliced  bool // copy_file_range moved data
	buf      []byte
}

// copy copies [start, end) and returns the bytes moved.
func (c *fileCopier) copy(start, end int64) (int64, error) {
	var moved int64
	for !c.noSplice && start < end {
		roff, woff := start, start
		n, err := unix.CopyFileRange(c.src, &roff, c.dst, &woff, int(end-start), 0)
		switch {
		case err == unix.EINTR:
			continue
		case errors.Is(err, unix.EXDEV), errors.Is(err, unix.EINVAL), errors.Is(err, unix.ENOSYS),
			errors.Is(err, unix.EOPNOTSUPP), errors.Is(err, unix.EPERM):
			// Not between these files (another file system, an older kernel).
			c.noSplice = true
		case err != nil:
			return moved, fmt.Errorf("copy_file_range %#x+%#x from the memory file: %w", start, end-start, err)
		case n == 0:
			return moved, fmt.Errorf("memory file ends at %#x, before the guest memory does", start)
		default:
			c.spliced = true
			start += int64(n)
			moved += int64(n)
		}
	}
	if c.buf == nil && start < end {
		c.buf = make([]byte, freezeWindow)
	}
	for start < end {
		b := c.buf[:min(end-start, int64(len(c.buf)))]
		for got := 0; got < len(b); {
			n, err := unix.Pread(c.src, b[got:], start+int64(got))
			if err == unix.EINTR {
				continue
			}
			if err != nil {
				return moved, fmt.Errorf("read the memory file at %#x: %w", start+int64(got), err)
			}
			if n == 0 {
				return moved, fmt.Errorf("memory file ends at %#x, before the guest memory does", start+int64(got))
			}
			got += n
		}
		if _, err := writeNonZero(c.dst, b, start); err != nil {
			return moved, fmt.Errorf("write the base file at %#x: %w", start, err)
		}
		start += int64(len(b))
		moved += int64(len(b))
	}
	return moved, nil
}

// pagemap reads this process's /proc/self/pagemap entries for the mapping
// that starts at host.
type pagemap struct {
	f    *os.File
	host uintptr
	buf  []byte
}

// openPagemap opens the pagemap and checks that it tells pages apart: a page
// just written must read as present. It fails where pagemap is missing or
// unreadable.
func openPagemap(host uintptr) (*pagemap, error) {
	f, err := os.Open("/proc/self/pagemap")
	if err != nil {
		return nil, fmt.Errorf("open pagemap: %w", err)
	}
	pm := &pagemap{f: f, host: host, buf: make([]byte, 8*freezeWindow/pageSize)}
	pm.buf[0] = 1
	var probe [8]byte
	if _, err := f.ReadAt(probe[:], int64(addrOf(pm.buf)/pageSize*8)); err != nil {
		f.Close()
		return nil, fmt.Errorf("read pagemap: %w", err)
	}
	if binary.NativeEndian.Uint64(probe[:])&(pmPresent|pmSwapped) == 0 {
		f.Close()
		return nil, errors.New("pagemap shows a page just written as absent")
	}
	return pm, nil
}

// read fills flags with the entries of the pages from offset off of the
// mapping on.
func (pm *pagemap) read(flags []uint64, off int64) error {
	b := pm.buf[:8*len(flags)]
	if _, err := pm.f.ReadAt(b, int64((pm.host+uintptr(off))/pageSize*8)); err != nil {
		return fmt.Errorf("read pagemap: %w", err)
	}
	for i := range flags {
		flags[i] = binary.NativeEndian.Uint64(b[8*i:])
	}
	return nil
}

func (pm *pagemap) close() { pm.f.Close() }
