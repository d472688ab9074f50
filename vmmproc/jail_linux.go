package vmmproc

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/jail"
	"github.com/kilnvm/kiln/memory"
	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmm"
	"github.com/kilnvm/kiln/vmmproc/vmmpb"
)

// JailEnv is the environment variable through which Start gives a jailed
// VMM process its jail (a jail.Config in JSON, without the binds its
// Create adds).
const JailEnv = "KILN_JAIL"

// JailDir is the folder, in a VMM process's folder, whose root subfolder
// becomes its jail's root (a tmpfs seen only in its mount namespace).
const JailDir = "jail"

// JailConfig jails a VMM process (package jail). Start clones it into new
// mount, PID, IPC and UTS namespaces and a network namespace (Netns, or
// a new empty one); once its VM is built and before the guest runs, it
// pivots into a root holding only what it needs (/dev/kvm, its folder,
// what its Create named: kernel, initrd, disks, snapshot, vsock folder;
// /dev/net/tun with a tap; Binds), and drops to UID/GID with no
// capabilities and NO_NEW_PRIVS, before its seccomp filter. The VMM must
// be a binary without cgo.
type JailConfig struct {
	// UID and GID are the process's ids (jail.IDs.Allocate); not 0.
	UID, GID int
	// IDFile is the id's locked file: the process inherits it, so the id
	// stays held while it lives. Start closes the caller's copy.
	IDFile *os.File
	// Netns, when set, is the network namespace (a path: a tap's
	// /var/run/netns/NAME, or /proc/self/ns/net for the caller's own)
	// the process starts in; empty gives it a new, empty one.
	Netns string
	// Binds are more host paths its jail holds.
	Binds []jail.Bind
}

// jailSetup prepares a jailed start: the clone flags, the child's
// environment entry and its inherited id file.
func jailSetup(cfg StartConfig, attr *syscall.SysProcAttr) (env string, err error) {
	j := cfg.Jail
	if j.UID <= 0 || j.GID <= 0 {
		return "", fmt.Errorf("vmmproc: jail: uid %d / gid %d: a jail needs ids other than root's", j.UID, j.GID)
	}
	if j.IDFile == nil {
		return "", errors.New("vmmproc: jail: no id file (jail.IDs.Allocate)")
	}
	dir, err := filepath.Abs(filepath.Join(cfg.Dir, JailDir))
	if err != nil {
		return "", fmt.Errorf("vmmproc: jail: %w", err)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", fmt.Errorf("vmmproc: jail: %w", err)
	}
	ns, err := jail.MountNS()
	if err != nil {
		return "", fmt.Errorf("vmmproc: %w", err)
	}
	b, err := json.Marshal(jail.Config{Dir: dir, UID: j.UID, GID: j.GID, Binds: j.Binds, ParentMountNS: ns})
	if err != nil {
		return "", fmt.Errorf("vmmproc: jail: %w", err)
	}
	attr.Cloneflags = unix.CLONE_NEWNS | unix.CLONE_NEWPID | unix.CLONE_NEWIPC | unix.CLONE_NEWUTS
	if j.Netns == "" {
		attr.Cloneflags |= unix.CLONE_NEWNET
	}
	return JailEnv + "=" + string(b), nil
}

// readJail reads the jail Start gave this process ($KILN_JAIL); nil when
// it has none.
func readJail() (*jail.Config, error) {
	v := os.Getenv(JailEnv)
	if v == "" {
		return nil, nil
	}
	var c jail.Config
	if err := decodeStrict([]byte(v), &c); err != nil {
		return nil, fmt.Errorf("$%s: %w", JailEnv, err)
	}
	if err := c.Validate(); err != nil {
		return nil, fmt.Errorf("$%s: %w", JailEnv, err)
	}
	return &c, nil
}

// hostPID is this process's ID in the host's PID namespace: /proc is
// still the host's when a jailed VMM process starts (its own PID is 1 in
// its namespace). os.Getpid where that cannot be read.
func hostPID() int {
	if s, err := os.Readlink("/proc/self"); err == nil {
		if pid, err := strconv.Atoi(s); err == nil && pid > 0 {
			return pid
		}
	}
	return os.Getpid()
}

// jailBinds lists what a jailed VMM process holds for its VM vm, built
// from req and its devices: /dev/kvm, its socket folder, the boot's kernel and initrd or
// the snapshot folder (read-only), each disk (read-only where the disk
// is), each vsock socket's folder, /dev/net/tun with a tap, and extra.
// Image roots (fs devices) are refused: they fetch chunks by host path
// and HTTP, which a jail does not hold yet.
func jailBinds(kvmPath, socket string, req *vmmpb.CreateRequest, devices []virtio.DeviceSpec, extra []jail.Bind) ([]jail.Bind, error) {
	if kvmPath == "" {
		kvmPath = "/dev/kvm"
	}
	want := map[string]bool{} // path → read-only
	add := func(p string, ro bool) {
		if p == "" {
			return
		}
		p = filepath.Clean(p)
		if old, ok := want[p]; ok {
			want[p] = old && ro
			return
		}
		want[p] = ro
	}
	add(kvmPath, false)
	add(filepath.Dir(socket), false)
	switch src := req.Source.(type) {
	case *vmmpb.CreateRequest_BootSpecJson:
		var spec vmm.Spec
		if err := json.Unmarshal(src.BootSpecJson, &spec); err != nil {
			return nil, err
		}
		add(spec.Kernel, true)
		add(spec.Initrd, true)
	case *vmmpb.CreateRequest_SnapshotDir:
		add(src.SnapshotDir, true)
	}
	for _, d := range devices {
		switch {
		case d.Kind == virtio.KindBlock && d.Block != nil:
			add(d.Block.Path, d.Block.ReadOnly)
		case d.Kind == virtio.KindNet:
			add("/dev/net/tun", false)
		case d.Kind == virtio.KindVsock && d.Vsock != nil:
			add(filepath.Dir(d.Vsock.Path), false)
		case d.Kind == virtio.KindFS && d.FS != nil && d.FS.Dir != "":
			// A host directory root, read-only: opened before the jail
			// is entered, but read by path inside it.
			add(d.FS.Dir, true)
		case d.Kind == virtio.KindFS && d.FS != nil:
			// Its store, read-only: the parent fetches missing chunks
			// into it (ChunkSocket, beside the socket bound above).
			add(d.FS.Images, true)
		}
	}
	for _, b := range extra {
		add(b.Path, b.ReadOnly)
	}
	out := make([]jail.Bind, 0, len(want))
	for p, ro := range want {
		if !filepath.IsAbs(p) {
			return nil, fmt.Errorf("%s is not an absolute path: a jailed VMM process needs them", p)
		}
		out = append(out, jail.Bind{Path: p, ReadOnly: ro})
	}
	// Folders before what is beneath them.
	sort.Slice(out, func(i, j int) bool { return out[i].Path < out[j].Path })
	return out, nil
}

