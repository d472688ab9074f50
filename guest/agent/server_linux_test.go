package agent_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/guest/agent"
	"github.com/kilnvm/kiln/guest/agentpb"
	"github.com/kilnvm/kiln/guest/client"
)

// TestMain lets the test binary serve as the exec trampoline: the Server
// re-executes /proc/self/exe, which is this binary.
func TestMain(m *testing.M) {
	agent.MaybeRunTrampoline()
	os.Exit(m.Run())
}

// fakeSystem records the snapshot hooks instead of touching the host.
type fakeSystem struct {
	mu         sync.Mutex
	syncs      int
	dropCaches int
	entropy    [][]byte
	clock      []time.Time
	hostnames  []string
}

func (f *fakeSystem) Sync() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.syncs++
	return nil
}

func (f *fakeSystem) DropCaches() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.dropCaches++
	return nil
}

func (f *fakeSystem) AddEntropy(b []byte) (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.entropy = append(f.entropy, bytes.Clone(b))
	return true, nil
}

func (f *fakeSystem) SetClock(t time.Time) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.clock = append(f.clock, t)
	return nil
}

func (f *fakeSystem) SetHostname(name string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.hostnames = append(f.hostnames, name)
	return nil
}

// testAgent is a Server on a Unix socket and a client of it.
type testAgent struct {
	*client.Client
	sock string
	sys  *fakeSystem
	srv  *agent.Server
}

// startAgent serves cfg on a Unix socket in a temporary directory (with a
// fake System unless cfg has one) and connects a client to it.
func startAgent(t *testing.T, cfg agent.Config) *testAgent {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "agent.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	sys := &fakeSystem{}
	if cfg.System == nil {
		cfg.System = sys
	}
	if cfg.Logger == nil && testing.Verbose() {
		cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	}
	srv := agent.NewServer(cfg)
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ctx, ln) }()
	c, err := client.New(ctx, unixDialer(sock))
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.Close()
		cancel()
		if err := <-served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return &testAgent{Client: c, sock: sock, sys: sys, srv: srv}
}

func unixDialer(path string) client.DialFunc {
	return func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", path)
	}
}

func testContext(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), d)
	t.Cleanup(cancel)
	return ctx
}

// wantCode checks err's gRPC code and that its message contains each of
// substrs.
func wantCode(t *testing.T, err error, code codes.Code, substrs ...string) {
	t.Helper()
	if got := status.Code(err); got != code {
		t.Fatalf("error %v: code %v, want %v", err, got, code)
	}
	for _, s := range substrs {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("error %q does not mention %q", err, s)
		}
	}
}

func TestExec(t *testing.T) {
	a := startAgent(t, agent.Config{})
	dir := t.TempDir()
	tests := []struct {
		name       string
		opts       client.ExecOptions
		stdout     string
		stderr     string
		code       int
		signal     int
		shellCode  int
		skipNoRoot bool
	}{
		{
			name:   "separate streams and exit code",
			opts:   client.ExecOptions{Argv: []string{"sh", "-c", "echo out; echo err >&2; exit 3"}},
			stdout: "out\n", stderr: "err\n", code: 3, shellCode: 3,
		},
		{
			name: "killed by a signal",
			opts: client.ExecOptions{Argv: []string{"sh", "-c", "kill -TERM $$"}},
			code: -1, signal: 15, shellCode: 143,
		},
		{
			name:   "default environment",
			opts:   client.ExecOptions{Argv: []string{"sh", "-c", `echo "$PATH $HOME $TERM"`}},
			stdout: agent.DefaultPath + " /root xterm\n",
		},
		{
			name:   "given environment",
			opts:   client.ExecOptions{Argv: []string{"sh", "-c", `echo "$FOO" "${HOME:-none}"`}, Env: []string{"FOO=bar baz", "PATH=/usr/bin:/bin"}},
			stdout: "bar baz none\n",
		},
		{
			name:   "working directory",
			opts:   client.ExecOptions{Argv: []string{"pwd"}, Dir: dir},
			stdout: dir + "\n",
		},
		{
			name:   "absolute argv[0] and arguments",
			opts:   client.ExecOptions{Argv: []string{"/bin/sh", "-c", `printf '%s|' "$0" "$@"`, "zero", "a b", ""}},
			stdout: "zero|a b||",
		},
		{
			name:   "own process group",
			opts:   client.ExecOptions{Argv: []string{"sh", "-c", `[ "$(ps -o pgid= $$ | tr -d ' ')" = "$$" ] && echo leader`}},
			stdout: "leader\n",
		},
		{
			name:       "uid and gid",
			opts:       client.ExecOptions{Argv: []string{"sh", "-c", "id -u; id -g; id -G"}, UID: 65534, GID: 65533},
			stdout:     "65534\n65533\n65533\n",
			skipNoRoot: true,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.skipNoRoot && os.Getuid() != 0 {
				t.Skip("needs root")
			}
			var stdout, stderr bytes.Buffer
			tt.opts.Stdout, tt.opts.Stderr = &stdout, &stderr
			st, err := a.Exec(testContext(t, 20*time.Second), tt.opts)
			if err != nil {
				t.Fatal(err)
			}
			if stdout.String() != tt.stdout || stderr.String() != tt.stderr {
				t.Errorf("stdout %q, stderr %q; want %q, %q", stdout.String(), stderr.String(), tt.stdout, tt.stderr)
			}
			if st.Code != tt.code || st.Signal != tt.signal || st.ShellCode() != tt.shellCode || st.TimedOut {
				t.Errorf("status %+v (shell code %d), want code %d signal %d shell code %d", st, st.ShellCode(), tt.code, tt.signal, tt.shellCode)
			}
		})
	}
}

