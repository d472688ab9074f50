package daemon

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/netip"
	"strings"
	"syscall"
	"time"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// Backend is what runs sandboxes for the server: vmmbackend.Backend in VMM
// processes (package sandbox; kilnd wires it in), daemontest.Backend as
// host folders and host processes for tests. The seam speaks the plain
// types of this file, never a guest's or a VMM's: the daemon imports no
// VMM layer. The server keeps the state, the IDs, the limits
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

// SharedFiles is what a backend whose sandboxes share host files says of
// them (an optional interface): the files every boot reads (a kernel, an
// initramfs) and the files of a checkpoint in folder dir that its
// restores map (its memory). With Config.Cgroups the server reads them
// into the page cache from its own cgroup first, so that no sandbox's is
// charged for them.
type SharedFiles interface {
	BootFiles() []string
	CheckpointFiles(dir string) []string
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
	// Volumes are mounted in the sandbox once Create returns, each in
	// its slot (at most MaxVolumes). A checkpoint whose sandbox already
	// held one in that slot (a hibernated sandbox's) reopens it there,
	// mounted as it was; an empty slot gets it inserted and mounted.
	Volumes []VolumeAttach
}

// MaxVolumes is how many volumes a sandbox mounts at most: the volume
// slots every sandbox of a backend has (sandbox.VolumeSlots, which
// vmmbackend's tests hold it to).
const MaxVolumes = 4

// VolumeAttach is a volume in a sandbox: the ext4 image at Path (on the
// host) in volume slot Slot (0 to MaxVolumes-1), mounted at MountPath in
// the guest, read-only when ReadOnly (the host refuses the guest's writes
// too).
type VolumeAttach struct {
	Slot      int
	Path      string
	ReadOnly  bool
	MountPath string
}

// HostSpec is what a sandbox gets of the host beyond its folder, made by
// the server before the sandbox starts: its network card (a tap in a
// network namespace of its own) and the cgroup its VMM process runs in.
// Plain data: a backend passes it on to the VMM process it starts.
type HostSpec struct {
	// Net, when set, gives the guest a network card on this tap.
	Net *NetSpec
	// Cgroup, when set, is the cgroup v2 folder (an absolute path under
	// the cgroup mount) the sandbox's VMM process starts in.
	Cgroup string
}

// NetSpec is a guest's network card: the tap it is, in the network
// namespace Netns (a path; "": the backend's own), and its MAC.
type NetSpec struct {
	Tap   string
	Netns string
	MAC   string
}

// Instance is one running sandbox of a backend: its machine, the
// processes and files of its guest, and its checkpoints. Its methods are
// safe for concurrent use.
type Instance interface {
	Machine
	Execs
	Files
	Checkpoints
	// Keep has the sandbox's VMM process keep value under key in its
	// memory, never on a disk, until set again or the sandbox ends (an
	// empty value drops key), so that it outlives a restart of the
	// server: a later Attach's Kept reads it back. Kept of a key not
	// kept is ErrNotKept. Keys and sizes are bounded as vmmproc.Keep's
	// (MaxKeepValue).
	// The server keeps the sandbox's secrets so.
	Keep(ctx context.Context, key string, value []byte) error
	Kept(ctx context.Context, key string) ([]byte, error)
}

