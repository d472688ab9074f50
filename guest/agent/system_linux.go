package agent

import (
	"encoding/binary"
	"fmt"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// System is what the snapshot hooks change in the guest. The agent uses
// [LinuxSystem]; tests inject a fake so that they leave the host alone.
type System interface {
	// Sync flushes every filesystem (sync(2)).
	Sync() error
	// DropCaches drops the page cache, dentries and inodes.
	DropCaches() error
	// AddEntropy mixes b into the kernel's entropy pool; credited says
	// whether the kernel also counted it as entropy.
	AddEntropy(b []byte) (credited bool, err error)
	// SetClock sets CLOCK_REALTIME.
	SetClock(t time.Time) error
	// SetHostname sets the kernel's host name (sethostname(2)).
	SetHostname(name string) error
}

// LinuxSystem returns the System of the running kernel.
func LinuxSystem() System { return linuxSystem{} }

type linuxSystem struct{}

func (linuxSystem) Sync() error {
	unix.Sync()
	return nil
}

func (linuxSystem) DropCaches() error {
	f, err := os.OpenFile("/proc/sys/vm/drop_caches", os.O_WRONLY, 0)
	if err != nil {
		return fmt.Errorf("dropping caches: %w", err)
	}
	defer f.Close()
	if _, err := f.WriteString("3\n"); err != nil {
		return fmt.Errorf("dropping caches: %w", err)
	}
	return nil
}

// AddEntropy credits b with RNDADDENTROPY (which needs CAP_SYS_ADMIN) and
// falls back to writing b to /dev/urandom, which mixes it in uncredited.
func (linuxSystem) AddEntropy(b []byte) (bool, error) {
	f, err := os.OpenFile("/dev/urandom", os.O_WRONLY, 0)
	if err != nil {
		return false, fmt.Errorf("opening /dev/urandom: %w", err)
	}
	defer f.Close()
	ierr := addEntropyIoctl(int(f.Fd()), randPoolInfo(b))
	if ierr == nil {
		return true, nil
	}
	if _, err := f.Write(b); err != nil {
		return false, fmt.Errorf("RNDADDENTROPY: %v; writing /dev/urandom: %w", ierr, err)
	}
	return false, nil
}

func (linuxSystem) SetClock(t time.Time) error {
	ts := unix.NsecToTimespec(t.UnixNano())
	if err := unix.ClockSettime(unix.CLOCK_REALTIME, &ts); err != nil {
		return fmt.Errorf("clock_settime(CLOCK_REALTIME, %s): %w", t.UTC().Format(time.RFC3339Nano), err)
	}
	return nil
}

func (linuxSystem) SetHostname(name string) error {
	if err := unix.Sethostname([]byte(name)); err != nil {
		return fmt.Errorf("sethostname(%q): %w", name, err)
	}
	return nil
}

// randPoolInfo lays out struct rand_pool_info { int entropy_count; int
// buf_size; __u32 buf[]; } for b, crediting 8 bits per byte. The buffer is
// padded to whole __u32s.
func randPoolInfo(b []byte) []byte {
	words := (len(b) + 3) / 4
	out := make([]byte, 8+4*words)
	binary.NativeEndian.PutUint32(out[0:], uint32(8*len(b)))
	binary.NativeEndian.PutUint32(out[4:], uint32(len(b)))
	copy(out[8:], b)
	return out
}

// writeOOMScoreAdj sets the process's own oom_score_adj.
func writeOOMScoreAdj(v int) error {
	f, err := os.OpenFile("/proc/self/oom_score_adj", os.O_WRONLY, 0)
	if err != nil {
		return fmt.Errorf("setting oom_score_adj: %w", err)
	}
	defer f.Close()
	if _, err := fmt.Fprintf(f, "%d\n", v); err != nil {
		return fmt.Errorf("setting oom_score_adj to %d: %w", v, err)
	}
	return nil
}