// TestExecOOMScoreReset checks that the trampoline gives processes an
// oom_score_adj of 0, whatever the agent's (here: the test's, raised to
// 500, which needs no privilege and only makes this test process more
// killable).
func TestExecOOMScoreReset(t *testing.T) {
	if err := os.WriteFile("/proc/self/oom_score_adj", []byte("500\n"), 0); err != nil {
		t.Skipf("cannot raise oom_score_adj: %v", err)
	}
	a := startAgent(t, agent.Config{})
	var out bytes.Buffer
	if _, err := a.Exec(testContext(t, 10*time.Second), client.ExecOptions{Argv: []string{"cat", "/proc/self/oom_score_adj"}, Stdout: &out}); err != nil {
		t.Fatal(err)
	}
	if got := strings.TrimSpace(out.String()); got != "0" {
		t.Errorf("oom_score_adj of an exec'd process: %q, want 0", got)
	}
}

// hashWriter hashes what is written to it.
type hashWriter struct {
	h interface {
		io.Writer
		Sum([]byte) []byte
	}
	n int64
}

func newHashWriter() *hashWriter { return &hashWriter{h: sha256.New()} }

func (w *hashWriter) Write(b []byte) (int, error) {
	w.n += int64(len(b))
	return w.h.Write(b)
}

func (w *hashWriter) sum() [32]byte { return [32]byte(w.h.Sum(nil)) }

func randomBytes(t *testing.T, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	rand.Read(b)
	return b
}

func TestExecStdin(t *testing.T) {
	a := startAgent(t, agent.Config{})
	ctx := testContext(t, 30*time.Second)

	t.Run("cat a few MiB", func(t *testing.T) {
		data := randomBytes(t, 3<<20+12345)
		out := newHashWriter()
		st, err := a.Exec(ctx, client.ExecOptions{Argv: []string{"cat"}, Stdin: bytes.NewReader(data), Stdout: out})
		if err != nil || !st.Success() {
			t.Fatalf("exec: %v, %v", st, err)
		}
		if out.n != int64(len(data)) || out.sum() != sha256.Sum256(data) {
			t.Errorf("got %d bytes (sha256 %x), sent %d (sha256 %x)", out.n, out.sum(), len(data), sha256.Sum256(data))
		}
	})

	t.Run("process reads only part", func(t *testing.T) {
		data := randomBytes(t, 4<<20)
		var out bytes.Buffer
		st, err := a.Exec(ctx, client.ExecOptions{Argv: []string{"head", "-c", "10"}, Stdin: bytes.NewReader(data), Stdout: &out})
		if err != nil || !st.Success() {
			t.Fatalf("exec: %v, %v", st, err)
		}
		if !bytes.Equal(out.Bytes(), data[:10]) {
			t.Errorf("got %x, want %x", out.Bytes(), data[:10])
		}
	})

	t.Run("close stdin from a pipe", func(t *testing.T) {
		pr, pw := io.Pipe()
		var out bytes.Buffer
		p, err := a.Start(ctx, client.ExecOptions{Argv: []string{"sh", "-c", "cat; echo done"}, Stdin: pr, Stdout: &out})
		if err != nil {
			t.Fatal(err)
		}
		io.WriteString(pw, "hello\n")
		pw.Close()
		st, err := p.Wait()
		if err != nil || !st.Success() {
			t.Fatalf("exec: %v, %v", st, err)
		}
		if out.String() != "hello\ndone\n" {
			t.Errorf("stdout %q", out.String())
		}
	})

	t.Run("no stdin is /dev/null", func(t *testing.T) {
		var out bytes.Buffer
		st, err := a.Exec(ctx, client.ExecOptions{Argv: []string{"sh", "-c", "wc -c"}, Stdout: &out})
		if err != nil || !st.Success() {
			t.Fatalf("exec: %v, %v", st, err)
		}
		if strings.TrimSpace(out.String()) != "0" {
			t.Errorf("stdout %q", out.String())
		}
	})
}

