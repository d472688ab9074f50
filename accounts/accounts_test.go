package accounts

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
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

func TestLookup(t *testing.T) {
	root := accountRoot(t,
		"root:x:0:0:root:/root:/bin/sh\n# a comment\n\napp:x:1000:1000::/home/app:/bin/sh\nnohome:x:1001:1001:::\napp:x:2000:2000::/dup:/bin/sh\n",
		"root:x:0:\napp:x:1000:\nwheel:x:10:root,app\naudio:x:29:app\nagain:x:10:app\nother:x:30:nohome\n")
	for _, want := range []User{
		{Name: "app", UID: 1000, GID: 1000, Home: "/home/app", Groups: []uint32{10, 29}},
		{Name: "root", Home: "/root", Groups: []uint32{10}},
		{Name: "nohome", UID: 1001, GID: 1001, Home: "/", Groups: []uint32{30}},
	} {
		u, err := Lookup(root, want.Name)
		if err != nil || u.Name != want.Name || u.UID != want.UID || u.GID != want.GID || u.Home != want.Home || !slices.Equal(u.Groups, want.Groups) {
			t.Errorf("Lookup(%q) = %+v, %v; want %+v", want.Name, u, err, want)
		}
	}
	for _, name := range []string{"nobody", "", "a:b"} {
		if _, err := Lookup(root, name); !errors.Is(err, ErrNoUser) || !strings.Contains(err.Error(), name) {
			t.Errorf("Lookup(%q): %v, want ErrNoUser naming it", name, err)
		}
	}
	// An account file that cannot be read is an error naming it.
	bad := t.TempDir()
	if err := os.MkdirAll(filepath.Join(bad, "etc/passwd"), 0o755); err != nil {
		t.Fatal(err)
	}
	var pe *fs.PathError
	if _, err := Lookup(bad, "app"); !errors.As(err, &pe) || pe.Op != "reading" || pe.Path != filepath.Join(bad, "etc/passwd") {
		t.Errorf("Lookup of an unreadable passwd: %v", err)
	}
	// No account files: no users, and names are numbers.
	n := NewNames(t.TempDir() + "/")
	if n.User(1000) != "1000" || n.Group(7) != "7" {
		t.Errorf("names without files: %q %q", n.User(1000), n.Group(7))
	}
	n = NewNames(root)
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
