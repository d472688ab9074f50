package ninep

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"

	"golang.org/x/sys/unix"
)

// StateVersion is the version of State's form.
const StateVersion = 1

// State is a server's session in a snapshot: the negotiated msize and the
// fid table. Files are named by inode number, which the same tree gives
// again in another process; directory listings and xattr values are read
// again from the tree on restore.
type State struct {
	Version int        `json:"version"`
	Msize   uint32     `json:"msize"`
	Fids    []FidState `json:"fids"`
}

// FidState is one fid.
type FidState struct {
	Fid uint32 `json:"fid"`
	// Path is the inode numbers from the root down to the fid's file: the
	// directories above it are what ".." walks to.
	Path []uint64 `json:"path"`
	// Open and Flags are the Tlopen that opened it.
	Open  bool   `json:"open,omitempty"`
	Flags uint32 `json:"flags,omitempty"`
	// Xattr is set for a fid made by Txattrwalk.
	Xattr *XattrState `json:"xattr,omitempty"`
}

// XattrState is an xattr fid: the attribute it reads ("" for the list).
type XattrState struct {
	Name string `json:"name"`
}

// SaveState returns the session's state. Call it with no request in
// flight (the device paused): a request served meanwhile may or may not be
// part of it.
func (s *Server) SaveState() (json.RawMessage, error) {
	s.mu.Lock()
	st := State{Version: StateVersion, Msize: s.msize, Fids: make([]FidState, 0, len(s.fids))}
	for n, f := range s.fids {
		fs := FidState{Fid: n, Path: f.node.path(), Open: f.open, Flags: f.flags}
		if f.xattr != nil {
			fs.Xattr = &XattrState{Name: f.xattr.name}
		}
		st.Fids = append(st.Fids, fs)
	}
	s.mu.Unlock()
	slices.SortFunc(st.Fids, func(a, b FidState) int { return cmp.Compare(a.Fid, b.Fid) })
	b, err := json.Marshal(st)
	if err != nil {
		return nil, fmt.Errorf("9P server state: %w", err)
	}
	return b, nil
}

// RestoreState replaces the session with a saved one, checking it against
// the tree: every fid's path must start at the root (or, for an FS with
// NamedRoots, a named tree's root) and name inodes that exist, directories
// all but the last, and an open fid must name what can be opened. Nothing
// changes when it fails. Call it with no request in flight.
func (s *Server) RestoreState(data json.RawMessage) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	var st State
	if err := dec.Decode(&st); err != nil {
		return fmt.Errorf("9P server state: %w", err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return errors.New("9P server state: data after the state object")
	}
	if st.Version != StateVersion {
		return fmt.Errorf("9P server state is version %d, this server reads version %d", st.Version, StateVersion)
	}
	if st.Msize != 0 && (st.Msize < MinMsize || st.Msize > s.maxMsize) {
		return fmt.Errorf("9P server state: msize %d is outside this server's %d..%d", st.Msize, MinMsize, s.maxMsize)
	}
	if st.Msize == 0 && len(st.Fids) > 0 {
		return fmt.Errorf("9P server state: %d fids but no msize (no Tversion)", len(st.Fids))
	}
	if len(st.Fids) > s.maxFids {
		return fmt.Errorf("9P server state: %d fids, this server holds at most %d", len(st.Fids), s.maxFids)
	}
	fids := make(map[uint32]*fid, len(st.Fids))
	held := 0
	nodes := map[uint64]*node{} // shared ancestors, as the walks made them
	for _, fs := range st.Fids {
		if _, dup := fids[fs.Fid]; dup {
			return fmt.Errorf("9P server state: fid %d appears twice", fs.Fid)
		}
		if fs.Fid == NoFid {
			return fmt.Errorf("9P server state: fid NOFID in the table")
		}
		f, err := s.restoreFid(fs, nodes)
		if err != nil {
			return fmt.Errorf("9P server state: fid %d: %w", fs.Fid, err)
		}
		fids[fs.Fid] = f
		if held += f.heldBytes(); held > maxXattrHeld {
			return fmt.Errorf("9P server state: xattr fids hold over %d bytes", maxXattrHeld)
		}
	}
	s.mu.Lock()
	s.msize = st.Msize
	s.fids = fids
	s.held = held
	s.mu.Unlock()
	return nil
}

// restoreFid checks one saved fid against the tree and builds it.
func (s *Server) restoreFid(fs FidState, nodes map[uint64]*node) (*fid, error) {
	if len(fs.Path) == 0 {
		return nil, fmt.Errorf("empty path")
	}
	if root := s.fs.Root(); fs.Path[0] != root {
		named, ok := s.fs.(NamedRoots)
		if !ok || !named.IsRoot(fs.Path[0]) {
			return nil, fmt.Errorf("path starts at inode %d, the tree's root is %d and no named tree's root is it", fs.Path[0], root)
		}
	}
	var n *node
	var mode uint32
	for i, ino := range fs.Path {
		a, err := s.fs.Getattr(ino)
		if err != nil {
			return nil, fmt.Errorf("inode %d is not in the tree: %w", ino, err)
		}
		if i < len(fs.Path)-1 && a.Mode&unix.S_IFMT != unix.S_IFDIR {
			return nil, fmt.Errorf("inode %d on its path is not a directory (mode %#o)", ino, a.Mode)
		}
		mode = a.Mode
		// Directories have one parent, so a directory's node can be shared
		// by every fid under it; a file may be a hard link in several.
		if a.Mode&unix.S_IFMT == unix.S_IFDIR {
			if m, ok := nodes[ino]; ok && samePath(m, n) {
				n = m
				continue
			}
			n = &node{ino: ino, parent: n}
			nodes[ino] = n
			continue
		}
		n = &node{ino: ino, parent: n}
	}
	f := &fid{node: n, mode: mode, open: fs.Open, flags: fs.Flags}
	if fs.Xattr != nil {
		if fs.Open {
			return nil, fmt.Errorf("an xattr fid cannot be open")
		}
		var val []byte
		if fs.Xattr.Name == "" {
			names, err := s.fs.Listxattr(n.ino)
			if err != nil {
				return nil, fmt.Errorf("listxattr of inode %d: %w", n.ino, err)
			}
			for _, name := range names {
				val = append(append(val, name...), 0)
			}
		} else {
			v, err := s.fs.Getxattr(n.ino, fs.Xattr.Name)
			if err != nil {
				return nil, fmt.Errorf("xattr %q of inode %d: %w", fs.Xattr.Name, n.ino, err)
			}
			val = v
		}
		if len(val) > maxXattrSize {
			return nil, fmt.Errorf("xattr %q of inode %d is %d bytes, over %d", fs.Xattr.Name, n.ino, len(val), maxXattrSize)
		}
		if val == nil {
			val = []byte{}
		}
		f.xattr = &xattrValue{name: fs.Xattr.Name, value: val}
	}
	if fs.Open {
		if fs.Flags&openAccMode != unix.O_RDONLY || fs.Flags&(openCreate|openTrunc|openExcl) != 0 {
			return nil, fmt.Errorf("open with flags %#o that ask to write", fs.Flags)
		}
		if t := mode & unix.S_IFMT; t != unix.S_IFDIR && t != unix.S_IFREG {
			return nil, fmt.Errorf("open, but inode %d (mode %#o) is neither a file nor a directory", n.ino, mode)
		}
	}
	return f, nil
}

// samePath reports whether node m's parent chain is parent's.
func samePath(m, parent *node) bool { return m.parent == parent }
