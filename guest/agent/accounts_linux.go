package agent

import (
	"errors"
	"path/filepath"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/accounts"
	"github.com/kilnvm/kiln/guest/agentpb"
)

// checkUserName checks a client's user name before it is looked up.
func checkUserName(name string) error {
	if name == "" || len(name) > agentpb.MaxUserNameBytes {
		return invalidf("user %s: want 1 to %d bytes, got %d", quoteShort(name), agentpb.MaxUserNameBytes, len(name))
	}
	if strings.ContainsAny(name, ":\n\x00") {
		return invalidf("user %s: not a user name (it has a colon, newline or NUL)", quoteShort(name))
	}
	return nil
}

// lookupUser resolves name in the account files under root ("/" in the
// guest). An unknown user is InvalidArgument naming it; account files
// that cannot be read, FailedPrecondition.
func lookupUser(root, name string) (*accounts.User, error) {
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
