package envd

import (
	"encoding/base64"
	"net/http"
	"path"
	"strings"
	"testing"

	filesystempb "github.com/kilnvm/kiln/daemon/e2b/envd/envdpb/filesystem"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

func TestUserFromAuth(t *testing.T) {
	b64 := func(s string) string { return base64.StdEncoding.EncodeToString([]byte(s)) }
	tests := []struct {
		hdr, want string
		bad       bool
	}{
		{"", "", false},
		{"Basic " + b64("user:"), "user", false},
		{"basic " + b64("root:secret"), "root", false},
		{"Basic " + b64(":"), "", false},
		{"Basic " + b64("no-colon"), "no-colon", false},
		{"Bearer abc", "", true},
		{"Basic", "", true},
		{"Basic !!!", "", true},
		{"Basic " + b64("-rf:"), "", true},
		{"Basic " + b64("a/b:"), "", true},
		{"Basic " + b64(strings.Repeat("a", 65)+":"), "", true},
	}
	for _, tc := range tests {
		h := http.Header{}
		if tc.hdr != "" {
			h.Set("Authorization", tc.hdr)
		}
		got, err := userFromAuth(h)
		if (err != nil) != tc.bad || got != tc.want {
			t.Errorf("%q: %q, %v; want %q, error %v", tc.hdr, got, err, tc.want, tc.bad)
		}
	}
}

func TestResolvePath(t *testing.T) {
	tests := []struct{ in, home, want string }{
		{"/a/b", "/root", "/a/b"},
		{"a/b", "/root", "/root/a/b"},
		{"", "/home/user", "/home/user"},
		{"~/x", "/home/user", "/home/user/x"},
		{"../../../etc", "/home/user", "/etc"},
		{"/a//b/./c/", "/root", "/a/b/c"},
	}
	for _, tc := range tests {
		if got, err := resolvePath(tc.in, tc.home); err != nil || got != tc.want {
			t.Errorf("%q in %s: %q, %v; want %q", tc.in, tc.home, got, err, tc.want)
		}
	}
	for _, bad := range []string{"a\x00b", "/" + strings.Repeat("a", maxPath)} {
		if _, err := resolvePath(bad, "/root"); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
}

func TestEntryInfo(t *testing.T) {
	tests := []struct {
		fi    *kilnpb.FileInfo
		typ   filesystempb.FileType
		perms string
		mode  uint32
		link  string
	}{
		{&kilnpb.FileInfo{Path: "/a/f", Mode: 0o100644}, filesystempb.FileType_FILE_TYPE_FILE, "-rw-r--r--", 0o644, ""},
		{&kilnpb.FileInfo{Path: "/a", Mode: 0o040755, IsDir: true}, filesystempb.FileType_FILE_TYPE_DIRECTORY, "drwxr-xr-x", 0o755, ""},
		{&kilnpb.FileInfo{Path: "/a/l", Mode: 0o120777, Symlink: "f"}, filesystempb.FileType_FILE_TYPE_SYMLINK, "Lrwxrwxrwx", 0o777, "/a/f"},
		{&kilnpb.FileInfo{Path: "/tmp", Mode: 0o041777, IsDir: true}, filesystempb.FileType_FILE_TYPE_DIRECTORY, "dtrwxrwxrwx", 0o1777, ""},
		{&kilnpb.FileInfo{Path: "/bin/su", Mode: 0o104755}, filesystempb.FileType_FILE_TYPE_FILE, "urwxr-xr-x", 0o4755, ""},
	}
	for _, tc := range tests {
		e := entryInfo(tc.fi)
		if e.GetType() != tc.typ || e.GetPermissions() != tc.perms || e.GetMode() != tc.mode || e.GetSymlinkTarget() != tc.link ||
			e.GetName() != path.Base(tc.fi.GetPath()) || e.GetOwner() != "0" {
			t.Errorf("%v: %v", tc.fi, e)
		}
	}
}

func TestEndEvent(t *testing.T) {
	tests := []struct {
		x      *kilnpb.ExecExit
		code   int32
		exited bool
		status string
		err    bool
	}{
		{&kilnpb.ExecExit{}, 0, true, "exit status 0", false},
		{&kilnpb.ExecExit{ExitCode: 2}, 2, true, "exit status 2", false},
		{&kilnpb.ExecExit{ExitCode: -1, Signal: 9}, -1, false, "signal: killed", false},
		{&kilnpb.ExecExit{ExitCode: -1, Signal: 15}, -1, false, "signal: terminated", false},
		{&kilnpb.ExecExit{ExitCode: -1, Signal: 9, OomKilled: true}, -1, false, "signal: killed", true},
		{&kilnpb.ExecExit{ExitCode: -1, Signal: 9, TimedOut: true}, -1, false, "signal: killed", true},
	}
	for _, tc := range tests {
		e := endEvent(tc.x)
		if e.GetExitCode() != tc.code || e.GetExited() != tc.exited || e.GetStatus() != tc.status || (e.Error != nil) != tc.err {
			t.Errorf("%v: %v", tc.x, e)
		}
	}
}

func TestHomeIn(t *testing.T) {
	passwd := []byte("root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user/:/bin/sh\nbad:x:1:1::relative:/bin/sh\nshort:x\n")
	for _, tc := range []struct{ user, want string }{{"root", "/root"}, {"user", "/home/user"}, {"bad", ""}, {"short", ""}, {"nobody", ""}} {
		if got := homeIn(passwd, tc.user); got != tc.want {
			t.Errorf("%s: %q, want %q", tc.user, got, tc.want)
		}
	}
}

func FuzzUserFromAuth(f *testing.F) {
	for _, s := range []string{"", "Basic dXNlcjo=", "Basic Og==", "Bearer x", "Basic !!", "basic cm9vdDpz"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) {
		h := http.Header{}
		h.Set("Authorization", v)
		u, err := userFromAuth(h)
		if err == nil && checkUser(u) != nil {
			t.Fatalf("%q: took user %q", v, u)
		}
	})
}

func FuzzPartNames(f *testing.F) {
	for _, s := range []string{`form-data; name="file"; filename="/tmp/a.txt"`, `form-data; name=file`, `attachment; filename*=UTF-8''%2Ftmp%2Fx`, `bogus`, ``} {
		f.Add(s, "/root")
	}
	f.Fuzz(func(t *testing.T, disposition, home string) {
		_, name, err := partNames(disposition)
		if err != nil || name == "" {
			return
		}
		if !strings.HasPrefix(home, "/") {
			home = "/" + home
		}
		p, err := resolvePath(name, path.Clean(home))
		if err != nil {
			return
		}
		if !strings.HasPrefix(p, "/") || path.Clean(p) != p || strings.Contains(p, "/../") {
			t.Fatalf("%q in %q: resolved to %q", name, home, p)
		}
	})
}

func FuzzHomeIn(f *testing.F) {
	f.Add([]byte("root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/sh\n"), "user")
	f.Fuzz(func(t *testing.T, passwd []byte, user string) {
		if h := homeIn(passwd, user); h != "" && (!strings.HasPrefix(h, "/") || path.Clean(h) != h) {
			t.Fatalf("home %q", h)
		}
	})
}
