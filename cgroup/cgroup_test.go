package cgroup

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// fakeTree is a cgroup tree of plain folders: a mount with a delegated
// root whose cgroup.controllers lists ctrls, and a /proc/self whose
// cgroup file puts the current process in self.
type fakeTree struct {
	mount, proc string
}

func newFakeTree(t *testing.T, root, self, ctrls string) fakeTree {
	t.Helper()
	dir := t.TempDir()
	ft := fakeTree{mount: filepath.Join(dir, "cgroup"), proc: filepath.Join(dir, "proc")}
	for _, d := range []string{filepath.Join(ft.mount, root), filepath.Join(ft.mount, self), ft.proc} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	writeFile(t, filepath.Join(ft.mount, root, "cgroup.controllers"), ctrls)
	writeFile(t, filepath.Join(ft.proc, "cgroup"), "12:memory:/user.slice\n0::"+self+"\n")
	return ft
}

func (ft fakeTree) open(t *testing.T, root string) (*Manager, error) {
	t.Helper()
	return OpenOptions(Options{Root: root, Mount: ft.mount, ProcSelf: ft.proc, Sys: filepath.Join(ft.mount, "nosys"),
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), fake: true})
}

func writeFile(t *testing.T, path, s string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(s), 0o644); err != nil {
		t.Fatal(err)
	}
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestOpen(t *testing.T) {
	pid := fmt.Sprint(os.Getpid())
	for _, tc := range []struct {
		name       string
		root, self string // root "" in Open: the process's own
		openRoot   string
		ctrls      string
		wantErr    string
		wantCtl    string // root's and sandboxes' subtree_control
		wantMoved  bool
	}{
		{name: "own cgroup, all controllers", root: "/system.slice/kilnd.service", self: "/system.slice/kilnd.service",
			ctrls: "cpuset cpu io memory hugetlb pids rdma misc", wantCtl: "+cpu +memory +pids +io", wantMoved: true},
		{name: "named root, process elsewhere", root: "/kiln", self: "/user.slice", openRoot: "/kiln",
			ctrls: "cpu memory pids io", wantCtl: "+cpu +memory +pids +io"},
		{name: "named root as a folder", root: "/kiln", self: "/user.slice", openRoot: "MOUNT/kiln",
			ctrls: "memory pids", wantCtl: "+memory +pids"},
		{name: "no memory controller", root: "/kiln", self: "/kiln", ctrls: "cpu pids io", wantErr: "lacks the memory controller"},
		{name: "host root", root: "/", self: "/kiln", openRoot: "/", wantErr: "host's root cgroup"},
		{name: "relative root", root: "/kiln", self: "/kiln", openRoot: "kiln", wantErr: "want a folder under"},
		{name: "missing root", root: "/kiln", self: "/kiln", openRoot: "/nope", ctrls: "memory", wantErr: "not a cgroup folder"},
		{name: "bad controllers file", root: "/kiln", self: "/kiln", ctrls: "memory CPU!", wantErr: "controller"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ft := newFakeTree(t, tc.root, tc.self, tc.ctrls)
			root := strings.ReplaceAll(tc.openRoot, "MOUNT", ft.mount)
			m, err := ft.open(t, root)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("Open: %v, want an error with %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			rootDir := filepath.Join(ft.mount, tc.root)
			if m.Root() != rootDir {
				t.Errorf("Root %s, want %s", m.Root(), rootDir)
			}
			for _, f := range []string{filepath.Join(rootDir, "cgroup.subtree_control"), filepath.Join(rootDir, SandboxesDir, "cgroup.subtree_control")} {
				if got := readFile(t, f); got != tc.wantCtl {
					t.Errorf("%s = %q, want %q", f, got, tc.wantCtl)
				}
			}
			procs := filepath.Join(rootDir, SelfDir, "cgroup.procs")
			got, err := os.ReadFile(procs)
			switch {
			case tc.wantMoved && string(got) != pid:
				t.Errorf("%s = %q (%v), want this process %s", procs, got, err, pid)
			case !tc.wantMoved && err == nil:
				t.Errorf("%s written (%q), the process was not in the root", procs, got)
			}
		})
	}
}

