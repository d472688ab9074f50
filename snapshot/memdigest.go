package snapshot

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"hash"
	"io"
	"os"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/memory"
)

// pageHasher computes a memory image's digest: SHA-256 over each page
// that is not all zeros, in file order, as its offset (8 bytes, little
// endian) and then its bytes, and at the end the image's size. Pages of
// zeros (a sparse file's holes, or zeros written) do not count, so the
// digest is of the contents, however sparse the file is, and checking it
// reads only the file's data.
type pageHasher struct {
	h   hash.Hash
	buf [8]byte
}

func newPageHasher() *pageHasher { return &pageHasher{h: sha256.New()} }

// add adds the non-zero page at off; pages come in increasing offsets.
func (p *pageHasher) add(off int64, page []byte) {
	binary.LittleEndian.PutUint64(p.buf[:], uint64(off))
	p.h.Write(p.buf[:])
	p.h.Write(page)
}

// sum returns the digest of an image of size bytes, hex.
func (p *pageHasher) sum(size int64) string {
	binary.LittleEndian.PutUint64(p.buf[:], uint64(size))
	p.h.Write(p.buf[:])
	return hex.EncodeToString(p.h.Sum(nil))
}

// readChunk is how much of the memory file one read takes.
const readChunk = 1 << 20

// digestMemory streams the memory file f of size bytes (its data extents
// only: holes are not read) and returns its digest (pageHasher). When dst
// is set, each non-zero page is also written to it at its offset. It
// checks ctx between reads.
func digestMemory(ctx context.Context, f *os.File, size int64, dst io.WriterAt) (string, error) {
	ext, err := fileExtents(int(f.Fd()), 0, size)
	if err != nil {
		ext = []extent{{0, size}} // no SEEK_DATA here: read it all
	}
	h := newPageHasher()
	buf := make([]byte, readChunk)
	zero := make([]byte, pageSize)
	for _, e := range ext {
		for off := e.start; off < e.end; {
			if err := ctx.Err(); err != nil {
				return "", err
			}
			n := int(min(int64(len(buf)), e.end-off))
			if _, err := f.ReadAt(buf[:n], off); err != nil {
				return "", fmt.Errorf("read memory file at %#x: %w (it changed size while read?)", off, err)
			}
			run := 0 // start of the pending run of non-zero pages, for dst
			flush := func(end int) error {
				if dst != nil && end > run {
					if _, err := dst.WriteAt(buf[run:end], off+int64(run)); err != nil {
						return err
					}
				}
				return nil
			}
			for p := 0; p < n; p += pageSize {
				page := buf[p : p+pageSize]
				if bytes.Equal(page, zero) {
					if err := flush(p); err != nil {
						return "", err
					}
					run = p + pageSize
					continue
				}
				h.add(off+int64(p), page)
			}
			if err := flush(n); err != nil {
				return "", err
			}
			off += int64(n)
		}
	}
	return h.sum(size), nil
}

// Cache keeps what Load makes of a memory file it checked: the file's
// sealed copy (memory.NewSealed), by the file's identity (device, inode,
// size, modification and change times) and digest, so that the restores
// of one snapshot in a process read and copy its memory once and share
// the copy's pages (each maps it copy-on-write). It keeps the copies of
// the max files used last (each costs the memory file's data in RAM
// while kept; the VMs mapping a copy keep it whatever the Cache does). A
// Cache is safe for concurrent use; Close releases the copies it keeps
// (mappings made of them live on).
type Cache struct {
	mu      sync.Mutex
	max     int
	tick    uint64
	entries map[fileID]*cached
}

// DefaultCacheSize is how many copies NewCache(0) keeps.
const DefaultCacheSize = 8

// NewCache returns an empty Cache that keeps max copies (DefaultCacheSize
// when max <= 0).
func NewCache(max int) *Cache {
	if max <= 0 {
		max = DefaultCacheSize
	}
	return &Cache{max: max, entries: map[fileID]*cached{}}
}

