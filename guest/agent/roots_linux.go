package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/guest/agentpb"
)

// Container roots (MountRoot): trees the host serves beside the guest's
// image root on its virtio-9p device (which takes one mount: they are
// reached through it, under TreesDir), each mounted read-only under a
// tmpfs overlay below RootsDir, so that one VM runs the processes of
// several containers (a pod), each in its own root and mount namespace.

// RootsDir holds the container roots: RootsDir/NAME/{lower,rw,root}.
const RootsDir = "/run/kiln/roots"

// TreesDir holds the host's further trees in the guest: guest/pid1's
// ImageTree (the image root's 9p mount, kept reachable) and, in it,
// hostfs.TreesDir.
const TreesDir = "/run/kiln/image/.kiln-trees"

// maxRoots bounds the container roots one guest holds.
const maxRoots = 64

// rootFiles are copied from the guest's root into each container root
// (where the guest has them): the name, hosts and resolver the host
// configured apply to every container of the pod.
var rootFiles = []string{"/etc/hosts", "/etc/hostname", "/etc/resolv.conf"}

// containerRoot is one mounted root.
type containerRoot struct {
	name string
	dir  string // RootsDir/name
	path string // dir/root: the processes' root
	// mntns are the mount namespaces (inode numbers) of the processes
	// Exec started in it: UnmountRoot kills every process in one.
	mntns map[uint64]bool
	// gone: UnmountRoot has begun; Exec refuses it.
	gone bool
}

// rootTable holds the mounted roots.
type rootTable struct {
	mu sync.Mutex
	m  map[string]*containerRoot
}

// checkRootName checks a root name from the host.
func checkRootName(name string) error {
	if !agentpb.ValidRootName(name) {
		return invalidf("root name %s: want 1 to %d bytes of A-Z a-z 0-9 . _ -, not . or ..", quoteShort(name), agentpb.MaxRootNameLen)
	}
	return nil
}

// MountRoot mounts a container root; see agentpb.AgentServer.
func (s *Server) MountRoot(ctx context.Context, req *agentpb.MountRootRequest) (*agentpb.MountRootResponse, error) {
	name := req.GetName()
	if err := checkRootName(name); err != nil {
		return nil, err
	}
	tree := filepath.Join(s.treesDir, name)
	if fi, err := os.Stat(tree); err != nil || !fi.IsDir() {
		return nil, status.Errorf(codes.NotFound, "root %s: the host serves no tree %s", name, tree)
	}
	s.roots.mu.Lock()
	if s.roots.m == nil {
		s.roots.m = map[string]*containerRoot{}
	}
	if _, ok := s.roots.m[name]; ok {
		s.roots.mu.Unlock()
		return nil, status.Errorf(codes.AlreadyExists, "root %s is mounted", name)
	}
	if len(s.roots.m) >= maxRoots {
		s.roots.mu.Unlock()
		return nil, status.Errorf(codes.ResourceExhausted, "root %s: %d roots are mounted, the most a guest holds", name, maxRoots)
	}
	dir := filepath.Join(s.rootsDir, name)
	r := &containerRoot{name: name, dir: dir, path: filepath.Join(dir, "root"), mntns: map[uint64]bool{}, gone: true}
	s.roots.m[name] = r // held (gone) while it is mounted
	s.roots.mu.Unlock()

	err := mountRoot(r, tree, req.GetWritableMib())
	s.roots.mu.Lock()
	defer s.roots.mu.Unlock()
	if err != nil {
		delete(s.roots.m, name)
		return nil, err
	}
	r.gone = false
	s.log.Info("container root mounted", "root", name, "path", r.path)
	return &agentpb.MountRootResponse{Path: r.path}, nil
}

