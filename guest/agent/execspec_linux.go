package agent

import (
	"errors"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/accounts"
	"github.com/kilnvm/kiln/filetree"
	"github.com/kilnvm/kiln/guest/agentpb"
)

// DefaultPath is the PATH of an Exec that brings no environment.
const DefaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// DefaultEnv returns the environment of an Exec that brings none.
func DefaultEnv() []string {
	return []string{"PATH=" + DefaultPath, "HOME=/root", "TERM=xterm"}
}

// Limits on an Exec's arguments, so that a request cannot make the agent
// build something enormous. The kernel's own limit (ARG_MAX) is lower.
const (
	maxArgs    = 1 << 16
	maxEnvVars = 1 << 16
)

// execSpec is a validated ExecStart.
type execSpec struct {
	path     string // the executable, absolute
	argv     []string
	env      []string
	dir      string
	uid, gid *uint32
	timeout  time.Duration // 0: none
	hasStdin bool
	// groups are the supplementary groups of a named user (nil: the
	// default, see trampolineArgv).
	groups []uint32
	// pty, when set, is the size of the terminal to run on.
	pty *agentpb.PtySize
	// chroot, when set, is the container root (MountRoot) the process
	// runs in, in a mount namespace of its own; path and dir are then
	// paths in it.
	chroot string
	// rootName is that root's name.
	rootName string
}

// checkPtySize checks a terminal size from a client.
func checkPtySize(field string, p *agentpb.PtySize) error {
	if p.GetRows() < 1 || p.GetRows() > agentpb.MaxPtyDimension || p.GetCols() < 1 || p.GetCols() > agentpb.MaxPtyDimension {
		return invalidf("exec: %s %dx%d: want 1 to %d rows and columns", field, p.GetRows(), p.GetCols(), agentpb.MaxPtyDimension)
	}
	return nil
}

// newExecSpec validates start and resolves its executable. d, when not nil,
// fills what start leaves unset (ExecDefaults), with the image's account
// files under root.
func newExecSpec(start *agentpb.ExecStart, d *ExecDefaults, root string) (*execSpec, error) {
	return newExecSpecIn(start, d, root, "")
}

// newExecSpecIn is newExecSpec for a process that runs in chroot (a
// container root; "" for the guest's own): its working directory,
// executable and account files are resolved in it.
func newExecSpecIn(start *agentpb.ExecStart, d *ExecDefaults, root, chroot string) (*execSpec, error) {
	argv := start.GetArgv()
	switch {
	case len(argv) == 0:
		return nil, invalidf("exec: argv is empty")
	case len(argv) > maxArgs:
		return nil, invalidf("exec: %d arguments, at most %d", len(argv), maxArgs)
	case argv[0] == "":
		return nil, invalidf("exec: argv[0] is empty")
	}
	for i, a := range argv {
		if strings.IndexByte(a, 0) >= 0 {
			return nil, invalidf("exec: argv[%d] %s contains a NUL byte", i, quoteShort(a))
		}
	}
	env := start.GetEnv()
	if err := validateEnv(env); err != nil {
		return nil, err
	}
	var named *accounts.User
	if name := start.GetUser(); name != "" {
		if start.Uid != nil || start.Gid != nil {
			return nil, invalidf("exec: user %s and uid/gid both given: name one or the other", quoteShort(name))
		}
		u, err := filetree.LookupUser(root, name)
		if err != nil {
			return nil, status.Errorf(status.Code(err), "exec: %s", status.Convert(err).Message())
		}
		named = u
	}
	if start.Pty != nil {
		if err := checkPtySize("pty", start.GetPty()); err != nil {
			return nil, err
		}
	}
	var user *resolvedUser
	if named != nil {
		user = &resolvedUser{uid: named.UID, gid: named.GID, home: named.Home}
	} else if d != nil && d.User != "" && start.Uid == nil {
		u, err := resolveUser(root, d.User)
		if err != nil {
			return nil, err
		}
		user = u
	}
	switch {
	case d != nil:
		base := d.Env
		if _, ok := envValue(base, "PATH"); !ok {
			base = append([]string{"PATH=" + DefaultPath}, base...)
		}
		if _, ok := envValue(base, "HOME"); !ok {
			home := "/root"
			if user != nil {
				home = user.home
			}
			base = append(base, "HOME="+home)
		}
		env = mergeEnv(base, env)
	case len(env) == 0:
		env = DefaultEnv()
		if named != nil {
			env = mergeEnv(env, []string{"HOME=" + named.Home})
		}
	}
	if named != nil {
		// The user's own variables, where the environment has none.
		var add []string
		for _, kv := range []string{"HOME=" + named.Home, "USER=" + named.Name, "LOGNAME=" + named.Name} {
			name, _, _ := strings.Cut(kv, "=")
			if _, ok := envValue(env, name); !ok {
				add = append(add, kv)
			}
		}
		env = append(slices.Clone(env), add...)
	}

	dir := start.GetCwd()
	if dir == "" && d != nil {
		dir = d.Cwd
	}
	if dir == "" {
		dir = "/"
	}
	if strings.IndexByte(dir, 0) >= 0 || !filepath.IsAbs(dir) {
		return nil, invalidf("exec: working directory %s is not an absolute path", quoteShort(dir))
	}
	dir = filepath.Clean(dir)
	if fi, err := statIn(chroot, dir); err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "exec: working directory %s: %s", dir, errText(err))
	} else if !fi.IsDir() {
		return nil, status.Errorf(codes.InvalidArgument, "exec: working directory %s: not a directory", dir)
	}

	pathEnv, ok := envValue(env, "PATH")
	if !ok {
		pathEnv = DefaultPath
	}
	path, err := lookPathIn(chroot, argv[0], pathEnv, dir)
	if err != nil {
		return nil, err
	}

	var timeout time.Duration
	if ms := start.GetTimeoutMs(); ms > 0 && ms <= uint64(math.MaxInt64/int64(time.Millisecond)) {
		timeout = time.Duration(ms) * time.Millisecond
	}
	spec := &execSpec{
		path:     path,
		argv:     argv,
		env:      env,
		dir:      dir,
		timeout:  timeout,
		hasStdin: start.GetHasStdin(),
		pty:      start.GetPty(),
		chroot:   chroot,
	}
	if named != nil {
		spec.groups = append([]uint32{}, named.Groups...)
	}
	if user != nil {
		uid, gid := user.uid, user.gid
		spec.uid, spec.gid = &uid, &gid
	}
	if start.Uid != nil {
		uid := start.GetUid()
		spec.uid = &uid
	}
	if start.Gid != nil {
		gid := start.GetGid()
		spec.gid = &gid
	}
	return spec, nil
}

