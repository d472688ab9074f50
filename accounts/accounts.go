// Package accounts reads the users and groups of a Unix root: the
// etc/passwd and etc/group files under a root folder (a guest's /, an
// image's root, the host's /). The files may be anyone's, so what is read
// of them is bounded. The guest agent resolves its execs' and file calls'
// users with it; kilnd's test double, the host's.
package accounts

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// Bounds on what is read.
const (
	// MaxGroups bounds the supplementary groups Lookup gives a user.
	MaxGroups = 4096
	// maxFile bounds what is read of an account file.
	maxFile = 16 << 20
	// maxNames bounds how many names Names keeps of each file.
	maxNames = 1 << 16
)

// User is a user of an account file.
type User struct {
	Name     string
	UID, GID uint32
	Home     string // "/" when the file gives none
	// Groups are the supplementary groups etc/group lists it in, without
	// GID; at most MaxGroups.
	Groups []uint32
}

// ErrNoUser is Lookup's error for a name etc/passwd lacks.
var ErrNoUser = errors.New("no such user")

// Lookup resolves the user name in root's etc/passwd, with the groups
// root's etc/group lists it in. A name the file lacks is an error wrapping
// ErrNoUser; a file that cannot be read, an *fs.PathError whose Op is
// "reading". A missing file has no users.
func Lookup(root, name string) (User, error) {
	passwd, group := filepath.Join(root, "etc/passwd"), filepath.Join(root, "etc/group")
	var u *User
	err := scanLines(passwd, func(line string) bool {
		e, ok := parsePasswdLine(line)
		if !ok || e.name != name {
			return false
		}
		u = &User{Name: e.name, UID: e.uid, GID: e.gid, Home: e.home}
		return true
	})
	if err != nil {
		return User{}, err
	}
	if u == nil {
		return User{}, fmt.Errorf("user %q is not in %s: %w", name, passwd, ErrNoUser)
	}
	if u.Home == "" {
		u.Home = "/"
	}
	seen := map[uint32]bool{u.GID: true}
	err = scanLines(group, func(line string) bool {
		g, ok := parseGroupLine(line)
		if !ok || seen[g.gid] {
			return false
		}
		for _, m := range g.members {
			if m == name {
				seen[g.gid] = true
				u.Groups = append(u.Groups, g.gid)
				break
			}
		}
		return len(u.Groups) >= MaxGroups
	})
	if err != nil {
		return User{}, err
	}
	return *u, nil
}

// Names names uids and gids from the account files under a root, read
// once on first use (one per call that describes files). It is not safe
// for concurrent use.
type Names struct {
	root          string
	loaded        bool
	users, groups map[uint32]string
}

// NewNames names ids from root's etc/passwd and etc/group.
func NewNames(root string) *Names { return &Names{root: root} }

func (n *Names) load() {
	if n.loaded {
		return
	}
	n.loaded = true
	n.users, n.groups = map[uint32]string{}, map[uint32]string{}
	scanLines(filepath.Join(n.root, "etc/passwd"), func(line string) bool {
		if e, ok := parsePasswdLine(line); ok {
			if _, dup := n.users[e.uid]; !dup {
				n.users[e.uid] = e.name
			}
		}
		return len(n.users) >= maxNames
	})
	scanLines(filepath.Join(n.root, "etc/group"), func(line string) bool {
		if g, ok := parseGroupLine(line); ok {
			if _, dup := n.groups[g.gid]; !dup {
				n.groups[g.gid] = g.name
			}
		}
		return len(n.groups) >= maxNames
	})
}

// User is uid's name, or the number when it has none.
func (n *Names) User(uid uint32) string {
	n.load()
	if s, ok := n.users[uid]; ok {
		return s
	}
	return strconv.FormatUint(uint64(uid), 10)
}

// Group is gid's name, or the number when it has none.
func (n *Names) Group(gid uint32) string {
	n.load()
	if s, ok := n.groups[gid]; ok {
		return s
	}
	return strconv.FormatUint(uint64(gid), 10)
}

// ScanFile calls fn with the colon-separated fields of each line of the
// account file path that is neither empty nor a comment, until fn
// returns true. A missing file has no lines; at most 16 MiB are read, and
// a line past 1 MiB ends the scan. A file that cannot be read is an
// *fs.PathError whose Op is "reading".
func ScanFile(path string, fn func(fields []string) bool) error {
	return scanLines(path, func(line string) bool { return fn(strings.Split(line, ":")) })
}

// scanLines is ScanFile's reading: fn gets each line whole.
func scanLines(path string, fn func(line string) bool) error {
	data, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		if pe := (*fs.PathError)(nil); errors.As(err, &pe) {
			err = pe.Err
		}
		return &fs.PathError{Op: "reading", Path: path, Err: err}
	}
	if len(data) > maxFile {
		data = data[:maxFile]
	}
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 0, 4096), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		if fn(line) {
			return nil
		}
	}
	return nil
}

// passwdEntry is one line of etc/passwd.
type passwdEntry struct {
	name     string
	uid, gid uint32
	home     string
}

// parsePasswdLine parses one etc/passwd line
// (name:password:uid:gid:gecos:home:shell); ok is false for a line that
// is not one.
func parsePasswdLine(line string) (passwdEntry, bool) {
	f := strings.Split(line, ":")
	if len(f) < 7 || f[0] == "" {
		return passwdEntry{}, false
	}
	uid, err1 := strconv.ParseUint(f[2], 10, 32)
	gid, err2 := strconv.ParseUint(f[3], 10, 32)
	if err1 != nil || err2 != nil {
		return passwdEntry{}, false
	}
	return passwdEntry{name: f[0], uid: uint32(uid), gid: uint32(gid), home: f[5]}, true
}

// groupEntry is one line of etc/group.
type groupEntry struct {
	name    string
	gid     uint32
	members []string
}

// parseGroupLine parses one etc/group line (name:password:gid:members).
func parseGroupLine(line string) (groupEntry, bool) {
	f := strings.Split(line, ":")
	if len(f) < 3 || f[0] == "" {
		return groupEntry{}, false
	}
	gid, err := strconv.ParseUint(f[2], 10, 32)
	if err != nil {
		return groupEntry{}, false
	}
	g := groupEntry{name: f[0], gid: uint32(gid)}
	if len(f) > 3 && f[3] != "" {
		for _, m := range strings.Split(f[3], ",") {
			if m = strings.TrimSpace(m); m != "" {
				g.members = append(g.members, m)
			}
		}
	}
	return g, true
}