// mountRoot mounts r's tree, overlay and system folders; on failure it
// undoes what it did.
func mountRoot(r *containerRoot, tree string, writableMiB uint32) (err error) {
	lower, rw := filepath.Join(r.dir, "lower"), filepath.Join(r.dir, "rw")
	if err := os.MkdirAll(r.dir, 0o700); err != nil {
		return status.Errorf(codes.Internal, "root %s: %v", r.name, err)
	}
	var mounted []string // innermost last
	defer func() {
		if err != nil {
			for i := len(mounted) - 1; i >= 0; i-- {
				unix.Unmount(mounted[i], unix.MNT_DETACH)
			}
			os.RemoveAll(r.dir)
		}
	}()
	mount := func(src, dst, fstype string, flags uintptr, data string) error {
		// dst is our folder or one just below the tree's root: a link or
		// file the tree put there goes (from the overlay only), so a
		// mount never lands where a link points (the guest's own /etc).
		if fi, err := os.Lstat(dst); err == nil && !fi.IsDir() {
			if err := os.Remove(dst); err != nil {
				return status.Errorf(codes.Internal, "root %s: replacing %s with a folder: %v", r.name, dst, err)
			}
		}
		if err := os.Mkdir(dst, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			return status.Errorf(codes.Internal, "root %s: making %s: %v", r.name, dst, err)
		}
		if err := unix.Mount(src, dst, fstype, flags, data); err != nil {
			return status.Errorf(codes.Internal, "root %s: mounting %s (%s %q) on %s: %v", r.name, src, fstype, data, dst, err)
		}
		mounted = append(mounted, dst)
		return nil
	}
	// The tree, read-only as its 9p mount is (a bind keeps the mount's
	// flags), on a path of this root's own.
	if err := mount(tree, lower, "", unix.MS_BIND, ""); err != nil {
		return err
	}
	tmpfs := "mode=0755"
	if writableMiB > 0 {
		tmpfs += ",size=" + strconv.FormatUint(uint64(writableMiB), 10) + "m"
	}
	if err := mount("tmpfs", rw, "tmpfs", 0, tmpfs); err != nil {
		return err
	}
	upper, work := filepath.Join(rw, "upper"), filepath.Join(rw, "work")
	for _, d := range []string{upper, work} {
		if err := os.Mkdir(d, 0o755); err != nil {
			return status.Errorf(codes.Internal, "root %s: %v", r.name, err)
		}
	}
	ov := fmt.Sprintf("lowerdir=%s,upperdir=%s,workdir=%s", lower, upper, work)
	if err := mount("overlay", r.path, "overlay", 0, ov); err != nil {
		return err
	}
	if err := mount("proc", filepath.Join(r.path, "proc"), "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return err
	}
	if err := mount("sysfs", filepath.Join(r.path, "sys"), "sysfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return err
	}
	// The guest's /dev, with its pts, shm and mqueue mounts: the pod's
	// containers share a kernel, and a terminal Exec opens there.
	if err := mount("/dev", filepath.Join(r.path, "dev"), "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		return err
	}
	for _, f := range rootFiles {
		copyRootFile(f, r.path)
	}
	return nil
}

// copyRootFile copies the guest's file f into root, replacing what the
// tree has there; best effort (the guest may have none, or the tree a
// folder in its place). The file is written beneath root without
// following the tree's symbolic links.
func copyRootFile(f, root string) {
	b, err := os.ReadFile(f)
	if err != nil {
		return
	}
	rfd, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return
	}
	defer unix.Close(rfd)
	dfd, err := unix.Openat2(rfd, strings.TrimPrefix(filepath.Dir(f), "/"), &unix.OpenHow{
		Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC, Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS})
	if err != nil {
		return
	}
	defer unix.Close(dfd)
	name := filepath.Base(f)
	unix.Unlinkat(dfd, name, 0)
	fd, err := unix.Openat(dfd, name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o644)
	if err != nil {
		return
	}
	out := os.NewFile(uintptr(fd), f)
	out.Write(b)
	out.Close()
}