// Machine is an instance's machine: what runs the sandbox on the host,
// and the guest's identity, network and description.
type Machine interface {
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

	Pause(ctx context.Context) error
	Resume(ctx context.Context) error
	// ConfigureNetwork gives the guest's network card (the sandbox has
	// one: HostSpec.Net) its address, gateway, MAC, MTU and nameservers,
	// after every start, restore and fork.
	ConfigureNetwork(ctx context.Context, cfg NetworkConfig) error
	// Refresh gives the sandbox a new identity, as a restore does: fresh
	// entropy, the host's time, and the host name (a warm pool's sandbox
	// handed out).
	Refresh(ctx context.Context, hostname string) error
	// DialPort connects to TCP port port (1 to 65535) on the guest's
	// loopback, through the guest's agent and not its network card, so
	// that what listens there (on any address of the guest) is reached
	// and nothing else is opened. A guest that refuses is ErrPortRefused.
	// The connection outlives ctx, which bounds the dial only.
	DialPort(ctx context.Context, port int) (net.Conn, error)
	// AttachVolume inserts the volume v into its slot, which must be
	// empty, and mounts it in the guest; the sandbox holds it until it
	// ends. A sandbox without that slot (a checkpoint saved before
	// volume slots) is FailedPrecondition.
	AttachVolume(ctx context.Context, v VolumeAttach) error
	// FreezeVolumes leaves the images of the sandbox's writable volumes
	// clean, as an unmount would (the guest flushes and freezes their
	// file systems; no write reaches them after), before the sandbox is
	// closed for good, never before a hibernation.
	FreezeVolumes(ctx context.Context) error
	// Info asks the guest about itself: its memory (MemTotal,
	// MemAvailable) and its root file system (DiskTotal, DiskUsed), which
	// the server samples for GetSandboxMetrics.
	Info(ctx context.Context) (GuestInfo, error)

	// Close stops the sandbox and removes everything it holds on the host
	// (its VMM process, folder and sockets).
	Close(ctx context.Context) error
	// Detach lets go of the sandbox without stopping it: a later
	// Backend.Attach takes it over.
	Detach()
}

// Execs are the processes of an instance's guest.
type Execs interface {
	// Start starts a process; cancelling ctx kills its process group,
	// unless opts.DetachID is set: a detached process outlives ctx and
	// the server, kept by the sandbox under that ID (Detached lists it)
	// until it exits and is forgotten, and its Process's Wait outlasts a
	// broken connection.
	Start(ctx context.Context, opts ExecOptions) (Process, error)
	// Detached lists the sandbox's detached processes, running and
	// exited, oldest first: those a previous server started are there.
	Detached(ctx context.Context) ([]DetachedExec, error)
	// ForgetDetached drops the exited detached process id.
	ForgetDetached(ctx context.Context, id string) error
	// AttachDetached copies the output the detached process id writes
	// from now on to stdout and stderr and returns its exit status once
	// it has exited (at once for one that has); several may attach at
	// once. An ID the sandbox lacks is NotFound.
	AttachDetached(ctx context.Context, id string, stdout, stderr io.Writer) (ExitStatus, error)
}

// Checkpoints are an instance's checkpoints: on disk (Save), as children
// (Fork), and in memory, kept by ID in the sandbox's VMM process (so that
// they outlive a restart of the server) until released or the sandbox
// ends: Hold takes one of the running sandbox (it runs on), Frozen hands
// one out to restore from (CreateSpec.Frozen) or to Adopt into another
// instance (a rollback's new machine), Release drops one. An ID not held
// is ErrNotHeld for Frozen.
type Checkpoints interface {
	// Save writes a checkpoint of the running sandbox into dir (which
	// must not exist); the sandbox runs on.
	Save(ctx context.Context, dir string) error
	// Fork makes a child of the running sandbox per entry of hosts, each
	// in a folder of its own and with that share of the host; the sandbox
	// runs on.
	Fork(ctx context.Context, hosts []HostSpec) ([]Instance, error)
	// ExportWritable writes, as one tar, what the writes to the sandbox's
	// image root made (its writable layer as a diff, /tmp, container
	// engines' storage) for a hibernation that keeps files and not memory;
	// FailedPrecondition for a root that is no image's. ImportWritable
	// applies such a tar to a sandbox booted anew from the same image.
	ExportWritable(ctx context.Context, w io.Writer) (int64, error)
	ImportWritable(ctx context.Context, r io.Reader) error
	Hold(ctx context.Context, id string) error
	Release(ctx context.Context, id string) error
	Held(ctx context.Context) ([]string, error)
	Frozen(ctx context.Context, id string) (Frozen, error)
	Adopt(ctx context.Context, f Frozen) error
}

// Frozen is an in-memory checkpoint handed out of the instance that holds
// it; Close lets go of it (the hold stays).
type Frozen interface {
	ID() string
	Close() error
}

// MaxDetached is the most detached processes the server takes from a
// sandbox's list (Instance.Detached): as many as a guest's agent keeps
// (agentpb.MaxDetached, which vmmbackend's tests hold it to).
const MaxDetached = 1024