func TestExecLargeOutput(t *testing.T) {
	a := startAgent(t, agent.Config{})
	data := randomBytes(t, 20<<20)
	f := filepath.Join(t.TempDir(), "big")
	if err := os.WriteFile(f, data, 0o644); err != nil {
		t.Fatal(err)
	}
	out, errOut := newHashWriter(), newHashWriter()
	st, err := a.Exec(testContext(t, 30*time.Second), client.ExecOptions{
		Argv:   []string{"sh", "-c", `cat "$1"; cat "$1" >&2`, "sh", f},
		Stdout: out, Stderr: errOut,
	})
	if err != nil || !st.Success() {
		t.Fatalf("exec: %v, %v", st, err)
	}
	want := sha256.Sum256(data)
	for name, w := range map[string]*hashWriter{"stdout": out, "stderr": errOut} {
		if w.n != int64(len(data)) || w.sum() != want {
			t.Errorf("%s: %d bytes (sha256 %x), want %d (%x)", name, w.n, w.sum(), len(data), want)
		}
	}
}

// slowWriter sleeps on every write, to exercise flow control.
type slowWriter struct {
	n int
}

func (w *slowWriter) Write(b []byte) (int, error) {
	time.Sleep(time.Millisecond)
	w.n += len(b)
	return len(b), nil
}

// TestExecSlowReader checks that output is held back, not lost, when the
// client reads slowly.
func TestExecSlowReader(t *testing.T) {
	a := startAgent(t, agent.Config{})
	w := &slowWriter{}
	st, err := a.Exec(testContext(t, 30*time.Second), client.ExecOptions{Argv: []string{"head", "-c", "8388608", "/dev/zero"}, Stdout: w})
	if err != nil || !st.Success() {
		t.Fatalf("exec: %v, %v", st, err)
	}
	if w.n != 8<<20 {
		t.Errorf("got %d bytes, want %d", w.n, 8<<20)
	}
}

func TestExecConcurrent(t *testing.T) {
	a := startAgent(t, agent.Config{})
	ctx := testContext(t, 60*time.Second)
	const n = 50
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() {
			var out, errOut bytes.Buffer
			st, err := a.Exec(ctx, client.ExecOptions{
				Argv:   []string{"sh", "-c", `echo "out $1"; echo "err $1" >&2; exit $(($1 % 7))`, "sh", strconv.Itoa(i)},
				Stdout: &out, Stderr: &errOut,
			})
			switch {
			case err != nil:
				errs[i] = err
			case out.String() != fmt.Sprintf("out %d\n", i) || errOut.String() != fmt.Sprintf("err %d\n", i):
				errs[i] = fmt.Errorf("exec %d: stdout %q stderr %q", i, out.String(), errOut.String())
			case st.Code != i%7:
				errs[i] = fmt.Errorf("exec %d: %v, want code %d", i, st, i%7)
			}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
}

// gone reports whether pid no longer runs (it is gone, or a zombie).
func gone(pid int) bool {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true
	}
	_, rest, _ := strings.Cut(string(data), ") ")
	return strings.HasPrefix(rest, "Z") || strings.HasPrefix(rest, "X")
}

