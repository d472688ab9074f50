package filetree

import (
	"bytes"
	"context"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/dirwatch"
)

// testTree is a tree in a temporary folder, its owners the host's.
func testTree(t *testing.T) Tree {
	t.Helper()
	return Tree{Root: t.TempDir(), Accounts: "/"}
}

// wantStatus checks err's code and that its message has want.
func wantStatus(t *testing.T, what string, err error, code codes.Code, want string) {
	t.Helper()
	if st := status.Convert(err); st.Code() != code || !strings.Contains(st.Message(), want) {
		t.Errorf("%s: %v, want %v with %q", what, err, code, want)
	}
}

func TestWriteReadStat(t *testing.T) {
	tr := testTree(t)
	for _, tt := range []struct {
		name     string
		path     string
		perm     uint32
		parents  bool
		user     string
		code     codes.Code
		msg      string
		wantPerm fs.FileMode
	}{
		{name: "plain", path: "/f", wantPerm: 0o644},
		{name: "mode", path: "/g", perm: 0o600, wantPerm: 0o600},
		{name: "setuid", path: "/s", perm: 0o4755, wantPerm: 0o755 | fs.ModeSetuid},
		{name: "parents", path: "/a/b/c", parents: true, wantPerm: 0o644},
		{name: "owner", path: "/o", user: "root", wantPerm: 0o644},
		{name: "no parent", path: "/x/y", code: codes.NotFound, msg: "writing /x/y: no such file or directory"},
		{name: "root", path: "/", code: codes.InvalidArgument, msg: "path is /"},
		{name: "relative", path: "rel", code: codes.InvalidArgument, msg: "not absolute"},
		{name: "empty", path: "", code: codes.InvalidArgument, msg: "path is empty"},
		{name: "NUL", path: "/a\x00b", code: codes.InvalidArgument, msg: "NUL"},
		{name: "bad mode", path: "/m", perm: 0o10644, code: codes.InvalidArgument, msg: "bits other than permissions"},
		{name: "no user", path: "/u", user: "no-such-user-here", code: codes.InvalidArgument, msg: "write file: user \"no-such-user-here\""},
		{name: "bad user", path: "/u", user: "a:b", code: codes.InvalidArgument, msg: "not a user name"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			fi, err := tr.Write(tt.path, tt.perm, tt.parents, tt.user, strings.NewReader("data "+tt.name))
			if tt.code != codes.OK {
				wantStatus(t, "write", err, tt.code, tt.msg)
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if fi.Path != tt.path || fi.Name != filepath.Base(tt.path) || fi.Size != int64(len("data "+tt.name)) || fi.Mode != tt.wantPerm || fi.Owner != "root" || fi.Group != "root" {
				t.Errorf("write: %+v", fi)
			}
			var b bytes.Buffer
			if n, err := tr.Read(tt.path, &b); err != nil || n != int64(b.Len()) || b.String() != "data "+tt.name {
				t.Errorf("read: %d %q %v", n, b.String(), err)
			}
			if st, err := tr.Stat(tt.path, false); err != nil || st != fi {
				t.Errorf("stat: %+v %v, want %+v", st, err, fi)
			}
		})
	}
	if ents, _ := os.ReadDir(tr.Root); len(ents) != 5 {
		t.Errorf("a temporary file stayed: %v", ents)
	}
}

func TestReadStatErrors(t *testing.T) {
	tr := testTree(t)
	os.Mkdir(filepath.Join(tr.Root, "d"), 0o755)
	os.Symlink("d", filepath.Join(tr.Root, "link"))
	for _, tt := range []struct {
		path string
		code codes.Code
		msg  string
	}{
		{"/nope", codes.NotFound, "reading /nope: no such file or directory"},
		{"/d", codes.InvalidArgument, "reading /d: is a directory"},
		{"rel", codes.InvalidArgument, "not absolute"},
	} {
		_, err := tr.Read(tt.path, &bytes.Buffer{})
		wantStatus(t, "read "+tt.path, err, tt.code, tt.msg)
	}
	if fi, err := tr.Stat("/link", true); err != nil || fi.Symlink != "d" || fi.Mode.Type() != fs.ModeSymlink {
		t.Errorf("lstat of a symlink: %+v %v", fi, err)
	}
	if fi, err := tr.Stat("/link", false); err != nil || !fi.IsDir || fi.Symlink != "" || fi.Name != "link" {
		t.Errorf("stat through a symlink: %+v %v", fi, err)
	}
	if fi, err := tr.Stat("/", false); err != nil || !fi.IsDir || fi.Path != "/" || fi.Name != "/" {
		t.Errorf("stat of the root: %+v %v", fi, err)
	}
	_, err := tr.Stat("/nope", false)
	wantStatus(t, "stat", err, codes.NotFound, "stat /nope: no such file or directory")
}