// MaxKeepValue is the largest value an Instance keeps (Instance.Keep): a
// VMM process's bound (vmmproc.MaxKeepValue, which vmmbackend's tests
// hold it to).
const MaxKeepValue = 2 << 20

// DetachedExec is a detached process an instance keeps (Instance.Detached).
type DetachedExec struct {
	ID      string
	Pid     int
	Argv    []string
	Started time.Time
	// Exit is set once it has exited.
	Exit *ExitStatus
	// Process signals it and waits for its exit (until the instance is
	// closed or detached).
	Process Process
}

// Process is a process running in a sandbox.
type Process interface {
	Pid() int
	Signal(sig syscall.Signal) error
	SignalGroup(sig syscall.Signal) error
	// Resize sets the size of the process's terminal (one started with
	// ExecOptions.Pty); FailedPrecondition without one.
	Resize(size PtySize) error
	// Wait waits for the process to exit and its output to be delivered.
	Wait() (ExitStatus, error)
}

// Files are a sandbox's file calls, on absolute clean paths. Their errors
// carry the agent's gRPC status codes (NotFound for a missing file,
// InvalidArgument, FailedPrecondition, ...), which the server passes on.
// An owner is a user name of the guest's /etc/passwd ("": root); the
// files and directories a call creates are then its and its group's.
type Files interface {
	WriteFile(ctx context.Context, path string, r io.Reader, mode fs.FileMode, makeParents bool, owner string) (FileInfo, error)
	ReadFile(ctx context.Context, path string, w io.Writer) (int64, error)
	Stat(ctx context.Context, path string, noFollow bool) (FileInfo, error)
	// List lists a directory, and depth levels (0 as 1) down its
	// subdirectories', with full paths, not following symlinks.
	List(ctx context.Context, path string, depth int) ([]FileInfo, error)
	Mkdir(ctx context.Context, path string, mode fs.FileMode, parents bool, owner string) error
	Remove(ctx context.Context, path string, recursive bool) error
	// Move renames source to destination (rename(2); FailedPrecondition
	// across file systems) and describes the destination.
	Move(ctx context.Context, source, destination string) (FileInfo, error)
	// Watch calls fn with the changes below directory path (recursive:
	// in its subdirectories too), a started event first, until ctx ends
	// or the directory goes (nil), fn fails (its error) or the watch
	// does (ResourceExhausted when events were lost).
	Watch(ctx context.Context, path string, recursive bool, fn func(WatchEvent) error) error
}

// The plain types of the seam: what an exec, a file call, a watch and the
// guest's description carry across it. They are the daemon's own (a
// backend converts its guest's to them), so that the daemon knows no guest
// package; their fields are the guest agent's, as kiln.v1 passes them on.

// ExecOptions is a process to start (Instance.Start).
type ExecOptions struct {
	// Argv is the command line; Argv[0] is looked up in the guest's PATH
	// unless it contains a slash.
	Argv []string
	// Env holds NAME=VALUE entries; empty means the guest's default.
	Env []string
	// Dir is the absolute working directory; empty means "/".
	Dir string
	// UID and GID to run as; 0 keeps the default: the image's user in an
	// image-rooted sandbox, else root.
	UID, GID uint32
	// AsRoot runs the process as root even where the image names another
	// user.
	AsRoot bool
	// Timeout kills the process group with SIGKILL after this long; 0
	// means none.
	Timeout time.Duration
	// Stdin is copied to the process's stdin, which is closed at its EOF;
	// nil gives the process /dev/null.
	Stdin io.Reader
	// Stdout and Stderr receive the process's output; nil discards it.
	Stdout, Stderr io.Writer
	// DetachID, when set, detaches the process under this ID (see
	// Instance.Start).
	DetachID string
	// User, when set, runs the process as this user of the guest's
	// /etc/passwd; exclusive with UID, GID and AsRoot.
	User string
	// Pty, when set, runs the process on a terminal of this size: Stdout
	// gets what it shows (Stderr nothing), Stdin is typed into it.
	Pty *PtySize
	// Root, when set, runs the process in the guest's container root of
	// this name.
	Root string
}

// PtySize is a terminal's size in characters.
type PtySize struct {
	Rows, Cols uint32
}

