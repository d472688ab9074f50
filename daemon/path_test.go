package daemon

import (
	"path"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// FuzzCheckPath: a path from a client is accepted only when it is
// absolute, clean, without NUL and without "..", and refused with
// InvalidArgument otherwise, never a panic.
func FuzzCheckPath(f *testing.F) {
	for _, s := range []string{"/", "/a/b", "a", "/../x", "/a/..", "//", "/a\x00", "/./", "/a/b/"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, p string) {
		err := checkPath("path", p)
		if err != nil {
			if status.Code(err) != codes.InvalidArgument {
				t.Fatalf("%q: %v", p, err)
			}
			return
		}
		if !strings.HasPrefix(p, "/") || path.Clean(p) != p || strings.ContainsRune(p, 0) || len(p) > maxPath {
			t.Fatalf("accepted %q", p)
		}
		for _, el := range strings.Split(p, "/") {
			if el == ".." || el == "." {
				t.Fatalf("accepted %q with element %q", p, el)
			}
		}
	})
}

// FuzzCheckID: IDs from clients never panic and never name a path.
func FuzzCheckID(f *testing.F) {
	for _, s := range []string{"sb-0123", "", "..", "a/b", "ck-x.y"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, id string) {
		if err := checkID("id", id); err != nil {
			if status.Code(err) != codes.InvalidArgument {
				t.Fatalf("%q: %v", id, err)
			}
			return
		}
		if strings.ContainsAny(id, "/\x00") || strings.HasPrefix(id, ".") || id == "" {
			t.Fatalf("accepted %q", id)
		}
	})
}
