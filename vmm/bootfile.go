package vmm

import (
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// MaxKernelSize bounds the kernel file New reads (an uncompressed Debian
// vmlinux is about 70 MiB; a bzImage about 10).
const MaxKernelSize = 512 << 20

// readBootFile reads the regular file at path, of at most max bytes: a
// larger file, or one that is not a regular file (/dev/zero, a FIFO) is
// refused before it is read, with an error that names it and the limit.
// It never blocks on a FIFO: the open is non-blocking, and a FIFO is not
// a regular file (a kiln boot that waited on one ignored SIGINT).
func readBootFile(path string, max int64) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%s: not a regular file (%s)", path, fi.Mode().Type())
	}
	if fi.Size() > max {
		return nil, fmt.Errorf("%s: %d MiB, over the limit of %d MiB", path, (fi.Size()+(1<<20)-1)>>20, max>>20)
	}
	// The file may grow while it is read: read no more than the limit.
	data, err := io.ReadAll(io.LimitReader(f, max+1))
	if err != nil {
		return nil, err
	}
	if int64(len(data)) > max {
		return nil, fmt.Errorf("%s: grew over the limit of %d MiB while read", path, max>>20)
	}
	return data, nil
}
