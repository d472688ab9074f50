package memory

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// freezeWindow is how much of the mapping the freeze copy classifies at a
// time; it also bounds every read and write it issues.
const freezeWindow = 4 << 20

// Bits of a /proc/self/pagemap entry (Documentation/admin-guide/mm/pagemap.rst).
const (
	pmFile    = 1 << 61 // file page or shared anonymous page
	pmSwapped = 1 << 62
	pmPresent = 1 << 63
)

// freezeOptions turn off the fast path, so that tests can check it against
// the path it falls back to.
type freezeOptions struct {
	noPagemap bool // scan every page of the mapping
}

// freezeStats tells what one copy into a base file did.
type freezeStats struct {
	pagemap    bool  // pagemap told written pages from untouched ones
	scanned    int64 // bytes of the mapping read to find non-zero pages
	fromMemory int64 // bytes written from the mapping
	fileRead   int64 // bytes read from the backing file's data
	fromFile   int64 // bytes of it written (not zero, not written over)
}

// copyToBase sizes the empty file dst to the memory's size and fills it with
// the memory's current contents, leaving holes where they are zero. Memory
// mapped copy-on-write over a file holds two kinds of pages: ones the guest
// never wrote, which read as the file does, and anonymous ones the guest
// wrote. /proc/self/pagemap tells them apart, so the first are copied from
// the file's data extents (never faulting the mapping in) and only the
// others are read from the mapping. Anonymous memory is read only where
// pages exist. Without a usable pagemap every page is read.
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
		cp = &fileCopier{src: m.fd, dst: dst}
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
		// The file's data, but for the pages the guest wrote.
		wrote := func(off int64) bool { return written(flags[(off-w)/pageSize]) }
		for off := w; ext != nil && off < end; {
			start, stop, err := ext.within(off, end)
			if err != nil {
				return st, err
			}
			if start == stop {
				break
			}
			read, n, err := cp.copy(start, stop, wrote)
			st.fileRead += read
			st.fromFile += n
			if err != nil {
				return st, err
			}
			off = stop
		}
		// The pages the guest wrote.
		run := int64(-1)
		for p := w; p <= end; p += pageSize {
			if p < end && written(flags[(p-w)/pageSize]) {
				if run < 0 {
					run = p
				}
				continue
			}
			if run >= 0 {
				if err := m.writeNonZero(dst, run, p, &st); err != nil {
					return st, err
				}
				run = -1
			}
		}
	}
	return st, nil
}

