package agent_test

import (
	"context"
	"errors"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/kilnvm/kiln/guest/agent"
	"github.com/kilnvm/kiln/guest/client"
)

// TestExecPty runs processes on terminals: tty names one, stty sees its
// size and a resize, input is typed into it, a closed stdin is ^D, and a
// detached process gets one too.
func TestExecPty(t *testing.T) {
	a := startDetachedAgent(t, agent.Config{})
	ctx := testContext(t, time.Minute)

	var out syncBuffer
	stdinR, stdinW := io.Pipe()
	defer stdinW.Close()
	script := `tty; stty size; [ -t 0 ] && [ -t 2 ] && echo all-tty; ps -o sid= -o pgid= $$; echo pid $$; read line; stty size; echo "got $line"`
	p, err := a.Start(ctx, client.ExecOptions{Argv: []string{"sh", "-c", script}, Pty: &client.PtySize{Rows: 24, Cols: 80},
		Stdin: stdinR, Stdout: &out, Stderr: failWriter{t}})
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { return strings.Contains(out.String(), "pid ") })
	if err := p.Resize(client.PtySize{Rows: 30, Cols: 100}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond) // the resize goes first on the same stream anyway
	io.WriteString(stdinW, "hello\n")
	st, err := p.Wait()
	if err != nil || !st.Success() {
		t.Fatalf("wait: %v %v; output %q", st, err, out.String())
	}
	got := strings.ReplaceAll(out.String(), "\r\n", "\n")
	for _, want := range []string{"/dev/pts/", "\n24 80\n", "all-tty\n", "\n30 100\n", "got hello\n"} {
		if !strings.Contains(got, want) {
			t.Errorf("output %q lacks %q", got, want)
		}
	}
	// The terminal is its controlling one, in a session it leads.
	if f := strings.Fields(got[strings.Index(got, "all-tty\n")+len("all-tty\n"):]); len(f) < 4 || f[0] != f[1] || f[3] != f[0] {
		t.Errorf("session and group: %q", f)
	}

	// The end of stdin is ^D: cat ends as on a terminal.
	out = syncBuffer{}
	st, err = a.Exec(ctx, client.ExecOptions{Argv: []string{"cat"}, Pty: &client.PtySize{Rows: 5, Cols: 20},
		Stdin: strings.NewReader("abc\n"), Stdout: &out})
	if err != nil || !st.Success() || !strings.Contains(out.String(), "abc") {
		t.Errorf("cat on a pty: %v %v %q", st, err, out.String())
	}

	// A detached one, with its tail kept.
	p, err = a.Start(ctx, client.ExecOptions{Argv: []string{"sh", "-c", "tty; stty size"}, Pty: &client.PtySize{Rows: 7, Cols: 9}, DetachID: "pty-1"})
	if err != nil {
		t.Fatal(err)
	}
	d, err := a.WaitDetached(ctx, "pty-1")
	if err != nil || !d.Status.Success() || !strings.Contains(string(d.StdoutTail), "/dev/pts/") || !strings.Contains(string(d.StdoutTail), "7 9") {
		t.Errorf("detached on a pty: %+v %v", d, err)
	}
	p.Wait()

	// Bad sizes.
	for _, size := range []client.PtySize{{Rows: 0, Cols: 80}, {Rows: 24, Cols: 70000}} {
		_, err := a.Exec(ctx, client.ExecOptions{Argv: []string{"true"}, Pty: &size})
		wantCode(t, err, codes.InvalidArgument, "pty")
	}
}

type failWriter struct{ t *testing.T }

func (w failWriter) Write(p []byte) (int, error) {
	w.t.Errorf("unexpected stderr %q", p)
	return len(p), nil
}

// hostUser is a user of this host's /etc/passwd that is not root.
func hostUser(t *testing.T) (name, uid, gid, home string) {
	t.Helper()
	b, err := os.ReadFile("/etc/passwd")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Split(l, ":"); len(f) >= 7 && f[0] == "nobody" {
			return f[0], f[2], f[3], f[5]
		}
	}
	t.Fatal("no user nobody in /etc/passwd")
	return
}

