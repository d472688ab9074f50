package vmmbackend

import (
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"

	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/sandbox"
	"github.com/kilnvm/kiln/snapshot"
)

// Options are what New makes a Backend of.
type Options struct {
	// StateDir is the daemon's state folder (daemon.Config.StateDir): the
	// sandboxes' folders are under it, and the host key of the
	// checkpoints in it.
	StateDir string
	// Runtime is the kernel and agent initramfs sandboxes boot.
	Runtime sandbox.Runtime
	// Images is the images folder of image-rooted sandboxes.
	Images string
	// Command starts a VMM process: ["/usr/bin/kiln-vmm"] (required).
	Command []string
	// Jail, when set, jails every sandbox's VMM process
	// (sandbox.ProcessOptions.Jail; kilnd --jail). An image root's
	// missing chunks are fetched by kilnd for the jailed process
	// (image/chunkrpc).
	Jail   *sandbox.JailOptions
	Logger *slog.Logger
}

// SnapshotKeyFile is the host key of the checkpoints kilnd saves and
// restores, in its state folder (snapshot.LoadKey).
const SnapshotKeyFile = "snapshot.key"

// New makes the Backend of a daemon over opts.StateDir: its checkpoints'
// host key is made there on first use (mode 0600).
func New(opts Options) (*Backend, error) {
	abs, err := filepath.Abs(opts.StateDir)
	if opts.StateDir == "" || err != nil {
		return nil, errors.New("daemon: no state folder")
	}
	// A sandbox's sockets are StateDir/sandboxes/ID/vmm.sock: a Unix
	// socket's path has at most 107 bytes.
	if n := len(abs) + len("/sandboxes/sb-0123456789abcdef/vsock.sock"); n > 100 {
		return nil, fmt.Errorf("daemon: state folder %s is too long: its sandboxes' socket paths would have %d bytes, Unix sockets take at most 100 here", abs, n)
	}
	if len(opts.Command) == 0 {
		return nil, errors.New("daemon: no VMM process command (kiln-vmm)")
	}
	key, err := snapshot.LoadKey(filepath.Join(abs, SnapshotKeyFile))
	if err != nil {
		return nil, fmt.Errorf("daemon: %w", err)
	}
	return &Backend{Runtime: opts.Runtime, Images: opts.Images,
		Process: sandbox.ProcessOptions{Command: opts.Command, Jail: opts.Jail}, Logger: opts.Logger, SnapshotKey: key}, nil
}

var (
	_ daemon.Backend     = (*Backend)(nil)
	_ daemon.SharedFiles = (*Backend)(nil)
)

// BootFiles implements daemon.SharedFiles: the kernel and initramfs every
// boot reads.
func (b *Backend) BootFiles() []string { return []string{b.Runtime.Kernel, b.Runtime.Initrd} }

// CheckpointFiles implements daemon.SharedFiles: a checkpoint's memory,
// which its restores map.
func (b *Backend) CheckpointFiles(dir string) []string {
	return []string{filepath.Join(dir, snapshot.MemoryFile)}
}
