package daemontest

import (
	"context"
	"errors"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/creack/pty"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/filetree"
)

// rootEnv names the environment variable through which an exec learns
// its sandbox's root folder on the host (the double runs commands on the
// host, not inside the root).
const rootEnv = "KILN_TEST_ROOT"

// proc is an exec of the double: a host process in a process group of
// its own, or in a session of its own on a host pty.
type proc struct {
	cmd      *exec.Cmd
	done     chan struct{}
	status   daemon.ExitStatus // once done
	err      error
	argv     []string
	id       string // a detached exec's
	started  time.Time
	pty      *os.File // its terminal's master, or nil
	copied   chan struct{}
	mu       sync.Mutex
	timedOut bool
	attached map[*[2]io.Writer]bool // AttachDetached's stdout and stderr
}

// Start runs argv on the host, in the root (cwd mapped into it), in a
// process group of its own; ctx's end (unless detached), the timeout or
// the sandbox's end kill the group.
func (in *Instance) Start(ctx context.Context, opts daemon.ExecOptions) (daemon.Process, error) {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.ended() {
		return nil, status.Error(codes.Unavailable, "daemontest: the sandbox has stopped")
	}
	bin, err := exec.LookPath(opts.Argv[0])
	if err != nil {
		return nil, status.Errorf(codes.NotFound, "daemontest: %s: %v", opts.Argv[0], err)
	}
	cmd := exec.Command(bin, opts.Argv[1:]...)
	cmd.Dir = filepath.Join(in.rootPath(), filepath.FromSlash(opts.Dir))
	if fi, err := os.Stat(cmd.Dir); err != nil || !fi.IsDir() {
		return nil, status.Errorf(codes.InvalidArgument, "daemontest: working directory %s is not a directory", opts.Dir)
	}
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH"), rootEnv + "=" + in.rootPath()}, opts.Env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	p := &proc{cmd: cmd, done: make(chan struct{}), argv: opts.Argv, id: opts.DetachID, started: time.Now()}
	stdout, stderr := opts.Stdout, opts.Stderr
	v := vmmOf(in.dir)
	if p.id != "" {
		v.mu.Lock()
		_, dup := v.detached[p.id]
		v.mu.Unlock()
		if dup {
			return nil, status.Errorf(codes.AlreadyExists, "daemontest: a detached exec %q exists", p.id)
		}
		stdout, stderr = p.tee(stdout, 0), p.tee(stderr, 1) // AttachDetached sees its output
		ctx = context.Background()                          // it outlives the call
	}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = opts.Stdin, stdout, stderr
	if opts.User != "" {
		if err := asUser(cmd, opts.User, opts.Dir == ""); err != nil {
			return nil, err
		}
	}
	if _, isFile := opts.Stdin.(*os.File); opts.Stdin != nil && !isFile && opts.Pty == nil {
		// Its own pipe, so that its exit is reported when it exits, as the
		// agent does, not when its stdin ends (exec.Cmd's Wait waits for
		// the copy of a non-file Stdin).
		cmd.Stdin = nil
		w, err := cmd.StdinPipe()
		if err != nil {
			return nil, status.Errorf(codes.Internal, "daemontest: stdin: %v", err)
		}
		go func() {
			io.Copy(w, opts.Stdin)
			w.Close()
		}()
	}
	if opts.Pty != nil {
		err = p.startOnPty(opts.Pty, opts.Stdin, stdout)
	} else {
		err = cmd.Start()
	}
	if err != nil {
		return nil, status.Errorf(codes.Internal, "daemontest: start %s: %v", opts.Argv[0], err)
	}
	in.procs[p] = true
	if p.id != "" {
		v.mu.Lock()
		v.detached[p.id] = p
		v.mu.Unlock()
	}
	go p.wait(ctx, opts.Timeout, func() {
		in.mu.Lock()
		delete(in.procs, p)
		in.mu.Unlock()
	})
	return p, nil
}

