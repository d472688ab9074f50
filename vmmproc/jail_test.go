package vmmproc

import (
	"context"
	"fmt"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/jail"
	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmmproc/vmmpb"
)

// TestJailedStart: a jailed VMM process starts in new mount, PID, IPC,
// UTS and (without Netns) network namespaces, or in the network
// namespace Netns names; its PID is the host's (Hello reports it, though
// it is PID 1 in its own namespace); its id stays held while it lives
// and is free once Close has ended it. (The jail itself is entered at
// Create, once a VM is built: TestKVMJail in package sandbox.)
func TestJailedStart(t *testing.T) {
	if os.Getuid() != 0 {
		t.Fatal("a jailed start needs root (namespaces)")
	}
	ids, err := jail.NewIDs(t.TempDir(), jail.FirstID, 16)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, netns string
		sameNet     bool
	}{
		{"new netns", "", false},
		{"caller's netns", "/proc/self/ns/net", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			id, f, err := ids.Allocate()
			if err != nil {
				t.Fatal(err)
			}
			dir := t.TempDir()
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			p, err := Start(ctx, StartConfig{Command: []string{os.Args[0], "-test.run=^$"}, Dir: dir,
				Jail: &JailConfig{UID: id, GID: id, IDFile: f, Netns: tc.netns}})
			if err != nil {
				t.Fatalf("Start: %v", err)
			}
			defer p.Close(context.Background())
			hello, err := p.api.Hello(ctx, &vmmpb.HelloRequest{})
			if err != nil {
				t.Fatal(err)
			}
			if int(hello.Pid) != p.PID() || p.PID() != p.cmd.Process.Pid {
				t.Fatalf("Hello says PID %d, Start's child is %d, PID() %d", hello.Pid, p.cmd.Process.Pid, p.PID())
			}
			st, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", p.PID()))
			if err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(string(st), fmt.Sprintf("\nNSpid:\t%d\t1\n", p.PID())) {
				t.Errorf("not PID 1 of a PID namespace of its own:\n%s", st)
			}
			for _, ns := range []string{"mnt", "pid", "ipc", "uts", "net"} {
				mine, _ := os.Readlink("/proc/self/ns/" + ns)
				its, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/%s", p.PID(), ns))
				if err != nil {
					t.Fatal(err)
				}
				if same := its == mine; same != (ns == "net" && tc.sameNet) {
					t.Errorf("ns %s: its %s, mine %s", ns, its, mine)
				}
			}
			if held, err := ids.Held(id); err != nil || !held {
				t.Fatalf("id %d while the process runs: held %v, %v", id, held, err)
			}
			if jailed, uid := p.Jailed(); !jailed || uid != id {
				t.Fatalf("Jailed() = %v, %d", jailed, uid)
			}
			if err := p.Close(context.Background()); err != nil {
				t.Fatal(err)
			}
			<-p.Exited()
			if held, err := ids.Held(id); err != nil || held {
				t.Fatalf("id %d after the process ended: held %v, %v", id, held, err)
			}
		})
	}
}

// TestJailedStartErrors: a jail without ids or id file is refused before
// anything starts, and the id file is closed either way.
func TestJailedStartErrors(t *testing.T) {
	ids, err := jail.NewIDs(t.TempDir(), jail.FirstID, 4)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		j    func(f *os.File) *JailConfig
		want string
	}{
		{"root uid", func(f *os.File) *JailConfig { return &JailConfig{UID: 0, GID: jail.FirstID, IDFile: f} }, "ids other than root's"},
		{"no id file", func(*os.File) *JailConfig { return &JailConfig{UID: jail.FirstID, GID: jail.FirstID} }, "no id file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			id, f, err := ids.Allocate()
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			j := tc.j(f)
			_, err = Start(context.Background(), StartConfig{Command: []string{os.Args[0], "-test.run=^$"}, Dir: t.TempDir(), Jail: j})
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Start: %v, want %q", err, tc.want)
			}
			if j.IDFile != nil {
				if held, _ := ids.Held(id); held {
					t.Fatal("the id file was left open")
				}
			}
		})
	}
}

