package agent

import (
	"fmt"
	"os"
	"strconv"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/guest/agentpb"
)

// openPty opens a new pseudo-terminal of size: the agent's end
// (non-blocking, so that reads take deadlines and a close ends them) and
// the process's. It opens the devices itself rather than through
// creack/pty, whose ioctls take the descriptor out of the poller.
func openPty(size *agentpb.PtySize) (master, slave *os.File, err error) {
	fd, err := unix.Open("/dev/ptmx", unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		fd, err = unix.Open("/dev/pts/ptmx", unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	}
	if err != nil {
		return nil, nil, fmt.Errorf("opening /dev/ptmx: %w", err)
	}
	fail := func(what string, err error) (*os.File, *os.File, error) {
		unix.Close(fd)
		return nil, nil, fmt.Errorf("%s: %w", what, err)
	}
	n, err := unix.IoctlGetInt(fd, unix.TIOCGPTN)
	if err != nil {
		return fail("TIOCGPTN", err)
	}
	if err := unix.IoctlSetPointerInt(fd, unix.TIOCSPTLCK, 0); err != nil {
		return fail("unlocking the terminal", err)
	}
	if err := unix.IoctlSetWinsize(fd, unix.TIOCSWINSZ, winsize(size)); err != nil {
		return fail("setting the window size", err)
	}
	name := "/dev/pts/" + strconv.Itoa(n)
	sfd, err := unix.Open(name, unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fail("opening "+name, err)
	}
	return os.NewFile(uintptr(fd), "/dev/ptmx"), os.NewFile(uintptr(sfd), name), nil
}

func winsize(size *agentpb.PtySize) *unix.Winsize {
	return &unix.Winsize{Row: uint16(size.GetRows()), Col: uint16(size.GetCols())}
}

// resizePty sets the window size of the terminal whose agent's end is
// master; the kernel sends SIGWINCH to its foreground process group.
func resizePty(master *os.File, size *agentpb.PtySize) error {
	rc, err := master.SyscallConn()
	if err != nil {
		return err
	}
	var ierr error
	if err := rc.Control(func(fd uintptr) { ierr = unix.IoctlSetWinsize(int(fd), unix.TIOCSWINSZ, winsize(size)) }); err != nil {
		return err
	}
	return ierr
}
