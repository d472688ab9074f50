package sandbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"sync"

	"github.com/kilnvm/kiln/image"
	"github.com/kilnvm/kiln/image/chunkrpc"
	"github.com/kilnvm/kiln/virtio"
	"github.com/opencontainers/go-digest"
)

// chunkServer fetches a jailed VMM process's missing image chunks on its
// behalf (the process reads the image store through a read-only bind, and
// has no network of the registry's): it serves vmmproc.ChunkSocket and
// fetches what a request names, after image.Root.FetchChunks checked it
// against the sandbox's own image. The root is opened on the first
// request: most sandboxes from a warm template fetch nothing.
type chunkServer struct {
	srv *chunkrpc.Server

	roots    *image.Roots
	dir      string
	manifest digest.Digest

	mu      sync.Mutex
	root    *image.Root
	release func() error
}

// serveChunks serves the chunk socket at path for a process of uid and
// gid whose image root is fs, fetching through roots (new ones if nil).
// The jailed process reaches the socket by its path, in the sandbox's
// folder: the folder gets search permission for others (0711: no listing;
// its other files keep their own modes, none of them open to others) and
// the socket is the jail uid's alone. The images folder must be readable
// by others (0755, as kiln makes it): the jail binds it in read-only.
func serveChunks(path string, uid, gid int, roots *image.Roots, fs virtio.FSSpec, log *slog.Logger) (*chunkServer, error) {
	if roots == nil {
		roots = image.NewRoots(image.Options{Logger: log})
	}
	if fi, err := os.Stat(fs.Images); err != nil {
		return nil, fmt.Errorf("sandbox: images folder: %w", err)
	} else if fi.Mode().Perm()&0o005 != 0o005 {
		return nil, fmt.Errorf("sandbox: images folder %s is mode %#o: a jailed VMM process (uid %d) cannot read it; make it 0755", fs.Images, fi.Mode().Perm(), uid)
	}
	if err := letJailSearch(filepath.Dir(path)); err != nil {
		return nil, err
	}
	c := &chunkServer{roots: roots, dir: fs.Images, manifest: digest.Digest(fs.Image)}
	srv, err := chunkrpc.Listen(path, uid, gid, c, 0, log)
	if err != nil {
		return nil, fmt.Errorf("sandbox: the jail's image chunk socket: %w", err)
	}
	c.srv = srv
	return c, nil
}

// FetchChunks opens the root on first use and fetches through it.
func (c *chunkServer) FetchChunks(ctx context.Context, req image.ChunkRequest) error {
	c.mu.Lock()
	if c.root == nil {
		r, release, err := c.roots.Open(ctx, c.dir, c.manifest)
		if err != nil {
			c.mu.Unlock()
			return fmt.Errorf("sandbox: image %s: %w", c.manifest, err)
		}
		c.root, c.release = r, release
	}
	r := c.root
	c.mu.Unlock()
	return r.FetchChunks(ctx, req)
}

// Close stops serving and releases the root.
func (c *chunkServer) Close() error {
	err := c.srv.Close()
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.release != nil {
		err = errors.Join(err, c.release())
		c.root, c.release = nil, nil
	}
	return err
}

// serveAttachedJail serves the sockets of an attached jailed process (its
// parent, which served them, is gone): the vsock dial socket and, with an
// image root, the chunk socket. One that cannot be served is logged, not
// fatal: the sandbox runs on, and only its guest's connections to the
// host, or its reads of chunks not yet stored (EIO), fail.
func (m *processVM) serveAttachedJail(s *Sandbox, opts AttachOptions) {
	uid, gid := m.p.JailIDs()
	if uid == 0 {
		return
	}
	var fs *virtio.FSSpec
	if i := slices.IndexFunc(m.specs, func(d virtio.DeviceSpec) bool { return d.Kind == virtio.KindFS && d.FS != nil && d.FS.Dir == "" }); i >= 0 {
		fs = m.specs[i].FS
	}
	roots := opts.ImageRoots
	if fs != nil && roots == nil {
		roots = image.NewRoots(image.Options{Logger: s.log})
	}
	if err := m.serveJail(s, uid, gid, roots, fs); err != nil {
		s.log.Warn("attach: the jailed VMM process's sockets cannot be served", "err", err)
		return
	}
	if fs != nil {
		s.imageFS, s.roots = fs, roots
	}
}
