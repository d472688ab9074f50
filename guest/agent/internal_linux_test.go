package agent

import (
	"context"
	"encoding/binary"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/filetree"
	"github.com/kilnvm/kiln/guest/agentpb"
)

func runReaper(t *testing.T, r *Reaper) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
}

func waitChild(t *testing.T, c *Child) syscall.WaitStatus {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ws, err := c.Wait(ctx)
	if err != nil {
		t.Fatalf("pid %d: %v", c.Pid(), err)
	}
	return ws
}

func shAttr() *syscall.ProcAttr {
	return &syscall.ProcAttr{Env: []string{"PATH=" + DefaultPath}, Sys: &syscall.SysProcAttr{Setpgid: true}}
}

func TestReaper(t *testing.T) {
	// Orphan mode reaps every child of the test process: no other test
	// may run children meanwhile, so these subtests are not parallel
	// (and nor is any test of this package that starts processes).
	for _, orphans := range []bool{false, true} {
		t.Run("orphans="+strconv.FormatBool(orphans), func(t *testing.T) {
			r := NewReaper(nil, orphans)
			runReaper(t, r)
			var children []*Child
			for i := range 20 {
				c, err := r.ForkExec("/bin/sh", []string{"sh", "-c", "exit " + strconv.Itoa(i)}, shAttr())
				if err != nil {
					t.Fatal(err)
				}
				children = append(children, c)
			}
			for i, c := range children {
				if ws := waitChild(t, c); !ws.Exited() || ws.ExitStatus() != i {
					t.Errorf("child %d: %s", i, describeWaitStatus(ws))
				}
			}

			c, err := r.ForkExec("/bin/sleep", []string{"sleep", "30"}, shAttr())
			if err != nil {
				t.Fatal(err)
			}
			if err := c.Signal(syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
			if ws := waitChild(t, c); !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
				t.Errorf("killed child: %s", describeWaitStatus(ws))
			}
			if err := c.Signal(syscall.SIGKILL); err != os.ErrProcessDone {
				t.Errorf("Signal after exit: %v", err)
			}
		})
	}
}