// validateEnv checks that every entry is NAME=VALUE with a non-empty name
// and no NUL byte.
func validateEnv(env []string) error {
	if len(env) > maxEnvVars {
		return invalidf("exec: %d environment variables, at most %d", len(env), maxEnvVars)
	}
	for i, kv := range env {
		name, _, ok := strings.Cut(kv, "=")
		switch {
		case !ok:
			return invalidf("exec: env[%d] %s is not NAME=VALUE", i, quoteShort(kv))
		case name == "":
			return invalidf("exec: env[%d] %s has an empty name", i, quoteShort(kv))
		case strings.IndexByte(kv, 0) >= 0:
			return invalidf("exec: env[%d] %s contains a NUL byte", i, quoteShort(kv))
		}
	}
	return nil
}

// envValue returns the value of the first entry named key, as getenv(3)
// would.
func envValue(env []string, key string) (string, bool) {
	for _, kv := range env {
		if name, value, ok := strings.Cut(kv, "="); ok && name == key {
			return value, true
		}
	}
	return "", false
}

// lookPath resolves file like execvp(3): a name with a slash is taken as a
// path (relative to dir), any other is searched for in pathEnv. The errors
// are gRPC statuses naming what was looked for: NotFound if there is no
// such file, PermissionDenied if it is not executable, InvalidArgument if
// it is a directory.
func lookPath(file, pathEnv, dir string) (string, error) {
	return lookPathIn("", file, pathEnv, dir)
}

// lookPathIn is lookPath in chroot ("" for the guest's root): the
// paths it returns and tries are paths in it.
func lookPathIn(chroot, file, pathEnv, dir string) (string, error) {
	abs := func(p string) string {
		if filepath.IsAbs(p) {
			return p
		}
		return filepath.Join(dir, p)
	}
	if strings.Contains(file, "/") {
		p := abs(file)
		if err := checkExecutableIn(chroot, p); err != nil {
			return "", execStatus(p, err)
		}
		return p, nil
	}
	var firstErr error // a match that is not executable
	for _, d := range filepath.SplitList(pathEnv) {
		if d == "" {
			d = "."
		}
		p := abs(filepath.Join(d, file))
		err := checkExecutableIn(chroot, p)
		if err == nil {
			return p, nil
		}
		if firstErr == nil && !errors.Is(err, fs.ErrNotExist) && errnoOf(err) != syscall.ENOTDIR {
			firstErr = execStatus(p, err)
		}
	}
	if firstErr != nil {
		return "", firstErr
	}
	return "", status.Errorf(codes.NotFound, "exec: %s: executable file not found in PATH=%s", quoteShort(file), quoteShort(pathEnv))
}

// statIn stats p, a path in chroot ("" for the guest's root), resolved
// in it: its symbolic links, absolute ones included, cannot leave it.
func statIn(chroot, p string) (fs.FileInfo, error) {
	if chroot == "" {
		return os.Stat(p)
	}
	rfd, err := unix.Open(chroot, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &fs.PathError{Op: "stat", Path: p, Err: err}
	}
	defer unix.Close(rfd)
	fd, err := unix.Openat2(rfd, p, &unix.OpenHow{Flags: unix.O_PATH | unix.O_CLOEXEC, Resolve: unix.RESOLVE_IN_ROOT})
	if err != nil {
		return nil, &fs.PathError{Op: "stat", Path: p, Err: err}
	}
	f := os.NewFile(uintptr(fd), p)
	defer f.Close()
	return f.Stat()
}

// checkExecutable reports why p is not an executable regular file.
func checkExecutable(p string) error { return checkExecutableIn("", p) }

// checkExecutableIn is checkExecutable for p in chroot.
func checkExecutableIn(chroot, p string) error {
	fi, err := statIn(chroot, p)
	if err != nil {
		return err
	}
	switch m := fi.Mode(); {
	case m.IsDir():
		return syscall.EISDIR
	case !m.IsRegular():
		return syscall.EACCES
	case m&0o111 == 0:
		return syscall.EACCES
	}
	return nil
}

// execStatus is the status of a failure to exec path.
func execStatus(path string, err error) error {
	errno := errnoOf(err)
	if errno == 0 {
		return status.Errorf(codes.Internal, "exec %s: %v", path, err)
	}
	return status.Errorf(filetree.Code(errno), "exec %s: %s", path, errno.Error())
}

// errText is err's errno text if it has one ("no such file or directory"),
// else the whole error.
func errText(err error) string {
	if errno := errnoOf(err); errno != 0 {
		return errno.Error()
	}
	return err.Error()
}

// quoteShort quotes s, shortened to keep error messages readable.
func quoteShort(s string) string {
	const limit = 128
	if len(s) > limit {
		s = s[:limit] + "..."
	}
	return strconv.Quote(s)
}
