package pid1

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// fakeSys records the system calls made through its Sys as strings and
// fails those named in errs.
type fakeSys struct {
	calls   []string
	mounted map[string]bool   // mount points mountinfo lists once /proc is mounted
	files   map[string]string // what ReadFile reads
	exist   map[string]bool   // what Stat finds
	errs    map[string]error  // call -> its error
	env     map[string]string
	sleeps  int
	// appearAfter makes Stat find the paths in appear after this many sleeps.
	appearAfter int
	appear      map[string]bool
	// modes is what Lstat finds: a path's file type (fs.ModeDir, ...).
	modes map[string]fs.FileMode
}

// fakeInfo is a file Lstat finds.
type fakeInfo struct {
	name string
	mode fs.FileMode
}

func (i fakeInfo) Name() string       { return i.name }
func (i fakeInfo) Size() int64        { return 0 }
func (i fakeInfo) Mode() fs.FileMode  { return i.mode }
func (i fakeInfo) ModTime() time.Time { return time.Time{} }
func (i fakeInfo) IsDir() bool        { return i.mode.IsDir() }
func (i fakeInfo) Sys() any           { return nil }

func newFake() *fakeSys {
	return &fakeSys{mounted: map[string]bool{}, files: map[string]string{}, exist: map[string]bool{},
		errs: map[string]error{}, env: map[string]string{}, appear: map[string]bool{}, modes: map[string]fs.FileMode{}}
}

func (f *fakeSys) call(format string, args ...any) error {
	c := fmt.Sprintf(format, args...)
	f.calls = append(f.calls, c)
	return f.errs[c]
}

func notExist(op, path string) error {
	return &fs.PathError{Op: op, Path: path, Err: unix.ENOENT}
}

func (f *fakeSys) sys() *Sys {
	return &Sys{
		Mount: func(source, target, fstype string, flags uintptr, data string) error {
			err := f.call("mount %s %s %s %s %s", source, target, fstype, flagNames(flags), data)
			if err == nil && flags&unix.MS_MOVE == 0 {
				f.mounted[target] = true
			}
			return err
		},
		Unmount:  func(target string, flags int) error { return f.call("umount %s %#x", target, flags) },
		MkdirAll: func(path string, perm fs.FileMode) error { return f.call("mkdir %s %v", path, perm) },
		Symlink:  func(target, link string) error { return f.call("symlink %s -> %s", link, target) },
		Stat: func(path string) (fs.FileInfo, error) {
			if f.exist[path] || f.appear[path] && f.sleeps >= f.appearAfter {
				return nil, nil
			}
			return nil, notExist("stat", path)
		},
		ReadFile: func(path string) ([]byte, error) {
			if path == mountInfo {
				if !f.mounted["/proc"] {
					return nil, notExist("open", path)
				}
				points := make([]string, 0, len(f.mounted))
				for p := range f.mounted {
					points = append(points, p)
				}
				sort.Strings(points)
				var b strings.Builder
				for i, p := range points {
					fmt.Fprintf(&b, "%d 1 0:%d / %s rw - fake fake rw\n", 20+i, i, strings.ReplaceAll(p, " ", `\040`))
				}
				return []byte(b.String()), nil
			}
			if err := f.errs["read "+path]; err != nil {
				return nil, err
			}
			data, ok := f.files[path]
			if !ok {
				return nil, notExist("open", path)
			}
			return []byte(data), nil
		},
		ReadAt: func(path string, off int64, n int) ([]byte, error) {
			if err := f.call("readat %s %d %d", path, off, n); err != nil {
				return nil, err
			}
			data, ok := f.files[path]
			if !ok {
				return nil, notExist("open", path)
			}
			if off+int64(n) > int64(len(data)) {
				return nil, fmt.Errorf("reading %s: EOF", path)
			}
			return []byte(data[off : off+int64(n)]), nil
		},
		WriteFile:   func(path string, data []byte) error { return f.call("write %s %s", path, data) },
		CreateFile:  func(path string, perm fs.FileMode) error { return f.call("create %s %v", path, perm) },
		Chdir:       func(dir string) error { return f.call("chdir %s", dir) },
		Chroot:      func(dir string) error { return f.call("chroot %s", dir) },
		Sethostname: func(name []byte) error { return f.call("sethostname %s", name) },
		FinitModule: func(file *os.File, params string) error {
			return f.call("finit %s %q", filepath.Base(file.Name()), params)
		},
		Sync:          func() { f.call("sync") },
		RebootSyscall: func(cmd int) error { return f.call("reboot %#x", cmd) },
		Sleep:         func(time.Duration) { f.sleeps++ },
		LookupEnv: func(key string) (string, bool) {
			v, ok := f.env[key]
			return v, ok
		},
		Setenv: func(key, value string) error {
			err := f.call("setenv %s=%s", key, value)
			if err == nil {
				f.env[key] = value
			}
			return err
		},
		LinkUp: func(name string) error { return f.call("linkup %s", name) },
		Lstat: func(path string) (fs.FileInfo, error) {
			if err := f.errs["lstat "+path]; err != nil {
				return nil, err
			}
			m, ok := f.modes[path]
			if !ok {
				return nil, notExist("lstat", path)
			}
			return fakeInfo{filepath.Base(path), m}, nil
		},
	}
}

// flagNames spells mount flags symbolically.
func flagNames(flags uintptr) string {
	names := []struct {
		bit  uintptr
		name string
	}{
		{unix.MS_RDONLY, "ro"}, {unix.MS_NOSUID, "nosuid"}, {unix.MS_NODEV, "nodev"}, {unix.MS_NOEXEC, "noexec"},
		{unix.MS_SYNCHRONOUS, "sync"}, {unix.MS_DIRSYNC, "dirsync"}, {unix.MS_NOATIME, "noatime"},
		{unix.MS_NODIRATIME, "nodiratime"}, {unix.MS_RELATIME, "relatime"}, {unix.MS_STRICTATIME, "strictatime"},
		{unix.MS_LAZYTIME, "lazytime"}, {unix.MS_MOVE, "move"}, {unix.MS_BIND, "bind"}, {unix.MS_REMOUNT, "remount"},
	}
	var out []string
	for _, n := range names {
		if flags&n.bit != 0 {
			out = append(out, n.name)
			flags &^= n.bit
		}
	}
	if flags != 0 {
		out = append(out, fmt.Sprintf("%#x", flags))
	}
	if len(out) == 0 {
		return "0"
	}
	return strings.Join(out, "|")
}

// diffCalls reports the calls made unless they are want.
func diffCalls(t *testing.T, got, want []string) {
	t.Helper()
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("calls:\n\t%s\nwant:\n\t%s", strings.Join(got, "\n\t"), strings.Join(want, "\n\t"))
	}
}