// TestExecAsUser runs a process as a named user of the (host's) account
// files.
func TestExecAsUser(t *testing.T) {
	if os.Getuid() != 0 {
		t.Fatal("needs root to switch users")
	}
	a := startAgent(t, agent.Config{})
	ctx := testContext(t, time.Minute)
	name, uid, gid, home := hostUser(t)
	var out syncBuffer
	st, err := a.Exec(ctx, client.ExecOptions{Argv: []string{"sh", "-c", `echo "$(id -u) $(id -g) $HOME $USER $LOGNAME"`}, User: name, Stdout: &out})
	if want := uid + " " + gid + " " + home + " " + name + " " + name + "\n"; err != nil || !st.Success() || out.String() != want {
		t.Errorf("as %s: %v %v %q, want %q", name, st, err, out.String(), want)
	}
	// The exec's own HOME wins.
	out = syncBuffer{}
	a.Exec(ctx, client.ExecOptions{Argv: []string{"sh", "-c", `echo "$HOME $USER"`}, Env: []string{"PATH=/usr/bin:/bin", "HOME=/x"}, User: name, Stdout: &out})
	if out.String() != "/x "+name+"\n" {
		t.Errorf("with an environment: %q", out.String())
	}
	_, err = a.Exec(ctx, client.ExecOptions{Argv: []string{"true"}, User: "no-such-user-here"})
	wantCode(t, err, codes.InvalidArgument, "no-such-user-here")
	_, err = a.Exec(ctx, client.ExecOptions{Argv: []string{"true"}, User: name, UID: 5})
	wantCode(t, err, codes.InvalidArgument, "uid")
}

// TestFileOwnersMoveAndDepth: owned writes and directories, owner names,
// deep listings and moves.
func TestFileOwnersMoveAndDepth(t *testing.T) {
	a := startAgent(t, agent.Config{})
	ctx := testContext(t, time.Minute)
	name, uid, _, _ := hostUser(t)
	dir := t.TempDir()

	fi, err := a.WriteFileInfo(ctx, dir+"/new/sub/f", strings.NewReader("x"), 0o640, client.MakeParents(), client.WriteOwner(name))
	if err != nil {
		t.Fatal(err)
	}
	if fi.Owner != name || itoa(fi.UID) != uid || fi.Mode.Perm() != 0o640 {
		t.Errorf("owned write: %+v", fi)
	}
	for _, p := range []string{dir + "/new", dir + "/new/sub"} {
		if fi, err := a.Stat(ctx, p); err != nil || fi.Owner != name || fi.Mode.Perm() != 0o755 {
			t.Errorf("parent %s: %+v %v", p, fi, err)
		}
	}
	if fi, _ := a.Stat(ctx, dir); fi.Owner != "root" || fi.Group != "root" {
		t.Errorf("the existing parent changed: %+v", fi)
	}
	if err := a.Mkdir(ctx, dir+"/m/n", 0o700, true, client.MkdirOwner(name)); err != nil {
		t.Fatal(err)
	}
	if fi, err := a.Stat(ctx, dir+"/m/n"); err != nil || fi.Owner != name || fi.Mode.Perm() != 0o700 {
		t.Errorf("owned mkdir: %+v %v", fi, err)
	}
	err = a.Mkdir(ctx, dir+"/o", 0, false, client.MkdirOwner("no-such-user-here"))
	wantCode(t, err, codes.InvalidArgument, "no-such-user-here")
	err = a.WriteFile(ctx, dir+"/o", strings.NewReader(""), 0, client.WriteOwner("no-such-user-here"))
	wantCode(t, err, codes.InvalidArgument, "no-such-user-here")

	// Depth: 1 is the directory's own entries, 3 reaches new/sub/f.
	os.Symlink(dir+"/new", dir+"/link")
	for _, tt := range []struct {
		depth int
		want  []string
	}{
		{0, []string{"link", "m", "new"}},
		{1, []string{"link", "m", "new"}},
		{2, []string{"link", "m", "m/n", "new", "new/sub"}},
		{3, []string{"link", "m", "m/n", "new", "new/sub", "new/sub/f"}},
		{10, []string{"link", "m", "m/n", "new", "new/sub", "new/sub/f"}},
	} {
		ents, err := a.ListDepth(ctx, dir, tt.depth)
		var got []string
		for _, e := range ents {
			got = append(got, strings.TrimPrefix(e.Path, dir+"/"))
		}
		if err != nil || strings.Join(got, " ") != strings.Join(tt.want, " ") {
			t.Errorf("depth %d: %q %v, want %q", tt.depth, got, err, tt.want)
		}
	}

	// Move: a file, over another, a directory; errors named.
	os.WriteFile(dir+"/a", []byte("a"), 0o644)
	os.WriteFile(dir+"/b", []byte("b"), 0o644)
	fi, err = a.Move(ctx, dir+"/a", dir+"/b")
	if b, _ := os.ReadFile(dir + "/b"); err != nil || fi.Path != dir+"/b" || fi.Size != 1 || string(b) != "a" {
		t.Errorf("move a over b: %+v %v %q", fi, err, b)
	}
	if fi, err := a.Move(ctx, dir+"/m", dir+"/new/m2"); err != nil || !fi.IsDir || fi.Owner != name {
		t.Errorf("move a directory: %+v %v", fi, err)
	}
	_, err = a.Move(ctx, dir+"/nope", dir+"/x")
	wantCode(t, err, codes.NotFound, dir+"/nope")
	_, err = a.Move(ctx, "rel", dir+"/x")
	wantCode(t, err, codes.InvalidArgument, "source")
	_, err = a.Move(ctx, dir+"/b", "/")
	wantCode(t, err, codes.InvalidArgument, "/")
	// Across file systems, where this host has two.
	var st1, st2 syscall.Stat_t
	if syscall.Stat(dir, &st1) == nil && syscall.Stat("/dev/shm", &st2) == nil && st1.Dev != st2.Dev {
		_, err = a.Move(ctx, dir+"/b", "/dev/shm/kiln-agent-test-move")
		wantCode(t, err, codes.FailedPrecondition, "different file systems")
	} else {
		t.Logf("%s and /dev/shm share a file system: no EXDEV check", dir)
	}
}