// TestJailBinds: what a jailed process's Create binds, from its request
// and devices.
func TestJailBinds(t *testing.T) {
	boot := &vmmpb.CreateRequest{Source: &vmmpb.CreateRequest_BootSpecJson{BootSpecJson: []byte(`{"kernel":"/k/vmlinux","initrd":"/k/initrd.img"}`)}}
	snap := &vmmpb.CreateRequest{Source: &vmmpb.CreateRequest_SnapshotDir{SnapshotDir: "/snaps/base"}}
	fork := &vmmpb.CreateRequest{Source: &vmmpb.CreateRequest_Fork{Fork: &vmmpb.ForkSource{}}}
	disks := []virtio.DeviceSpec{
		{ID: "root", Kind: virtio.KindBlock, Block: &virtio.BlockSpec{Path: "/d/root.ext4", ReadOnly: true}},
		{ID: "data", Kind: virtio.KindBlock, Block: &virtio.BlockSpec{Path: "/d/data.ext4"}},
		{ID: "vsock", Kind: virtio.KindVsock, Vsock: &virtio.VsockSpec{Path: "/sb/1/vsock.sock"}},
		{ID: "net0", Kind: virtio.KindNet, Net: &virtio.NetSpec{Tap: "tap0"}},
		{ID: "rng", Kind: virtio.KindRNG},
	}
	for _, tc := range []struct {
		name    string
		req     *vmmpb.CreateRequest
		devices []virtio.DeviceSpec
		extra   []jail.Bind
		want    []jail.Bind
		err     string
	}{
		{"boot", boot, disks, nil, []jail.Bind{
			{Path: "/d/data.ext4"}, {Path: "/d/root.ext4", ReadOnly: true}, {Path: "/dev/kvm"}, {Path: "/dev/net/tun"},
			{Path: "/k/initrd.img", ReadOnly: true}, {Path: "/k/vmlinux", ReadOnly: true}, {Path: "/sb/1"},
		}, ""},
		{"restore", snap, disks[2:3], nil, []jail.Bind{{Path: "/dev/kvm"}, {Path: "/sb/1"}, {Path: "/snaps/base", ReadOnly: true}}, ""},
		{"fork, extra bind", fork, nil, []jail.Bind{{Path: "/opt/x", ReadOnly: true}}, []jail.Bind{{Path: "/dev/kvm"}, {Path: "/opt/x", ReadOnly: true}, {Path: "/sb/1"}}, ""},
		{"read-write wins", fork, nil, []jail.Bind{{Path: "/sb/1", ReadOnly: true}}, []jail.Bind{{Path: "/dev/kvm"}, {Path: "/sb/1"}}, ""},
		{"image root: its store read-only", fork, []virtio.DeviceSpec{{ID: "rootfs", Kind: virtio.KindFS, FS: &virtio.FSSpec{Tag: "kilnroot", Images: "/var/lib/kiln/images"}}}, nil,
			[]jail.Bind{{Path: "/dev/kvm"}, {Path: "/sb/1"}, {Path: "/var/lib/kiln/images", ReadOnly: true}}, ""},
		{"relative images folder", fork, []virtio.DeviceSpec{{ID: "rootfs", Kind: virtio.KindFS, FS: &virtio.FSSpec{Images: "images"}}}, nil, nil, "not an absolute path"},
		{"relative disk", fork, []virtio.DeviceSpec{{ID: "d", Kind: virtio.KindBlock, Block: &virtio.BlockSpec{Path: "d.ext4"}}}, nil, nil, "not an absolute path"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := jailBinds("", "/sb/1/vmm.sock", tc.req, tc.devices, tc.extra)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("jailBinds: %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("binds\n%v\nwant\n%v", got, tc.want)
			}
		})
	}
}
