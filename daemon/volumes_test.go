package daemon_test

import (
	"os"
	"path/filepath"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

func (e *env) createVolume(req *kilnpb.CreateVolumeRequest) *kilnpb.Volume {
	e.t.Helper()
	v, err := e.c.CreateVolume(ctxT(e.t), req)
	if err != nil {
		e.t.Fatalf("create volume: %v", err)
	}
	return v
}

func mounts(ms ...*kilnpb.VolumeMount) []*kilnpb.VolumeMount { return ms }

// TestVolumes: a volume's files outlive the sandbox that wrote them and a
// restart of kilnd; read-write in one sandbox at a time, read-only in
// any number; refused for a checkpoint, for a fork while read-write, and
// for a delete while mounted.
func TestVolumes(t *testing.T) {
	e := newEnv(t, nil)
	ctx := ctxT(t)
	v := e.createVolume(&kilnpb.CreateVolumeRequest{Name: "data", SizeMib: 32, Labels: map[string]string{"team": "a"}})
	if v.Id == "" || v.Name != "data" || v.SizeMib != 32 || len(v.Users) != 0 {
		t.Fatalf("created volume %+v", v)
	}
	a := e.create(&kilnpb.CreateSandboxRequest{Volumes: mounts(&kilnpb.VolumeMount{Volume: "data", Path: "/data"})})
	if len(a.Volumes) != 1 || a.Volumes[0].Volume != v.Id || a.Volumes[0].Path != "/data" || a.Volumes[0].ReadOnly {
		t.Fatalf("sandbox's volumes %v", a.Volumes)
	}
	if _, err := e.writeFile(ctx, &kilnpb.WriteFileHeader{SandboxId: a.Id, Path: "/data/hello"}, []byte("kept\n")); err != nil {
		t.Fatal(err)
	}

	// Read-write in one sandbox only; read-only not beside it.
	for _, ro := range []bool{false, true} {
		_, err := e.c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{RequestId: nextReq(), Source: &kilnpb.CreateSandboxRequest_Image{Image: "busybox"},
			Volumes: mounts(&kilnpb.VolumeMount{Volume: v.Id, Path: "/data", ReadOnly: ro})})
		wantCode(t, err, codes.FailedPrecondition, "mounted in sandbox "+a.Id)
	}
	got, err := e.c.GetVolume(ctx, &kilnpb.GetVolumeRequest{Id: "data"})
	if err != nil || len(got.Users) != 1 || got.Users[0].Sandbox != a.Id {
		t.Fatalf("GetVolume: %v, %v", got, err)
	}
	_, err = e.c.DeleteVolume(ctx, &kilnpb.DeleteVolumeRequest{Id: v.Id})
	wantCode(t, err, codes.FailedPrecondition, "mounted in sandbox "+a.Id)
	_, err = e.c.Checkpoint(ctx, &kilnpb.CheckpointRequest{SandboxId: a.Id})
	wantCode(t, err, codes.FailedPrecondition, "mounts volume "+v.Id)
	_, err = e.fork(&kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_SandboxId{SandboxId: a.Id}, Count: 1})
	wantCode(t, err, codes.FailedPrecondition, "read-write")

	// A hibernated sandbox keeps its volume, and has it again resumed.
	e.hibernate(a.Id)
	_, err = e.c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{RequestId: nextReq(), Source: &kilnpb.CreateSandboxRequest_Image{Image: "busybox"},
		Volumes: mounts(&kilnpb.VolumeMount{Volume: v.Id, Path: "/data"})})
	wantCode(t, err, codes.FailedPrecondition, "mounted in sandbox "+a.Id)
	e.resume(a.Id)
	if b, err := e.readFile(ctx, a.Id, "/data/hello"); err != nil || string(b) != "kept\n" {
		t.Fatalf("resumed sandbox reads %q, %v", b, err)
	}
	if _, err := e.c.DestroySandbox(ctx, &kilnpb.DestroySandboxRequest{Id: a.Id}); err != nil {
		t.Fatal(err)
	}

	// Across a restart of kilnd: the volume, and who holds it.
	b := e.create(&kilnpb.CreateSandboxRequest{Volumes: mounts(&kilnpb.VolumeMount{Volume: v.Id, Path: "/mnt/in", ReadOnly: true})})
	e.stop()
	e.start()
	ls, err := e.c.ListVolumes(ctx, &kilnpb.ListVolumesRequest{Labels: map[string]string{"team": "a"}})
	if err != nil || len(ls.Volumes) != 1 || ls.Volumes[0].Id != v.Id || len(ls.Volumes[0].Users) != 1 || ls.Volumes[0].Users[0].Sandbox != b.Id || !ls.Volumes[0].Users[0].ReadOnly {
		t.Fatalf("ListVolumes after a restart: %v, %v", ls, err)
	}
	if got, err := e.readFile(ctx, b.Id, "/mnt/in/hello"); err != nil || string(got) != "kept\n" {
		t.Fatalf("next sandbox reads %q, %v", got, err)
	}
	// Read-only in any number: a second sandbox, and a fork.
	c := e.create(&kilnpb.CreateSandboxRequest{Volumes: mounts(&kilnpb.VolumeMount{Volume: v.Id, Path: "/ro", ReadOnly: true})})
	kids, err := e.fork(&kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_SandboxId{SandboxId: c.Id}, Count: 2})
	if err != nil || len(kids) != 2 || len(kids[0].Volumes) != 1 || !kids[0].Volumes[0].ReadOnly {
		t.Fatalf("fork of a sandbox with a read-only volume: %v, %v", kids, err)
	}
	if got, _ := e.c.GetVolume(ctx, &kilnpb.GetVolumeRequest{Id: v.Id}); len(got.Users) != 4 {
		t.Fatalf("users %v, want 4", got.Users)
	}
	for _, id := range []string{b.Id, c.Id, kids[0].Id, kids[1].Id} {
		if _, err := e.c.DestroySandbox(ctx, &kilnpb.DestroySandboxRequest{Id: id}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := e.c.DeleteVolume(ctx, &kilnpb.DeleteVolumeRequest{Id: "data"}); err != nil {
		t.Fatal(err)
	}
	_, err = e.c.GetVolume(ctx, &kilnpb.GetVolumeRequest{Id: v.Id})
	wantCode(t, err, codes.NotFound, v.Id)
}

func TestVolumeRequestsInvalid(t *testing.T) {
	e := newEnv(t, nil)
	ctx := ctxT(t)
	v := e.createVolume(&kilnpb.CreateVolumeRequest{Name: "v1", SizeMib: 16})
	w := e.createVolume(&kilnpb.CreateVolumeRequest{SizeMib: 16})
	for _, c := range []struct {
		name string
		req  *kilnpb.CreateVolumeRequest
		code codes.Code
		msg  string
	}{
		{"taken name", &kilnpb.CreateVolumeRequest{Name: "v1", SizeMib: 16}, codes.AlreadyExists, `named "v1"`},
		{"ID prefix", &kilnpb.CreateVolumeRequest{Name: "vol-x"}, codes.InvalidArgument, "prefix vol-"},
		{"bad name", &kilnpb.CreateVolumeRequest{Name: "a/b"}, codes.InvalidArgument, "volume name"},
		{"too small", &kilnpb.CreateVolumeRequest{SizeMib: 1}, codes.InvalidArgument, "size_mib 1"},
		{"too big", &kilnpb.CreateVolumeRequest{SizeMib: 1 << 30}, codes.InvalidArgument, "size_mib"},
	} {
		_, err := e.c.CreateVolume(ctx, c.req)
		wantCode(t, err, c.code, c.msg)
	}
	for _, c := range []struct {
		name string
		ms   []*kilnpb.VolumeMount
		code codes.Code
		msg  string
	}{
		{"unknown", mounts(&kilnpb.VolumeMount{Volume: "nope", Path: "/d"}), codes.NotFound, "volumes[0]"},
		{"relative", mounts(&kilnpb.VolumeMount{Volume: v.Id, Path: "d"}), codes.InvalidArgument, "absolute"},
		{"unclean", mounts(&kilnpb.VolumeMount{Volume: v.Id, Path: "/d/../e"}), codes.InvalidArgument, "clean"},
		{"root", mounts(&kilnpb.VolumeMount{Volume: v.Id, Path: "/"}), codes.InvalidArgument, "root"},
		{"twice", mounts(&kilnpb.VolumeMount{Volume: v.Id, Path: "/a"}, &kilnpb.VolumeMount{Volume: "v1", Path: "/b"}), codes.InvalidArgument, "already"},
		{"nested", mounts(&kilnpb.VolumeMount{Volume: v.Id, Path: "/a"}, &kilnpb.VolumeMount{Volume: w.Id, Path: "/a/b"}), codes.InvalidArgument, "in or over"},
		{"too many", mounts(&kilnpb.VolumeMount{Volume: v.Id, Path: "/a"}, &kilnpb.VolumeMount{Volume: v.Id, Path: "/b"}, &kilnpb.VolumeMount{Volume: v.Id, Path: "/c"},
			&kilnpb.VolumeMount{Volume: v.Id, Path: "/d"}, &kilnpb.VolumeMount{Volume: v.Id, Path: "/e"}), codes.InvalidArgument, "at most 4"},
	} {
		_, err := e.c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{RequestId: nextReq(), Source: &kilnpb.CreateSandboxRequest_Image{Image: "busybox"}, Volumes: c.ms})
		if err == nil {
			t.Errorf("%s: created", c.name)
			continue
		}
		wantCode(t, err, c.code, c.msg)
	}
	_, err := e.c.DeleteVolume(ctx, &kilnpb.DeleteVolumeRequest{Id: "nope"})
	wantCode(t, err, codes.NotFound, "nope")
}