func itoa(n uint32) string { return strconv.FormatUint(uint64(n), 10) }

// watchRecorder collects a watch's events.
type watchRecorder struct {
	mu      sync.Mutex
	started chan struct{}
	events  []client.WatchEvent
}

func (r *watchRecorder) fn(ev client.WatchEvent) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if ev.Started {
		close(r.started)
		return nil
	}
	r.events = append(r.events, ev)
	return nil
}

func (r *watchRecorder) has(op client.WatchOp, name string, entry bool) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, e := range r.events {
		if e.Op == op && e.Name == name && e.HasEntry == entry {
			return true
		}
	}
	return false
}

// TestWatch: a recursive watch sees changes in the directory and in
// subdirectories made after it started; removing the directory ends it.
func TestWatch(t *testing.T) {
	a := startAgent(t, agent.Config{})
	ctx := testContext(t, time.Minute)
	dir := t.TempDir() + "/w"
	os.MkdirAll(dir+"/old", 0o755)
	r := &watchRecorder{started: make(chan struct{})}
	done := make(chan error, 1)
	go func() { done <- a.Watch(ctx, dir, true, r.fn) }()
	select {
	case <-r.started:
	case err := <-done:
		t.Fatalf("watch ended before it started: %v", err)
	}
	steps := []struct {
		do    func()
		op    client.WatchOp
		name  string
		entry bool
	}{
		{func() { os.WriteFile(dir+"/f", nil, 0o644) }, client.WatchCreate, "f", true},
		{func() { os.WriteFile(dir+"/f", []byte("data"), 0o644) }, client.WatchWrite, "f", true},
		{func() { os.Chmod(dir+"/f", 0o600) }, client.WatchChmod, "f", true},
		{func() { os.WriteFile(dir+"/old/g", nil, 0o644) }, client.WatchCreate, "old/g", true},
		{func() { os.Mkdir(dir+"/sub", 0o755) }, client.WatchCreate, "sub", true},
		{func() { os.WriteFile(dir+"/sub/h", nil, 0o644) }, client.WatchCreate, "sub/h", true},
		{func() { os.Rename(dir+"/f", dir+"/sub/f2") }, client.WatchRename, "f", false},
		{func() {}, client.WatchCreate, "sub/f2", true},
		{func() { os.Remove(dir + "/sub/h") }, client.WatchRemove, "sub/h", false},
	}
	for _, s := range steps {
		s.do()
		waitFor(t, func() bool { return r.has(s.op, s.name, s.entry) })
	}
	os.RemoveAll(dir)
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("watch of a removed directory: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Error("the watch did not end with its directory")
	}

	// A non-recursive watch does not see below; its context ends it.
	os.MkdirAll(dir+"/sub", 0o755)
	wctx, cancel := context.WithCancel(ctx)
	r = &watchRecorder{started: make(chan struct{})}
	go func() { done <- a.Watch(wctx, dir, false, r.fn) }()
	<-r.started
	os.WriteFile(dir+"/sub/x", nil, 0o644)
	os.WriteFile(dir+"/y", nil, 0o644)
	waitFor(t, func() bool { return r.has(client.WatchCreate, "y", true) })
	if r.has(client.WatchCreate, "sub/x", true) {
		t.Error("a non-recursive watch saw a subdirectory's change")
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("watch ended by its context: %v", err)
	}

	err := a.Watch(ctx, dir+"/y", false, r.fn)
	wantCode(t, err, codes.InvalidArgument, "not a directory")
	err = a.Watch(ctx, dir+"/none", false, r.fn)
	wantCode(t, err, codes.NotFound, dir+"/none")
	stop := errors.New("enough")
	if err := a.Watch(ctx, dir, false, func(client.WatchEvent) error { return stop }); !errors.Is(err, stop) {
		t.Errorf("fn's error: %v", err)
	}
}