func TestCreate(t *testing.T) {
	for _, tc := range []struct {
		name    string
		ctrls   string
		id      string
		lim     Limits
		want    map[string]string // file → content
		absent  []string
		wantErr string
	}{
		{name: "all limits", ctrls: "cpu memory pids io", id: "sb-0123",
			lim: Limits{CPUs: 2, MemoryMiB: 512, OverheadMiB: 64, PidsMax: 1024,
				IO: []IOLimit{{Device: "253:0", ReadBPS: 1 << 20, WriteIOPS: 100}}},
			want: map[string]string{"cpu.max": "200000 100000", "memory.max": fmt.Sprint(576 << 20), "memory.swap.max": "0",
				"memory.oom.group": "1", "pids.max": "1024", "io.max": "253:0 rbps=1048576 wbps=max riops=max wiops=100"}},
		{name: "memory only", ctrls: "memory", id: "pool-1",
			lim:    Limits{CPUs: 4, MemoryMiB: 128, OverheadMiB: 64, PidsMax: 10},
			want:   map[string]string{"memory.max": fmt.Sprint(192 << 20), "memory.oom.group": "1"},
			absent: []string{"cpu.max", "pids.max", "io.max"}},
		{name: "no caps", ctrls: "cpu memory pids", id: "x",
			want:   map[string]string{"memory.oom.group": "1"},
			absent: []string{"cpu.max", "memory.max", "pids.max"}},
		{name: "io without the controller", ctrls: "memory", id: "a", lim: Limits{IO: []IOLimit{{Device: "8:0"}}}, wantErr: "lacks the io controller"},
		{name: "io on a file not on a block device", ctrls: "memory io", id: "a", lim: Limits{IO: []IOLimit{{Device: "/proc/self/status"}}}, wantErr: "not a block device"},
		{name: "io on a missing device", ctrls: "memory io", id: "a", lim: Limits{IO: []IOLimit{{Device: "/nonexistent/disk"}}}, wantErr: "no such file"},
		{name: "io with no device", ctrls: "memory io", id: "a", lim: Limits{IO: []IOLimit{{}}}, wantErr: "no device"},
		{name: "negative", ctrls: "memory", id: "a", lim: Limits{CPUs: -1}, wantErr: "negative"},
		{name: "slash", ctrls: "memory", id: "a/b", wantErr: "slash"},
		{name: "dots", ctrls: "memory", id: "..", wantErr: "only dots"},
		{name: "empty", ctrls: "memory", id: "", wantErr: "empty"},
		{name: "long", ctrls: "memory", id: strings.Repeat("a", 129), wantErr: "at most 128"},
		{name: "newline", ctrls: "memory", id: "a\nb", wantErr: "control character"},
		{name: "interface-like", ctrls: "memory", id: "cgroup.procs", wantErr: "interface file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ft := newFakeTree(t, "/kiln", "/other", tc.ctrls)
			m, err := ft.open(t, "/kiln")
			if err != nil {
				t.Fatal(err)
			}
			g, err := m.Create(tc.id, tc.lim)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("Create: %v, want an error with %q", err, tc.wantErr)
				}
				if ids, _ := m.List(); len(ids) != 0 {
					t.Errorf("a failed Create left cgroups %q", ids)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if want := filepath.Join(ft.mount, "kiln", SandboxesDir, tc.id); g.Path != want || g.ID != tc.id {
				t.Errorf("group %s at %s, want %s at %s", g.ID, g.Path, tc.id, want)
			}
			for f, want := range tc.want {
				if got := readFile(t, filepath.Join(g.Path, f)); got != want {
					t.Errorf("%s = %q, want %q", f, got, want)
				}
			}
			for _, f := range tc.absent {
				if _, err := os.Stat(filepath.Join(g.Path, f)); err == nil {
					t.Errorf("%s written, its controller is off", f)
				}
			}
			if _, err := m.Create(tc.id, tc.lim); !errors.Is(err, os.ErrExist) {
				t.Errorf("second Create of %s: %v, want ErrExist", tc.id, err)
			}
		})
	}
}

