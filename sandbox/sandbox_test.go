package sandbox

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kilnvm/kiln/guestkernel"
	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmm"
)

func TestVMConfig(t *testing.T) {
	agent := filepath.Join(t.TempDir(), "agent")
	// A kernel path given: no module lookup; an Initrd given: no build.
	_ = agent
	base := Options{Runtime: Runtime{Kernel: "/k", Initrd: "/i"}}
	for _, tc := range []struct {
		name    string
		opts    func(*Options)
		cmdline []string // words that must be in the command line
		absent  []string
		err     string
	}{
		{"defaults", func(o *Options) {}, []string{"console=ttyS0", "kiln.hostname=kiln", "quiet", "nowatchdog", "sysctl.vm.compaction_proactiveness=0"}, []string{"kiln.root"}, ""},
		{"disk", func(o *Options) { o.Disk = "/d"; o.DiskReadOnly = true; o.RootFSType = "xfs" }, []string{"kiln.root=/dev/vda", "kiln.ro", "kiln.rootfstype=xfs"}, nil, ""},
		{"hostname", func(o *Options) { o.Hostname = "box-1" }, []string{"kiln.hostname=box-1"}, nil, ""},
		{"extra", func(o *Options) { o.Cmdline = "kiln.debug" }, []string{"kiln.debug"}, nil, ""},
		{"bad hostname", func(o *Options) { o.Hostname = "a b" }, nil, nil, "hostname"},
		{"quoting hostname", func(o *Options) { o.Hostname = `a"b` }, nil, nil, "hostname"},
		{"bad fstype", func(o *Options) { o.Disk = "/d"; o.RootFSType = "ext4 init=/bin/sh" }, nil, nil, "root filesystem type"},
		{"no runtime", func(o *Options) { o.Runtime = Runtime{} }, nil, nil, "no runtime"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := base
			tc.opts(&o)
			cfg, err := o.vmConfig()
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if cfg.CPUs != 1 || cfg.MemoryMiB != 512 || cfg.Kernel != "/k" || cfg.Initrd != "/i" {
				t.Fatalf("config %+v", cfg)
			}
			words := strings.Fields(cfg.Cmdline)
			has := func(w string) bool {
				for _, x := range words {
					if x == w || strings.HasPrefix(x, w+"=") && !strings.Contains(w, "=") {
						return true
					}
				}
				return false
			}
			for _, w := range tc.cmdline {
				if !has(w) {
					t.Errorf("command line %q lacks %q", cfg.Cmdline, w)
				}
			}
			for _, w := range tc.absent {
				if has(w) {
					t.Errorf("command line %q has %q", cfg.Cmdline, w)
				}
			}
		})
	}
}

func TestFindAgent(t *testing.T) {
	p := filepath.Join(t.TempDir(), "kiln-agent")
	t.Setenv(AgentEnv, p)
	if _, err := FindAgent(); err == nil {
		t.Fatal("FindAgent found a missing $KILN_AGENT")
	}
	if err := os.WriteFile(p, []byte("x"), 0o755); err != nil {
		t.Fatal(err)
	}
	if got, err := FindAgent(); err != nil || got != p {
		t.Fatalf("FindAgent = %q, %v", got, err)
	}
}

func TestAgentInitrdCached(t *testing.T) {
	if _, err := os.Stat("/bin/busybox"); err != nil {
		t.Skip("no busybox-static")
	}
	cache := t.TempDir()
	// Any static binary serves as the agent here: busybox is one.
	agent := filepath.Join(t.TempDir(), "agent")
	data, err := os.ReadFile("/bin/busybox")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(agent, data, 0o755); err != nil {
		t.Fatal(err)
	}
	p1, err := AgentInitrd(agent, nil, cache)
	if err != nil {
		t.Fatal(err)
	}
	fi1, _ := os.Stat(p1)
	p2, err := AgentInitrd(agent, nil, cache)
	if err != nil || p2 != p1 {
		t.Fatalf("second build %q, %v; want the cached %q", p2, err, p1)
	}
	if fi2, _ := os.Stat(p2); !fi2.ModTime().Equal(fi1.ModTime()) {
		t.Error("the cached image was rewritten")
	}
	// Another agent, another image.
	if err := os.WriteFile(agent, append(data, 0), 0o755); err != nil {
		t.Fatal(err)
	}
	if p3, err := AgentInitrd(agent, nil, cache); err != nil || p3 == p1 {
		t.Fatalf("changed agent: %q, %v", p3, err)
	}
	if filepath.Dir(p1) != cache {
		t.Errorf("image %s is not in the cache folder given", p1)
	}
	if _, err := AgentInitrd(filepath.Join(t.TempDir(), "missing"), &guestkernel.Kernel{}, cache); err == nil {
		t.Fatal("a missing agent built an image")
	}
}

func TestTail(t *testing.T) {
	tl := newTail(8)
	tl.Write([]byte("hello "))
	tl.Write([]byte("world"))
	if got := tl.String(); got != "lo world" {
		t.Fatalf("tail %q", got)
	}
}

func TestCheckNewNIC(t *testing.T) {
	for _, tc := range []struct {
		had, given bool
		want       string
	}{
		{false, false, ""},
		{true, true, ""},
		{true, false, "has a network card: RestoreOptions.Net must give"},
		{false, true, "has no network card for RestoreOptions.Net"},
	} {
		err := checkNewNIC("snapshot /s", tc.had, tc.given, "RestoreOptions.Net")
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("had %v, given %v: %v, want %q", tc.had, tc.given, err, tc.want)
		}
	}
}