// evict forgets the copies used least recently past c.max, with c.mu
// held; a copy still being made is kept.
func (c *Cache) evict() {
	for len(c.entries) > c.max {
		var oldest fileID
		var found bool
		var t uint64
		for id, e := range c.entries {
			if e.ready && (!found || e.used < t) {
				oldest, t, found = id, e.used, true
			}
		}
		if !found {
			return
		}
		if e := c.entries[oldest]; e.fd >= 0 {
			unix.Close(e.fd)
			e.fd = -1
		}
		delete(c.entries, oldest)
	}
}

type fileID struct {
	dev, ino     uint64
	size         int64
	mtime, ctime unix.Timespec
}

// cached is one memory file's sealed copy, made once.
type cached struct {
	once   sync.Once
	digest string // of the copy
	fd     int    // the sealed copy, -1 when making it failed
	err    error
	// used and ready are guarded by Cache.mu: when it was last handed
	// out, and whether once has run.
	used  uint64
	ready bool
}

// Close closes the sealed copies c keeps and forgets them.
func (c *Cache) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	for id, e := range c.entries {
		if e.ready && e.fd >= 0 {
			unix.Close(e.fd)
			e.fd = -1
		}
		delete(c.entries, id)
	}
	return nil
}

// Len returns how many sealed copies c keeps.
func (c *Cache) Len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.entries)
}

// sealedMemory returns a sealed copy (memory.NewSealed) of the memory
// file f of size bytes, whose digest must be want: from c when c has one
// of this file, else made now (and kept in c when c is set). The caller
// owns the returned descriptor.
func sealedMemory(ctx context.Context, c *Cache, f *os.File, size int64, want string) (int, error) {
	if c == nil {
		fd, _, err := makeSealed(ctx, f, size, want)
		return fd, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return -1, fmt.Errorf("memory file: %w", err)
	}
	id := fileID{dev: st.Dev, ino: st.Ino, size: st.Size, mtime: st.Mtim, ctime: st.Ctim}
	c.mu.Lock()
	e, ok := c.entries[id]
	if !ok {
		e = &cached{fd: -1}
		c.entries[id] = e
	}
	c.mu.Unlock()
	e.once.Do(func() {
		e.fd, e.digest, e.err = makeSealed(ctx, f, size, want)
	})
	c.mu.Lock()
	defer c.mu.Unlock()
	if e.err != nil {
		if c.entries[id] == e {
			delete(c.entries, id) // the next Load tries again
		}
		return -1, e.err
	}
	if e.digest != want {
		// The same file (by its identity) with another manifest: its
		// copy is not this snapshot's memory.
		return -1, fmt.Errorf("memory file: %w: its contents are not what the manifest says", ErrChecksum)
	}
	if c.entries[id] != e {
		// Evicted or dropped (Close) meanwhile.
		if e.fd >= 0 {
			unix.Close(e.fd)
			e.fd = -1
		}
		return -1, fmt.Errorf("memory file: its sealed copy was dropped from the cache as it was made; try again")
	}
	fd, err := unix.FcntlInt(uintptr(e.fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("memory file: dup its sealed copy: %w", err)
	}
	c.tick++
	e.used, e.ready = c.tick, true
	c.evict()
	return fd, nil
}

// makeSealed copies the memory file into a sealed memfd, checking its
// digest on the way: the copy is what was checked, whatever happens to
// the file after. It returns the copy and its digest.
func makeSealed(ctx context.Context, f *os.File, size int64, want string) (int, string, error) {
	var got string
	fd, err := memory.NewSealed("kiln-snapshot-memory", size, func(w io.WriterAt) error {
		var err error
		got, err = digestMemory(ctx, f, size, w)
		if err != nil {
			return fmt.Errorf("memory file: %w", err)
		}
		if got != want {
			return fmt.Errorf("memory file: %w: its contents are not what the manifest says", ErrChecksum)
		}
		return nil
	})
	if err != nil {
		return -1, "", err
	}
	return fd, got, nil
}