// TestIOPartition: an io limit on a partition caps its whole disk
// (io.max takes no partitions), found through sysfs.
func TestIOPartition(t *testing.T) {
	ft := newFakeTree(t, "/kiln", "/other", "memory io")
	m, err := ft.open(t, "/kiln")
	if err != nil {
		t.Fatal(err)
	}
	disk := filepath.Join(m.sys, "devices", "pci0", "block", "sda")
	if err := os.MkdirAll(filepath.Join(disk, "sda1"), 0o755); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(disk, "dev"), "8:0\n")
	writeFile(t, filepath.Join(disk, "sda1", "dev"), "8:1\n")
	writeFile(t, filepath.Join(disk, "sda1", "partition"), "1\n")
	links := filepath.Join(m.sys, "dev", "block")
	if err := os.MkdirAll(links, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(disk, "sda1"), filepath.Join(links, "8:1")); err != nil {
		t.Fatal(err)
	}
	g, err := m.Create("sb-io", Limits{IO: []IOLimit{{Device: "8:1", WriteBPS: 4096}}})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := readFile(t, filepath.Join(g.Path, "io.max")), "8:0 rbps=max wbps=4096 riops=max wiops=max"; got != want {
		t.Errorf("io.max = %q, want %q", got, want)
	}
}

func TestGroupLifecycle(t *testing.T) {
	ft := newFakeTree(t, "/kiln", "/other", "cpu memory pids io")
	m, err := ft.open(t, "/kiln")
	if err != nil {
		t.Fatal(err)
	}
	var made []string
	for _, id := range []string{"sb-a", "sb-b", "pool-c"} {
		g, err := m.Create(id, Limits{MemoryMiB: 128})
		if err != nil {
			t.Fatal(err)
		}
		made = append(made, g.ID)
	}
	// A stray file in sandboxes/ is not a cgroup.
	writeFile(t, filepath.Join(m.sandboxes, "cgroup.procs"), "")
	ids, err := m.List()
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(ids, ",") != "pool-c,sb-a,sb-b" {
		t.Errorf("List = %q, want %q", ids, made)
	}
	g, err := m.Get("sb-a")
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(g.Path, "memory.events"), "low 0\nhigh 0\nmax 7\noom 2\noom_kill 1\noom_group_kill 1\n")
	writeFile(t, filepath.Join(g.Path, "memory.current"), "4096\n")
	writeFile(t, filepath.Join(g.Path, "memory.peak"), "8192\n")
	ev, err := m.Events("sb-a")
	if err != nil {
		t.Fatal(err)
	}
	if want := (Events{Max: 7, OOM: 2, OOMKill: 1, OOMGroupKill: 1}); ev != want {
		t.Errorf("Events = %+v, want %+v", ev, want)
	}
	if cur, err := g.Current(); err != nil || cur != 4096 {
		t.Errorf("Current = %d, %v; want 4096", cur, err)
	}
	if pk, err := g.Peak(); err != nil || pk != 8192 {
		t.Errorf("Peak = %d, %v; want 8192", pk, err)
	}
	if mx, err := g.MemoryMax(); err != nil || mx != 128<<20 {
		t.Errorf("MemoryMax = %d, %v; want %d", mx, err, 128<<20)
	}
	if err := g.Kill(); err != nil {
		t.Fatal(err)
	}
	if got := readFile(t, filepath.Join(g.Path, "cgroup.kill")); got != "1" {
		t.Errorf("cgroup.kill = %q, want 1", got)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := m.Remove(ctx, "sb-a"); err != nil {
		t.Fatal(err)
	}
	if err := m.Remove(ctx, "sb-a"); err != nil {
		t.Errorf("removing a removed cgroup: %v", err)
	}
	if _, err := m.Get("sb-a"); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Get of a removed cgroup: %v", err)
	}
	if _, err := m.Get("../kiln"); !errors.Is(err, ErrInvalidID) {
		t.Errorf("Get(../kiln): %v, want ErrInvalidID", err)
	}
	if err := m.Remove(ctx, "a/b"); !errors.Is(err, ErrInvalidID) {
		t.Errorf("Remove(a/b): %v, want ErrInvalidID", err)
	}
	if _, err := m.Events("sb-a"); err == nil {
		t.Error("Events of a removed cgroup: no error")
	}
}