// TestExecSetMAC: the addresses travel to the guest's script as
// arguments, never as script text.
func TestExecSetMAC(t *testing.T) {
	o := execSetMAC("02:00:00:00:00:01", "02:00:00:00:00:02")
	if len(o.Argv) != 6 || o.Argv[4] != "02:00:00:00:00:01" || o.Argv[5] != "02:00:00:00:00:02" || strings.Contains(o.Argv[2], "02:00") {
		t.Fatalf("argv %q", o.Argv)
	}
}

func TestNewRuntime(t *testing.T) {
	dir := t.TempDir()
	kernel := filepath.Join(dir, "vmlinux")
	initrd := filepath.Join(dir, "initrd.cpio")
	for _, p := range []string{kernel, initrd} {
		if err := os.WriteFile(p, []byte("x"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	tests := []struct {
		name    string
		cfg     RuntimeConfig
		want    Runtime
		wantErr string
	}{
		{"paths", RuntimeConfig{KernelPath: kernel, Initrd: initrd}, Runtime{Kernel: kernel, Initrd: initrd}, ""},
		{"cached kernel's vmlinux", RuntimeConfig{Kernel: &guestkernel.Kernel{Image: "/nonexistent", Vmlinux: kernel}, Initrd: initrd}, Runtime{Kernel: kernel, Initrd: initrd}, ""},
		{"no kernel", RuntimeConfig{Initrd: initrd}, Runtime{}, "no kernel"},
		{"two kernels", RuntimeConfig{Kernel: &guestkernel.Kernel{Image: kernel}, KernelPath: kernel}, Runtime{}, "give one"},
		{"missing kernel", RuntimeConfig{KernelPath: filepath.Join(dir, "none"), Initrd: initrd}, Runtime{}, "kernel: stat"},
		{"missing initrd", RuntimeConfig{KernelPath: kernel, Initrd: filepath.Join(dir, "none")}, Runtime{}, "initramfs: stat"},
		{"no agent", RuntimeConfig{KernelPath: kernel}, Runtime{}, "no agent binary"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := NewRuntime(tt.cfg)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("NewRuntime = %+v, %v; want %q", got, err, tt.wantErr)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Fatalf("NewRuntime = %+v, %v; want %+v", got, err, tt.want)
			}
		})
	}
}

// TestWritableMiBRefused: a cap on the writable layer needs an image root
// and fits in the guest's memory; both are refused before anything starts.
func TestWritableMiBRefused(t *testing.T) {
	rt := Runtime{Kernel: "/nonexistent/vmlinux", Initrd: "/nonexistent/initrd"}
	for _, tc := range []struct {
		o    Options
		want string
	}{
		{Options{Runtime: rt, WritableMiB: 64}, "needs Options.Image"},
		{Options{Runtime: rt, Image: "debian", Images: t.TempDir(), MemoryMiB: 256, WritableMiB: 300}, "WritableMiB 300"},
		{Options{Runtime: rt, Image: "debian", Images: t.TempDir(), WritableMiB: -1}, "WritableMiB -1"},
	} {
		if _, err := Start(context.Background(), tc.o); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want an error saying %q", tc.o, err, tc.want)
		}
	}
}

// TestRestoreRootDirNamed: a snapshot whose root was a host directory is
// restored only onto a directory the caller names, never the path the
// snapshot records (as disks); with one named, the device serves it.
func TestRestoreRootDirNamed(t *testing.T) {
	devs := []virtio.DeviceSpec{{ID: ImageDevice, Kind: virtio.KindFS, FS: &virtio.FSSpec{Tag: ImageTag, Dir: "/"}}}
	s := &Sandbox{}
	var cfg vmm.RestoreConfig
	if err := s.restoreImage("snapshot /s", devs, RestoreOptions{}, &cfg); err == nil || !strings.Contains(err.Error(), "RestoreOptions.RootDir") {
		t.Errorf("restore without RootDir: %v, want an error naming RestoreOptions.RootDir", err)
	}
	if len(cfg.Devices) != 0 {
		t.Errorf("a refused restore set devices %+v", cfg.Devices)
	}
	dir := t.TempDir()
	if err := s.restoreImage("snapshot /s", devs, RestoreOptions{RootDir: dir}, &cfg); err != nil {
		t.Fatal(err)
	}
	if len(cfg.Devices) != 1 || cfg.Devices[0].FS.Dir != dir || cfg.OpenFS == nil {
		t.Errorf("devices %+v, want the fs device on %s", cfg.Devices, dir)
	}
	if err := s.restoreImage("snapshot /s", devs, RestoreOptions{RootDir: dir, Image: "x"}, &cfg); err == nil {
		t.Error("RootDir with Image accepted")
	}
}

func TestRootQueues(t *testing.T) {
	for _, tc := range []struct{ cpus, want int }{{0, 0}, {1, 0}, {2, 2}, {8, 8}, {64, 16}} {
		if got := rootQueues(tc.cpus); got != tc.want {
			t.Errorf("rootQueues(%d) = %d, want %d", tc.cpus, got, tc.want)
		}
	}
}
