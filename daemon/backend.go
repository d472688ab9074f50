package daemon

import (
	"context"
	"io"
	"io/fs"
	"syscall"
	"time"

	"github.com/kilnvm/kiln/guest/client"
	"github.com/kilnvm/kiln/virtio"
)

// Backend is what runs sandboxes for the server: SandboxBackend in VMM
// processes (package sandbox), daemontest.Backend as host folders and host
// processes for tests. The server keeps the state, the IDs, the limits
// and the timers; a backend only starts, adopts and stops machines.
type Backend interface {
	// Create starts a sandbox in the folder spec.Dir (which exists and is
	// empty) and returns once it answers execs.
	Create(ctx context.Context, spec CreateSpec) (Instance, error)
	// Attach takes over a sandbox a previous server started in dir (its
	// VMM process kept running); paused says it was left paused, as it
	// must be again once attached.
	Attach(ctx context.Context, dir string, paused bool) (Instance, error)
}

// CreateSpec is a sandbox to start: from an image, a checkpoint folder
// (Instance.Save wrote it) or an in-memory checkpoint (Instance.Frozen
// handed it out), exactly one.
type CreateSpec struct {
	Dir        string // the sandbox's host folder
	Image      string // image reference or manifest digest
	Checkpoint string // a checkpoint's folder
	Frozen     Frozen // an in-memory checkpoint; the caller closes it
	CPUs       int
	MemoryMiB  int
	// WritableMiB caps an image root's writable layer; 0: half the
	// guest's memory.
	WritableMiB int
	Hostname    string
	// Init is an image root's process 1: "" (the agent) or "systemd"
	// (sandbox.Options.Init).
	Init string
	// Host is what the sandbox gets of the host: network card, cgroup.
	Host HostSpec
}

// HostSpec is what a sandbox gets of the host beyond its folder, made by
// the server before the sandbox starts: its network card (a tap in a
// network namespace of its own) and the cgroup its VMM process runs in.
// Plain data: a backend passes it on to the VMM process it starts.
type HostSpec struct {
	// Net, when set, gives the guest a network card on this tap.
	Net *virtio.NetSpec
	// Cgroup, when set, is the cgroup v2 folder (an absolute path under
	// the cgroup mount) the sandbox's VMM process starts in.
	Cgroup string
}

// Instance is one running sandbox of a backend. Its methods are safe for
// concurrent use.
type Instance interface {
	// Dir is the sandbox's host folder (Backend.Attach takes it).
	Dir() string
	// PID is the process that runs the sandbox's VM.
	PID() int
	// Image is the manifest digest of its image root, "" without one.
	Image() string
	// Done is closed when the sandbox stopped on its own or was closed;
	// Exited then says how.
	Done() <-chan struct{}
	Exited() string
	// PoweredOff says the sandbox stopped because its guest powered
	// itself off (a clean end), once Done is closed.
	PoweredOff() bool

	// Start starts a process; cancelling ctx kills its process group
	// (as client.Client.Start), unless opts.DetachID is set: a detached
	// process outlives ctx and the server, kept by the sandbox under
	// that ID (Detached lists it) until it exits and is forgotten, and
	// its Process's Wait outlasts a broken connection.
	Start(ctx context.Context, opts client.ExecOptions) (Process, error)
	// Detached lists the sandbox's detached processes, running and
	// exited, oldest first: those a previous server started are there.
	Detached(ctx context.Context) ([]DetachedExec, error)
	// ForgetDetached drops the exited detached process id.
	ForgetDetached(ctx context.Context, id string) error
	// AttachDetached copies the output the detached process id writes
	// from now on to stdout and stderr and returns its exit status once
	// it has exited (at once for one that has); several may attach at
	// once. An ID the sandbox lacks is NotFound.
	AttachDetached(ctx context.Context, id string, stdout, stderr io.Writer) (client.ExitStatus, error)
	Files

	Pause(ctx context.Context) error
	Resume(ctx context.Context) error
	// ConfigureNetwork gives the guest's network card (the sandbox has
	// one: HostSpec.Net) its address, gateway, MAC, MTU and nameservers,
	// after every start, restore and fork.
	ConfigureNetwork(ctx context.Context, cfg client.NetworkConfig) error
	// Refresh gives the sandbox a new identity, as a restore does: fresh
	// entropy, the host's time, and the host name (a warm pool's sandbox
	// handed out).
	Refresh(ctx context.Context, hostname string) error
	// Save writes a checkpoint of the running sandbox into dir (which
	// must not exist); the sandbox runs on.
	Save(ctx context.Context, dir string) error
	// Fork makes a child of the running sandbox per entry of hosts, each
	// in a folder of its own and with that share of the host; the sandbox
	// runs on.
	Fork(ctx context.Context, hosts []HostSpec) ([]Instance, error)

	// In-memory checkpoints, kept by ID in the sandbox's VMM process (so
	// that they outlive a restart of the server) until released or the
	// sandbox ends: Hold takes one of the running sandbox (it runs on),
	// Frozen hands one out to restore from (CreateSpec.Frozen) or to
	// Adopt into another instance (a rollback's new machine), Release
	// drops one. An ID not held is sandbox.ErrNotHeld for Frozen.
	Hold(ctx context.Context, id string) error
	Release(ctx context.Context, id string) error
	Held(ctx context.Context) ([]string, error)
	Frozen(ctx context.Context, id string) (Frozen, error)
	Adopt(ctx context.Context, f Frozen) error

	// Keep has the sandbox's VMM process keep value under key in its
	// memory, never on a disk, until set again or the sandbox ends (an
	// empty value drops key), so that it outlives a restart of the
	// server: a later Attach's Kept reads it back. Kept of a key not
	// kept is sandbox.ErrNotKept. Keys and sizes are bounded as
	// vmmproc.Keep's. The server keeps the sandbox's secrets so.
	Keep(ctx context.Context, key string, value []byte) error
	Kept(ctx context.Context, key string) ([]byte, error)

	// Info asks the guest's agent about the guest: its memory (MemTotal,
	// MemAvailable) and its root file system (DiskTotal, DiskUsed), which
	// the server samples for GetSandboxMetrics.
	Info(ctx context.Context) (client.Info, error)

	// Close stops the sandbox and removes everything it holds on the host
	// (its VMM process, folder and sockets).
	Close(ctx context.Context) error
	// Detach lets go of the sandbox without stopping it: a later
	// Backend.Attach takes it over.
	Detach()
}