func TestParseEvents(t *testing.T) {
	for _, tc := range []struct {
		in      string
		want    Events
		wantErr bool
	}{
		{in: "low 1\nhigh 2\nmax 3\noom 4\noom_kill 5\noom_group_kill 6\n", want: Events{1, 2, 3, 4, 5, 6}},
		{in: "max 3\nsock_throttled 9\n", want: Events{Max: 3}},
		{in: "", want: Events{}},
		{in: "max", wantErr: true},
		{in: "max -1", wantErr: true},
		{in: "oom_kill 99999999999999999999999", wantErr: true},
	} {
		got, err := ParseEvents(tc.in)
		if (err != nil) != tc.wantErr || got != tc.want {
			t.Errorf("ParseEvents(%q) = %+v, %v; want %+v, error %v", tc.in, got, err, tc.want, tc.wantErr)
		}
	}
}

func TestParseProcCgroup(t *testing.T) {
	for _, tc := range []struct {
		in, want string
		wantErr  string
	}{
		{in: "0::/system.slice/kilnd.service\n", want: "/system.slice/kilnd.service"},
		{in: "12:pids:/user.slice\n1:name=systemd:/user.slice\n0::/user.slice/x\n", want: "/user.slice/x"},
		{in: "0::/\n", want: "/"},
		{in: "12:pids:/user.slice\n", wantErr: "no cgroup v2 line"},
		{in: "0::relative\n", wantErr: "not absolute"},
		{in: "0::/a/../b\n", wantErr: "not clean"},
		{in: "0::/a (deleted)\n", wantErr: "was removed"},
	} {
		got, err := ParseProcCgroup(tc.in)
		if tc.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("ParseProcCgroup(%q) = %q, %v; want an error with %q", tc.in, got, err, tc.wantErr)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("ParseProcCgroup(%q) = %q, %v; want %q", tc.in, got, err, tc.want)
		}
	}
}

func TestParseControllers(t *testing.T) {
	got, err := ParseControllers("cpuset cpu io memory hugetlb pids rdma misc\n")
	if err != nil || !got["memory"] || !got["io"] || got["freezer"] || len(got) != 8 {
		t.Errorf("ParseControllers = %v, %v", got, err)
	}
	if _, err := ParseControllers("memory +cpu"); err == nil {
		t.Error("ParseControllers(+cpu): no error")
	}
}

func FuzzParseEvents(f *testing.F) {
	f.Add("low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\noom_group_kill 0\n")
	f.Add("max\n")
	f.Fuzz(func(t *testing.T, s string) {
		e, err := ParseEvents(s)
		if err != nil && e != (Events{}) {
			t.Errorf("ParseEvents(%q) failed (%v) and returned %+v", s, err, e)
		}
	})
}

func FuzzParseControllers(f *testing.F) {
	f.Add("cpuset cpu io memory hugetlb pids rdma misc\n")
	f.Add("")
	f.Fuzz(func(t *testing.T, s string) {
		got, err := ParseControllers(s)
		if err != nil {
			return
		}
		for c := range got {
			if c == "" || strings.ContainsAny(c, " \t\n/") {
				t.Errorf("ParseControllers(%q) gave controller %q", s, c)
			}
		}
	})
}

func FuzzParseProcCgroup(f *testing.F) {
	f.Add("0::/system.slice/kilnd.service\n")
	f.Add("12:pids:/user.slice\n0::/\n")
	f.Fuzz(func(t *testing.T, s string) {
		p, err := ParseProcCgroup(s)
		if err != nil {
			return
		}
		if !strings.HasPrefix(p, "/") {
			t.Errorf("ParseProcCgroup(%q) = %q: not an absolute path", s, p)
		}
		if j := filepath.Join("/sys/fs/cgroup", p); j != "/sys/fs/cgroup" && !strings.HasPrefix(j, "/sys/fs/cgroup/") {
			t.Errorf("ParseProcCgroup(%q) = %q: climbs out of the mount (%s)", s, p, j)
		}
	})
}