// written reports whether a page's pagemap entry shows one the guest wrote:
// present or swapped, and not the file's. (A swapped file page is one being
// migrated.) Pages never touched, only read, or written and then dropped
// (MADV_DONTNEED) read as the file does (or as zeros, without one).
func written(entry uint64) bool {
	return entry&(pmPresent|pmSwapped) != 0 && entry&pmFile == 0
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

// pageRuns calls fn with each maximal run [start, end) of b's pages that
// are all zeros or all not, in order.
func pageRuns(b []byte, fn func(start, end int, zero bool) error) error {
	run, runZero := 0, false
	for p := 0; p < len(b); p += pageSize {
		end := min(p+pageSize, len(b))
		zero := bytes.Equal(b[p:end], zeroPage[:end-p])
		if p > run && zero != runZero {
			if err := fn(run, p, runZero); err != nil {
				return err
			}
			run = p
		}
		runZero = zero
	}
	if len(b) > run {
		return fn(run, len(b), runZero)
	}
	return nil
}

// writeNonZero writes the pages of b that are not all zeros to fd at off,
// one write per run of consecutive such pages, and returns the bytes
// written.
func writeNonZero(fd int, b []byte, off int64) (int64, error) {
	var written int64
	err := pageRuns(b, func(start, end int, zero bool) error {
		if zero {
			return nil
		}
		if err := pwriteAll(fd, b[start:end], off+int64(start)); err != nil {
			return err
		}
		written += int64(end - start)
		return nil
	})
	return written, err
}

// pwriteAll writes all of b to fd at off.
func pwriteAll(fd int, b []byte, off int64) error {
	for len(b) > 0 {
		n, err := unix.Pwrite(fd, b, off)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		if n == 0 {
			return io.ErrShortWrite
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
	start, end int64 // the extent last looked at; [0, 0) before
}

// within returns the first range of file data in [off, end), or an empty
// range if there is none. Calls must come with ascending offsets.
func (e *extents) within(off, end int64) (int64, int64, error) {
	if off >= e.end {
		if err := e.next(off); err != nil {
			return 0, 0, err
		}
	}
	start := max(e.start, off)
	if start >= end {
		return 0, 0, nil
	}
	return start, min(e.end, end), nil
}

// next finds the first data extent that ends after off.
func (e *extents) next(off int64) error {
	start, err := unix.Seek(e.fd, off, unix.SEEK_DATA)
	switch {
	case err == unix.ENXIO: // no data from off on
		e.start, e.end = e.size, e.size
		return nil
	case err == unix.EINVAL || err == unix.EOPNOTSUPP:
		// The file system cannot tell holes: take it all for data (the
		// copy still leaves its zero pages holes).
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

// fileCopier copies byte ranges of one file to the same offsets of another
// through a buffer, leaving pages that read as zeros holes. (A copy in the
// kernel, sendfile or copy_file_range, saves little over it and would
// allocate every zero page the file holds as data: in a base memfd, each
// page a guest only read; in a file on a file system that cannot tell
// holes, such as 9p, all of them.)
type fileCopier struct {
	src, dst int
	buf      []byte
}

// copy copies [start, end) but for the pages at offsets skip reports, and
// returns the bytes read and written.
func (c *fileCopier) copy(start, end int64, skip func(off int64) bool) (read, written int64, err error) {
	if c.buf == nil {
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
				return read, written, fmt.Errorf("read the memory file at %#x: %w", start+int64(got), err)
			}
			if n == 0 {
				return read, written, fmt.Errorf("memory file ends at %#x, before the guest memory does", start+int64(got))
			}
			got += n
		}
		for p := 0; p < len(b); p += pageSize {
			if skip(start + int64(p)) {
				clear(b[p:min(p+pageSize, len(b))])
			}
		}
		n, err := writeNonZero(c.dst, b, start)
		read += int64(len(b))
		written += n
		if err != nil {
			return read, written, fmt.Errorf("write the base file at %#x: %w", start, err)
		}
		start += int64(len(b))
	}
	return read, written, nil
}

// pagemap reads this process's /proc/self/pagemap entries for the mapping
// that starts at host.
type pagemap struct {
	f    *os.File
	host uintptr
	buf  []byte
}

// keptPagemap is /proc/self/pagemap opened by KeepPagemap, or nil.
var keptPagemap struct {
	sync.Mutex
	f *os.File
}

// KeepPagemap opens this process's /proc/self/pagemap now and keeps it for
// the copies Freeze makes later: a process about to lose its /proc (a VMM
// process entering its jail, package jail) calls it first. Without it,
// such a process's Freeze reads every page (correct, slower).
func KeepPagemap() error {
	f, err := os.Open("/proc/self/pagemap")
	if err != nil {
		return fmt.Errorf("memory: keep the pagemap: %w", err)
	}
	keptPagemap.Lock()
	defer keptPagemap.Unlock()
	if keptPagemap.f != nil {
		keptPagemap.f.Close()
	}
	keptPagemap.f = f
	return nil
}

// pagemapFile opens the pagemap: a duplicate of the kept one, else
// /proc/self/pagemap.
func pagemapFile() (*os.File, error) {
	keptPagemap.Lock()
	defer keptPagemap.Unlock()
	if keptPagemap.f == nil {
		return os.Open("/proc/self/pagemap")
	}
	fd, err := unix.FcntlInt(keptPagemap.f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), "pagemap"), nil
}

// openPagemap opens the pagemap and checks that it tells pages apart: a page
// just written must read as present. It fails where pagemap is missing or
// unreadable.
func openPagemap(host uintptr) (*pagemap, error) {
	f, err := pagemapFile()
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
