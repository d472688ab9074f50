package jail

import (
	"debug/buildinfo"
	"fmt"
)

// Unavailable says why the VMM processes of a parent whose effective uid
// is euid, running the kiln binary at path, cannot be jailed, or returns
// "" when they can: a jail needs root (namespaces, binds, a uid to drop
// to) and a binary built with CGO_ENABLED=0 (Enter changes every thread
// through the Go runtime: syscall.AllThreadsSyscall). kilnd's --jail=auto
// and kiln run's and kiln fork's default both decide by it.
func Unavailable(euid int, path string) string {
	if euid != 0 {
		return fmt.Sprintf("running as uid %d, not root", euid)
	}
	return cgoWhy(path)
}

// cgoWhy is "" when the binary at path was built with CGO_ENABLED=0, else
// why it cannot jail.
func cgoWhy(path string) string {
	bi, err := buildinfo.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("cannot tell how %s was built: %v", path, err)
	}
	for _, s := range bi.Settings {
		if s.Key == "CGO_ENABLED" {
			if s.Value == "0" {
				return ""
			}
			break
		}
	}
	return fmt.Sprintf("%s is not built with CGO_ENABLED=0 (make build builds it so)", path)
}
