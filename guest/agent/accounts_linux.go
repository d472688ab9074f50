package agent

import (
	"strconv"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/guest/agentpb"
)

// maxGroups bounds the supplementary groups an Exec gets from /etc/group
// (the trampoline takes them on its command line).
const maxGroups = 4096

// groupEntry is one line of /etc/group.
type groupEntry struct {
	name    string
	gid     uint32
	members []string
}

// parsePasswdLine parses one /etc/passwd line
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

// parseGroupLine parses one /etc/group line (name:password:gid:members).
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

// guestUser is a user of the guest's /etc/passwd, with the groups
// /etc/group lists it in.
type guestUser struct {
	name     string
	uid, gid uint32
	home     string
	groups   []uint32 // supplementary, without gid; at most maxGroups
}

// lookupUser resolves name in the account files under root ("/" in the
// guest). An unknown user is InvalidArgument naming it.
func lookupUser(root, name string) (*guestUser, error) {
	if err := checkUserName(name); err != nil {
		return nil, err
	}
	passwd, groupFile := root+"etc/passwd", root+"etc/group"
	var u *guestUser
	err := scanColonLines(passwd, func(line string) bool {
		e, ok := parsePasswdLine(line)
		if !ok || e.name != name {
			return false
		}
		u = &guestUser{name: e.name, uid: e.uid, gid: e.gid, home: e.home}
		return true
	})
	if err != nil {
		return nil, status.Errorf(codes.FailedPrecondition, "user %q: reading %s: %s", name, passwd, errText(err))
	}
	if u == nil {
		return nil, status.Errorf(codes.InvalidArgument, "user %q is not in %s", name, passwd)
	}
	if u.home == "" {
		u.home = "/"
	}
	seen := map[uint32]bool{u.gid: true}
	err = scanColonLines(groupFile, func(line string) bool {
		g, ok := parseGroupLine(line)
		if !ok || seen[g.gid] {
			return false
		}
		for _, m := range g.members {
			if m == name {
				seen[g.gid] = true
				u.groups = append(u.groups, g.gid)
				break
			}
		}
		return len(u.groups) >= maxGroups
	})
	if err != nil {
		return nil, status.Errorf(codes.FailedPrecondition, "user %q: reading %s: %s", name, groupFile, errText(err))
	}
	return u, nil
}

// AccountNames names uids and gids from the account files under root,
// read once on first use (one per call that describes files). It is not
// safe for concurrent use.
type AccountNames struct {
	root          string
	loaded        bool
	users, groups map[uint32]string
}

// NewAccountNames names ids from root's etc/passwd and etc/group (root
// ends in a slash: "/" in the guest).
func NewAccountNames(root string) *AccountNames { return &AccountNames{root: root} }

// maxNames bounds how many names AccountNames keeps of each file.
const maxNames = 1 << 16

func (n *AccountNames) load() {
	if n.loaded {
		return
	}
	n.loaded = true
	n.users, n.groups = map[uint32]string{}, map[uint32]string{}
	scanColonLines(n.root+"etc/passwd", func(line string) bool {
		if e, ok := parsePasswdLine(line); ok {
			if _, dup := n.users[e.uid]; !dup {
				n.users[e.uid] = e.name
			}
		}
		return len(n.users) >= maxNames
	})
	scanColonLines(n.root+"etc/group", func(line string) bool {
		if g, ok := parseGroupLine(line); ok {
			if _, dup := n.groups[g.gid]; !dup {
				n.groups[g.gid] = g.name
			}
		}
		return len(n.groups) >= maxNames
	})
}

// User is uid's name, or the number when it has none.
func (n *AccountNames) User(uid uint32) string {
	n.load()
	if s, ok := n.users[uid]; ok {
		return s
	}
	return strconv.FormatUint(uint64(uid), 10)
}

// Group is gid's name, or the number when it has none.
func (n *AccountNames) Group(gid uint32) string {
	n.load()
	if s, ok := n.groups[gid]; ok {
		return s
	}
	return strconv.FormatUint(uint64(gid), 10)
}

// User is a user of an account file.
type User struct {
	Name     string
	UID, GID uint32
	Home     string
	// Groups are the supplementary groups /etc/group lists it in.
	Groups []uint32
}

// LookupUser resolves the user name in root's etc/passwd and etc/group as
// an Exec's user is (root ends in a slash); an unknown user is a gRPC
// InvalidArgument naming it. kilnd's test double runs host processes as
// users of the host's files with it.
func LookupUser(root, name string) (User, error) {
	u, err := lookupUser(root, name)
	if err != nil {
		return User{}, err
	}
	return User{Name: u.name, UID: u.uid, GID: u.gid, Home: u.home, Groups: u.groups}, nil
}
