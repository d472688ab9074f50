package memory

import (
	"fmt"
	"io"

	"golang.org/x/sys/unix"
)

// Seals is what a sealed memory image can no longer have done to it: be
// written (through write(2) or a shared writable mapping), shrunk, grown,
// or have its seals changed.
const Seals = unix.F_SEAL_WRITE | unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_SEAL

// NewSealed makes an immutable memory image: a memfd named name of size
// bytes, whose contents fill writes (through w, at offsets below size;
// what it does not write stays zeros, as holes), sealed with Seals once
// fill returns. Nothing, in this process or another that the descriptor
// is passed to, can change it after: a copy-on-write mapping of it
// (MapFile with private set) never sees a write or a truncation, as a
// mapping of a file on disk would. The caller owns the descriptor.
func NewSealed(name string, size int64, fill func(w io.WriterAt) error) (int, error) {
	if size <= 0 || size%pageSize != 0 {
		return -1, fmt.Errorf("sealed memory of %d bytes: want a positive multiple of %d", size, pageSize)
	}
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return -1, fmt.Errorf("memfd_create: %w", err)
	}
	if err := unix.Ftruncate(fd, size); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("size sealed memory to %d MiB: %w", size>>20, err)
	}
	if err := fill(&fdWriter{fd: fd, size: size}); err != nil {
		unix.Close(fd)
		return -1, err
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, Seals); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("seal memory: %w", err)
	}
	return fd, nil
}

// CheckSealed checks that fd is a memory image NewSealed made (of size
// bytes): a memfd with every one of Seals. A descriptor passed in from
// another process is checked so before it is mapped as guest memory.
func CheckSealed(fd int, size int64) error {
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return fmt.Errorf("memory image: not a sealable memfd: %w", err)
	}
	if seals&Seals != Seals {
		return fmt.Errorf("memory image has seals %#x, want %#x: it could still change", seals, Seals)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("memory image: %w", err)
	}
	if st.Size != size {
		return fmt.Errorf("memory image is %d bytes, want %d", st.Size, size)
	}
	return nil
}

// fdWriter writes to a descriptor at offsets below size.
type fdWriter struct {
	fd   int
	size int64
}

func (w *fdWriter) WriteAt(b []byte, off int64) (int, error) {
	if off < 0 || off > w.size || int64(len(b)) > w.size-off {
		return 0, fmt.Errorf("write of %d bytes at %d: outside the %d bytes of sealed memory", len(b), off, w.size)
	}
	n := 0
	for n < len(b) {
		m, err := unix.Pwrite(w.fd, b[n:], off+int64(n))
		if err != nil {
			if err == unix.EINTR {
				continue
			}
			return n, fmt.Errorf("write sealed memory: %w", err)
		}
		if m == 0 {
			return n, io.ErrShortWrite
		}
		n += m
	}
	return n, nil
}
