package daemon_test

import (
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

func (e *env) writeFile(ctx context.Context, h *kilnpb.WriteFileHeader, data []byte) (*kilnpb.FileInfo, error) {
	stream, err := e.c.WriteFile(ctx)
	if err != nil {
		return nil, err
	}
	if err := stream.Send(&kilnpb.WriteFileRequest{Kind: &kilnpb.WriteFileRequest_Header{Header: h}}); err != nil {
		return stream.CloseAndRecv()
	}
	for len(data) > 0 {
		n := min(len(data), 100<<10)
		if err := stream.Send(&kilnpb.WriteFileRequest{Kind: &kilnpb.WriteFileRequest_Data{Data: data[:n]}}); err != nil {
			break
		}
		data = data[n:]
	}
	return stream.CloseAndRecv()
}

func (e *env) readFile(ctx context.Context, id, path string) ([]byte, error) {
	stream, err := e.c.ReadFile(ctx, &kilnpb.ReadFileRequest{SandboxId: id, Path: path})
	if err != nil {
		return nil, err
	}
	var b bytes.Buffer
	for {
		c, err := stream.Recv()
		if err == io.EOF {
			return b.Bytes(), nil
		}
		if err != nil {
			return b.Bytes(), err
		}
		b.Write(c.Data)
	}
}

func TestFiles(t *testing.T) {
	e := newEnv(t, nil)
	sb := e.create(nil)
	ctx := ctxT(t)
	data := bytes.Repeat([]byte("kiln "), 100_000) // several chunks
	fi, err := e.writeFile(ctx, &kilnpb.WriteFileHeader{SandboxId: sb.Id, Path: "/work/a/data.txt", Mode: 0o600, MakeParents: true}, data)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Size != int64(len(data)) || fi.Mode&0o777 != 0o600 || fi.Name != "data.txt" || fi.Path != "/work/a/data.txt" {
		t.Errorf("written: %v", fi)
	}
	got, err := e.readFile(ctx, sb.Id, "/work/a/data.txt")
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read back %d bytes, %v; want %d", len(got), err, len(data))
	}
	// The exec sees what the file calls wrote.
	if r := e.sh(sb.Id, `cat "$KILN_TEST_ROOT/work/a/data.txt" | wc -c`); strings.TrimSpace(r.stdout) != "500000" {
		t.Errorf("exec sees %q", r.stdout)
	}
	if _, err := e.c.MakeDir(ctx, &kilnpb.MakeDirRequest{SandboxId: sb.Id, Path: "/work/b/c", Parents: true}); err != nil {
		t.Fatal(err)
	}
	dir, err := e.c.ListDir(ctx, &kilnpb.ListDirRequest{SandboxId: sb.Id, Path: "/work"})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, x := range dir.Entries {
		names = append(names, x.Name)
		if !x.IsDir || x.Mode&0o170000 != 0o040000 {
			t.Errorf("%s: not a directory: %v", x.Name, x)
		}
	}
	if strings.Join(names, ",") != "a,b" {
		t.Errorf("ListDir /work: %v", names)
	}
	st, err := e.c.Stat(ctx, &kilnpb.StatRequest{SandboxId: sb.Id, Path: "/work/a/data.txt"})
	if err != nil || st.Size != int64(len(data)) || st.Mode&0o170000 != 0o100000 {
		t.Errorf("stat: %v %v", st, err)
	}
	_, err = e.c.Remove(ctx, &kilnpb.RemoveRequest{SandboxId: sb.Id, Path: "/work"})
	wantCode(t, err, codes.FailedPrecondition, "/work")
	if _, err := e.c.Remove(ctx, &kilnpb.RemoveRequest{SandboxId: sb.Id, Path: "/work", Recursive: true}); err != nil {
		t.Fatal(err)
	}
	_, err = e.c.Stat(ctx, &kilnpb.StatRequest{SandboxId: sb.Id, Path: "/work"})
	wantCode(t, err, codes.NotFound, "/work")
	_, err = e.readFile(ctx, sb.Id, "/missing")
	wantCode(t, err, codes.NotFound, "/missing")
	// A symlink out of the root does not lead out of it.
	if err := os.Symlink("/etc", filepath.Join(e.state, "sandboxes", sb.Id, "root", "out")); err != nil {
		t.Fatal(err)
	}
	_, err = e.readFile(ctx, sb.Id, "/out/hostname")
	if err == nil {
		t.Error("read through a symlink out of the root")
	}
}

func TestFilePathsInvalid(t *testing.T) {
	e := newEnv(t, nil)
	sb := e.create(nil)
	ctx := ctxT(t)
	paths := []struct{ path, msg string }{
		{"", "empty"},
		{"etc/passwd", "relative"},
		{"/../etc/passwd", `".."`},
		{"/a/../../etc", `".."`},
		{"/a/./b", "not clean"},
		{"//a", "not clean"},
		{"/a/", "not clean"},
		{"/a\x00b", "NUL"},
		{"/" + strings.Repeat("a", 5000), "at most 4096"},
	}
	for _, p := range paths {
		t.Run(p.path[:min(len(p.path), 20)], func(t *testing.T) {
			calls := map[string]error{}
			_, calls["stat"] = e.c.Stat(ctx, &kilnpb.StatRequest{SandboxId: sb.Id, Path: p.path})
			_, calls["read"] = e.readFile(ctx, sb.Id, p.path)
			_, calls["write"] = e.writeFile(ctx, &kilnpb.WriteFileHeader{SandboxId: sb.Id, Path: p.path}, []byte("x"))
			_, calls["list"] = e.c.ListDir(ctx, &kilnpb.ListDirRequest{SandboxId: sb.Id, Path: p.path})
			_, calls["mkdir"] = e.c.MakeDir(ctx, &kilnpb.MakeDirRequest{SandboxId: sb.Id, Path: p.path})
			_, calls["remove"] = e.c.Remove(ctx, &kilnpb.RemoveRequest{SandboxId: sb.Id, Path: p.path, Recursive: true})
			for name, err := range calls {
				t.Run(name, func(t *testing.T) { wantCode(t, err, codes.InvalidArgument, p.msg) })
			}
		})
	}
	_, err := e.c.Remove(ctx, &kilnpb.RemoveRequest{SandboxId: sb.Id, Path: "/", Recursive: true})
	wantCode(t, err, codes.InvalidArgument, "root")
	_, err = e.writeFile(ctx, &kilnpb.WriteFileHeader{SandboxId: sb.Id, Path: "/f", Mode: 0o170000}, nil)
	wantCode(t, err, codes.InvalidArgument, "mode")
	if _, err := os.Stat(filepath.Join(e.state, "sandboxes", sb.Id, "root", "f")); !os.IsNotExist(err) {
		t.Errorf("a refused write left a file: %v", err)
	}
}
