package agent

import (
	"fmt"
	"strconv"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/accounts"
)

// ExecDefaults are what an Exec gets for the fields it leaves unset: an OCI
// image's config (its Env, WorkingDir and User), as a container runtime
// applies it.
type ExecDefaults struct {
	// Env (NAME=VALUE) is the environment every Exec starts from: an
	// Exec's own entries are added to it, replacing those of the same name
	// (docker exec -e does the same). PATH is DefaultPath and HOME the
	// user's home directory (from the image's /etc/passwd, else /root) when
	// Env has none.
	Env []string
	// Cwd is the working directory of an Exec without one; Setup creates
	// it when the image lacks it, as runc does.
	Cwd string
	// User is who an Exec without credentials runs as: "name", "uid",
	// "name:group" or "uid:gid", names looked up in the image's /etc/passwd
	// and /etc/group when the Exec starts.
	User string
}

// Validate checks the defaults' form (not that the user exists: that is
// known only in the guest's root).
func (d *ExecDefaults) Validate() error {
	if d == nil {
		return nil
	}
	if err := validateEnv(d.Env); err != nil {
		return fmt.Errorf("image config: %v", status.Convert(err).Message())
	}
	if d.Cwd != "" && (d.Cwd[0] != '/' || strings.IndexByte(d.Cwd, 0) >= 0) {
		return fmt.Errorf("image config: working directory %q is not an absolute path", d.Cwd)
	}
	if strings.IndexByte(d.User, 0) >= 0 || len(d.User) > 256 {
		return fmt.Errorf("image config: user %q is not a user name or id", d.User)
	}
	return nil
}

// mergeEnv returns base with over's entries added, each replacing base's of
// the same name, in base's order then over's new names.
func mergeEnv(base, over []string) []string {
	out := make([]string, 0, len(base)+len(over))
	idx := map[string]int{}
	add := func(kv string) {
		name, _, _ := strings.Cut(kv, "=")
		if i, ok := idx[name]; ok {
			out[i] = kv
			return
		}
		idx[name] = len(out)
		out = append(out, kv)
	}
	for _, kv := range base {
		add(kv)
	}
	for _, kv := range over {
		add(kv)
	}
	return out
}

// passwdEntry is one line of /etc/passwd.
type passwdEntry struct {
	name     string
	uid, gid uint32
	home     string
}

// lookupPasswd finds a user by name, or by uid when byID.
func lookupPasswd(path, key string, byID bool) (*passwdEntry, error) {
	var found *passwdEntry
	err := accounts.ScanFile(path, func(f []string) bool {
		if len(f) < 7 {
			return false
		}
		uid, err1 := strconv.ParseUint(f[2], 10, 32)
		gid, err2 := strconv.ParseUint(f[3], 10, 32)
		if err1 != nil || err2 != nil {
			return false
		}
		if (byID && f[2] == key) || (!byID && f[0] == key) {
			found = &passwdEntry{name: f[0], uid: uint32(uid), gid: uint32(gid), home: f[5]}
			return true
		}
		return false
	})
	return found, err
}

// lookupGroup finds a group's gid by name.
func lookupGroup(path, name string) (uint32, bool, error) {
	var gid uint32
	var ok bool
	err := accounts.ScanFile(path, func(f []string) bool {
		if len(f) < 3 || f[0] != name {
			return false
		}
		g, err := strconv.ParseUint(f[2], 10, 32)
		if err != nil {
			return false
		}
		gid, ok = uint32(g), true
		return true
	})
	return gid, ok, err
}

// resolvedUser is who an Exec runs as and the home directory to give it.
type resolvedUser struct {
	uid, gid uint32
	home     string
}

// resolveUser resolves an image config's User against the account files
// under root ("/" in the guest).
func resolveUser(root, user string) (*resolvedUser, error) {
	name, group, hasGroup := strings.Cut(user, ":")
	passwd, groupFile := root+"etc/passwd", root+"etc/group"
	if name == "" {
		return nil, status.Errorf(codes.InvalidArgument, "exec: image user %q has no user part", user)
	}
	r := &resolvedUser{home: "/"}
	if uid, err := strconv.ParseUint(name, 10, 32); err == nil {
		r.uid = uint32(uid)
		e, err := lookupPasswd(passwd, name, true)
		if err != nil {
			return nil, status.Errorf(codes.FailedPrecondition, "exec: reading %s: %s", passwd, errText(err))
		}
		if e != nil {
			r.gid, r.home = e.gid, e.home
		}
	} else {
		e, err := lookupPasswd(passwd, name, false)
		if err != nil {
			return nil, status.Errorf(codes.FailedPrecondition, "exec: reading %s: %s", passwd, errText(err))
		}
		if e == nil {
			return nil, status.Errorf(codes.FailedPrecondition, "exec: the image's user %q is not in %s", name, passwd)
		}
		r.uid, r.gid, r.home = e.uid, e.gid, e.home
	}
	if hasGroup {
		if gid, err := strconv.ParseUint(group, 10, 32); err == nil {
			r.gid = uint32(gid)
		} else {
			gid, ok, err := lookupGroup(groupFile, group)
			if err != nil {
				return nil, status.Errorf(codes.FailedPrecondition, "exec: reading %s: %s", groupFile, errText(err))
			}
			if !ok {
				return nil, status.Errorf(codes.FailedPrecondition, "exec: the image's group %q is not in %s", group, groupFile)
			}
			r.gid = gid
		}
	}
	if r.uid == 0 && r.home == "/" {
		r.home = "/root"
	}
	return r, nil
}
