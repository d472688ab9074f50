package shim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/kilnvm/kiln/guest/client"
	"github.com/kilnvm/kiln/sandbox"
	"github.com/kilnvm/kiln/virtio"
)

// BootSpec is what the shim asks of a Booter: a VM for one container.
type BootSpec struct {
	ID        string // the container's ID
	Bundle    string // its bundle folder (links to the VM's folder: vmLink)
	RootDir   string // its mounted rootfs: the VM's root
	CPUs      int
	MemoryMiB int
	Hostname  string
	// Checkpoint, when set, is a checkpoint's folder (Service.Checkpoint
	// wrote a snapshot under it): the VM is restored from it instead.
	Checkpoint string
	// Network, when set, is the pod's network for the VM to take over
	// (a network card on a tap beside CNI's interface).
	Network *PodNetwork
}

// Booter starts a container's VM. The seam lets the Task service be
// tested without KVM.
type Booter interface {
	Boot(ctx context.Context, spec BootSpec) (VM, error)
}

// VM is a booted container's machine.
type VM interface {
	// Start starts a process in the guest; ctx bounds its life.
	Start(ctx context.Context, opts client.ExecOptions) (GuestProcess, error)
	// ReadFile copies a guest file to w.
	ReadFile(ctx context.Context, path string, w io.Writer) (int64, error)
	Pause(ctx context.Context) error
	Resume(ctx context.Context) error
	// Save writes a snapshot of the VM into dir.
	Save(ctx context.Context, dir string) error
	// MountRoot serves the host directory dir to the guest as container
	// root name (a pod's further container); a process started with
	// ExecOptions.Root = name runs in it.
	MountRoot(ctx context.Context, name, dir string) error
	// UnmountRoot kills root name's processes, unmounts it in the guest
	// and stops serving its directory.
	UnmountRoot(ctx context.Context, name string) error
	// ServeDir serves the host directory dir read-only beside the VM's
	// root as tree name (a read-only volume); StopServingDir ends that.
	ServeDir(name, dir string) error
	StopServingDir(name string) error
	// AddMounts mounts volumes into container root root ("" for the VM's
	// root).
	AddMounts(ctx context.Context, root string, ms []client.Mount) error
	// Adopt takes over the detached process id (ExecOptions.DetachID)
	// that a restored VM runs: its output from now on goes to stdout and
	// stderr; ctx bounds the attachment, not the process.
	Adopt(ctx context.Context, id string, stdout, stderr io.Writer) (GuestProcess, error)
	// Close stops the VM and frees what it holds.
	Close(ctx context.Context) error
}

// GuestProcess is a process started in a VM.
type GuestProcess interface {
	Pid() int
	Signal(sig syscall.Signal) error
	SignalGroup(sig syscall.Signal) error
	Resize(size client.PtySize) error
	// Wait waits for its exit, once its output has been written.
	Wait() (client.ExitStatus, error)
}

// SandboxBooter boots VMs as Kiln sandboxes in the shim's process.
type SandboxBooter struct {
	Runtime sandbox.Runtime
	Logger  *slog.Logger
	// SnapshotKey authenticates checkpoints (nil: the host's key file,
	// sandbox.SnapshotKeyFile).
	SnapshotKey []byte
	// RunDir holds each VM's folder; DefaultRunDir when empty.
	RunDir string
}