// enterJail jails this process once its VM is built (server.Create, before
// the seccomp filter): the kept pagemap (Freeze without /proc), then
// jail.Enter. A process that fails part way must not run a guest.
func (s *server) enterJail(req *vmmpb.CreateRequest, vm *vmm.VM) error {
	binds, err := jailBinds(s.kvmPath, s.socket, req, vm.Devices(), s.jail.Binds)
	if err != nil {
		return status.Errorf(codes.InvalidArgument, "jail the VMM process: %v", err)
	}
	if err := memory.KeepPagemap(); err != nil {
		s.log.Warn("jail: no pagemap kept: forks will read every page", "err", err)
	}
	c := *s.jail
	c.Binds = binds
	if err := jail.Enter(c); err != nil {
		return status.Errorf(codes.Internal, "jail the VMM process: %v", err)
	}
	paths := make([]string, len(binds))
	for i, b := range binds {
		paths[i] = b.Path
		if b.ReadOnly {
			paths[i] += " (ro)"
		}
	}
	s.log.Info("jailed", "uid", c.UID, "gid", c.GID, "binds", strings.Join(paths, ", "))
	return nil
}

// saveStaged has a jailed process save into dir: a folder made here
// beside dir, owned by the jail's ids, goes to the process as a
// descriptor (it sees no host path); once written, its files are given
// back to root and it is renamed to dir (which must not exist).
func (p *Process) saveStaged(ctx context.Context, dir string, labels map[string]string) (err error) {
	dir = filepath.Clean(dir)
	if _, err := os.Lstat(dir); err == nil {
		return fmt.Errorf("vmmproc: save: %s exists", dir)
	}
	tmp, err := os.MkdirTemp(filepath.Dir(dir), filepath.Base(dir)+".tmp-")
	if err != nil {
		return fmt.Errorf("vmmproc: save: %w", err)
	}
	defer func() {
		if err != nil {
			os.RemoveAll(tmp)
		}
	}()
	if err := os.Chown(tmp, p.jailUID, p.jailGID); err != nil {
		return fmt.Errorf("vmmproc: save: give the staged folder to the jail: %w", err)
	}
	d, err := os.Open(tmp)
	if err != nil {
		return fmt.Errorf("vmmproc: save: %w", err)
	}
	token, err := newToken()
	if err == nil {
		err = putFD(ctx, FDSocket(p.sock), token, d)
	}
	d.Close()
	if err != nil {
		return fmt.Errorf("vmmproc: save: %w", err)
	}
	if _, err := p.api.Save(ctx, &vmmpb.SaveRequest{Dir: saveFDPrefix + token, Labels: labels}); err != nil {
		return p.rpcErr("save", err)
	}
	// Back to root: the jail's uid (reused by a later sandbox) keeps no
	// hold on the snapshot. Lchown: the process may have left links.
	ents, err := os.ReadDir(tmp)
	if err != nil {
		return fmt.Errorf("vmmproc: save: %w", err)
	}
	for _, e := range ents {
		if err := os.Lchown(filepath.Join(tmp, e.Name()), 0, 0); err != nil {
			return fmt.Errorf("vmmproc: save: %w", err)
		}
	}
	if err := os.Chown(tmp, 0, 0); err != nil {
		return fmt.Errorf("vmmproc: save: %w", err)
	}
	err = unix.Renameat2(unix.AT_FDCWD, tmp, unix.AT_FDCWD, dir, unix.RENAME_NOREPLACE)
	if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOSYS) {
		// No renameat2 flags on this filesystem: check, then rename.
		if _, serr := os.Lstat(dir); serr == nil {
			return fmt.Errorf("vmmproc: save: %s exists", dir)
		}
		err = os.Rename(tmp, dir)
	}
	if err != nil {
		return fmt.Errorf("vmmproc: save: rename into place: %w", err)
	}
	return nil
}

// saveFDPrefix starts a SaveRequest's dir that names a directory passed
// as a descriptor (the rest is its token): a jailed process's save.
const saveFDPrefix = "fd:"

// jailIDs reads a process's uid and gid from /proc/PID/status: non-zero
// for a jailed one (Attach learns it so).
func jailIDs(pid int) (uid, gid int) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) < 2 {
			continue
		}
		switch f[0] {
		case "Uid:":
			uid, _ = strconv.Atoi(f[1])
		case "Gid:":
			gid, _ = strconv.Atoi(f[1])
		}
	}
	return uid, gid
}