// TestAttachDetached: two attachers see the same output written after
// they attached, then the exit; an exited process answers at once.
func TestAttachDetached(t *testing.T) {
	a := startDetachedAgent(t, agent.Config{})
	ctx := testContext(t, time.Minute)
	stdinR, stdinW := io.Pipe()
	var first syncBuffer
	p, err := a.Start(ctx, client.ExecOptions{Argv: []string{"sh", "-c", "echo before; read x; echo out-$x; echo err-$x >&2; exit 4"},
		DetachID: "att-1", Stdin: stdinR, Stdout: &first})
	if err != nil {
		t.Fatal(err)
	}
	// What it wrote before anyone attached is not the attachers': wait
	// until it has written it.
	for first.String() != "before\n" {
		if ctx.Err() != nil {
			t.Fatalf("no 'before' from the process: %q", first.String())
		}
		time.Sleep(5 * time.Millisecond)
	}
	type result struct {
		out, errOut string
		st          client.ExitStatus
		err         error
	}
	results := make(chan result, 2)
	for range 2 {
		go func() {
			var o, e syncBuffer
			st, err := a.reconnect(t).AttachDetached(ctx, "att-1", &o, &e)
			results <- result{o.String(), e.String(), st, err}
		}()
	}
	time.Sleep(200 * time.Millisecond) // let both attach (no output is written meanwhile)
	io.WriteString(stdinW, "v\n")
	for range 2 {
		r := <-results
		if r.err != nil || r.st.Code != 4 || r.out != "out-v\n" || r.errOut != "err-v\n" {
			t.Errorf("attacher: %+v", r)
		}
	}
	p.Wait()
	st, err := a.AttachDetached(ctx, "att-1", nil, nil)
	if err != nil || st.Code != 4 {
		t.Errorf("attach to an exited process: %v %v", st, err)
	}
	_, err = a.AttachDetached(ctx, "no-such", nil, nil)
	wantCode(t, err, codes.NotFound, "no-such")
}