// Boot starts (or restores) the container's sandbox: spec.RootDir is its
// root over virtio-9p.
func (b SandboxBooter) Boot(ctx context.Context, spec BootSpec) (_ VM, err error) {
	dir, err := b.vmDir(spec.ID, spec.Bundle)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			os.RemoveAll(dir)
		}
	}()
	if spec.Checkpoint != "" {
		snap := filepath.Join(spec.Checkpoint, checkpointDir)
		s, err := sandbox.Restore(ctx, snap, sandbox.RestoreOptions{Dir: dir, RootDir: spec.RootDir,
			Hostname: spec.Hostname, Logger: b.Logger, SnapshotKey: b.SnapshotKey, Net: spec.Network.nic()})
		if err != nil {
			return nil, fmt.Errorf("restoring checkpoint %s: %w", spec.Checkpoint, err)
		}
		return joinNetwork(ctx, s, dir, spec.Network)
	}
	s, err := sandbox.Start(ctx, sandbox.Options{
		Runtime: b.Runtime, RootDir: spec.RootDir, CPUs: spec.CPUs, MemoryMiB: spec.MemoryMiB,
		Hostname: spec.Hostname, Dir: dir, Logger: b.Logger, SnapshotKey: b.SnapshotKey, Net: spec.Network.nic(),
	})
	if err != nil {
		return nil, fmt.Errorf("booting the VM: %w", err)
	}
	return joinNetwork(ctx, s, dir, spec.Network)
}

// nic is the VM's network card for n (nil: none).
func (n *PodNetwork) nic() *virtio.NetSpec {
	if n == nil {
		return nil
	}
	return &virtio.NetSpec{Tap: n.Tap, Netns: n.Netns, MAC: n.MAC}
}

// joinNetwork connects a started sandbox's tap to the pod's interface and
// gives the guest the pod's addresses; on failure it closes the sandbox.
func joinNetwork(ctx context.Context, s *sandbox.Sandbox, dir string, n *PodNetwork) (VM, error) {
	if n != nil {
		err := n.connect()
		if err == nil {
			err = s.ConfigureNetwork(ctx, client.NetworkConfig{MAC: n.MAC, Addresses: n.Addresses, Gateway: n.Gateway, MTU: n.MTU, Nameservers: n.Nameservers})
		}
		if err != nil {
			s.Close(context.WithoutCancel(ctx))
			return nil, fmt.Errorf("the pod's network: %w", err)
		}
	}
	return sandboxVM{s, dir}, nil
}

// DefaultRunDir holds the VMs' folders (their vsock sockets): not the
// bundle, whose path under containerd's state with a 64-digit CRI ID
// makes a socket path longer than a sockaddr_un holds (108 bytes).
const DefaultRunDir = "/run/kiln-shim"

// vmLink is the bundle's symbolic link to its VM's folder: the delete
// command (Manager.Stop) removes the folder of a shim that died.
const vmLink = "kiln-vm"

// vmDir makes a VM's folder: in RunDir (DefaultRunDir when empty), else
// the temporary directory when that cannot be made; the bundle links to
// it (vmLink).
func (b SandboxBooter) vmDir(id, bundle string) (string, error) {
	run := b.RunDir
	if run == "" {
		run = DefaultRunDir
	}
	if err := os.MkdirAll(run, 0o700); err != nil {
		run = os.TempDir()
	}
	dir, err := os.MkdirTemp(run, shortID(id)+"-")
	if err != nil {
		return "", fmt.Errorf("VM folder: %w", err)
	}
	link := filepath.Join(bundle, vmLink)
	os.Remove(link) // a restored task's bundle may hold one
	if err := os.Symlink(dir, link); err != nil {
		os.RemoveAll(dir)
		return "", fmt.Errorf("VM folder: linking it from the bundle: %w", err)
	}
	return dir, nil
}

// sandboxVM is a container's sandbox and its folder, removed by Close.
type sandboxVM struct {
	s   *sandbox.Sandbox
	dir string
}

func (v sandboxVM) Start(ctx context.Context, opts client.ExecOptions) (GuestProcess, error) {
	p, err := v.s.Client().Start(ctx, opts)
	if err != nil {
		return nil, err
	}
	if opts.DetachID != "" {
		return forgetting{p, v.s.Client(), opts.DetachID}, nil
	}
	return p, nil
}

// forgetting is a detached process the agent forgets once it has exited
// and its status is read.
type forgetting struct {
	*client.Process
	c  *client.Client
	id string
}

