package kilnpb

import (
	"io/fs"

	"github.com/kilnvm/kiln/stmode"
)

// A FileInfo's mode is a Unix st_mode: its type bits and its permission
// bits. FileMode and StMode convert it to and from an fs.FileMode, for the
// server (which has the guest's fs.FileMode) and its clients (envd, kiln).

// FileMode converts a Unix st_mode to an fs.FileMode.
func FileMode(st uint32) fs.FileMode { return stmode.FileMode(st) }

// StMode converts an fs.FileMode to a Unix st_mode.
func StMode(m fs.FileMode) uint32 { return stmode.FromFileMode(m) }