// TestVolumeFreezeAndRecovery: a running sandbox's end freezes its
// writable volumes (left clean); a volume left with a journal to replay
// is refused read-only, saying how to recover it, and taken read-write.
func TestVolumeFreezeAndRecovery(t *testing.T) {
	e := newEnv(t, nil)
	ctx := ctxT(t)
	v := e.createVolume(&kilnpb.CreateVolumeRequest{SizeMib: 16})
	sb := e.create(&kilnpb.CreateSandboxRequest{Volumes: mounts(&kilnpb.VolumeMount{Volume: v.Id, Path: "/d"})})
	in := e.be.ByPID(int(sb.Pid))
	if _, err := e.c.DestroySandbox(ctx, &kilnpb.DestroySandboxRequest{Id: sb.Id}); err != nil {
		t.Fatal(err)
	}
	if n := in.Freezes(); n != 1 {
		t.Errorf("volumes frozen %d times at the end, want 1", n)
	}
	ro := e.create(&kilnpb.CreateSandboxRequest{Volumes: mounts(&kilnpb.VolumeMount{Volume: v.Id, Path: "/d", ReadOnly: true})})
	in = e.be.ByPID(int(ro.Pid))
	if _, err := e.c.DestroySandbox(ctx, &kilnpb.DestroySandboxRequest{Id: ro.Id}); err != nil {
		t.Fatal(err)
	}
	if n := in.Freezes(); n != 0 {
		t.Errorf("read-only volumes frozen %d times, want 0", n)
	}

	// As a guest killed with it mounted read-write leaves it.
	img := filepath.Join(e.state, "volumes", v.Id+".ext4")
	f, err := os.OpenFile(img, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	var b [1]byte
	f.ReadAt(b[:], 1024+0x60)
	b[0] |= 0x4 // RECOVER
	f.WriteAt(b[:], 1024+0x60)
	f.Close()
	_, err = e.c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{RequestId: nextReq(), Source: &kilnpb.CreateSandboxRequest_Image{Image: "busybox"},
		Volumes: mounts(&kilnpb.VolumeMount{Volume: v.Id, Path: "/d", ReadOnly: true})})
	wantCode(t, err, codes.FailedPrecondition, "mount it read-write once")
	e.create(&kilnpb.CreateSandboxRequest{Volumes: mounts(&kilnpb.VolumeMount{Volume: v.Id, Path: "/d"})})
}