// TestReaperUnclaimed: in orphan mode, the status of a child that exits
// before anyone watches it is kept for Watch, and a stale status never
// reaches a new child with the same pid.
func TestReaperUnclaimed(t *testing.T) {
	r := NewReaper(nil, true)
	runReaper(t, r)
	pid, err := syscall.ForkExec("/bin/sh", []string{"sh", "-c", "exit 7"}, shAttr())
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; ; i++ {
		r.mu.Lock()
		_, ok := r.unclaimed[pid]
		r.mu.Unlock()
		if ok {
			break
		}
		if i == 500 {
			t.Fatalf("pid %d not reaped", pid)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if ws := waitChild(t, r.Watch(pid)); ws.ExitStatus() != 7 {
		t.Errorf("watched: %s", describeWaitStatus(ws))
	}

	// A stale entry for a pid is dropped when ForkExec registers a new
	// child with that pid.
	c := newChild(4242)
	r.mu.Lock()
	r.unclaimed[4242] = unclaimedStatus{status: 0, at: time.Now()}
	r.mu.Unlock()
	r.register(c, true)
	select {
	case <-c.Done():
		t.Fatal("fresh child got a stale status")
	case <-time.After(50 * time.Millisecond):
	}
	r.mu.Lock()
	delete(r.children, 4242)
	r.mu.Unlock()

	// A Watch does not take a status older than unclaimedTTL (no pass
	// has expired it: passes run on SIGCHLD only).
	r.mu.Lock()
	r.unclaimed[4244] = unclaimedStatus{at: time.Now().Add(-unclaimedTTL - time.Second)}
	r.mu.Unlock()
	stale := r.Watch(4244)
	select {
	case <-stale.Done():
		t.Fatal("a watch got an expired status")
	case <-time.After(50 * time.Millisecond):
	}
	r.mu.Lock()
	delete(r.children, 4244)
	r.mu.Unlock()

	// Old unclaimed statuses expire.
	r.mu.Lock()
	r.unclaimed[4243] = unclaimedStatus{at: time.Now().Add(-unclaimedTTL)}
	r.expireUnclaimedLocked(time.Now())
	_, kept := r.unclaimed[4243]
	r.mu.Unlock()
	if kept {
		t.Error("expired status kept")
	}
}

func TestReaperStop(t *testing.T) {
	r := NewReaper(nil, false)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	for !r.running.Load() {
		time.Sleep(time.Millisecond)
	}
	c, err := r.ForkExec("/bin/sleep", []string{"sleep", "30"}, shAttr())
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		syscall.Kill(c.Pid(), syscall.SIGKILL)
		var ws syscall.WaitStatus
		syscall.Wait4(c.Pid(), &ws, 0, nil)
	}()
	if err := r.Run(ctx); err == nil {
		t.Error("second Run did not fail")
	}
	cancel()
	<-done
	if _, err := c.Status(); err != ErrReaperStopped {
		t.Errorf("status after stop: %v", err)
	}
}

func TestTrampolineArgs(t *testing.T) {
	uid, gid := uint32(1000), uint32(0)
	args := trampolineArgv("/bin/echo", []string{"echo", "a"}, &uid, &gid, []uint32{4, 27})
	if strings.Join(args, " ") != TrampolineArg0+" "+trampolineTag+" 1000 0 4,27 /bin/echo echo a" {
		t.Errorf("argv %q", args)
	}
	if !isTrampoline(args) {
		t.Error("not recognised as a trampoline")
	}
	args = trampolineArgv("/bin/true", []string{"true"}, nil, nil, nil)
	if args[2] != "-" || args[3] != "-" || args[4] != "-" || !isTrampoline(args) {
		t.Errorf("argv %q", args)
	}
	for _, args := range [][]string{
		{TrampolineArg0, trampolineTag, "-", "-", "-", "/bin/true"}, // no argv
		{"kiln-agent", trampolineTag, "-", "-", "-", "/bin/true", "true"},
		{TrampolineArg0, "kiln-trampoline-v1", "-", "-", "-", "/bin/true", "true"},
		{"/usr/bin/kiln-agent"},
	} {
		if isTrampoline(args) {
			t.Errorf("%q taken for a trampoline", args)
		}
	}
}

func TestParseTrampolineReport(t *testing.T) {
	for _, tt := range []struct {
		in    string
		errno syscall.Errno
		msg   string
	}{
		{"2 exec /x: no such file or directory", syscall.ENOENT, "exec /x: no such file or directory"},
		{"13 exec /x: permission denied", syscall.EACCES, "exec /x: permission denied"},
		{"0 resetting oom_score_adj: odd", 0, "resetting oom_score_adj: odd"},
		{"garbage", 0, "garbage"},
		{"99999999 x", 0, "99999999 x"},
		{"", 0, ""},
	} {
		errno, msg := parseTrampolineReport([]byte(tt.in))
		if errno != tt.errno || msg != tt.msg {
			t.Errorf("parseTrampolineReport(%q) = %d, %q; want %d, %q", tt.in, errno, msg, tt.errno, tt.msg)
		}
	}
}

func TestLookPath(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "bin")
	os.Mkdir(bin, 0o755)
	os.WriteFile(filepath.Join(bin, "tool"), []byte("#!/bin/sh\n"), 0o755)
	os.WriteFile(filepath.Join(bin, "data"), []byte("x"), 0o644)
	os.Mkdir(filepath.Join(bin, "subdir"), 0o755)

	for _, tt := range []struct {
		file, path string
		want       string
		code       codes.Code
	}{
		{"tool", "/nonexistent:" + bin, filepath.Join(bin, "tool"), codes.OK},
		{"tool", "bin", filepath.Join(bin, "tool"), codes.OK}, // relative PATH entry, from dir
		{"./bin/tool", "", filepath.Join(bin, "tool"), codes.OK},
		{filepath.Join(bin, "tool"), "", filepath.Join(bin, "tool"), codes.OK},
		{"nothing", bin, "", codes.NotFound},
		{"data", bin, "", codes.PermissionDenied},
		{"subdir", bin, "", codes.InvalidArgument},
		{filepath.Join(bin, "data"), "", "", codes.PermissionDenied},
		{filepath.Join(bin, "nothing"), "", "", codes.NotFound},
		{filepath.Join(bin, "data", "x"), "", "", codes.InvalidArgument}, // ENOTDIR
	} {
		got, err := lookPath(tt.file, tt.path, dir)
		if got != tt.want || status.Code(err) != tt.code {
			t.Errorf("lookPath(%q, %q) = %q, %v; want %q, %v", tt.file, tt.path, got, err, tt.want, tt.code)
		}
	}
}

// TestFileBounds: the file calls' bounds, package filetree's, are the ones
// the API states.
func TestFileBounds(t *testing.T) {
	for _, tt := range []struct {
		name      string
		got, want int
	}{
		{"MaxListEntries", filetree.MaxListEntries, agentpb.MaxListEntries},
		{"MaxWatchDirs", filetree.MaxWatchDirs, agentpb.MaxWatchDirs},
		{"MaxUserNameBytes", filetree.MaxUserNameBytes, agentpb.MaxUserNameBytes},
	} {
		if tt.got != tt.want {
			t.Errorf("filetree.%s = %d, agentpb's %d", tt.name, tt.got, tt.want)
		}
	}
}

