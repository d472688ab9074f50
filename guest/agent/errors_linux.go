package agent

import (
	"errors"
	"fmt"
	"syscall"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// codeForErrno maps an errno to the gRPC code the agent reports it with.
func codeForErrno(errno syscall.Errno) codes.Code {
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

// fsStatus turns the error of a filesystem operation on path into a gRPC
// status. op is a gerund ("writing", "reading", ...). The message names the
// path the client asked about, not any temporary file.
func fsStatus(op, path string, err error) error {
	if _, ok := status.FromError(err); ok {
		return err
	}
	var errno syscall.Errno
	if !errors.As(err, &errno) {
		return status.Errorf(codes.Internal, "%s %s: %v", op, path, err)
	}
	code := codeForErrno(errno)
	if code == codes.ResourceExhausted {
		// "no space left on device writing /x: ENOSPC"
		return status.Errorf(code, "%s %s %s: %s", errno.Error(), op, path, unix.ErrnoName(errno))
	}
	return status.Errorf(code, "%s %s: %s", op, path, errno.Error())
}

// errnoOf returns the errno inside err, or 0.
func errnoOf(err error) syscall.Errno {
	var errno syscall.Errno
	if errors.As(err, &errno) {
		return errno
	}
	return 0
}

// invalidf is a shorthand for an InvalidArgument status.
func invalidf(format string, args ...any) error {
	return status.Error(codes.InvalidArgument, fmt.Sprintf(format, args...))
}