func TestListDepth(t *testing.T) {
	tr := testTree(t)
	for _, d := range []string{"a/b/c", "e"} {
		os.MkdirAll(filepath.Join(tr.Root, "top", d), 0o755)
	}
	os.WriteFile(filepath.Join(tr.Root, "top/a/f"), nil, 0o644)
	os.Symlink("/", filepath.Join(tr.Root, "top/l"))
	for _, tt := range []struct {
		depth uint32
		want  string
	}{
		{0, "a e l"},
		{1, "a e l"},
		{2, "a a/b a/f e l"},
		{3, "a a/b a/b/c a/f e l"},
		{9, "a a/b a/b/c a/f e l"},
	} {
		ents, err := tr.List(context.Background(), "/top", tt.depth)
		var got []string
		for _, e := range ents {
			got = append(got, strings.TrimPrefix(e.Path, "/top/"))
		}
		if err != nil || strings.Join(got, " ") != tt.want {
			t.Errorf("depth %d: %q %v, want %q", tt.depth, got, err, tt.want)
		}
	}
	_, err := tr.List(context.Background(), "/top/a/f", 1)
	wantStatus(t, "list a file", err, codes.InvalidArgument, "listing /top/a/f: not a directory")
	_, err = tr.List(context.Background(), "/nope", 1)
	wantStatus(t, "list nothing", err, codes.NotFound, "listing /nope")
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = tr.List(ctx, "/top", 1)
	wantStatus(t, "list, cancelled", err, codes.Canceled, "")
}

func TestMkdirMoveRemove(t *testing.T) {
	tr := testTree(t)
	for _, tt := range []struct {
		name    string
		path    string
		perm    uint32
		parents bool
		user    string
		code    codes.Code
		msg     string
	}{
		{name: "one", path: "/d", perm: 0o700},
		{name: "default mode", path: "/e"},
		{name: "parents", path: "/p/q/r", perm: 0o750, parents: true},
		{name: "parents, existing", path: "/p/q", parents: true},
		{name: "owned parents", path: "/o/p", parents: true, user: "root"},
		{name: "exists", path: "/d", code: codes.AlreadyExists, msg: "creating directory /d: file exists"},
		{name: "no parent", path: "/x/y", code: codes.NotFound, msg: "creating directory /x/y"},
		{name: "no user", path: "/u", user: "no-such-user-here", code: codes.InvalidArgument, msg: "mkdir: user"},
		{name: "bad mode", path: "/m", perm: 0o70000, code: codes.InvalidArgument, msg: "mode"},
	} {
		err := tr.Mkdir(tt.path, tt.perm, tt.parents, tt.user)
		if tt.code != codes.OK {
			wantStatus(t, tt.name, err, tt.code, tt.msg)
			continue
		}
		want := fileMode(tt.perm)
		if tt.perm == 0 {
			want = 0o755
		}
		if fi, serr := tr.Stat(tt.path, false); err != nil || serr != nil || !fi.IsDir || (tt.name != "parents, existing" && fi.Mode.Perm() != want) {
			t.Errorf("%s: %v; %+v %v", tt.name, err, fi, serr)
		}
	}

	os.WriteFile(filepath.Join(tr.Root, "a"), []byte("a"), 0o644)
	if fi, err := tr.Move("/a", "/p/b"); err != nil || fi.Path != "/p/b" || fi.Size != 1 {
		t.Errorf("move: %+v %v", fi, err)
	}
	for _, tt := range []struct {
		src, dst string
		msg      string
		code     codes.Code
	}{
		{"/nope", "/x", "moving /nope to /x: no such file or directory", codes.NotFound},
		{"rel", "/x", "move: source: path \"rel\" is not absolute", codes.InvalidArgument},
		{"/p/b", "", "move: destination: path is empty", codes.InvalidArgument},
		{"/p/b", "/", "refusing to move / or onto it", codes.InvalidArgument},
	} {
		_, err := tr.Move(tt.src, tt.dst)
		wantStatus(t, "move "+tt.src, err, tt.code, tt.msg)
	}

	wantStatus(t, "remove /", tr.Remove("/", true), codes.InvalidArgument, "refusing to remove /")
	wantStatus(t, "remove nothing", tr.Remove("/nope", true), codes.NotFound, "removing /nope")
	wantStatus(t, "remove a full directory", tr.Remove("/p", false), codes.FailedPrecondition, "removing /p: directory not empty")
	if err := tr.Remove("/p", true); err != nil {
		t.Errorf("remove a tree: %v", err)
	}
	if err := tr.Remove("/d", false); err != nil {
		t.Errorf("remove an empty directory: %v", err)
	}
	if ents, _ := os.ReadDir(tr.Root); len(ents) != 2 {
		t.Errorf("left: %v", ents)
	}
}

