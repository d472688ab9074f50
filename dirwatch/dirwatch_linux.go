package dirwatch

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// Op is what an event saw happen.
type Op int

// The operations.
const (
	Create Op = iota + 1 // created, or moved in
	Write
	Remove
	Rename // moved away
	Chmod  // attributes changed
)

// Event is one event of a watch.
type Event struct {
	// Started is the first event: the watch is in place.
	Started bool
	Op      Op
	// Name is the entry's path relative to the watched directory.
	Name string
	// Info is the entry's lstat, where it exists (never for Remove and
	// Rename).
	Info fs.FileInfo
}

// The errors a watch ends with (errors.Is finds them), beside its fn's
// (unwrapped) and an *fs.PathError for a directory it could not watch.
var (
	// ErrOverflow: the kernel's event queue overflowed; changes were
	// lost, and the caller may watch again.
	ErrOverflow = errors.New("the kernel's event queue overflowed (changes were lost)")
	// ErrTooManyDirs: a recursive watch reached its bound of directories.
	ErrTooManyDirs = errors.New("too many directories below it")
)

// watchMask is what a watched directory reports.
const watchMask = unix.IN_CREATE | unix.IN_MODIFY | unix.IN_DELETE | unix.IN_MOVED_FROM | unix.IN_MOVED_TO |
	unix.IN_ATTRIB | unix.IN_DELETE_SELF | unix.IN_MOVE_SELF | unix.IN_ONLYDIR | unix.IN_DONT_FOLLOW

// Watch watches the directory dir (absolute) until ctx ends (then it
// returns nil), dir goes away (nil), fn fails (its error) or the watch
// does: fn gets a Started event once the watch is in place, then one
// event per change. recursive watches the subdirectories too, those
// created later included, up to maxDirs directories in all; symlinks are
// not followed.
func Watch(ctx context.Context, dir string, recursive bool, maxDirs int, fn func(Event) error) error {
	err := watch(ctx, dir, recursive, maxDirs, fn)
	if errors.Is(err, errClosed) {
		return nil // ctx ended while a directory was added
	}
	return err
}

// errClosed: the inotify descriptor was closed, ctx having ended.
var errClosed = errors.New("closed")

func watch(ctx context.Context, dir string, recursive bool, maxDirs int, fn func(Event) error) error {
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK)
	if err != nil {
		return &fs.PathError{Op: "watch", Path: dir, Err: err}
	}
	f := os.NewFile(uintptr(fd), "inotify") // non-blocking: in the poller
	defer f.Close()
	stop := context.AfterFunc(ctx, func() { f.Close() })
	defer stop()
	w := &watcher{f: f, root: dir, recursive: recursive, maxDirs: maxDirs, dirs: map[int32]string{}, wds: map[string]int32{}}
	if err := w.add(""); err != nil {
		return err
	}
	if recursive {
		if err := w.addTree(""); err != nil {
			return err
		}
	}
	if err := fn(Event{Started: true}); err != nil {
		return err
	}
	buf := make([]byte, 64<<10)
	for {
		n, err := f.Read(buf)
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, os.ErrClosed) {
				return nil
			}
			return fmt.Errorf("watching %s: reading events: %v", dir, err)
		}
		evs, perr := parseInotify(buf[:n])
		for _, ev := range evs {
			done, err := w.handle(ev, fn)
			if err != nil || done {
				return err
			}
		}
		if perr != nil {
			return fmt.Errorf("watching %s: %v", dir, perr)
		}
	}
}

// inotifyEvent is one event of an inotify read.
type inotifyEvent struct {
	wd     int32
	mask   uint32
	cookie uint32
	name   string
}

// parseInotify parses what a read of an inotify descriptor returned:
// struct inotify_event records, each with its NUL-padded name.
func parseInotify(buf []byte) ([]inotifyEvent, error) {
	var out []inotifyEvent
	for len(buf) > 0 {
		if len(buf) < unix.SizeofInotifyEvent {
			return out, fmt.Errorf("inotify: %d bytes left, less than an event", len(buf))
		}
		n := binary.NativeEndian.Uint32(buf[12:16])
		if uint64(n) > uint64(len(buf)-unix.SizeofInotifyEvent) {
			return out, fmt.Errorf("inotify: a name of %d bytes with %d left", n, len(buf)-unix.SizeofInotifyEvent)
		}
		name := buf[unix.SizeofInotifyEvent : unix.SizeofInotifyEvent+int(n)]
		if i := strings.IndexByte(string(name), 0); i >= 0 {
			name = name[:i]
		}
		out = append(out, inotifyEvent{
			wd:     int32(binary.NativeEndian.Uint32(buf[0:4])),
			mask:   binary.NativeEndian.Uint32(buf[4:8]),
			cookie: binary.NativeEndian.Uint32(buf[8:12]),
			name:   string(name),
		})
		buf = buf[unix.SizeofInotifyEvent+int(n):]
	}
	return out, nil
}