func TestExecTimeout(t *testing.T) {
	a := startAgent(t, agent.Config{})
	ctx := testContext(t, 20*time.Second)
	var out bytes.Buffer
	start := time.Now()
	// The background sleep holds stdout and is in the process group.
	st, err := a.Exec(ctx, client.ExecOptions{
		Argv:    []string{"sh", "-c", "sleep 30 & echo $!; sleep 30"},
		Timeout: 200 * time.Millisecond,
		Stdout:  &out,
	})
	took := time.Since(start)
	if err != nil {
		t.Fatal(err)
	}
	if !st.TimedOut || st.Signal != 9 || st.ShellCode() != 137 {
		t.Errorf("status %+v, want timed out by signal 9", st)
	}
	if took > 3*time.Second {
		t.Errorf("took %v", took)
	}
	bg, err := strconv.Atoi(strings.TrimSpace(out.String()))
	if err != nil {
		t.Fatalf("stdout %q: %v", out.String(), err)
	}
	for i := 0; !gone(bg); i++ {
		if i == 100 {
			t.Fatalf("background process %d of the timed-out group still runs", bg)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestExecBackgroundHoldsOutput checks that a background process keeping
// stdout open does not hold up the exit status for long.
func TestExecBackgroundHoldsOutput(t *testing.T) {
	a := startAgent(t, agent.Config{OutputGrace: 100 * time.Millisecond})
	var out bytes.Buffer
	start := time.Now()
	st, err := a.Exec(testContext(t, 20*time.Second), client.ExecOptions{
		Argv:   []string{"sh", "-c", "sleep 5 & echo $!; echo bye"},
		Stdout: &out,
	})
	if err != nil || !st.Success() {
		t.Fatalf("exec: %v, %v", st, err)
	}
	if took := time.Since(start); took > 3*time.Second {
		t.Errorf("took %v", took)
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(lines) != 2 || lines[1] != "bye" {
		t.Fatalf("stdout %q", out.String())
	}
	if pid, err := strconv.Atoi(lines[0]); err == nil {
		syscall.Kill(pid, syscall.SIGKILL)
	}
}

func TestExecSignalAndCancel(t *testing.T) {
	a := startAgent(t, agent.Config{})
	ctx := testContext(t, 20*time.Second)

	t.Run("signal", func(t *testing.T) {
		p, err := a.Start(ctx, client.ExecOptions{Argv: []string{"sleep", "30"}})
		if err != nil {
			t.Fatal(err)
		}
		if p.Pid() <= 0 {
			t.Errorf("pid %d", p.Pid())
		}
		if err := p.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		st, err := p.Wait()
		if err != nil || st.Signal != 15 || st.TimedOut {
			t.Fatalf("status %+v, %v; want signal 15", st, err)
		}
	})

	t.Run("group signal", func(t *testing.T) {
		var out bytes.Buffer
		p, err := a.Start(ctx, client.ExecOptions{Argv: []string{"sh", "-c", "trap 'echo got; exit 4' USR1; sleep 30 & wait"}, Stdout: &out})
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(200 * time.Millisecond) // let the shell set its trap
		if err := p.SignalGroup(syscall.SIGUSR1); err != nil {
			t.Fatal(err)
		}
		st, err := p.Wait()
		if err != nil || st.Code != 4 {
			t.Fatalf("status %+v, %v; want code 4", st, err)
		}
	})

	t.Run("cancel kills", func(t *testing.T) {
		cctx, cancel := context.WithCancel(ctx)
		p, err := a.Start(cctx, client.ExecOptions{Argv: []string{"sleep", "30"}})
		if err != nil {
			t.Fatal(err)
		}
		pid := p.Pid()
		cancel()
		if _, err := p.Wait(); status.Code(err) != codes.Canceled {
			t.Fatalf("Wait after cancel: %v", err)
		}
		for i := 0; !gone(pid); i++ {
			if i == 100 {
				t.Fatalf("pid %d still runs after cancel", pid)
			}
			time.Sleep(20 * time.Millisecond)
		}
	})
}

func TestExecErrors(t *testing.T) {
	a := startAgent(t, agent.Config{})
	ctx := testContext(t, 20*time.Second)
	dir := t.TempDir()
	notExec := filepath.Join(dir, "not-executable")
	if err := os.WriteFile(notExec, []byte("#!/bin/sh\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	badInterp := filepath.Join(dir, "bad-interpreter")
	if err := os.WriteFile(badInterp, []byte("#!/nonexistent/interpreter\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name    string
		start   *agentpb.ExecStart
		code    codes.Code
		mention []string
	}{
		{"missing binary", &agentpb.ExecStart{Argv: []string{"no-such-binary-kiln"}}, codes.NotFound, []string{"no-such-binary-kiln"}},
		{"missing path", &agentpb.ExecStart{Argv: []string{"/nonexistent/bin/x"}}, codes.NotFound, []string{"/nonexistent/bin/x"}},
		{"missing interpreter", &agentpb.ExecStart{Argv: []string{badInterp}}, codes.NotFound, []string{badInterp}},
		{"not executable", &agentpb.ExecStart{Argv: []string{notExec}}, codes.PermissionDenied, []string{notExec}},
		{"directory", &agentpb.ExecStart{Argv: []string{dir}}, codes.InvalidArgument, []string{dir}},
		{"missing cwd", &agentpb.ExecStart{Argv: []string{"true"}, Cwd: "/nonexistent/dir"}, codes.InvalidArgument, []string{"/nonexistent/dir"}},
		{"cwd is a file", &agentpb.ExecStart{Argv: []string{"true"}, Cwd: notExec}, codes.InvalidArgument, []string{notExec}},
		{"relative cwd", &agentpb.ExecStart{Argv: []string{"true"}, Cwd: "tmp"}, codes.InvalidArgument, []string{"tmp"}},
		{"empty argv", &agentpb.ExecStart{}, codes.InvalidArgument, []string{"argv"}},
		{"empty argv[0]", &agentpb.ExecStart{Argv: []string{""}}, codes.InvalidArgument, []string{"argv[0]"}},
		{"NUL in argv", &agentpb.ExecStart{Argv: []string{"echo", "a\x00b"}}, codes.InvalidArgument, []string{"argv[1]"}},
		{"bad env", &agentpb.ExecStart{Argv: []string{"true"}, Env: []string{"NOEQUALS"}}, codes.InvalidArgument, []string{"NOEQUALS"}},
		{"empty env name", &agentpb.ExecStart{Argv: []string{"true"}, Env: []string{"=x"}}, codes.InvalidArgument, []string{"env[0]"}},
		{"not in given PATH", &agentpb.ExecStart{Argv: []string{"sh"}, Env: []string{"PATH=/nonexistent"}}, codes.NotFound, []string{"sh", "/nonexistent"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			stream, err := a.API().Exec(ctx)
			if err != nil {
				t.Fatal(err)
			}
			stream.Send(&agentpb.ExecRequest{Kind: &agentpb.ExecRequest_Start{Start: tt.start}})
			_, err = stream.Recv()
			wantCode(t, err, tt.code, tt.mention...)
		})
	}

	t.Run("no start", func(t *testing.T) {
		stream, err := a.API().Exec(ctx)
		if err != nil {
			t.Fatal(err)
		}
		stream.Send(&agentpb.ExecRequest{Kind: &agentpb.ExecRequest_Stdin{Stdin: []byte("x")}})
		_, err = stream.Recv()
		wantCode(t, err, codes.InvalidArgument, "start")
	})

	t.Run("client: missing binary", func(t *testing.T) {
		_, err := a.Exec(ctx, client.ExecOptions{Argv: []string{"no-such-binary-kiln"}})
		wantCode(t, err, codes.NotFound, "no-such-binary-kiln")
	})

	// The agent keeps serving.
	if err := a.Health(ctx); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if st, err := a.Exec(ctx, client.ExecOptions{Argv: []string{"echo", "still here"}, Stdout: &out}); err != nil || !st.Success() || out.String() != "still here\n" {
		t.Fatalf("exec after errors: %v, %v, %q", st, err, out.String())
	}
}

func TestFileRoundTrip(t *testing.T) {
	a := startAgent(t, agent.Config{})
	ctx := testContext(t, 30*time.Second)
	data := randomBytes(t, 10<<20+7)
	path := filepath.Join(t.TempDir(), "sub", "file.bin")

	fi, err := a.WriteFileInfo(ctx, path, bytes.NewReader(data), 0o640, client.MakeParents())
	if err != nil {
		t.Fatal(err)
	}
	if fi.Size != int64(len(data)) || fi.Mode != 0o640 || fi.Path != path || fi.Name != "file.bin" {
		t.Errorf("WriteFile's info %+v", fi)
	}
	out := newHashWriter()
	n, err := a.ReadFile(ctx, path, out)
	if err != nil {
		t.Fatal(err)
	}
	if n != int64(len(data)) || out.sum() != sha256.Sum256(data) {
		t.Errorf("read %d bytes (sha256 %x), wrote %d (%x)", n, out.sum(), len(data), sha256.Sum256(data))
	}
	onDisk, err := os.ReadFile(path)
	if err != nil || !bytes.Equal(onDisk, data) {
		t.Errorf("file on disk differs (%v)", err)
	}

	// Overwrite with something shorter, setuid bits included.
	if err := a.WriteFile(ctx, path, strings.NewReader("short"), 0o4755); err != nil {
		t.Fatal(err)
	}
	st, err := a.Stat(ctx, path)
	if err != nil {
		t.Fatal(err)
	}
	if st.Size != 5 || st.Mode != 0o755|os.ModeSetuid || st.IsDir {
		t.Errorf("Stat after overwrite: %+v", st)
	}

	// Empty file, default mode.
	empty := filepath.Join(filepath.Dir(path), "empty")
	if err := a.WriteFile(ctx, empty, strings.NewReader(""), 0); err != nil {
		t.Fatal(err)
	}
	if st, err := a.Stat(ctx, empty); err != nil || st.Size != 0 || st.Mode != 0o644 {
		t.Errorf("empty file: %+v, %v", st, err)
	}
}

// failingReader returns some data, then an error.
type failingReader struct {
	data []byte
}

func (r *failingReader) Read(b []byte) (int, error) {
	if len(r.data) == 0 {
		return 0, errors.New("source broke")
	}
	n := copy(b, r.data)
	r.data = r.data[n:]
	return n, nil
}

func TestWriteFileErrors(t *testing.T) {
	a := startAgent(t, agent.Config{})
	ctx := testContext(t, 20*time.Second)
	dir := t.TempDir()

	t.Run("missing directory", func(t *testing.T) {
		p := filepath.Join(dir, "missing", "f")
		err := a.WriteFile(ctx, p, strings.NewReader("x"), 0o644)
		wantCode(t, err, codes.NotFound, p)
	})
	t.Run("relative path", func(t *testing.T) {
		err := a.WriteFile(ctx, "rel/f", strings.NewReader("x"), 0o644)
		wantCode(t, err, codes.InvalidArgument, "rel/f")
	})
	t.Run("over a directory", func(t *testing.T) {
		err := a.WriteFile(ctx, dir, strings.NewReader("x"), 0o644)
		if err == nil {
			t.Fatal("no error")
		}
	})
	t.Run("parent is a file", func(t *testing.T) {
		f := filepath.Join(dir, "plain")
		os.WriteFile(f, nil, 0o644)
		err := a.WriteFile(ctx, filepath.Join(f, "x"), strings.NewReader("x"), 0o644, client.MakeParents())
		wantCode(t, err, codes.InvalidArgument, f)
	})
	t.Run("bad mode", func(t *testing.T) {
		stream, err := a.API().WriteFile(ctx)
		if err != nil {
			t.Fatal(err)
		}
		stream.Send(&agentpb.WriteFileRequest{Kind: &agentpb.WriteFileRequest_Header{Header: &agentpb.WriteFileHeader{Path: filepath.Join(dir, "m"), Mode: 0o170644}}})
		_, err = stream.CloseAndRecv()
		wantCode(t, err, codes.InvalidArgument, "mode")
	})
	t.Run("no header", func(t *testing.T) {
		stream, err := a.API().WriteFile(ctx)
		if err != nil {
			t.Fatal(err)
		}
		stream.Send(&agentpb.WriteFileRequest{Kind: &agentpb.WriteFileRequest_Data{Data: []byte("x")}})
		_, err = stream.CloseAndRecv()
		wantCode(t, err, codes.InvalidArgument, "header")
	})
	t.Run("broken source leaves nothing", func(t *testing.T) {
		sub := filepath.Join(dir, "atomic")
		os.Mkdir(sub, 0o755)
		p := filepath.Join(sub, "f")
		err := a.WriteFile(ctx, p, &failingReader{data: randomBytes(t, 1<<20)}, 0o644)
		if err == nil || !strings.Contains(err.Error(), "source broke") {
			t.Fatalf("error %v", err)
		}
		// The agent removes its temporary file once it sees the call end.
		for i := 0; ; i++ {
			entries, _ := os.ReadDir(sub)
			if len(entries) == 0 {
				break
			}
			if i == 100 {
				t.Fatalf("left behind: %v", entries)
			}
			time.Sleep(20 * time.Millisecond)
		}
	})
	t.Run("failed overwrite keeps the old file", func(t *testing.T) {
		p := filepath.Join(dir, "keep")
		os.WriteFile(p, []byte("old"), 0o644)
		if err := a.WriteFile(ctx, p, &failingReader{data: []byte("new")}, 0o644); err == nil {
			t.Fatal("no error")
		}
		if b, _ := os.ReadFile(p); string(b) != "old" {
			t.Errorf("file now %q", b)
		}
	})
}

func TestFileOps(t *testing.T) {
	a := startAgent(t, agent.Config{})
	ctx := testContext(t, 20*time.Second)
	dir := t.TempDir()
	d := filepath.Join(dir, "d")

	if err := a.Mkdir(ctx, d, 0o750, false); err != nil {
		t.Fatal(err)
	}
	wantCode(t, a.Mkdir(ctx, d, 0o750, false), codes.AlreadyExists, d)
	if err := a.Mkdir(ctx, d, 0o750, true); err != nil {
		t.Errorf("Mkdir -p on an existing directory: %v", err)
	}
	deep := filepath.Join(d, "x", "y", "z")
	wantCode(t, a.Mkdir(ctx, deep, 0, false), codes.NotFound, deep)
	if err := a.Mkdir(ctx, deep, 0, true); err != nil {
		t.Fatal(err)
	}
	if st, err := a.Stat(ctx, d); err != nil || !st.IsDir || st.Mode != os.ModeDir|0o750 {
		t.Errorf("Stat %s: %+v, %v", d, st, err)
	}
	if err := a.WriteFile(ctx, filepath.Join(d, "b.txt"), strings.NewReader("hello"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("b.txt", filepath.Join(d, "a-link")); err != nil {
		t.Fatal(err)
	}

	entries, err := a.List(ctx, d)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range entries {
		got = append(got, fmt.Sprintf("%s %d %v %v %q", e.Name, map[bool]int64{true: -1, false: e.Size}[e.IsDir], e.Mode.Type(), e.IsDir, e.Symlink))
		if e.Path != filepath.Join(d, e.Name) || e.ModTime.IsZero() {
			t.Errorf("entry %+v", e)
		}
	}
	want := []string{
		`a-link 5 L--------- false "b.txt"`,
		`b.txt 5 ---------- false ""`,
		`x -1 d--------- true ""`,
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("List:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}

	link := filepath.Join(d, "a-link")
	if st, err := a.Stat(ctx, link); err != nil || st.Symlink != "" || st.Mode != 0o600 {
		t.Errorf("Stat follows the link: %+v, %v", st, err)
	}
	if st, err := a.Lstat(ctx, link); err != nil || st.Symlink != "b.txt" || st.Mode.Type() != os.ModeSymlink {
		t.Errorf("Lstat: %+v, %v", st, err)
	}

	missing := filepath.Join(dir, "missing")
	_, err = a.Stat(ctx, missing)
	wantCode(t, err, codes.NotFound, missing)
	_, err = a.List(ctx, missing)
	wantCode(t, err, codes.NotFound, missing)
	_, err = a.List(ctx, filepath.Join(d, "b.txt"))
	wantCode(t, err, codes.InvalidArgument, "b.txt")
	_, err = a.ReadFile(ctx, missing, io.Discard)
	wantCode(t, err, codes.NotFound, missing)
	_, err = a.ReadFile(ctx, d, io.Discard)
	wantCode(t, err, codes.InvalidArgument, d)
	fifo := filepath.Join(dir, "fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	_, err = a.ReadFile(ctx, fifo, io.Discard)
	wantCode(t, err, codes.InvalidArgument, fifo)
	_, err = a.Stat(ctx, "relative")
	wantCode(t, err, codes.InvalidArgument, "relative")

	wantCode(t, a.Remove(ctx, d, false), codes.FailedPrecondition, d)
	wantCode(t, a.Remove(ctx, missing, false), codes.NotFound, missing)
	wantCode(t, a.Remove(ctx, missing, true), codes.NotFound, missing)
	wantCode(t, a.Remove(ctx, "/", true), codes.InvalidArgument, "/")
	if err := a.Remove(ctx, filepath.Join(d, "b.txt"), false); err != nil {
		t.Fatal(err)
	}
	if err := a.Remove(ctx, d, true); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(d); !os.IsNotExist(err) {
		t.Errorf("%s still there: %v", d, err)
	}
}

func TestInfoAndHealth(t *testing.T) {
	a := startAgent(t, agent.Config{Version: "1.2.3-test"})
	ctx := testContext(t, 10*time.Second)
	if err := a.Health(ctx); err != nil {
		t.Fatal(err)
	}
	info, err := a.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.KernelRelease == "" || info.Hostname == "" || info.Uptime <= 0 || info.MemTotal == 0 ||
		info.MemAvailable == 0 || info.MemAvailable > info.MemTotal || info.NumCPU <= 0 || info.AgentVersion != "1.2.3-test" {
		t.Errorf("Info %+v", info)
	}
}

func TestSnapshotHooks(t *testing.T) {
	powered := make(chan struct{}, 2)
	a := startAgent(t, agent.Config{
		PowerOff:      func() error { powered <- struct{}{}; return nil },
		PowerOffDelay: time.Millisecond,
	})
	ctx := testContext(t, 10*time.Second)

	if err := a.Quiesce(ctx, true); err != nil {
		t.Fatal(err)
	}
	if a.sys.syncs != 1 || a.sys.dropCaches != 1 {
		t.Errorf("quiesce: %d syncs, %d cache drops", a.sys.syncs, a.sys.dropCaches)
	}

	for _, tt := range []struct {
		n    int
		code codes.Code
	}{{0, codes.InvalidArgument}, {31, codes.InvalidArgument}, {32, codes.OK}, {4096, codes.OK}, {4097, codes.InvalidArgument}} {
		credited, err := a.Reseed(ctx, make([]byte, tt.n))
		if status.Code(err) != tt.code || (err == nil && !credited) {
			t.Errorf("Reseed(%d bytes): %v, %v; want %v", tt.n, credited, err, tt.code)
		}
	}
	if len(a.sys.entropy) != 2 || len(a.sys.entropy[0]) != 32 || len(a.sys.entropy[1]) != 4096 {
		t.Errorf("entropy passed on: %d calls", len(a.sys.entropy))
	}

	when := time.Date(2031, 5, 6, 7, 8, 9, 10, time.UTC)
	if err := a.SetClock(ctx, when); err != nil {
		t.Fatal(err)
	}
	if len(a.sys.clock) != 1 || !a.sys.clock[0].Equal(when) {
		t.Errorf("clock set to %v", a.sys.clock)
	}
	wantCode(t, a.SetClock(ctx, time.Unix(0, 0)), codes.InvalidArgument)

	if err := a.PowerOff(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case <-powered:
	case <-time.After(5 * time.Second):
		t.Fatal("PowerOff callback not called")
	}

	b := startAgent(t, agent.Config{})
	wantCode(t, b.PowerOff(ctx), codes.FailedPrecondition)
}

// TestCgroupFallback points CgroupRoot at a plain directory: the sandbox
// "cgroup" is set up there, starting a process in it fails, and the agent
// runs the process without a cgroup.
func TestCgroupFallback(t *testing.T) {
	root := t.TempDir()
	if err := os.WriteFile(filepath.Join(root, "cgroup.procs"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	a := startAgent(t, agent.Config{CgroupRoot: root, PidsMax: 123})
	var out bytes.Buffer
	st, err := a.Exec(testContext(t, 10*time.Second), client.ExecOptions{Argv: []string{"echo", "ok"}, Stdout: &out})
	if err != nil || !st.Success() || out.String() != "ok\n" || st.OOMKilled {
		t.Fatalf("exec: %v, %v, %q", st, err, out.String())
	}
	if b, err := os.ReadFile(filepath.Join(root, "sandbox", "pids.max")); err != nil || string(b) != "123" {
		t.Errorf("pids.max: %q, %v", b, err)
	}
	if entries, _ := os.ReadDir(filepath.Join(root, "sandbox")); len(entries) != 3 { // pids.max, memory.max, cgroup.subtree_control
		t.Errorf("sandbox holds %d entries, want 3 (exec cgroups removed)", len(entries))
	}
}

// fakeVsockMux is the host side of a Firecracker-style vsock device: it
// accepts on a Unix socket, reads "CONNECT <port>\n" and, while up is set,
// connects the caller to the agent's Unix socket; otherwise it closes the
// connection, like a guest port nobody listens on.
type fakeVsockMux struct {
	path  string
	agent string
	up    chan struct{}
}

func startFakeVsockMux(t *testing.T, agentSock string) *fakeVsockMux {
	m := &fakeVsockMux{path: filepath.Join(t.TempDir(), "v.sock"), agent: agentSock, up: make(chan struct{})}
	ln, err := net.Listen("unix", m.path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go m.serve(conn)
		}
	}()
	return m
}

func (m *fakeVsockMux) serve(conn net.Conn) {
	defer conn.Close()
	var b strings.Builder
	one := make([]byte, 1)
	for !strings.HasSuffix(b.String(), "\n") {
		if _, err := conn.Read(one); err != nil {
			return
		}
		b.Write(one)
	}
	select {
	case <-m.up:
	default:
		return
	}
	guest, err := net.Dial("unix", m.agent)
	if err != nil {
		return
	}
	defer guest.Close()
	io.WriteString(conn, "OK 1073741824\n")
	go io.Copy(guest, conn)
	io.Copy(conn, guest)
}

// TestDialThroughVsockMux runs the client's real Dial and WaitReady through
// a fake vsock device that refuses connections until the "guest" is up.
func TestDialThroughVsockMux(t *testing.T) {
	a := startAgent(t, agent.Config{})
	mux := startFakeVsockMux(t, a.sock)

	ctx := testContext(t, 20*time.Second)
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	_, err := client.WaitReady(short, mux.path, client.WithRetryInterval(20*time.Millisecond))
	cancel()
	if err == nil || !strings.Contains(err.Error(), "connection closed") {
		t.Fatalf("WaitReady before the agent is up: %v", err)
	}

	time.AfterFunc(200*time.Millisecond, func() { close(mux.up) })
	c, err := client.WaitReady(ctx, mux.path, client.WithRetryInterval(20*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var out bytes.Buffer
	if st, err := c.Exec(ctx, client.ExecOptions{Argv: []string{"echo", "via vsock"}, Stdout: &out}); err != nil || !st.Success() || out.String() != "via vsock\n" {
		t.Fatalf("exec: %v, %v, %q", st, err, out.String())
	}
	d, err := client.Dial(ctx, mux.path)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if err := d.Health(ctx); err != nil {
		t.Fatal(err)
	}
}
