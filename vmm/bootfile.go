package vmm

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// MaxKernelSize bounds the kernel file New reads (an uncompressed Debian
// vmlinux is about 70 MiB; a bzImage about 10).
const MaxKernelSize = 512 << 20

// openBootFile opens the regular file at path, of at most max bytes, and
// returns it with its size: a larger file, or one that is not a regular
// file (/dev/zero, a FIFO) is refused before it is read, with an error that
// names it and the limit. It never blocks on a FIFO: the open is
// non-blocking, and a FIFO is not a regular file (a kiln boot that waited
// on one ignored SIGINT).
func openBootFile(path string, max int64) (*os.File, int64, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, 0, err
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, 0, err
	}
	if !fi.Mode().IsRegular() {
		f.Close()
		return nil, 0, fmt.Errorf("%s: not a regular file (%s)", path, fi.Mode().Type())
	}
	if fi.Size() > max {
		f.Close()
		return nil, 0, fmt.Errorf("%s: %d MiB, over the limit of %d MiB", path, (fi.Size()+(1<<20)-1)>>20, max>>20)
	}
	return f, fi.Size(), nil
}