// asUser makes cmd run as the host's user name, with HOME, USER and
// LOGNAME where its environment lacks them, and in the host's / when
// noDir (the root is in the test's folders, which only root may enter).
func asUser(cmd *exec.Cmd, name string, noDir bool) error {
	u, err := filetree.LookupUser("/", name)
	if err != nil {
		return err
	}
	cmd.SysProcAttr.Credential = &syscall.Credential{Uid: u.UID, Gid: u.GID, Groups: u.Groups}
	for _, kv := range []string{"HOME=" + u.Home, "USER=" + u.Name, "LOGNAME=" + u.Name} {
		k, _, _ := strings.Cut(kv, "=")
		if !slices.ContainsFunc(cmd.Env, func(e string) bool { return strings.HasPrefix(e, k+"=") }) {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	if noDir {
		cmd.Dir = "/"
	}
	return nil
}

// startOnPty starts p's command on a new host terminal of size (its
// stdin, stdout, stderr and controlling terminal), copying the
// terminal's output to stdout and stdin into it (^D at its end).
func (p *proc) startOnPty(size *daemon.PtySize, stdin io.Reader, stdout io.Writer) error {
	ptmx, tty, err := pty.Open()
	if err != nil {
		return err
	}
	defer tty.Close() // the child's once started
	p.pty, p.copied = ptmx, make(chan struct{})
	cmd := p.cmd
	cmd.Stdin, cmd.Stdout, cmd.Stderr = tty, tty, tty
	cmd.SysProcAttr.Setpgid, cmd.SysProcAttr.Setsid, cmd.SysProcAttr.Setctty = false, true, true
	if err := p.Resize(*size); err == nil {
		err = cmd.Start()
	}
	if err != nil {
		ptmx.Close()
		return err
	}
	go func() {
		defer close(p.copied)
		io.Copy(orDiscard(stdout), ptmx) // ends with EIO once the terminal's last user is gone
	}()
	if stdin != nil {
		go func() {
			if _, err := io.Copy(ptmx, stdin); err == nil {
				ptmx.Write([]byte{4})
			}
		}()
	}
	return nil
}

// orDiscard is w, or io.Discard for nil.
func orDiscard(w io.Writer) io.Writer {
	if w == nil {
		return io.Discard
	}
	return w
}

// Resize sets the size of the exec's terminal.
func (p *proc) Resize(size daemon.PtySize) error {
	if p.pty == nil {
		return status.Error(codes.FailedPrecondition, "daemontest: the exec has no terminal")
	}
	return pty.Setsize(p.pty, &pty.Winsize{Rows: uint16(size.Rows), Cols: uint16(size.Cols)})
}

// tee is w, its bytes written to the attachers' writer i (0: stdout, 1:
// stderr) too.
func (p *proc) tee(w io.Writer, i int) io.Writer {
	w = orDiscard(w)
	return writerFunc(func(b []byte) (int, error) {
		p.mu.Lock()
		for a := range p.attached {
			a[i].Write(b)
		}
		p.mu.Unlock()
		w.Write(b) // the call's end only drops its output
		return len(b), nil
	})
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(b []byte) (int, error) { return f(b) }

func (p *proc) wait(ctx context.Context, timeout time.Duration, forget func()) {
	var timer <-chan time.Time
	if timeout > 0 {
		t := time.NewTimer(timeout)
		defer t.Stop()
		timer = t.C
	}
	exited := make(chan error, 1)
	go func() { exited <- p.cmd.Wait() }()
	var err error
	select {
	case err = <-exited:
	case <-ctx.Done():
		p.kill()
		err = <-exited
	case <-timer:
		p.mu.Lock()
		p.timedOut = true
		p.mu.Unlock()
		p.kill()
		err = <-exited
	}
	if p.pty != nil {
		<-p.copied
		p.pty.Close()
	}
	forget()
	var st daemon.ExitStatus
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee) && ee.Sys().(syscall.WaitStatus).Signaled():
		st.Code, st.Signal = -1, int(ee.Sys().(syscall.WaitStatus).Signal())
	case errors.As(err, &ee):
		st.Code = ee.ExitCode()
	case err != nil:
		p.err = err
	}
	p.mu.Lock()
	st.TimedOut = p.timedOut
	p.mu.Unlock()
	p.status = st
	close(p.done)
}

func (p *proc) kill() {
	if !p.exited() {
		syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
	}
}

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

func (p *proc) Pid() int                             { return p.cmd.Process.Pid }
func (p *proc) Signal(sig syscall.Signal) error      { return p.cmd.Process.Signal(sig) }
func (p *proc) SignalGroup(sig syscall.Signal) error { return syscall.Kill(-p.cmd.Process.Pid, sig) }

func (p *proc) Wait() (daemon.ExitStatus, error) {
	<-p.done
	return p.status, p.err
}

// Detached lists the sandbox's detached execs, oldest first. The running
// ones end with this instance too.
func (in *Instance) Detached(ctx context.Context) ([]daemon.DetachedExec, error) {
	v := vmmOf(in.dir)
	v.mu.Lock()
	ps := slices.Collect(maps.Values(v.detached))
	v.mu.Unlock()
	in.mu.Lock()
	defer in.mu.Unlock()
	var out []daemon.DetachedExec
	for _, p := range ps {
		d := daemon.DetachedExec{ID: p.id, Pid: p.Pid(), Argv: p.argv, Started: p.started, Process: p}
		if p.exited() {
			d.Exit = &p.status
		} else {
			in.procs[p] = true
		}
		out = append(out, d)
	}
	slices.SortFunc(out, func(a, b daemon.DetachedExec) int { return a.Started.Compare(b.Started) })
	return out, nil
}

// detached is the detached exec id.
func (in *Instance) detached(id string) (*proc, error) {
	v := vmmOf(in.dir)
	v.mu.Lock()
	defer v.mu.Unlock()
	if p := v.detached[id]; p != nil {
		return p, nil
	}
	return nil, status.Errorf(codes.NotFound, "daemontest: no detached exec %q", id)
}

// ForgetDetached drops the exited detached exec id.
func (in *Instance) ForgetDetached(ctx context.Context, id string) error {
	p, err := in.detached(id)
	if err != nil {
		return err
	}
	if !p.exited() {
		return status.Errorf(codes.FailedPrecondition, "daemontest: detached exec %q still runs", id)
	}
	v := vmmOf(in.dir)
	v.mu.Lock()
	delete(v.detached, id)
	v.mu.Unlock()
	return nil
}

// AttachDetached implements daemon.Instance: the output the detached
// exec writes from now on, then its exit.
func (in *Instance) AttachDetached(ctx context.Context, id string, stdout, stderr io.Writer) (daemon.ExitStatus, error) {
	p, err := in.detached(id)
	if err != nil {
		return daemon.ExitStatus{}, err
	}
	a := &[2]io.Writer{orDiscard(stdout), orDiscard(stderr)}
	p.mu.Lock()
	if p.attached == nil {
		p.attached = map[*[2]io.Writer]bool{}
	}
	p.attached[a] = true
	p.mu.Unlock()
	defer func() {
		p.mu.Lock()
		delete(p.attached, a)
		p.mu.Unlock()
	}()
	select {
	case <-p.done:
		return p.status, p.err
	case <-ctx.Done():
		return daemon.ExitStatus{}, status.FromContextError(ctx.Err()).Err()
	}
}
