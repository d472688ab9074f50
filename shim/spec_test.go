package shim

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/kilnvm/kiln/sandbox"
)

func TestVMSize(t *testing.T) {
	i64 := func(v int64) *int64 { return &v }
	u64 := func(v uint64) *uint64 { return &v }
	for _, tt := range []struct {
		name      string
		res       *specs.LinuxResources
		ann       map[string]string
		cpus, mem int
		err       string
	}{
		{name: "defaults", cpus: 1, mem: 512},
		{name: "limits", res: &specs.LinuxResources{CPU: &specs.LinuxCPU{Quota: i64(150000), Period: u64(100000)}, Memory: &specs.LinuxMemory{Limit: i64(1<<30 + 1)}}, cpus: 2, mem: 1025},
		{name: "annotations win", res: &specs.LinuxResources{CPU: &specs.LinuxCPU{Quota: i64(400000), Period: u64(100000)}}, ann: map[string]string{AnnotationVCPUs: "3", AnnotationMemoryMiB: " 2048 "}, cpus: 3, mem: 2048},
		{name: "tiny memory raised", ann: map[string]string{AnnotationMemoryMiB: "16"}, cpus: 1, mem: sandbox.MinMemoryMiB},
		{name: "zero vCPUs", ann: map[string]string{AnnotationVCPUs: "0"}, err: "0 vCPUs"},
		{name: "bad vCPUs", ann: map[string]string{AnnotationVCPUs: "two"}, err: AnnotationVCPUs},
		{name: "huge memory", ann: map[string]string{AnnotationMemoryMiB: "99999999"}, err: "MiB"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s := &specs.Spec{Annotations: tt.ann, Linux: &specs.Linux{Resources: tt.res}}
			cpus, mem, err := vmSize(s, 1, 512)
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("vmSize = %d, %d, %v; want an error naming %q", cpus, mem, err, tt.err)
				}
				return
			}
			if err != nil || cpus != tt.cpus || mem != tt.mem {
				t.Fatalf("vmSize = %d, %d, %v; want %d, %d", cpus, mem, err, tt.cpus, tt.mem)
			}
		})
	}
}

func TestExecOptions(t *testing.T) {
	o, err := execOptions(&specs.Process{Args: []string{"sh"}, Env: []string{"A=b"}, User: specs.User{UID: 1000, GID: 1000}, Terminal: true, ConsoleSize: &specs.Box{Height: 40, Width: 100}})
	if err != nil || o.Dir != "/" || o.UID != 1000 || o.AsRoot || o.Pty == nil || o.Pty.Rows != 40 || o.Pty.Cols != 100 {
		t.Fatalf("execOptions = %+v, %v", o, err)
	}
	for _, p := range []*specs.Process{
		{Args: []string{"a\x00b"}},
		{Args: []string{"sh"}, Env: []string{"NOEQUALS"}},
		{Args: []string{"sh"}, Cwd: "relative"},
		{},
	} {
		if _, err := execOptions(p); err == nil {
			t.Errorf("execOptions(%+v) accepted", p)
		}
	}
}

func TestParseConfig(t *testing.T) {
	c, err := ParseConfig("t", []byte("kernel = \"/k\"\ncpus = 2\nboot_timeout = \"90s\"\n"))
	if err != nil || c.Kernel != "/k" || c.CPUs != 2 || c.MemoryMiB != 512 || c.bootTimeout().Seconds() != 90 {
		t.Fatalf("ParseConfig = %+v, %v", c, err)
	}
	for _, in := range []string{"cpus = -1", "memory_mib = 1", "boot_timeout = \"soon\"", "kernal = \"/k\"", "cpus = \"two\"", "cache = \"relative/dir\""} {
		if _, err := ParseConfig("t", []byte(in)); err == nil {
			t.Errorf("ParseConfig(%q) accepted", in)
		}
	}
	// A cache folder without a kernel: the error says so, at start.
	empty := t.TempDir()
	c, err = ParseConfig("t", []byte("cache = \""+empty+"\"\n"))
	if err != nil || c.Cache != empty {
		t.Fatalf("ParseConfig(cache) = %+v, %v", c, err)
	}
	if _, err := c.Runtime(); err == nil || !strings.Contains(err.Error(), "kernel") {
		t.Errorf("Runtime() from an empty cache: %v, want an error about the kernel", err)
	}
}