// watcher is one Watch's state: the watched directories by watch
// descriptor and by path relative to the root ("" for the root).
type watcher struct {
	f         *os.File
	root      string
	recursive bool
	maxDirs   int
	dirs      map[int32]string
	wds       map[string]int32
}

// add watches the directory rel.
func (w *watcher) add(rel string) error {
	if _, ok := w.wds[rel]; ok {
		return nil
	}
	if len(w.dirs) >= w.maxDirs {
		return fmt.Errorf("watching %s: more than %d directories: %w", w.root, w.maxDirs, ErrTooManyDirs)
	}
	full := filepath.Join(w.root, rel)
	rc, err := w.f.SyscallConn()
	if err != nil {
		return errClosed
	}
	mask := uint32(watchMask)
	if rel == "" {
		mask &^= unix.IN_DONT_FOLLOW // the root may be named by a symlink
	}
	var wd int
	var aerr error
	if err := rc.Control(func(fd uintptr) { wd, aerr = unix.InotifyAddWatch(int(fd), full, mask) }); err != nil {
		return errClosed
	}
	if aerr != nil {
		if rel != "" && (errors.Is(aerr, syscall.ENOENT) || errors.Is(aerr, syscall.ENOTDIR)) {
			return nil // gone meanwhile, or not a directory after all
		}
		return &fs.PathError{Op: "watch", Path: full, Err: aerr}
	}
	w.dirs[int32(wd)] = rel
	w.wds[rel] = int32(wd)
	return nil
}

// addTree watches the directories below rel (not rel itself).
func (w *watcher) addTree(rel string) error {
	top := filepath.Join(w.root, rel)
	return filepath.WalkDir(top, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if p != top && errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			if p == top && errors.Is(err, fs.ErrNotExist) {
				return filepath.SkipDir
			}
			return &fs.PathError{Op: "watch", Path: p, Err: err}
		}
		if p == top || !d.IsDir() {
			return nil
		}
		r, _ := filepath.Rel(w.root, p)
		return w.add(r)
	})
}

// forget drops the watches of rel and the directories below it (moved
// away: their paths would be wrong).
func (w *watcher) forget(rel string) {
	rc, err := w.f.SyscallConn()
	if err != nil {
		return
	}
	for p, wd := range w.wds {
		if p == rel || strings.HasPrefix(p, rel+"/") {
			rc.Control(func(fd uintptr) { unix.InotifyRmWatch(int(fd), uint32(wd)) })
			delete(w.wds, p)
			delete(w.dirs, wd)
		}
	}
}

// handle turns one inotify event into an Event for fn; done says the
// watch is over (the root went away).
func (w *watcher) handle(ev inotifyEvent, fn func(Event) error) (done bool, _ error) {
	if ev.mask&unix.IN_Q_OVERFLOW != 0 {
		return true, fmt.Errorf("watching %s: %w", w.root, ErrOverflow)
	}
	dir, ok := w.dirs[ev.wd]
	if !ok {
		return false, nil // a watch dropped since
	}
	if ev.mask&(unix.IN_DELETE_SELF|unix.IN_MOVE_SELF|unix.IN_IGNORED) != 0 {
		if dir == "" {
			return true, nil // the watched directory went away
		}
		if ev.mask&unix.IN_IGNORED != 0 {
			delete(w.dirs, ev.wd)
			if w.wds[dir] == ev.wd {
				delete(w.wds, dir)
			}
		}
		return false, nil // its parent reports it
	}
	if ev.name == "" || strings.ContainsRune(ev.name, '/') {
		return false, nil
	}
	rel := filepath.Join(dir, ev.name)
	isDir := ev.mask&unix.IN_ISDIR != 0
	out := Event{Name: rel}
	switch {
	case ev.mask&(unix.IN_CREATE|unix.IN_MOVED_TO) != 0:
		out.Op = Create
	case ev.mask&unix.IN_MODIFY != 0:
		out.Op = Write
	case ev.mask&unix.IN_DELETE != 0:
		out.Op = Remove
	case ev.mask&unix.IN_MOVED_FROM != 0:
		out.Op = Rename
	case ev.mask&unix.IN_ATTRIB != 0:
		out.Op = Chmod
	default:
		return false, nil
	}
	switch out.Op {
	case Remove, Rename:
		if isDir && w.recursive {
			w.forget(rel)
		}
	default:
		if fi, err := os.Lstat(filepath.Join(w.root, rel)); err == nil {
			out.Info = fi
		}
	}
	if out.Op == Create && isDir && w.recursive {
		if err := w.add(rel); err != nil {
			return true, err
		}
		if err := w.addTree(rel); err != nil {
			return true, err
		}
	}
	return false, fn(out)
}
