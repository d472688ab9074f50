package daemontest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/creack/pty"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/accounts"
	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/dirwatch"
)

// This file holds what the double does as the agent's ptys, users,
// attaches, moves, watches and deep listings do, on the host: a pty of
// the host's (creack/pty), users of the host's /etc/passwd, inotify on
// the root folder.

// asUser makes cmd run as the host's user name, with HOME, USER and
// LOGNAME where env lacks them; it returns the environment.
func asUser(cmd *exec.Cmd, name string, env []string) ([]string, error) {
	u, err := lookupUser(name)
	if err != nil {
		return nil, err
	}
	groups := make([]uint32, len(u.Groups))
	copy(groups, u.Groups)
	cmd.SysProcAttr.Credential = &syscall.Credential{Uid: u.UID, Gid: u.GID, Groups: groups}
	for _, kv := range []string{"HOME=" + u.Home, "USER=" + u.Name, "LOGNAME=" + u.Name} {
		k, _, _ := strings.Cut(kv, "=")
		has := false
		for _, e := range env {
			if strings.HasPrefix(e, k+"=") {
				has = true
			}
		}
		if !has {
			env = append(env, kv)
		}
	}
	return env, nil
}

// hostTerm is the host pty an exec of the double runs on.
type hostTerm struct {
	ptmx *os.File
	out  chan struct{} // closed once its output was copied
}

// onPty gives cmd a new terminal of size, its stdin, stdout, stderr and
// controlling terminal; start runs the copies once cmd has started.
func onPty(cmd *exec.Cmd, size *daemon.PtySize) (*hostTerm, *os.File, error) {
	ptmx, tty, err := pty.Open()
	if err != nil {
		return nil, nil, status.Errorf(codes.ResourceExhausted, "daemontest: pty: %v", err)
	}
	if err := pty.Setsize(ptmx, &pty.Winsize{Rows: uint16(size.Rows), Cols: uint16(size.Cols)}); err != nil {
		ptmx.Close()
		tty.Close()
		return nil, nil, status.Errorf(codes.Internal, "daemontest: pty size: %v", err)
	}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = tty, tty, tty
	cmd.SysProcAttr.Setpgid = false
	cmd.SysProcAttr.Setsid, cmd.SysProcAttr.Setctty, cmd.SysProcAttr.Ctty = true, true, 0
	return &hostTerm{ptmx: ptmx, out: make(chan struct{})}, tty, nil
}

// start copies the terminal's output to stdout and stdin into it (^D at
// its end).
func (t *hostTerm) start(stdin io.Reader, stdout io.Writer) {
	if stdout == nil {
		stdout = io.Discard
	}
	go func() {
		defer close(t.out)
		io.Copy(stdout, t.ptmx) // ends with EIO once the terminal's last user is gone
	}()
	if stdin != nil {
		go func() {
			if _, err := io.Copy(t.ptmx, stdin); err == nil {
				t.ptmx.Write([]byte{4})
			}
		}()
	}
}

func (t *hostTerm) wait() {
	<-t.out
	t.ptmx.Close()
}

// Resize sets the size of the exec's terminal.
func (p *proc) Resize(size daemon.PtySize) error {
	if p.term == nil {
		return status.Error(codes.FailedPrecondition, "daemontest: the exec has no terminal")
	}
	return pty.Setsize(p.term.ptmx, &pty.Winsize{Rows: uint16(size.Rows), Cols: uint16(size.Cols)})
}

// Resize of a process an earlier server started: out of reach.
func (p *foreignProc) Resize(daemon.PtySize) error {
	return status.Error(codes.FailedPrecondition, "daemontest: the exec's terminal is out of reach")
}

// fan copies a detached exec's output to its attachers too.
type fan struct {
	mu   sync.Mutex
	subs map[*fanSub]struct{}
}

type fanSub struct{ stdout, stderr io.Writer }

