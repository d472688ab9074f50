package dirwatch

import (
	"context"
	"encoding/binary"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// inotifyRecord encodes one struct inotify_event with its name padded to
// pad bytes.
func inotifyRecord(wd int32, mask uint32, name string, pad int) []byte {
	b := make([]byte, unix.SizeofInotifyEvent+pad)
	binary.NativeEndian.PutUint32(b[0:], uint32(wd))
	binary.NativeEndian.PutUint32(b[4:], mask)
	binary.NativeEndian.PutUint32(b[12:], uint32(pad))
	copy(b[unix.SizeofInotifyEvent:], name)
	return b
}

func TestParseInotify(t *testing.T) {
	buf := append(inotifyRecord(1, unix.IN_CREATE, "a.txt", 16), inotifyRecord(2, unix.IN_DELETE_SELF, "", 0)...)
	evs, err := parseInotify(buf)
	if err != nil || len(evs) != 2 || evs[0].name != "a.txt" || evs[0].wd != 1 || evs[0].mask != unix.IN_CREATE || evs[1].name != "" || evs[1].wd != 2 {
		t.Errorf("parseInotify: %+v %v", evs, err)
	}
	// A truncated record and a name running past the end are errors,
	// after the whole records before them.
	if evs, err := parseInotify(append(inotifyRecord(1, 0, "x", 4), 1, 2, 3)); err == nil || len(evs) != 1 {
		t.Errorf("truncated: %+v %v", evs, err)
	}
	bad := inotifyRecord(1, 0, "x", 4)
	binary.NativeEndian.PutUint32(bad[12:], 1<<31)
	if evs, err := parseInotify(bad); err == nil || len(evs) != 0 {
		t.Errorf("long name: %+v %v", evs, err)
	}
}

func FuzzParseInotify(f *testing.F) {
	f.Add(inotifyRecord(1, unix.IN_CREATE, "a", 16))
	f.Add(append(inotifyRecord(3, unix.IN_MOVED_FROM, "from", 8), inotifyRecord(3, unix.IN_MOVED_TO, "to", 8)...))
	f.Add([]byte{1, 2, 3})
	f.Fuzz(func(t *testing.T, b []byte) {
		evs, _ := parseInotify(b)
		total := 0
		for _, e := range evs {
			if strings.IndexByte(e.name, 0) >= 0 {
				t.Errorf("name %q has a NUL", e.name)
			}
			total += unix.SizeofInotifyEvent + len(e.name)
		}
		if total > len(b) {
			t.Errorf("%d events of %d bytes from %d bytes", len(evs), total, len(b))
		}
	})
}

// TestWatch watches a folder recursively: a file created and written, a
// folder created after the watch began and a file in it, a removal, and
// the end when the folder goes.
func TestWatch(t *testing.T) {
	dir := t.TempDir()
	if err := os.Mkdir(filepath.Join(dir, "old"), 0o755); err != nil {
		t.Fatal(err)
	}
	evs := make(chan Event, 64)
	done := make(chan error, 1)
	go func() {
		done <- Watch(context.Background(), dir, true, 16, func(ev Event) error { evs <- ev; return nil })
	}()
	next := func() Event {
		t.Helper()
		select {
		case ev := <-evs:
			return ev
		case err := <-done:
			t.Fatalf("the watch ended: %v", err)
		case <-time.After(10 * time.Second):
			t.Fatal("no event")
		}
		return Event{}
	}
	// want waits for an event of op on name, skipping others (a write
	// may come as several).
	want := func(op Op, name string, info bool) {
		t.Helper()
		for {
			ev := next()
			if ev.Op == op && ev.Name == name {
				if (ev.Info != nil) != info {
					t.Fatalf("%+v: info %v, want %v", ev, ev.Info != nil, info)
				}
				return
			}
		}
	}
	if ev := next(); !ev.Started {
		t.Fatalf("first event %+v, want Started", ev)
	}
	write := func(name string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(dir, name), []byte("x"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("a")
	want(Create, "a", true)
	want(Write, "a", true)
	write("old/b") // a folder there before the watch
	want(Create, "old/b", true)
	if err := os.Mkdir(filepath.Join(dir, "new"), 0o755); err != nil {
		t.Fatal(err)
	}
	want(Create, "new", true)
	write("new/c") // a folder created since
	want(Create, "new/c", true)
	if err := os.Remove(filepath.Join(dir, "a")); err != nil {
		t.Fatal(err)
	}
	want(Remove, "a", false)
	if err := os.Rename(filepath.Join(dir, "new"), filepath.Join(dir, "moved")); err != nil {
		t.Fatal(err)
	}
	want(Rename, "new", false)
	want(Create, "moved", true)
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	timeout := time.After(10 * time.Second)
	for {
		select {
		case <-evs: // the removals
		case err := <-done:
			if err != nil {
				t.Fatalf("the watch of a folder removed ended with %v, want nil", err)
			}
			return
		case <-timeout:
			t.Fatal("the watch outlived its folder")
		}
	}
}

func TestWatchEnds(t *testing.T) {
	dir := t.TempDir()
	for _, d := range []string{"a", "a/b", "c"} {
		if err := os.Mkdir(filepath.Join(dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	nop := func(Event) error { return nil }
	if err := Watch(context.Background(), dir, true, 3, nop); !errors.Is(err, ErrTooManyDirs) {
		t.Errorf("4 folders watched with a bound of 3: %v, want ErrTooManyDirs", err)
	}
	var pe *fs.PathError
	if err := Watch(context.Background(), filepath.Join(dir, "none"), false, 1, nop); !errors.As(err, &pe) || !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a missing folder: %v, want an *fs.PathError for ENOENT", err)
	}
	stop := errors.New("stop")
	if err := Watch(context.Background(), dir, false, 1, func(Event) error { return stop }); err != stop {
		t.Errorf("fn's error: the watch ended with %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := Watch(ctx, dir, false, 1, nop); err != nil {
		t.Errorf("a watch whose context has ended: %v, want nil", err)
	}
}
