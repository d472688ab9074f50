package snapshot

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/memory"
)

// maxWriteRun bounds one write of consecutive non-zero pages.
const maxWriteRun = 1 << 20

// extent is a byte range [start, end) of the memory image.
type extent struct{ start, end int64 }

// writeMemory writes guest memory to path as the memory image: the regions
// one after another, sized in full, with only the pages that are not all
// zeros written (the rest are holes). It returns the bytes written and
// the image's digest (pageHasher).
func (s *saver) writeMemory(ctx context.Context, path string, mem *memory.Memory) (int64, string, error) {
	f, err := s.create(path)
	if err != nil {
		return 0, "", err
	}
	if err := f.Truncate(int64(mem.Size())); err != nil {
		f.Close()
		return 0, "", fmt.Errorf("size %s to %d bytes: %w", filepath.Base(path), mem.Size(), err)
	}
	h := newPageHasher()
	var written int64
	zero := make([]byte, pageSize)
	for i, r := range mem.Regions() {
		host := mem.Host(i)
		extents, err := s.dataExtents(mem, i)
		if err != nil {
			f.Close()
			return written, "", err
		}
		for _, e := range extents {
			n, err := writeNonZero(ctx, f, host[e.start:e.end], int64(r.Offset)+e.start, zero, h)
			written += n
			if err != nil {
				f.Close()
				return written, "", fmt.Errorf("write %s: %w", filepath.Base(path), err)
			}
		}
	}
	if err := closeSynced(f, path); err != nil {
		return written, "", err
	}
	return written, h.sum(int64(mem.Size())), nil
}

// writeNonZero writes the pages of b that are not all zeros at off, in runs
// of consecutive pages, and adds them to h (when set). It checks ctx
// between runs.
func writeNonZero(ctx context.Context, f file, b []byte, off int64, zero []byte, h *pageHasher) (int64, error) {
	var written int64
	flush := func(start, end int) error {
		if start == end {
			return nil
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		n, err := f.WriteAt(b[start:end], off+int64(start))
		written += int64(n)
		return err
	}
	run := 0 // start of the pending run of non-zero pages
	for p := 0; p < len(b); p += pageSize {
		end := min(p+pageSize, len(b))
		if bytes.Equal(b[p:end], zero[:end-p]) {
			if err := flush(run, p); err != nil {
				return written, err
			}
			run = end
			continue
		}
		if h != nil {
			h.add(off+int64(p), b[p:end])
		}
		if end-run >= maxWriteRun {
			if err := flush(run, end); err != nil {
				return written, err
			}
			run = end
		}
	}
	if err := flush(run, len(b)); err != nil {
		return written, err
	}
	return written, nil
}

// dataExtents returns the ranges of region i (as offsets into it) that may
// hold data. Guest memory mapped shared from its memfd (a VM that New
// built) is read only where the memfd has pages: SEEK_DATA/SEEK_HOLE skip
// what the guest never touched, which reading would allocate. Memory
// mapped otherwise (a restored VM's private mapping, whose written pages
// the file does not have) is read whole.
func (s *saver) dataExtents(mem *memory.Memory, i int) ([]extent, error) {
	r := mem.Regions()[i]
	whole := []extent{{0, int64(r.Size)}}
	fd := mem.FD()
	if fd < 0 {
		return whole, nil
	}
	if mem.Private() {
		return whole, nil
	}
	ext, err := fileExtents(fd, int64(r.Offset), int64(r.Size))
	if err != nil {
		s.log.Debug("snapshot: reading all of guest memory", "err", err)
		return whole, nil
	}
	return ext, nil
}

// fileExtents returns the data ranges of fd within [off, off+size), as
// offsets from off, page-aligned.
func fileExtents(fd int, off, size int64) ([]extent, error) {
	var out []extent
	end := off + size
	for pos := off; pos < end; {
		d, err := unix.Seek(fd, pos, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // no data past pos
		}
		if err != nil {
			return nil, fmt.Errorf("SEEK_DATA: %w", err)
		}
		if d >= end {
			break
		}
		h, err := unix.Seek(fd, d, unix.SEEK_HOLE)
		if err != nil {
			return nil, fmt.Errorf("SEEK_HOLE: %w", err)
		}
		h = min(h, end)
		if h <= d {
			return nil, fmt.Errorf("SEEK_HOLE at %d returned %d", d, h)
		}
		start := max(d&^(pageSize-1), off)
		stop := min((h+pageSize-1)&^(pageSize-1), end)
		if n := len(out); n > 0 && out[n-1].end >= start-off {
			out[n-1].end = stop - off
		} else {
			out = append(out, extent{start - off, stop - off})
		}
		pos = h
	}
	return out, nil
}
