package tree

import (
	"errors"
	"fmt"
	"strings"
)

// Limits on names, as Linux has them (NAME_MAX, PATH_MAX).
const (
	MaxNameLen = 255
	MaxPathLen = 4096
)

// Whiteout names (OCI image-spec, "Whiteouts").
const (
	whiteoutPrefix = ".wh."
	whiteoutMeta   = ".wh..wh."     // AUFS metadata (.wh..wh.plnk, ...): never part of the tree
	whiteoutOpaque = ".wh..wh..opq" // hides everything lower layers had in its directory
)

// cleanName turns a TOC entry's name into the tree's form: no leading "./"
// or "/", no trailing "/", "" for the root. It rejects what a well-formed
// layer never holds: "..", "." or empty elements inside the path, NUL, an
// element over MaxNameLen bytes, a path over MaxPathLen bytes.
func cleanName(name string) (string, error) {
	if len(name) > MaxPathLen {
		return "", fmt.Errorf("path is %d bytes, over %d", len(name), MaxPathLen)
	}
	if strings.IndexByte(name, 0) >= 0 {
		return "", errors.New("NUL in name")
	}
	for {
		if s, ok := strings.CutPrefix(name, "./"); ok {
			name = s
		} else if s, ok := strings.CutPrefix(name, "/"); ok {
			name = s
		} else {
			break
		}
	}
	name = strings.TrimSuffix(name, "/")
	if name == "." {
		name = ""
	}
	if name == "" {
		return "", nil
	}
	for rest := name; ; {
		elem, tail, more := strings.Cut(rest, "/")
		if err := checkElem(elem); err != nil {
			return "", err
		}
		if !more {
			break
		}
		rest = tail
	}
	return name, nil
}

// checkElem checks one path element.
func checkElem(elem string) error {
	switch {
	case elem == "":
		return errors.New("empty path element")
	case elem == "." || elem == "..":
		return fmt.Errorf("%q path element", elem)
	case len(elem) > MaxNameLen:
		return fmt.Errorf("path element is %d bytes, over %d", len(elem), MaxNameLen)
	}
	return nil
}

// splitName splits a clean, non-root name into its parent ("" for the
// root) and its last element.
func splitName(name string) (dir, base string) {
	i := strings.LastIndexByte(name, '/')
	if i < 0 {
		return "", name
	}
	return name[:i], name[i+1:]
}