// Frozen is an in-memory checkpoint handed out of the instance that holds
// it; Close lets go of it (the hold stays).
type Frozen interface {
	ID() string
	Close() error
}

// DetachedExec is a detached process an instance keeps (Instance.Detached).
type DetachedExec struct {
	ID      string
	Pid     int
	Argv    []string
	Started time.Time
	// Exit is set once it has exited.
	Exit *client.ExitStatus
	// Process signals it and waits for its exit (until the instance is
	// closed or detached).
	Process Process
}

// Process is a process running in a sandbox (*client.Process is one).
type Process interface {
	Pid() int
	Signal(sig syscall.Signal) error
	SignalGroup(sig syscall.Signal) error
	// Resize sets the size of the process's terminal (one started with
	// client.ExecOptions.Pty); FailedPrecondition without one.
	Resize(size client.PtySize) error
	// Wait waits for the process to exit and its output to be delivered.
	Wait() (client.ExitStatus, error)
}

// Files are a sandbox's file calls, on absolute clean paths. Their errors
// carry the agent's gRPC status codes (NotFound for a missing file,
// InvalidArgument, FailedPrecondition, ...), which the server passes on.
// An owner is a user name of the guest's /etc/passwd ("": root); the
// files and directories a call creates are then its and its group's.
type Files interface {
	WriteFile(ctx context.Context, path string, r io.Reader, mode fs.FileMode, makeParents bool, owner string) (client.FileInfo, error)
	ReadFile(ctx context.Context, path string, w io.Writer) (int64, error)
	Stat(ctx context.Context, path string, noFollow bool) (client.FileInfo, error)
	// List lists a directory, and depth levels (0 as 1) down its
	// subdirectories', with full paths, not following symlinks.
	List(ctx context.Context, path string, depth int) ([]client.FileInfo, error)
	Mkdir(ctx context.Context, path string, mode fs.FileMode, parents bool, owner string) error
	Remove(ctx context.Context, path string, recursive bool) error
	// Move renames source to destination (rename(2); FailedPrecondition
	// across file systems) and describes the destination.
	Move(ctx context.Context, source, destination string) (client.FileInfo, error)
	// Watch calls fn with the changes below directory path (recursive:
	// in its subdirectories too), a started event first, until ctx ends
	// or the directory goes (nil), fn fails (its error) or the watch
	// does (ResourceExhausted when events were lost).
	Watch(ctx context.Context, path string, recursive bool, fn func(client.WatchEvent) error) error
}