func (p forgetting) Wait() (client.ExitStatus, error) {
	st, err := p.Process.Wait()
	if err == nil {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		p.c.ForgetDetached(ctx, p.id)
		cancel()
	}
	return st, err
}

func (v sandboxVM) Adopt(ctx context.Context, id string, stdout, stderr io.Writer) (GuestProcess, error) {
	c := v.s.Client()
	ps, err := c.ListDetached(ctx)
	if err != nil {
		return nil, err
	}
	i := slices.IndexFunc(ps, func(p client.DetachedProcess) bool { return p.ID == id })
	if i < 0 {
		return nil, fmt.Errorf("the restored VM runs no process %s", id)
	}
	a := &adopted{c: c, id: id, pid: ps[i].Pid, done: make(chan struct{})}
	go func() {
		a.status, a.err = c.AttachDetached(ctx, id, stdout, stderr)
		if a.err == nil {
			fctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			c.ForgetDetached(fctx, id)
			cancel()
		}
		close(a.done)
	}()
	return a, nil
}

// adopted is a detached process a restored VM runs, taken over by a new
// task.
type adopted struct {
	c      *client.Client
	id     string
	pid    int
	done   chan struct{}
	status client.ExitStatus
	err    error
}

func (a *adopted) Pid() int { return a.pid }
func (a *adopted) Signal(sig syscall.Signal) error {
	return a.c.SignalDetached(context.Background(), a.id, sig, false)
}
func (a *adopted) SignalGroup(sig syscall.Signal) error {
	return a.c.SignalDetached(context.Background(), a.id, sig, true)
}
func (a *adopted) Resize(client.PtySize) error {
	return errors.New("a restored process's terminal is not resized")
}
func (a *adopted) Wait() (client.ExitStatus, error) {
	<-a.done
	return a.status, a.err
}

func (v sandboxVM) ReadFile(ctx context.Context, path string, w io.Writer) (int64, error) {
	return v.s.Client().ReadFile(ctx, path, w)
}
func (v sandboxVM) Pause(ctx context.Context) error            { return v.s.Pause(ctx) }
func (v sandboxVM) Resume(ctx context.Context) error           { return v.s.Resume(ctx) }
func (v sandboxVM) Save(ctx context.Context, dir string) error { return v.s.Save(ctx, dir) }
func (v sandboxVM) MountRoot(ctx context.Context, name, dir string) error {
	if err := v.s.ServeDir(name, dir); err != nil {
		return err
	}
	if _, err := v.s.Client().MountRoot(ctx, name, 0); err != nil {
		v.s.StopServingDir(name)
		return err
	}
	return nil
}

func (v sandboxVM) UnmountRoot(ctx context.Context, name string) error {
	err := v.s.Client().UnmountRoot(ctx, name)
	return errors.Join(err, v.s.StopServingDir(name))
}

func (v sandboxVM) ServeDir(name, dir string) error  { return v.s.ServeDir(name, dir) }
func (v sandboxVM) StopServingDir(name string) error { return v.s.StopServingDir(name) }
func (v sandboxVM) AddMounts(ctx context.Context, root string, ms []client.Mount) error {
	return v.s.Client().AddMounts(ctx, root, ms)
}

func (v sandboxVM) Close(ctx context.Context) error {
	err := v.s.Close(ctx)
	if rerr := os.RemoveAll(v.dir); rerr != nil && err == nil {
		err = rerr
	}
	return err
}

// unmarshalProcess decodes an exec's OCI process spec, bounded.
func unmarshalProcess(b []byte, p *specs.Process) error {
	if len(b) > maxSpecBytes {
		return fmt.Errorf("%d bytes, more than the %d accepted", len(b), maxSpecBytes)
	}
	if len(b) == 0 {
		return errors.New("empty")
	}
	return json.Unmarshal(b, p)
}