// UnmountRoot kills a container root's processes and unmounts it; see
// agentpb.AgentServer.
func (s *Server) UnmountRoot(ctx context.Context, req *agentpb.UnmountRootRequest) (*agentpb.UnmountRootResponse, error) {
	name := req.GetName()
	if err := checkRootName(name); err != nil {
		return nil, err
	}
	s.roots.mu.Lock()
	r := s.roots.m[name]
	if r == nil || r.gone {
		s.roots.mu.Unlock()
		return nil, status.Errorf(codes.NotFound, "root %s is not mounted", name)
	}
	r.gone = true
	ns := make(map[uint64]bool, len(r.mntns))
	for k := range r.mntns {
		ns[k] = true
	}
	s.roots.mu.Unlock()

	if err := killMountNamespaces(ctx, ns); err != nil {
		s.roots.mu.Lock()
		r.gone = false
		s.roots.mu.Unlock()
		return nil, status.Errorf(codes.Internal, "root %s: killing its processes: %v", name, err)
	}
	// A lazy unmount of the overlay takes the mounts inside it along.
	var errs []error
	for _, m := range []string{r.path, filepath.Join(r.dir, "rw"), filepath.Join(r.dir, "lower")} {
		if err := unix.Unmount(m, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
			errs = append(errs, fmt.Errorf("unmount %s: %w", m, err))
		}
	}
	if err := os.RemoveAll(r.dir); err != nil {
		errs = append(errs, err)
	}
	s.roots.mu.Lock()
	delete(s.roots.m, name)
	s.roots.mu.Unlock()
	if err := errors.Join(errs...); err != nil {
		s.log.Warn("container root left behind", "root", name, "err", err)
	}
	s.log.Info("container root unmounted", "root", name)
	return &agentpb.UnmountRootResponse{}, nil
}

// rootFor returns the mounted root name for an Exec (NotFound when there
// is none, or it is being unmounted).
func (s *Server) rootFor(name string) (*containerRoot, error) {
	if err := checkRootName(name); err != nil {
		return nil, err
	}
	s.roots.mu.Lock()
	defer s.roots.mu.Unlock()
	r := s.roots.m[name]
	if r == nil || r.gone {
		return nil, status.Errorf(codes.NotFound, "exec: root %s is not mounted", name)
	}
	return r, nil
}

// noteProcess records the mount namespace of pid, a process started in
// root name, so that UnmountRoot finds it and its children.
func (s *Server) noteProcess(name string, pid int) {
	ino, err := mountNamespace(pid)
	if err != nil {
		s.log.Warn("exec: cannot note a process's mount namespace", "root", name, "pid", pid, "err", err)
		return
	}
	s.roots.mu.Lock()
	defer s.roots.mu.Unlock()
	if r := s.roots.m[name]; r != nil {
		r.mntns[ino] = true
	}
}

// mountNamespace is the inode number of pid's mount namespace.
func mountNamespace(pid int) (uint64, error) {
	var st unix.Stat_t
	if err := unix.Stat("/proc/"+strconv.Itoa(pid)+"/ns/mnt", &st); err != nil {
		return 0, err
	}
	return st.Ino, nil
}

// killMountNamespaces SIGKILLs every process in one of the mount
// namespaces ns until a pass finds none (a process forking meanwhile
// puts its child in the same namespace), or ctx or a bound ends.
func killMountNamespaces(ctx context.Context, ns map[uint64]bool) error {
	if len(ns) == 0 {
		return nil
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		ents, err := os.ReadDir("/proc")
		if err != nil {
			return err
		}
		found := 0
		for _, e := range ents {
			pid, err := strconv.Atoi(e.Name())
			if err != nil || pid == os.Getpid() {
				continue
			}
			ino, err := mountNamespace(pid)
			if err != nil || !ns[ino] {
				continue
			}
			// A zombie stays listed until reaped: count only the living.
			if b, err := os.ReadFile("/proc/" + e.Name() + "/stat"); err == nil && isZombieStat(b) {
				continue
			}
			found++
			syscall.Kill(pid, syscall.SIGKILL)
		}
		if found == 0 {
			return nil
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d processes still alive after 10s of SIGKILL", found)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// isZombieStat reports whether a /proc/PID/stat line is a zombie's (or
// a dead process's): its state, after the parenthesized command, is Z
// or X.
func isZombieStat(b []byte) bool {
	i := len(b) - 1
	for i >= 0 && b[i] != ')' {
		i--
	}
	if i < 0 || i+2 >= len(b) {
		return false
	}
	return b[i+2] == 'Z' || b[i+2] == 'X'
}
