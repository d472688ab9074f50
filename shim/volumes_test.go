package shim

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	taskAPI "github.com/containerd/containerd/api/runtime/task/v2"
	"github.com/containerd/containerd/errdefs"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/kilnvm/kiln/guest/client"
)

func TestPlanVolumes(t *testing.T) {
	dir := t.TempDir()
	hosts := filepath.Join(dir, "hosts")
	os.WriteFile(hosts, []byte("10.0.0.5 pod\n"), 0o640)
	big := filepath.Join(dir, "big")
	os.WriteFile(big, make([]byte, maxFileVolume+1), 0o644)
	empty := filepath.Join(dir, "pods/uid/volumes/kubernetes.io~empty-dir/cache")
	cfg := filepath.Join(dir, "pods/uid/volumes/kubernetes.io~configmap/cfg")
	for _, d := range []string{empty, cfg} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	sock := filepath.Join(dir, "s.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()

	ociDefaults := []specs.Mount{
		{Destination: "/proc", Type: "proc", Source: "proc"},
		{Destination: "/dev", Type: "tmpfs", Source: "tmpfs"},
		{Destination: "/dev/pts", Type: "devpts", Source: "devpts"},
		{Destination: "/dev/shm", Type: "bind", Source: dir, Options: []string{"rbind"}},
		{Destination: "/sys", Type: "sysfs", Source: "sysfs"},
		{Destination: "/sys/fs/cgroup", Type: "cgroup", Source: "cgroup"},
		{Destination: "/run", Type: "tmpfs", Source: "tmpfs"},
	}
	for _, tc := range []struct {
		name        string
		mounts      []specs.Mount
		want        []client.Mount
		unsupported bool
		wantErr     string
	}{
		{name: "the guest's own", mounts: ociDefaults},
		{name: "kubernetes volumes", mounts: []specs.Mount{
			{Destination: "/etc/hosts", Type: "bind", Source: hosts, Options: []string{"rbind", "rw"}},
			{Destination: "/cache", Type: "bind", Source: empty, Options: []string{"rbind"}},
			{Destination: "/etc/cfg", Type: "bind", Source: cfg, Options: []string{"rbind", "ro"}},
			{Destination: "/scratch", Type: "tmpfs", Source: "tmpfs", Options: []string{"size=64m"}},
		}, want: []client.Mount{
			{Destination: "/etc/hosts", Kind: client.MountFile, Data: []byte("10.0.0.5 pod\n"), Mode: 0o640},
			{Destination: "/cache", Kind: client.MountVolume, Name: "e-" + pathKey(empty)},
			{Destination: "/etc/cfg", Kind: client.MountTree, Name: "v-" + pathKey(cfg), ReadOnly: true},
			{Destination: "/scratch", Kind: client.MountTmpfs, Size: 64 << 20},
		}},
		{name: "writable host folder", mounts: []specs.Mount{{Destination: "/data", Type: "bind", Source: cfg, Options: []string{"rbind", "rw"}}},
			unsupported: true, wantErr: "writes in the guest would not reach the host"},
		{name: "big file", mounts: []specs.Mount{{Destination: "/f", Type: "bind", Source: big}}, unsupported: true, wantErr: "at most"},
		{name: "socket", mounts: []specs.Mount{{Destination: "/s", Type: "bind", Source: sock}}, unsupported: true, wantErr: "not shared"},
		{name: "other type", mounts: []specs.Mount{{Destination: "/o", Type: "overlay", Source: "overlay"}}, unsupported: true, wantErr: "overlay"},
		{name: "relative destination", mounts: []specs.Mount{{Destination: "x", Type: "tmpfs"}}, wantErr: "not an absolute path"},
		{name: "relative source", mounts: []specs.Mount{{Destination: "/x", Type: "bind", Source: "rel"}}, wantErr: "not an absolute path"},
		{name: "missing source", mounts: []specs.Mount{{Destination: "/x", Type: "bind", Source: filepath.Join(dir, "nope")}}, wantErr: "no such file"},
		{name: "bad tmpfs size", mounts: []specs.Mount{{Destination: "/x", Type: "tmpfs", Options: []string{"size=50%"}}}, wantErr: "size"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			vs, err := planVolumes(&specs.Spec{Mounts: tc.mounts})
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) || errors.Is(err, ErrUnsupported) != tc.unsupported {
					t.Fatalf("planVolumes = %v; want an error with %q (unsupported %v)", err, tc.wantErr, tc.unsupported)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			var got []client.Mount
			for _, v := range vs {
				got = append(got, v.mount)
			}
			if !slices.EqualFunc(got, tc.want, func(a, b client.Mount) bool {
				return a.Destination == b.Destination && a.Kind == b.Kind && a.Name == b.Name && string(a.Data) == string(b.Data) &&
					a.ReadOnly == b.ReadOnly && a.Size == b.Size && a.Mode == b.Mode
			}) {
				t.Errorf("mounts %+v\nwant %+v", got, tc.want)
			}
		})
	}
}

// TestServiceVolumes: a read-only volume two containers of a pod mount is
// served once and stopped after the last; each container's mounts go to
// its own root; a checkpoint of a VM with one is refused, as is a writable
// host folder at Create.
func TestServiceVolumes(t *testing.T) {
	s, _, boot := newTestService(t)
	ctx := context.Background()
	cfg := t.TempDir()
	appSpec := func(args ...string) *specs.Spec {
		sp := testSpec(args...)
		sp.Annotations = map[string]string{criContainerType: "container", criSandboxID: "pod1"}
		sp.Mounts = append(sp.Mounts, specs.Mount{Destination: "/etc/cfg", Type: "bind", Source: cfg, Options: []string{"rbind", "ro"}})
		return sp
	}
	if _, err := s.Create(ctx, &taskAPI.CreateTaskRequest{ID: "web", Bundle: bundle(t, appSpec("sleep", "600"))}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Create(ctx, &taskAPI.CreateTaskRequest{ID: "side", Bundle: bundle(t, appSpec("sleep", "600"))}); err != nil {
		t.Fatal(err)
	}
	rw := testSpec("true")
	rw.Annotations = map[string]string{criContainerType: "container", criSandboxID: "pod1"}
	rw.Mounts = append(rw.Mounts, specs.Mount{Destination: "/data", Type: "bind", Source: cfg, Options: []string{"rbind"}})
	if _, err := s.Create(ctx, &taskAPI.CreateTaskRequest{ID: "rw", Bundle: bundle(t, rw)}); !errdefs.IsNotImplemented(err) {
		t.Errorf("Create with a writable host folder = %v, want NotImplemented", err)
	}
	if _, err := s.Checkpoint(ctx, &taskAPI.CheckpointTaskRequest{ID: "web", Path: t.TempDir()}); !errdefs.IsFailedPrecondition(err) {
		t.Errorf("Checkpoint = %v, want FailedPrecondition", err)
	}
	for _, id := range []string{"web", "side"} {
		if _, err := s.Delete(ctx, &taskAPI.DeleteRequest{ID: id}); err != nil {
			t.Fatal(err)
		}
	}
	tree := "v-" + pathKey(cfg)
	m := "1:/etc/cfg:" + tree
	want := []string{"serve " + tree + " " + cfg, "mounts  " + m, "mountroot side", "mounts side " + m, "unmountroot side", "stopserving " + tree, "close"}
	if got := boot.vms[0].callList(); !slices.Equal(got, want) {
		t.Errorf("VM calls\n%q\nwant\n%q", got, want)
	}
}