func TestValidateEnv(t *testing.T) {
	for _, tt := range []struct {
		env []string
		ok  bool
	}{
		{[]string{"A=b", "EMPTY=", "X==y", "LANG=C.UTF-8"}, true},
		{[]string{"A"}, false},
		{[]string{"=b"}, false},
		{[]string{"A=b\x00c"}, false},
	} {
		if err := validateEnv(tt.env); (err == nil) != tt.ok {
			t.Errorf("validateEnv(%q) = %v", tt.env, err)
		}
	}
	if v, ok := envValue([]string{"A=1", "PATH=/a", "PATH=/b"}, "PATH"); !ok || v != "/a" {
		t.Errorf("envValue = %q, %v", v, ok)
	}
}

func TestProcParsers(t *testing.T) {
	m := parseMeminfo([]byte("MemTotal:       16318780 kB\nMemFree: 1 kB\nMemAvailable:   8000000 kB\nHugePages_Total:       4\nbroken line\n:\nBig: 99999999999999999999 kB\n"))
	if m["MemTotal"] != 16318780*1024 || m["MemAvailable"] != 8000000*1024 || m["HugePages_Total"] != 4 || len(m) != 4 {
		t.Errorf("parseMeminfo: %v", m)
	}
	for in, want := range map[string]time.Duration{
		"350735.47 234388.90\n": 350735*time.Second + 470*time.Millisecond,
		"12 0":                  12 * time.Second,
		"1.123456789123 0":      time.Second + 123456789,
	} {
		if got, err := parseUptime([]byte(in)); err != nil || got != want {
			t.Errorf("parseUptime(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, in := range []string{"", "x", "-1.5", "1.x", "99999999999999999999.1"} {
		if got, err := parseUptime([]byte(in)); err == nil {
			t.Errorf("parseUptime(%q) = %v, want an error", in, got)
		}
	}
	c := parseKeyedCounters([]byte("low 0\nhigh 3\noom 1\noom_kill 2\noom_group_kill 0\nbad\nworse x\n"))
	if c["oom_kill"] != 2 || c["high"] != 3 || len(c) != 5 {
		t.Errorf("parseKeyedCounters: %v", c)
	}
}

func TestRandPoolInfo(t *testing.T) {
	b := []byte{1, 2, 3, 4, 5}
	info := randPoolInfo(b)
	if len(info) != 8+8 {
		t.Fatalf("length %d", len(info))
	}
	if binary.NativeEndian.Uint32(info[0:]) != 40 || binary.NativeEndian.Uint32(info[4:]) != 5 || string(info[8:13]) != string(b) {
		t.Errorf("rand_pool_info %x", info)
	}
}

func TestCgroupsInDirectory(t *testing.T) {
	root := t.TempDir()
	if _, err := setupCgroups(slog.New(slog.DiscardHandler), root, 10, 1<<30, 48<<20); err == nil {
		t.Error("setup in a directory without cgroup.procs succeeded")
	}
	os.WriteFile(filepath.Join(root, "cgroup.procs"), nil, 0o644)
	cg, err := setupCgroups(slog.New(slog.DiscardHandler), root, 10, 1<<30, 48<<20)
	if err != nil {
		t.Fatal(err)
	}
	read := func(name string) string {
		b, _ := os.ReadFile(filepath.Join(root, sandboxCgroup, name))
		return string(b)
	}
	if read("pids.max") != "10" || read("memory.max") != strconv.Itoa(1<<30-48<<20) {
		t.Errorf("pids.max %q, memory.max %q", read("pids.max"), read("memory.max"))
	}
	e, err := cg.newExec()
	if err != nil {
		t.Fatal(err)
	}
	if e.oomKilled() {
		t.Error("oomKilled without memory.events")
	}
	events := filepath.Join(e.dir, "memory.events")
	os.WriteFile(events, []byte("low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n"), 0o644)
	if !e.oomKilled() {
		t.Error("oom_kill 1 not seen")
	}
	// Still "populated" (here: not empty): kept for a later sweep.
	cg.release(e)
	if len(cg.pending) != 1 {
		t.Fatalf("pending %v", cg.pending)
	}
	os.Remove(events)
	e2, err := cg.newExec() // sweeps
	if err != nil {
		t.Fatal(err)
	}
	cg.release(e2)
	if _, err := os.Stat(e.dir); !os.IsNotExist(err) || len(cg.pending) != 0 {
		t.Errorf("after sweep: %v, pending %v", err, cg.pending)
	}
	if e2.fd != -1 {
		t.Error("fd not closed")
	}
	var st unix.Stat_t
	if err := unix.Stat(e2.dir, &st); err == nil {
		t.Error("exec cgroup not removed")
	}
}