func (f *fan) writer(w io.Writer, stderr bool) io.Writer {
	if w == nil {
		w = io.Discard
	}
	return writerFunc(func(b []byte) (int, error) {
		f.mu.Lock()
		for s := range f.subs {
			if stderr {
				s.stderr.Write(b)
			} else {
				s.stdout.Write(b)
			}
		}
		f.mu.Unlock()
		w.Write(b) // the call's end only drops its output
		return len(b), nil
	})
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(b []byte) (int, error) { return f(b) }

// AttachDetached implements daemon.Instance: the output a detached exec
// this process started writes from now on, then its exit. One an
// earlier process started gives only its exit.
func (in *Instance) AttachDetached(ctx context.Context, id string, stdout, stderr io.Writer) (daemon.ExitStatus, error) {
	recPath, err := in.detachedPath(id)
	if err != nil {
		return daemon.ExitStatus{}, err
	}
	if _, err := os.Stat(recPath); err != nil {
		return daemon.ExitStatus{}, status.Errorf(codes.NotFound, "daemontest: no detached exec %q", id)
	}
	p := in.b.detachedProc(recPath)
	if p == nil {
		// An earlier process's: its output went there; watch it by pid.
		var rec detachedRecord
		b, err := os.ReadFile(recPath)
		if err == nil {
			err = json.Unmarshal(b, &rec)
		}
		if err != nil {
			return daemon.ExitStatus{}, fmt.Errorf("daemontest: detached exec %q: %w", id, err)
		}
		for alive(rec.Pid) {
			select {
			case <-ctx.Done():
				return daemon.ExitStatus{}, status.FromContextError(ctx.Err()).Err()
			case <-time.After(10 * time.Millisecond):
			}
		}
		return daemon.ExitStatus{Code: -1, Signal: int(syscall.SIGKILL)}, nil
	}
	if stdout == nil {
		stdout = io.Discard
	}
	if stderr == nil {
		stderr = io.Discard
	}
	sub := &fanSub{stdout: stdout, stderr: stderr}
	p.fan.mu.Lock()
	if p.fan.subs == nil {
		p.fan.subs = map[*fanSub]struct{}{}
	}
	p.fan.subs[sub] = struct{}{}
	p.fan.mu.Unlock()
	defer func() {
		p.fan.mu.Lock()
		delete(p.fan.subs, sub)
		p.fan.mu.Unlock()
	}()
	select {
	case <-p.done:
		return p.status, p.err
	case <-ctx.Done():
		return daemon.ExitStatus{}, status.FromContextError(ctx.Err()).Err()
	}
}

// owner resolves a file call's owner on the host (nil for none).
func owner(name string) (*accounts.User, error) {
	if name == "" {
		return nil, nil
	}
	u, err := lookupUser(name)
	if err != nil {
		return nil, err
	}
	return &u, nil
}

// mkdirs creates the root's folder r and its missing parents with perm,
// owned by u when set.
func (in *Instance) mkdirs(r string, perm fs.FileMode, u *accounts.User) error {
	var missing []string
	for p := r; p != "."; p = path.Dir(p) {
		fi, err := in.root.Stat(p)
		if err == nil {
			if !fi.IsDir() {
				return &fs.PathError{Op: "mkdir", Path: p, Err: syscall.ENOTDIR}
			}
			break
		}
		if !errors.Is(err, fs.ErrNotExist) {
			return err
		}
		missing = append(missing, p)
	}
	for i := len(missing) - 1; i >= 0; i-- {
		if err := in.root.Mkdir(missing[i], perm); err != nil && !errors.Is(err, fs.ErrExist) {
			return err
		}
		if u != nil {
			if err := in.root.Lchown(missing[i], int(u.UID), int(u.GID)); err != nil {
				return err
			}
		}
		if err := in.root.Chmod(missing[i], perm); err != nil {
			return err
		}
	}
	return nil
}

// List implements daemon.Files: each folder's entries sorted by name,
// followed by its subfolders' down to depth levels.
func (in *Instance) List(ctx context.Context, p string, depth int) ([]daemon.FileInfo, error) {
	depth = max(depth, 1)
	var out []daemon.FileInfo
	names := accounts.NewNames("/")
	var walk func(dir string, level int) error
	walk = func(dir string, level int) error {
		f, err := in.root.Open(rel(dir))
		if err != nil {
			if level > 1 && errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return fileErr("list", dir, err)
		}
		ents, err := f.ReadDir(-1)
		f.Close()
		if err != nil {
			return fileErr("list", dir, err)
		}
		sortEntries(ents)
		for _, e := range ents {
			fi, err := e.Info()
			if err != nil {
				continue // removed meanwhile
			}
			ep := path.Join(dir, e.Name())
			out = append(out, in.infoNamed(ep, fi, names))
			if e.IsDir() && level < depth {
				if err := walk(ep, level+1); err != nil {
					return err
				}
			}
		}
		return nil
	}
	if err := walk(p, 1); err != nil {
		return nil, err
	}
	return out, nil
}

// Move implements daemon.Files.
func (in *Instance) Move(ctx context.Context, src, dst string) (daemon.FileInfo, error) {
	if err := in.root.Rename(rel(src), rel(dst)); err != nil {
		if errors.Is(err, syscall.EXDEV) {
			return daemon.FileInfo{}, status.Errorf(codes.FailedPrecondition, "daemontest: move %s to %s: different file systems", src, dst)
		}
		return daemon.FileInfo{}, fileErr("move "+src+" to", dst, err)
	}
	return in.Stat(ctx, dst, true)
}

// Watch implements daemon.Files with dirwatch, on the root's folder.
func (in *Instance) Watch(ctx context.Context, p string, recursive bool, fn func(daemon.WatchEvent) error) error {
	fi, err := in.root.Stat(rel(p))
	if err != nil {
		return fileErr("watch", p, err)
	}
	if !fi.IsDir() {
		return status.Errorf(codes.InvalidArgument, "daemontest: watch %s: not a directory", p)
	}
	host := filepath.Join(in.Root(), filepath.FromSlash(rel(p)))
	var fnErr error
	names := accounts.NewNames("/")
	err = dirwatch.Watch(ctx, host, recursive, maxWatchDirs, func(ev dirwatch.Event) error {
		out := daemon.WatchEvent{Started: ev.Started, Op: watchOps[ev.Op], Name: ev.Name}
		if ev.Info != nil {
			out.Entry, out.HasEntry = in.infoNamed(path.Join(p, ev.Name), ev.Info, names), true
		}
		fnErr = fn(out)
		return fnErr
	})
	switch {
	case err == nil || err == fnErr:
		return err
	case errors.Is(err, dirwatch.ErrOverflow), errors.Is(err, dirwatch.ErrTooManyDirs):
		return status.Errorf(codes.ResourceExhausted, "daemontest: %v", err)
	}
	return fileErr("watch", p, err)
}

// maxWatchDirs bounds a recursive watch's directories, as the agent's
// (agentpb.MaxWatchDirs).
const maxWatchDirs = 8192

// watchOps are dirwatch's operations as the seam's.
var watchOps = [...]daemon.WatchOp{
	dirwatch.Create: daemon.WatchCreate,
	dirwatch.Write:  daemon.WatchWrite,
	dirwatch.Remove: daemon.WatchRemove,
	dirwatch.Rename: daemon.WatchRename,
	dirwatch.Chmod:  daemon.WatchChmod,
}

// lookupUser resolves a user of the host's account files; an unknown one
// is InvalidArgument, as the agent's.
func lookupUser(name string) (accounts.User, error) {
	u, err := accounts.Lookup("/", name)
	if err != nil {
		return u, status.Errorf(codes.InvalidArgument, "daemontest: %v", err)
	}
	return u, nil
}
