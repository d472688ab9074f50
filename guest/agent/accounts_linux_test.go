package agent

import (
	"encoding/binary"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestParseAccountLines(t *testing.T) {
	for _, tt := range []struct {
		line string
		ok   bool
		want passwdEntry
	}{
		{"root:x:0:0:root:/root:/bin/sh", true, passwdEntry{name: "root", home: "/root"}},
		{"app:x:1000:1001::/home/app:", true, passwdEntry{name: "app", uid: 1000, gid: 1001, home: "/home/app"}},
		{"app:x:1000:1001::/home/app", false, passwdEntry{}},                               // six fields
		{":x:1:1::/:/bin/sh", false, passwdEntry{}},                                        // no name
		{"big:x:4294967296:0::/:/bin/sh", false, passwdEntry{}},                            // uid past 32 bits
		{"neg:x:-1:0::/:/bin/sh", false, passwdEntry{}},                                    // negative
		{"odd:x:1:1:a:b:c:d:e", true, passwdEntry{name: "odd", uid: 1, gid: 1, home: "b"}}, // extra fields
	} {
		got, ok := parsePasswdLine(tt.line)
		if ok != tt.ok || got != tt.want {
			t.Errorf("parsePasswdLine(%q) = %+v, %v; want %+v, %v", tt.line, got, ok, tt.want, tt.ok)
		}
	}
	for _, tt := range []struct {
		line    string
		ok      bool
		name    string
		gid     uint32
		members []string
	}{
		{"wheel:x:10:root,app", true, "wheel", 10, []string{"root", "app"}},
		{"empty:x:11:", true, "empty", 11, nil},
		{"short:x:12", true, "short", 12, nil},
		{"spaces:x:13: a , ,b", true, "spaces", 13, []string{"a", "b"}},
		{"bad:x:g:", false, "", 0, nil},
		{":x:1:", false, "", 0, nil},
		{"two", false, "", 0, nil},
	} {
		g, ok := parseGroupLine(tt.line)
		if ok != tt.ok || g.name != tt.name || g.gid != tt.gid || !slices.Equal(g.members, tt.members) {
			t.Errorf("parseGroupLine(%q) = %+v, %v", tt.line, g, ok)
		}
	}
}

// accountRoot writes passwd and group files under a temporary root.
func accountRoot(t *testing.T, passwd, group string) string {
	t.Helper()
	root := t.TempDir() + "/"
	os.MkdirAll(filepath.Join(root, "etc"), 0o755)
	if err := os.WriteFile(filepath.Join(root, "etc/passwd"), []byte(passwd), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "etc/group"), []byte(group), 0o644); err != nil {
		t.Fatal(err)
	}
	return root
}

func TestLookupUser(t *testing.T) {
	root := accountRoot(t,
		"root:x:0:0:root:/root:/bin/sh\n# a comment\n\napp:x:1000:1000::/home/app:/bin/sh\nnohome:x:1001:1001:::\napp:x:2000:2000::/dup:/bin/sh\n",
		"root:x:0:\napp:x:1000:\nwheel:x:10:root,app\naudio:x:29:app\nagain:x:10:app\nother:x:30:nohome\n")
	for _, tt := range []struct {
		name   string
		uid    uint32
		gid    uint32
		home   string
		groups []uint32
		code   codes.Code
	}{
		{name: "app", uid: 1000, gid: 1000, home: "/home/app", groups: []uint32{10, 29}},
		{name: "root", home: "/root", groups: []uint32{10}},
		{name: "nohome", uid: 1001, gid: 1001, home: "/", groups: []uint32{30}},
		{name: "nobody", code: codes.InvalidArgument},
		{name: "", code: codes.InvalidArgument},
		{name: "a:b", code: codes.InvalidArgument},
		{name: strings.Repeat("u", 300), code: codes.InvalidArgument},
	} {
		u, err := lookupUser(root, tt.name)
		if tt.code != codes.OK {
			if status.Code(err) != tt.code || (tt.name != "" && len(tt.name) < 100 && !strings.Contains(err.Error(), tt.name)) {
				t.Errorf("lookupUser(%q): %v, want %v naming it", tt.name, err, tt.code)
			}
			continue
		}
		if err != nil {
			t.Errorf("lookupUser(%q): %v", tt.name, err)
			continue
		}
		if u.uid != tt.uid || u.gid != tt.gid || u.home != tt.home || !slices.Equal(u.groups, tt.groups) {
			t.Errorf("lookupUser(%q) = %+v", tt.name, u)
		}
	}
	// No account files: no users, and names are numbers.
	n := NewAccountNames(t.TempDir() + "/")
	if n.User(1000) != "1000" || n.Group(7) != "7" {
		t.Errorf("names without files: %q %q", n.User(1000), n.Group(7))
	}
	n = NewAccountNames(root)
	if n.User(1000) != "app" || n.User(2000) != "app" || n.User(3000) != "3000" || n.Group(10) != "wheel" || n.Group(99) != "99" {
		t.Errorf("names: %q %q %q %q", n.User(1000), n.User(2000), n.Group(10), n.Group(99))
	}
}

