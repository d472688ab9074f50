package filetree

import (
	"errors"
	"path/filepath"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/accounts"
)

// Code maps an errno to the gRPC code the calls report it with.
func Code(errno syscall.Errno) codes.Code {
	switch errno {
	case syscall.ENOENT:
		return codes.NotFound
	case syscall.EEXIST:
		return codes.AlreadyExists
	case syscall.EACCES, syscall.EPERM, syscall.EROFS:
		return codes.PermissionDenied
	case syscall.ENOSPC, syscall.EFBIG, syscall.EDQUOT, syscall.EMFILE, syscall.ENFILE, syscall.ENOMEM, syscall.EAGAIN:
		return codes.ResourceExhausted
	case syscall.ENOTDIR, syscall.EISDIR, syscall.EINVAL, syscall.ENAMETOOLONG, syscall.ELOOP,
		syscall.ENOEXEC, syscall.E2BIG, syscall.EXDEV:
		return codes.InvalidArgument
	case syscall.ENOTEMPTY, syscall.EBUSY, syscall.ETXTBSY:
		return codes.FailedPrecondition
	default:
		return codes.Internal
	}
}

// Status turns the error of a file system operation on path into a gRPC
// status (a status it leaves as it is). op is a gerund ("writing",
// "reading", ...). The message names the path the caller asked about,
// not any temporary file.
func Status(op, path string, err error) error {
	if _, ok := status.FromError(err); ok {
		return err
	}
	var errno syscall.Errno
	if !errors.As(err, &errno) {
		return status.Errorf(codes.Internal, "%s %s: %v", op, path, err)
	}
	code := Code(errno)
	if code == codes.ResourceExhausted {
		// "no space left on device writing /x: ENOSPC"
		return status.Errorf(code, "%s %s %s: %s", errno.Error(), op, path, unix.ErrnoName(errno))
	}
	return status.Errorf(code, "%s %s: %s", op, path, errno.Error())
}

// checkUserName checks a caller's user name before it is looked up.
func checkUserName(name string) error {
	if name == "" || len(name) > MaxUserNameBytes {
		return status.Errorf(codes.InvalidArgument, "user %s: want 1 to %d bytes, got %d", quoteShort(name), MaxUserNameBytes, len(name))
	}
	if strings.ContainsAny(name, ":\n\x00") {
		return status.Errorf(codes.InvalidArgument, "user %s: not a user name (it has a colon, newline or NUL)", quoteShort(name))
	}
	return nil
}

// LookupUser resolves name in the account files under root ("/" in a
// guest). An unknown user is InvalidArgument naming it; account files
// that cannot be read, FailedPrecondition.
func LookupUser(root, name string) (*accounts.User, error) {
	if err := checkUserName(name); err != nil {
		return nil, err
	}
	u, err := accounts.Lookup(root, name)
	switch {
	case errors.Is(err, accounts.ErrNoUser):
		return nil, status.Errorf(codes.InvalidArgument, "user %q is not in %s", name, filepath.Join(root, "etc/passwd"))
	case err != nil:
		return nil, status.Errorf(codes.FailedPrecondition, "user %q: %v", name, err)
	}
	return &u, nil
}
