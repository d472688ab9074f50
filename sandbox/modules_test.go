package sandbox

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kilnvm/kiln/guestkernel"
	"github.com/kilnvm/kiln/virtio"
)

// fakeModulesKernel is a kernel of release whose modules tree has one
// module and a modules.dep.
func fakeModulesKernel(t *testing.T, release string) *guestkernel.Kernel {
	t.Helper()
	dir := t.TempDir()
	mods := filepath.Join(dir, "modules")
	for name, data := range map[string]string{"modules.dep": "kernel/a.ko:\n", "kernel/a.ko": "module"} {
		p := filepath.Join(mods, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	vmlinux := filepath.Join(dir, "vmlinux")
	if err := os.WriteFile(vmlinux, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	return &guestkernel.Kernel{Version: release, Image: vmlinux, Vmlinux: vmlinux, ModulesDir: mods}
}

func TestNewRuntimeModules(t *testing.T) {
	k := fakeModulesKernel(t, "6.1.0-90-test")
	initrd := filepath.Join(t.TempDir(), "initrd.cpio")
	if err := os.WriteFile(initrd, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	cache := t.TempDir()
	rt, err := NewRuntime(RuntimeConfig{Kernel: k, Initrd: initrd, ModulesCache: cache})
	if err != nil {
		t.Fatal(err)
	}
	if want := filepath.Join(cache, guestkernel.ModulesDiskName(k.Version)); rt.Modules != want {
		t.Fatalf("Runtime.Modules = %q, want %q", rt.Modules, want)
	}
	if rel, err := guestkernel.ReadModulesDisk(rt.Modules); err != nil || rel != k.Version {
		t.Fatalf("the runtime's modules disk: %q, %v", rel, err)
	}
	if rt, err := NewRuntime(RuntimeConfig{Kernel: k, Initrd: initrd, ModulesCache: cache, NoModules: true}); err != nil || rt.Modules != "" {
		t.Fatalf("NoModules: %+v, %v", rt, err)
	}
	bad := *k
	bad.ModulesDir = t.TempDir() // no modules.dep
	if _, err := NewRuntime(RuntimeConfig{Kernel: &bad, Initrd: initrd, ModulesCache: cache}); err == nil || !strings.Contains(err.Error(), "NoModules") {
		t.Fatalf("a tree without modules.dep: %v, want an error naming NoModules", err)
	}
}

func TestModulesDevice(t *testing.T) {
	k := fakeModulesKernel(t, "6.1.0-91-test")
	disk, err := k.ModulesDisk(context.Background(), t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	s := &Sandbox{dir: t.TempDir()}
	data := virtio.DeviceSpec{ID: "data", Kind: virtio.KindBlock, Block: &virtio.BlockSpec{Path: "/data.img"}}
	opts := Options{Runtime: Runtime{Kernel: "/k", Initrd: "/i", Modules: disk}, Disk: "/root.img", Devices: []virtio.DeviceSpec{data}}
	devs, err := s.deviceSpecs(opts)
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, d := range devs {
		ids = append(ids, d.ID)
	}
	if want := []string{RootDevice, "data", ModulesDevice, VsockDevice, RNGDevice}; !slices.Equal(ids, want) {
		t.Fatalf("devices %q, want %q (the modules disk after the other disks)", ids, want)
	}
	if m := devs[2].Block; m.Path != disk || !m.ReadOnly || m.Serial != ModulesDevice {
		t.Errorf("modules disk spec %+v: want %s, read-only, serial %q", m, disk, ModulesDevice)
	}
	cfg, err := opts.vmConfig()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(cfg.Cmdline, " kiln.modules="+ModulesDevice) {
		t.Errorf("command line %q lacks kiln.modules", cfg.Cmdline)
	}
	opts.Runtime.Modules = ""
	if devs, _ := s.deviceSpecs(opts); slices.ContainsFunc(devs, func(d virtio.DeviceSpec) bool { return d.ID == ModulesDevice }) {
		t.Error("a runtime without a modules disk got one")
	}
	if cfg, _ := opts.vmConfig(); strings.Contains(cfg.Cmdline, "kiln.modules") {
		t.Errorf("a runtime without a modules disk: command line %q", cfg.Cmdline)
	}
	opts.Devices = []virtio.DeviceSpec{{ID: ModulesDevice, Kind: virtio.KindBlock, Block: &virtio.BlockSpec{Path: "/x"}}}
	if _, err := s.deviceSpecs(opts); err == nil || !strings.Contains(err.Error(), "the sandbox's own") {
		t.Errorf("a device of ID %q: %v, want it refused", ModulesDevice, err)
	}
}

func TestCheckModulesDisk(t *testing.T) {
	ctx := context.Background()
	const rel, other = "6.1.0-92-test", "6.1.0-93-test"
	disk, err := fakeModulesKernel(t, rel).ModulesDisk(ctx, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	otherDisk, err := fakeModulesKernel(t, other).ModulesDisk(ctx, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	corrupt := filepath.Join(t.TempDir(), "corrupt.ext4")
	if err := os.WriteFile(corrupt, make([]byte, 4096), 0o644); err != nil {
		t.Fatal(err)
	}
	devs := func(path string) []virtio.DeviceSpec {
		return []virtio.DeviceSpec{modulesSpec(path), {ID: VsockDevice, Kind: virtio.KindVsock, Vsock: &virtio.VsockSpec{}}}
	}
	tests := []struct {
		name    string
		src     restoreSource
		disks   map[string]string
		want    string
		wantErr string
	}{
		{name: "no modules disk", src: restoreSource{what: "snapshot s", devices: devs("")[1:]}},
		{name: "its own disk", src: restoreSource{what: "snapshot s", devices: devs(disk), modules: rel}, want: rel},
		{name: "unlabelled (a hold)", src: restoreSource{what: "hold h", devices: devs(disk)}, want: rel},
		{name: "another kernel's disk at the path", src: restoreSource{what: "snapshot s", devices: devs(otherDisk), modules: rel},
			wantErr: "snapshot s runs kernel 6.1.0-92-test; the modules disk " + otherDisk + " is kernel 6.1.0-93-test's"},
		{name: "another kernel's disk given", src: restoreSource{what: "snapshot s", devices: devs(disk), modules: rel},
			disks: map[string]string{ModulesDevice: otherDisk}, wantErr: "restores only with its own kernel's modules"},
		{name: "the same kernel's disk given", src: restoreSource{what: "snapshot s", devices: devs(otherDisk), modules: rel},
			disks: map[string]string{ModulesDevice: disk}, want: rel},
		{name: "gone", src: restoreSource{what: "snapshot s", devices: devs("/nonexistent/m.ext4"), modules: rel},
			wantErr: "its modules disk (of 6.1.0-92-test) cannot be reopened"},
		{name: "corrupt", src: restoreSource{what: "snapshot s", devices: devs(corrupt), modules: rel},
			wantErr: "not a Kiln modules disk"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := checkModulesDisk(tt.src, tt.disks)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("checkModulesDisk = %q, %v; want an error containing %q", got, err, tt.wantErr)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Fatalf("checkModulesDisk = %q, %v; want %q", got, err, tt.want)
			}
		})
	}
}