func FuzzAccountLines(f *testing.F) {
	f.Add("root:x:0:0:root:/root:/bin/sh")
	f.Add("wheel:x:10:root,app")
	f.Add("::::::")
	f.Add("a:x:99999999999999999999:0::/:")
	f.Fuzz(func(t *testing.T, line string) {
		if e, ok := parsePasswdLine(line); ok {
			if e.name == "" || strings.Contains(e.name, ":") || strings.Contains(e.home, ":") {
				t.Errorf("passwd %q: %+v", line, e)
			}
		}
		if g, ok := parseGroupLine(line); ok {
			for _, m := range g.members {
				if m == "" || strings.ContainsAny(m, ",:") {
					t.Errorf("group %q: member %q", line, m)
				}
			}
		}
	})
}

// inotifyRecord encodes one struct inotify_event with its name padded to
// pad bytes.
func inotifyRecord(wd int32, mask uint32, name string, pad int) []byte {
	b := make([]byte, unix.SizeofInotifyEvent+pad)
	binary.NativeEndian.PutUint32(b[0:], uint32(wd))
	binary.NativeEndian.PutUint32(b[4:], mask)
	binary.NativeEndian.PutUint32(b[12:], uint32(pad))
	copy(b[unix.SizeofInotifyEvent:], name)
	return b
}

func TestParseInotify(t *testing.T) {
	buf := append(inotifyRecord(1, unix.IN_CREATE, "a.txt", 16), inotifyRecord(2, unix.IN_DELETE_SELF, "", 0)...)
	evs, err := parseInotify(buf)
	if err != nil || len(evs) != 2 || evs[0].name != "a.txt" || evs[0].wd != 1 || evs[0].mask != unix.IN_CREATE || evs[1].name != "" || evs[1].wd != 2 {
		t.Errorf("parseInotify: %+v %v", evs, err)
	}
	// A truncated record and a name running past the end are errors,
	// after the whole records before them.
	if evs, err := parseInotify(append(inotifyRecord(1, 0, "x", 4), 1, 2, 3)); err == nil || len(evs) != 1 {
		t.Errorf("truncated: %+v %v", evs, err)
	}
	bad := inotifyRecord(1, 0, "x", 4)
	binary.NativeEndian.PutUint32(bad[12:], 1<<31)
	if evs, err := parseInotify(bad); err == nil || len(evs) != 0 {
		t.Errorf("long name: %+v %v", evs, err)
	}
}

func FuzzParseInotify(f *testing.F) {
	f.Add(inotifyRecord(1, unix.IN_CREATE, "a", 16))
	f.Add(append(inotifyRecord(3, unix.IN_MOVED_FROM, "from", 8), inotifyRecord(3, unix.IN_MOVED_TO, "to", 8)...))
	f.Add([]byte{1, 2, 3})
	f.Fuzz(func(t *testing.T, b []byte) {
		evs, _ := parseInotify(b)
		total := 0
		for _, e := range evs {
			if strings.IndexByte(e.name, 0) >= 0 {
				t.Errorf("name %q has a NUL", e.name)
			}
			total += unix.SizeofInotifyEvent + len(e.name)
		}
		if total > len(b) {
			t.Errorf("%d events of %d bytes from %d bytes", len(evs), total, len(b))
		}
	})
}