// ExitStatus is how a process ended.
type ExitStatus struct {
	// Code is the exit code, or -1 if a signal killed the process.
	Code int
	// Signal is the signal that killed the process, or 0.
	Signal int
	// TimedOut says ExecOptions.Timeout expired and the process group was
	// killed (Signal is then 9).
	TimedOut bool
	// OOMKilled says the guest's OOM killer killed a process of the exec.
	OOMKilled bool
}

// Success reports a zero exit code.
func (s ExitStatus) Success() bool { return s.Code == 0 && s.Signal == 0 }

func (s ExitStatus) String() string {
	var b strings.Builder
	if s.Signal != 0 {
		fmt.Fprintf(&b, "killed by signal %d (%v)", s.Signal, syscall.Signal(s.Signal))
	} else {
		fmt.Fprintf(&b, "exit code %d", s.Code)
	}
	if s.TimedOut {
		b.WriteString(", timed out")
	}
	if s.OOMKilled {
		b.WriteString(", OOM-killed")
	}
	return b.String()
}

// FileInfo describes a file of the guest.
type FileInfo struct {
	Path    string
	Name    string
	Size    int64
	Mode    fs.FileMode
	ModTime time.Time
	IsDir   bool
	Symlink string // the target, for a symlink that was not followed
	UID     uint32
	GID     uint32
	// Owner and Group are the guest's names for UID and GID, or the
	// numbers when it has none.
	Owner string
	Group string
}

// WatchOp is what a watch saw happen; its values are kiln.v1's.
type WatchOp int

// The operations a watch reports.
const (
	WatchCreate = WatchOp(kilnpb.WatchEvent_OP_CREATE) // created, or moved in
	WatchWrite  = WatchOp(kilnpb.WatchEvent_OP_WRITE)
	WatchRemove = WatchOp(kilnpb.WatchEvent_OP_REMOVE)
	WatchRename = WatchOp(kilnpb.WatchEvent_OP_RENAME) // moved away
	WatchChmod  = WatchOp(kilnpb.WatchEvent_OP_CHMOD)  // attributes changed
)

// WatchEvent is a change a watch saw (Files.Watch).
type WatchEvent struct {
	// Started is the first event: the watch is in place.
	Started bool
	Op      WatchOp
	// Name is the entry's path relative to the watched directory.
	Name string
	// Entry describes it as it is now, when it exists (HasEntry).
	Entry    FileInfo
	HasEntry bool
}

// NetworkConfig is the guest's network card's setup
// (Instance.ConfigureNetwork).
type NetworkConfig struct {
	// Interface names the card; empty: the guest's first ethernet card.
	Interface string
	// MAC is the card's new address; empty keeps its own.
	MAC string
	// Addresses replace the card's (at least one).
	Addresses []netip.Prefix
	// Gateway is the default route's; the zero Addr: no default route.
	Gateway netip.Addr
	// MTU is the card's MTU; 0 keeps it.
	MTU int
	// Nameservers go to the guest's /etc/resolv.conf; none leaves it.
	Nameservers []netip.Addr
}

// GuestInfo describes the guest (Instance.Info): its memory and its root
// file system, in bytes, among the rest.
type GuestInfo struct {
	KernelRelease string
	Hostname      string
	Uptime        time.Duration
	MemTotal      uint64
	MemAvailable  uint64
	NumCPU        int
	AgentVersion  string
	DiskTotal     uint64 // the root file system's size
	DiskUsed      uint64
}

// The errors a backend marks (errors.Is finds them) for the server to
// tell apart.
var (
	// ErrNotHeld: Instance.Frozen of an ID the sandbox does not hold.
	ErrNotHeld = errors.New("no such held checkpoint")
	// ErrNotKept: Instance.Kept of a key not kept.
	ErrNotKept = errors.New("no such kept value")
	// ErrMachineExited: the sandbox's machine (its VMM process) died.
	ErrMachineExited = errors.New("the sandbox's machine exited")
	// ErrPortRefused: Instance.DialPort's guest refused the connection
	// (nothing listens on the port, or it forwards too many already).
	ErrPortRefused = errors.New("the guest refused the connection")
)