func TestParseMetrics(t *testing.T) {
	m := parseMetrics([]byte("MemTotal: 1000 kB\nMemAvailable: 400 kB\nCached: 100 kB\nAnonPages: 50 kB\n"),
		[]byte("cpu  10 0 5 100 0 0 0 0 0 0\ncpu0 10 0 5 100\n"), []byte("0.00 0.01 0.05 1/42 100\n"))
	if m.Memory.Usage != 600*1024 || m.Memory.UsageLimit != 1000*1024 || m.CPU.UsageUsec != 150000 || m.Pids.Current != 42 {
		t.Fatalf("parseMetrics = %+v", m)
	}
	// Garbage from a hostile guest parses to zeros, not a panic.
	parseMetrics([]byte("MemTotal:\nMemAvailable: x\n"), []byte("cpu\ncpu 1"), []byte("1/"))
}

// TestVMDirLink: a VM's folder is linked from its bundle, and the delete
// command's cleanup removes it through the link, but never a folder that
// is not this container's.
func TestVMDirLink(t *testing.T) {
	bundle := t.TempDir()
	b := SandboxBooter{RunDir: t.TempDir()}
	dir, err := b.vmDir("0123456789abcdef", bundle)
	if err != nil {
		t.Fatal(err)
	}
	if target, err := os.Readlink(filepath.Join(bundle, vmLink)); err != nil || target != dir {
		t.Fatalf("bundle link -> %q, %v; want %q", target, err, dir)
	}
	removeVMDir(bundle, "0123456789abcdef")
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("the VM folder is still there: %v", err)
	}
	other := t.TempDir()
	if err := os.Symlink(other, filepath.Join(bundle, vmLink)); err != nil {
		t.Fatal(err)
	}
	removeVMDir(bundle, "0123456789abcdef")
	if _, err := os.Stat(other); err != nil {
		t.Errorf("a folder that is not the container's was removed: %v", err)
	}
}

// FuzzParseMetrics: the guest writes the /proc files Stats parses; any
// bytes give metrics (zeros where unparsable), never a panic.
func FuzzParseMetrics(f *testing.F) {
	f.Add([]byte("MemTotal: 1000 kB\nMemAvailable: 400 kB\n"), []byte("cpu  10 0 5 100\n"), []byte("0.00 0.01 0.05 1/42 100\n"))
	f.Add([]byte("MemTotal:\nMemAvailable: 99999999999999999999 kB\n"), []byte("cpu\ncpu 1"), []byte("1/"))
	f.Fuzz(func(t *testing.T, meminfo, stat, loadavg []byte) {
		m := parseMetrics(meminfo, stat, loadavg)
		if m.Memory == nil || m.CPU == nil || m.Pids == nil {
			t.Fatal("a section is missing")
		}
		if m.CPU.UsageUsec != m.CPU.UserUsec+m.CPU.SystemUsec {
			t.Fatalf("usage %d != user %d + system %d", m.CPU.UsageUsec, m.CPU.UserUsec, m.CPU.SystemUsec)
		}
	})
}

// FuzzSpec: a bundle's config.json is a request; whatever it holds, the
// checks Create runs on it (spec, size, process) answer with an error or
// a VM within the bounds, never a panic.
func FuzzSpec(f *testing.F) {
	ok, _ := json.Marshal(testSpec("sh", "-c", "true"))
	f.Add(ok)
	f.Add([]byte(`{"process":{"args":["x"],"cwd":"rel"},"root":{"path":"rootfs"},"linux":{"namespaces":[{"type":"pid"}]}}`))
	f.Add([]byte(`{"annotations":{"io.kiln.vcpus":"-1","io.kiln.memory-mib":"1e9"}}`))
	f.Fuzz(func(t *testing.T, config []byte) {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, "config.json"), config, 0o644); err != nil {
			t.Fatal(err)
		}
		spec, err := readSpec(dir)
		if err != nil {
			return
		}
		if checkSpec(spec) != nil {
			return
		}
		cpus, mem, err := vmSize(spec, 1, 512)
		if err == nil && (cpus < 1 || cpus > sandbox.MaxCPUs || mem < sandbox.MinMemoryMiB || mem > sandbox.MaxMemoryMiB) {
			t.Fatalf("vmSize = %d vCPUs, %d MiB: out of bounds", cpus, mem)
		}
		execOptions(spec.Process)
		netnsPath(spec)
		resolvConf(spec)
		vs, err := planVolumes(spec)
		for _, v := range vs {
			d := v.mount.Destination
			if err != nil || !filepath.IsAbs(d) || filepath.Clean(d) != d || underAny(d, guestDirs) || len(v.mount.Data) > maxFileVolume {
				t.Fatalf("planVolumes gave %+v (err %v)", v.mount, err)
			}
		}
	})
}
