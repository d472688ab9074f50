package daemon

// This file maps a backend's errors to statuses.

import (
	"context"
	"errors"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// callErr turns a backend's error into a status: the agent's code when it
// gave one, else Internal; what names the call.
func callErr(what string, err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, context.Canceled) {
		return status.Errorf(codes.Canceled, "%s: %v", what, err)
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return status.Errorf(codes.DeadlineExceeded, "%s: %v", what, err)
	}
	code := codes.Internal
	if st, ok := status.FromError(err); ok && st.Code() != codes.Unknown && st.Code() != codes.OK {
		code = st.Code()
	}
	return status.Errorf(code, "%s: %v", what, err)
}
