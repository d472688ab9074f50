package filetree

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

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
		u, err := LookupUser(root, tt.name)
		if tt.code != codes.OK {
			if status.Code(err) != tt.code || (tt.name != "" && len(tt.name) < 100 && !strings.Contains(err.Error(), tt.name)) {
				t.Errorf("LookupUser(%q): %v, want %v naming it", tt.name, err, tt.code)
			}
			continue
		}
		if err != nil {
			t.Errorf("LookupUser(%q): %v", tt.name, err)
			continue
		}
		if u.UID != tt.uid || u.GID != tt.gid || u.Home != tt.home || !slices.Equal(u.Groups, tt.groups) {
			t.Errorf("LookupUser(%q) = %+v", tt.name, u)
		}
	}
}

func TestStatus(t *testing.T) {
	for _, tt := range []struct {
		err  error
		code codes.Code
		msg  string
	}{
		{&os.PathError{Op: "open", Path: "/tmp/.x.kiln-1", Err: syscall.ENOENT}, codes.NotFound, "writing /x: no such file or directory"},
		{syscall.EEXIST, codes.AlreadyExists, "writing /x: file exists"},
		{syscall.EACCES, codes.PermissionDenied, "writing /x: permission denied"},
		{syscall.EPERM, codes.PermissionDenied, "writing /x: operation not permitted"},
		{syscall.ENOSPC, codes.ResourceExhausted, "no space left on device writing /x: ENOSPC"},
		{syscall.EFBIG, codes.ResourceExhausted, "file too large writing /x: EFBIG"},
		{syscall.ENOTDIR, codes.InvalidArgument, "writing /x: not a directory"},
		{syscall.EISDIR, codes.InvalidArgument, "writing /x: is a directory"},
		{syscall.EINVAL, codes.InvalidArgument, "writing /x: invalid argument"},
		{syscall.EIO, codes.Internal, "writing /x: input/output error"},
	} {
		err := Status("writing", "/x", tt.err)
		st := status.Convert(err)
		if st.Code() != tt.code || st.Message() != tt.msg {
			t.Errorf("Status(%v) = %v %q; want %v %q", tt.err, st.Code(), st.Message(), tt.code, tt.msg)
		}
	}
}
