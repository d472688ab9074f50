package vmmbackend

import (
	"errors"

	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/guest/client"
	"github.com/kilnvm/kiln/sandbox"
	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmmproc"
)

// The conversions between the guest's client and package sandbox's types
// and the daemon's plain ones: the seam is crossed here only.

func execOptions(o daemon.ExecOptions) client.ExecOptions {
	return client.ExecOptions{
		Argv: o.Argv, Env: o.Env, Dir: o.Dir, UID: o.UID, GID: o.GID, AsRoot: o.AsRoot,
		Timeout: o.Timeout, Stdin: o.Stdin, Stdout: o.Stdout, Stderr: o.Stderr,
		DetachID: o.DetachID, User: o.User, Pty: (*client.PtySize)(o.Pty), Root: o.Root,
	}
}

func exitStatus(s client.ExitStatus) daemon.ExitStatus { return daemon.ExitStatus(s) }

func plainFileInfo(fi client.FileInfo) daemon.FileInfo { return daemon.FileInfo(fi) }

func fileInfo(fi client.FileInfo, err error) (daemon.FileInfo, error) {
	return plainFileInfo(fi), err
}

func watchEvent(ev client.WatchEvent) daemon.WatchEvent {
	return daemon.WatchEvent{Started: ev.Started, Op: watchOp(ev.Op), Name: ev.Name,
		Entry: plainFileInfo(ev.Entry), HasEntry: ev.HasEntry}
}

func watchOp(op client.WatchOp) daemon.WatchOp {
	switch op {
	case client.WatchCreate:
		return daemon.WatchCreate
	case client.WatchWrite:
		return daemon.WatchWrite
	case client.WatchRemove:
		return daemon.WatchRemove
	case client.WatchRename:
		return daemon.WatchRename
	case client.WatchChmod:
		return daemon.WatchChmod
	}
	return daemon.WatchOp(op)
}

func netSpec(n *daemon.NetSpec) *virtio.NetSpec {
	if n == nil {
		return nil
	}
	return &virtio.NetSpec{Tap: n.Tap, Netns: n.Netns, MAC: n.MAC}
}

// process is a guest process of the client as a daemon.Process.
type process struct{ *client.Process }

func (p process) Resize(size daemon.PtySize) error { return p.Process.Resize(client.PtySize(size)) }

func (p process) Wait() (daemon.ExitStatus, error) {
	st, err := p.Process.Wait()
	return exitStatus(st), err
}

// markErr marks err with the daemon's error for what it is (errors.Is
// finds both): a hold or a kept value missing, a VMM process dead.
func markErr(err error) error {
	var pe *vmmproc.ProcessError
	var refused *client.PortError
	switch {
	case err == nil:
		return nil
	case errors.Is(err, sandbox.ErrNotHeld):
		return marked{err, daemon.ErrNotHeld}
	case errors.Is(err, sandbox.ErrNotKept):
		return marked{err, daemon.ErrNotKept}
	case errors.As(err, &pe):
		return marked{err, daemon.ErrMachineExited}
	case errors.As(err, &refused):
		return marked{err, daemon.ErrPortRefused}
	}
	return err
}

// marked is err, which errors.Is and errors.As also read as mark; its
// message is err's.
type marked struct{ err, mark error }

func (m marked) Error() string   { return m.err.Error() }
func (m marked) Unwrap() []error { return []error{m.err, m.mark} }