func TestWatch(t *testing.T) {
	tr := testTree(t)
	os.Mkdir(filepath.Join(tr.Root, "w"), 0o755)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	events := make(chan Event, 16)
	done := make(chan error, 1)
	go func() {
		done <- tr.Watch(ctx, "/w", true, func(ev Event) error {
			events <- ev
			return nil
		})
	}()
	if ev := <-events; !ev.Started {
		t.Fatalf("first event %+v, want started", ev)
	}
	if _, err := tr.Write("/w/f", 0, false, "", strings.NewReader("x")); err != nil {
		t.Fatal(err)
	}
	for ev := range events {
		if ev.Op == dirwatch.Create && ev.Name == "f" {
			if ev.Entry == nil || ev.Entry.Path != "/w/f" || ev.Entry.Owner != "root" || ev.Entry.Size != 1 {
				t.Errorf("create: %+v", ev.Entry)
			}
			break
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("watch after its context: %v", err)
	}

	for _, tt := range []struct {
		path string
		code codes.Code
		msg  string
	}{
		{"/nope", codes.NotFound, "watching /nope"},
		{"/w/f", codes.InvalidArgument, "watching /w/f: not a directory"},
		{"rel", codes.InvalidArgument, "not absolute"},
	} {
		err := tr.Watch(context.Background(), tt.path, false, func(Event) error { return nil })
		wantStatus(t, "watch "+tt.path, err, tt.code, tt.msg)
	}
}

func TestTreePath(t *testing.T) {
	for _, tt := range []struct {
		root, host, want string
	}{
		{"/", "/a/b", "/a/b"},
		{"/srv/box", "/srv/box/a/b", "/a/b"},
		{"/srv/box", "/srv/box", "/"},
	} {
		if got := (Tree{Root: tt.root}).treePath(tt.host); got != tt.want {
			t.Errorf("Tree{%q}.treePath(%q) = %q, want %q", tt.root, tt.host, got, tt.want)
		}
	}
}

// TestHost: a path of a tree under a folder resolves its symlinks in the
// tree, as a guest's would, never on this machine; under "/", it is the
// path itself.
func TestHost(t *testing.T) {
	root := t.TempDir()
	os.MkdirAll(filepath.Join(root, "d/e"), 0o755)
	for link, target := range map[string]string{
		"host": "/etc", "up": "../../../d", "rel": "d/e", "dangling": "/missing", "loop": "/loop", "d/abs": "/d/e",
	} {
		os.Symlink(target, filepath.Join(root, link))
	}
	tr := Tree{Root: root}
	for _, tt := range []struct {
		path   string
		follow bool
		want   string // under root
	}{
		{"/", true, "/"},
		{"/d/e", true, "/d/e"},
		{"/host", false, "/host"},
		{"/host", true, "/etc"},
		{"/host/hostname", true, "/etc/hostname"},
		{"/up", true, "/d"},
		{"/up/x", false, "/d/x"},
		{"/rel/f", true, "/d/e/f"},
		{"/d/abs", true, "/d/e"},
		{"/d/abs", false, "/d/abs"},
		{"/dangling/x/y", true, "/missing/x/y"},
		{"/new/a", true, "/new/a"},
	} {
		if got := tr.host(tt.path, tt.follow); got != filepath.Join(root, tt.want) {
			t.Errorf("host(%q, follow %v) = %q, want %q under the root", tt.path, tt.follow, got, tt.want)
		}
	}
	// Through the calls: no file of this machine's /etc is read, a loop
	// reads nothing.
	for _, p := range []string{"/host/hostname", "/dangling"} {
		_, err := tr.Read(p, &bytes.Buffer{})
		wantStatus(t, "read "+p, err, codes.NotFound, "reading "+p)
	}
	_, err := tr.Read("/loop/hostname", &bytes.Buffer{})
	wantStatus(t, "read through a loop", err, codes.InvalidArgument, "reading /loop/hostname")
	if got := (Tree{Root: "/"}).host("/etc/hostname", true); got != "/etc/hostname" {
		t.Errorf("host under / = %q", got)
	}
}
