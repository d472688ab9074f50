package image

import (
	"fmt"
	"net"
	"strings"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/kilnvm/kiln/image/store"
)

// maxRefLen bounds a reference from the user or a tarball.
const maxRefLen = 4096

// Normalize returns the canonical form of an image reference, as docker
// spells it in full: "debian:bookworm" is
// "index.docker.io/library/debian:bookworm" and "debian" is
// "index.docker.io/library/debian:latest". A bare manifest digest
// ("sha256:" and 64 hex digits, the name of an image imported without one)
// is its own canonical form. A malformed reference gives an error wrapping
// ErrInvalid.
func Normalize(ref string) (string, error) {
	if _, err := store.ParseDigest(ref); err == nil {
		return ref, nil
	}
	r, err := parseRef(ref)
	if err != nil {
		return "", err
	}
	return r.Name(), nil
}

func parseRef(ref string) (name.Reference, error) {
	if ref == "" {
		return nil, fmt.Errorf("%w: empty image reference", ErrInvalid)
	}
	if len(ref) > maxRefLen {
		return nil, fmt.Errorf("%w: image reference of %d bytes (at most %d)", ErrInvalid, len(ref), maxRefLen)
	}
	r, err := name.ParseReference(ref)
	if err != nil {
		return nil, fmt.Errorf("%w: image reference %q: %v", ErrInvalid, ref, err)
	}
	if isLoopback(r.Context().RegistryStr()) {
		// Plain HTTP is allowed for loopback registries: say so to
		// go-containerregistry explicitly ("localhost" without a port and
		// [::1] are not all in its own list).
		r, err = name.ParseReference(ref, name.Insecure)
		if err != nil {
			return nil, fmt.Errorf("%w: image reference %q: %v", ErrInvalid, ref, err)
		}
	}
	return r, nil
}

// isLoopback reports whether a registry host (with an optional port) is on
// the loopback interface: localhost, 127.0.0.0/8 or [::1].
func isLoopback(hostport string) bool {
	host := hostport
	if h, _, err := net.SplitHostPort(hostport); err == nil {
		host = h
	}
	host = strings.TrimSuffix(strings.TrimPrefix(host, "["), "]")
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

func parseInsecure(ref string) (name.Reference, error) {
	r, err := name.ParseReference(ref, name.Insecure)
	if err != nil {
		return nil, fmt.Errorf("%w: image reference %q: %v", ErrInvalid, ref, err)
	}
	return r, nil
}
