package hostcheck

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/fsverity"
	"github.com/kilnvm/kiln/sandbox"
)

// tree is a fake host: files under a temporary root.
type tree struct {
	t    *testing.T
	root string
}

func newTree(t *testing.T) *tree { return &tree{t: t, root: t.TempDir()} }

func (tr *tree) path(p string) string { return filepath.Join(tr.root, p) }

func (tr *tree) write(p, content string, mode os.FileMode) string {
	tr.t.Helper()
	full := tr.path(p)
	if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
		tr.t.Fatal(err)
	}
	if err := os.WriteFile(full, []byte(content), mode); err != nil {
		tr.t.Fatal(err)
	}
	return full
}

// host is a Host over the tree, with a working KVM, nftables and netns,
// a cgroup2 mount, 100 GiB free, and every file a healthy host has.
func (tr *tree) host() *Host {
	tr.write("proc/cpuinfo", "processor\t: 0\nflags\t\t: fpu vme vmx sse\n", 0o644)
	tr.write("proc/self/cgroup", "0::/user.slice/user-0.slice/session-1.scope\n", 0o644)
	tr.write("proc/self/status", "Name:\tkiln\nCapEff:\t000001ffffffffff\n", 0o644)
	tr.write("proc/sys/net/ipv4/ip_forward", "1\n", 0o644)
	tr.write("sys/kernel/mm/transparent_hugepage/shmem_enabled", "always within_size [advise] never deny force\n", 0o644)
	tr.write("dev/net/tun", "", 0o600)
	tr.write("proc/self/ns/net", "", 0o444)
	cg := "sys/fs/cgroup/user.slice/user-0.slice/session-1.scope/"
	tr.write(cg+"cgroup.controllers", "cpuset cpu io memory hugetlb pids rdma misc\n", 0o444)
	tr.write(cg+"cgroup.subtree_control", "", 0o644)
	tr.write(cg+"cgroup.procs", "", 0o644)
	tr.write("cache/kernel/6.1.0-57-amd64/vmlinuz", "MZ", 0o644)
	tr.write("cache/kernel/6.1.0-57-amd64/vmlinux", "\x7fELF", 0o644)
	os.MkdirAll(tr.path("cache/kernel/6.1.0-57-amd64/modules"), 0o755)
	os.Symlink("6.1.0-57-amd64", tr.path("cache/kernel/current"))
	tr.write("bin/kiln-agent", "\x7fELF\x02\x01\x01", 0o755)
	tr.write("bin/kiln-vmm", "\x7fELF\x02\x01\x01", 0o755)
	os.MkdirAll(tr.path("var/lib"), 0o755)
	return &Host{
		KVM:            tr.path("dev/kvm"),
		CPUInfo:        tr.path("proc/cpuinfo"),
		SysModule:      tr.path("sys/module"),
		CgroupMount:    tr.path("sys/fs/cgroup"),
		ProcSelfCgroup: tr.path("proc/self/cgroup"),
		Tun:            tr.path("dev/net/tun"),
		NetNS:          tr.path("proc/self/ns/net"),
		ProcSelfStatus: tr.path("proc/self/status"),
		IPForward:      tr.path("proc/sys/net/ipv4/ip_forward"),
		ShmemTHP:       tr.path("sys/kernel/mm/transparent_hugepage/shmem_enabled"),
		StateDir:       tr.path("var/lib/kiln"),
		KernelCache:    tr.path("cache"),
		Agent:          tr.path("bin/kiln-agent"),
		VMM:            tr.path("bin/kiln-vmm"),
		Network:        true,
		Statfs:         fakeStatfs(cgroup2Magic, 100<<30),
		ProbeKVM:       func(string) error { return nil },
		ListTables:     func() (int, error) { return 2, nil },
		UnshareNet:     func() error { return nil },
		ProbeVerity:    func(string) error { return nil },
	}
}

// fakeStatfs answers statfs with a file system type for paths with
// "cgroup" in them and free bytes for the others.
func fakeStatfs(cgroupType int64, free uint64) func(string, *unix.Statfs_t) error {
	return func(p string, st *unix.Statfs_t) error {
		if _, err := os.Stat(p); err != nil {
			return err
		}
		*st = unix.Statfs_t{Type: 0xef53, Bsize: 4096, Bavail: free / 4096}
		if strings.Contains(p, "cgroup") {
			st.Type = cgroupType
			if strings.HasSuffix(p, "unified") {
				st.Type = cgroup2Magic
			}
		}
		return nil
	}
}

func TestChecks(t *testing.T) {
	tests := []struct {
		name   string
		check  string
		modify func(tr *tree, h *Host)
		want   Status
		detail string // in Detail
		hint   string // in Hint
		notReq bool   // the result is not required
	}{
		{name: "kvm ok", check: "kvm", want: OK, detail: "hardware virtualization"},
		{name: "no kvm", check: "kvm", modify: func(tr *tree, h *Host) { h.ProbeKVM = probeKVM }, want: Fail, detail: "no such file", hint: "modprobe"},
		{name: "kvm not a device", check: "kvm", modify: func(tr *tree, h *Host) {
			tr.write("dev/kvm", "", 0o600)
			h.ProbeKVM = probeKVM
		}, want: Fail, detail: "KVM_GET_API_VERSION", hint: "not a working KVM"},
		{name: "kvm refused", check: "kvm", modify: func(tr *tree, h *Host) {
			h.ProbeKVM = func(p string) error { return &fs.PathError{Op: "open", Path: p, Err: fs.ErrPermission} }
		}, want: Fail, hint: "kvm group"},
		{name: "paravirtual kvm", check: "kvm", modify: func(tr *tree, h *Host) {
			tr.write("proc/cpuinfo", "flags\t\t: fpu vme sse hypervisor\n", 0o644)
			os.MkdirAll(tr.path("sys/module/kvm_pvm"), 0o755)
		}, want: Fail, detail: "paravirtual KVM (kvm_pvm)", hint: "nested"},
		{name: "svm is hardware too", check: "kvm", modify: func(tr *tree, h *Host) {
			tr.write("proc/cpuinfo", "flags\t\t: fpu svm\n", 0o644)
		}, want: OK},

		{name: "cgroup2", check: "cgroup2", want: OK, detail: "is cgroup2"},
		{name: "cgroup v1 hybrid", check: "cgroup2", modify: func(tr *tree, h *Host) {
			os.MkdirAll(tr.path("sys/fs/cgroup/unified"), 0o755)
			h.Statfs = fakeStatfs(tmpfsMagic, 100<<30)
		}, want: Fail, detail: "cgroup v1 hybrid", hint: "unified_cgroup_hierarchy"},
		{name: "cgroup v1 with cgroups off", check: "cgroup2", modify: func(tr *tree, h *Host) {
			h.Statfs = fakeStatfs(tmpfsMagic, 100<<30)
			h.CgroupRoot = "none"
		}, want: Warn, detail: "tmpfs", notReq: true},

		{name: "own cgroup delegated", check: "cgroup-delegation", want: OK, detail: "session-1.scope (this process's"},
		{name: "kilnd.service's cgroup first", check: "cgroup-delegation", modify: func(tr *tree, h *Host) {
			cg := "sys/fs/cgroup/system.slice/kilnd.service/"
			tr.write(cg+"cgroup.controllers", "cpu io memory pids\n", 0o444)
			tr.write(cg+"cgroup.subtree_control", "", 0o644)
			tr.write(cg+"cgroup.procs", "", 0o644)
		}, want: OK, detail: "kilnd.service (kilnd.service's)"},
		{name: "cgroup-root given", check: "cgroup-delegation", modify: func(tr *tree, h *Host) {
			h.CgroupRoot = filepath.Dir(tr.write("sys/fs/cgroup/kiln.slice/cgroup.controllers", "memory pids\n", 0o444))
			tr.write("sys/fs/cgroup/kiln.slice/cgroup.subtree_control", "", 0o644)
			tr.write("sys/fs/cgroup/kiln.slice/cgroup.procs", "", 0o644)
		}, want: Warn, detail: "missing cpu io", hint: "subtree_control"},
		{name: "no memory controller", check: "cgroup-delegation", modify: func(tr *tree, h *Host) {
			tr.write("sys/fs/cgroup/user.slice/user-0.slice/session-1.scope/cgroup.controllers", "cpu pids io\n", 0o444)
		}, want: Fail, detail: "missing memory", hint: "memory controller"},
		{name: "not delegated", check: "cgroup-delegation", modify: func(tr *tree, h *Host) {
			os.Remove(tr.path("sys/fs/cgroup/user.slice/user-0.slice/session-1.scope/cgroup.subtree_control"))
		}, want: Fail, detail: "cannot write cgroup.subtree_control", hint: "Delegate=yes"},
		{name: "cgroup v1 process", check: "cgroup-delegation", modify: func(tr *tree, h *Host) {
			tr.write("proc/self/cgroup", "4:memory:/x\n1:cpu:/\n", 0o644)
		}, want: Fail, detail: "no cgroup v2 entry"},
		{name: "cgroups off", check: "cgroup-delegation", modify: func(tr *tree, h *Host) { h.CgroupRoot = "none" }, want: Warn, notReq: true},

		{name: "nftables", check: "nftables", want: OK, detail: "2 tables"},
		{name: "nftables refused", check: "nftables", modify: func(tr *tree, h *Host) {
			h.ListTables = func() (int, error) { return 0, fmt.Errorf("netlink: %w", unix.EPERM) }
		}, want: Fail, hint: "CAP_NET_ADMIN"},
		{name: "no nf_tables", check: "nftables", modify: func(tr *tree, h *Host) {
			h.ListTables = func() (int, error) { return 0, unix.EPROTONOSUPPORT }
		}, want: Fail, hint: "modprobe nf_tables"},
		{name: "no nf_tables, no network", check: "nftables", modify: func(tr *tree, h *Host) {
			h.ListTables = func() (int, error) { return 0, unix.EPROTONOSUPPORT }
			h.Network = false
		}, want: Warn, detail: "only with --net-pool", notReq: true},

		{name: "tun", check: "tun", want: OK},
		{name: "no tun", check: "tun", modify: func(tr *tree, h *Host) { os.Remove(h.Tun) }, want: Fail, hint: "modprobe tun"},

		{name: "netns", check: "netns", want: OK},
		{name: "no CAP_NET_ADMIN", check: "netns", modify: func(tr *tree, h *Host) {
			tr.write("proc/self/status", "CapEff:\t0000000000000000\n", 0o644)
		}, want: Fail, detail: "no CAP_NET_ADMIN", hint: "root"},
		{name: "bad CapEff", check: "netns", modify: func(tr *tree, h *Host) {
			tr.write("proc/self/status", "CapEff:\tzz\n", 0o644)
		}, want: Fail, detail: "CapEff"},
		{name: "unshare refused", check: "netns", modify: func(tr *tree, h *Host) {
			h.UnshareNet = func() error { return unix.EPERM }
		}, want: Fail, hint: "refused"},
		{name: "no netns", check: "netns", modify: func(tr *tree, h *Host) { os.Remove(h.NetNS) }, want: Fail, hint: "CONFIG_NET_NS"},

		{name: "forwarding on", check: "ip-forward", want: OK, detail: "on", notReq: true},
		{name: "forwarding off", check: "ip-forward", modify: func(tr *tree, h *Host) {
			tr.write("proc/sys/net/ipv4/ip_forward", "0\n", 0o644)
		}, want: Warn, hint: "sysctl", notReq: true},

		{name: "shmem huge pages advised", check: "guest-ram-hugepages", want: OK, detail: "shmem advise", notReq: true},
		{name: "shmem huge pages always", check: "guest-ram-hugepages", modify: func(tr *tree, h *Host) {
			tr.write("sys/kernel/mm/transparent_hugepage/shmem_enabled", "[always] within_size advise never deny force\n", 0o644)
		}, want: OK, detail: "shmem always", notReq: true},
		{name: "shmem huge pages never", check: "guest-ram-hugepages", modify: func(tr *tree, h *Host) {
			tr.write("sys/kernel/mm/transparent_hugepage/shmem_enabled", "always within_size advise [never] deny force\n", 0o644)
		}, want: Warn, detail: "4 KiB pages", hint: "echo advise", notReq: true},
		{name: "shmem huge pages denied", check: "guest-ram-hugepages", modify: func(tr *tree, h *Host) {
			tr.write("sys/kernel/mm/transparent_hugepage/shmem_enabled", "always within_size advise never [deny] force\n", 0o644)
		}, want: Warn, detail: "shmem deny", hint: "tmpfiles.d", notReq: true},
		{name: "no transparent huge pages", check: "guest-ram-hugepages", modify: func(tr *tree, h *Host) { os.Remove(h.ShmemTHP) }, want: Warn, hint: "CONFIG_TRANSPARENT_HUGEPAGE", notReq: true},
		{name: "shmem huge pages unreadable form", check: "guest-ram-hugepages", modify: func(tr *tree, h *Host) {
			tr.write("sys/kernel/mm/transparent_hugepage/shmem_enabled", "advise\n", 0o644)
		}, want: Warn, detail: "holds", notReq: true},

		{name: "disk", check: "disk", want: OK, detail: "not made yet"},
		{name: "verity, no state folder yet", check: "snapshot-verity", want: OK, detail: "not made yet", notReq: true},
		{name: "verity", check: "snapshot-verity", modify: func(tr *tree, h *Host) { os.MkdirAll(h.StateDir, 0o700) }, want: OK, detail: "first restores map", notReq: true},
		{name: "no verity", check: "snapshot-verity", modify: func(tr *tree, h *Host) {
			os.MkdirAll(h.StateDir, 0o700)
			h.ProbeVerity = func(string) error { return fmt.Errorf("x: %w", fsverity.ErrUnsupported) }
		}, want: Warn, detail: "copies and hashes", hint: "tune2fs -O verity", notReq: true},
		{name: "disk low", check: "disk", modify: func(tr *tree, h *Host) { h.Statfs = fakeStatfs(cgroup2Magic, 5<<30) }, want: Warn, detail: "5.0 GiB free, under 10.0 GiB"},
		{name: "disk full", check: "disk", modify: func(tr *tree, h *Host) { h.Statfs = fakeStatfs(cgroup2Magic, 100<<20) }, want: Fail, detail: "0.1 GiB free"},

		{name: "kernel", check: "guest-kernel", want: OK, detail: "6.1.0-57-amd64"},
		{name: "no kernel", check: "guest-kernel", modify: func(tr *tree, h *Host) { os.Remove(tr.path("cache/kernel/current")) }, want: Fail, hint: "make kernel"},
		{name: "no vmlinux", check: "guest-kernel", modify: func(tr *tree, h *Host) { os.Remove(tr.path("cache/kernel/6.1.0-57-amd64/vmlinux")) }, want: OK, detail: "no vmlinux"},

		{name: "agent", check: "agent", want: OK},
		{name: "no agent", check: "agent", modify: func(tr *tree, h *Host) { os.Remove(h.Agent) }, want: Fail, hint: "make"},
		{name: "agent not executable", check: "agent", modify: func(tr *tree, h *Host) { os.Chmod(h.Agent, 0o644) }, want: Fail, hint: "chmod"},
		{name: "agent not ELF", check: "agent", modify: func(tr *tree, h *Host) { tr.write("bin/kiln-agent", "#!/bin/sh\n", 0o755) }, want: Fail, detail: "not an ELF"},

		{name: "vmm", check: "vmm", want: OK, detail: "bin/kiln-vmm"},
		{name: "no vmm", check: "vmm", modify: func(tr *tree, h *Host) { os.Remove(h.VMM) }, want: Fail, hint: "make build (bin/kiln-vmm)"},
		{name: "vmm not executable", check: "vmm", modify: func(tr *tree, h *Host) { os.Chmod(h.VMM, 0o644) }, want: Fail, hint: "chmod"},
		{name: "vmm not ELF", check: "vmm", modify: func(tr *tree, h *Host) { tr.write("bin/kiln-vmm", "#!/bin/sh\n", 0o755) }, want: Fail, hint: "./cmd/kiln-vmm"},
		{name: "vmm not found", check: "vmm", modify: func(tr *tree, h *Host) {
			h.VMM = ""
			tr.t.Setenv(sandbox.VMMEnv, tr.path("none"))
		}, want: Fail, detail: "$KILN_VMM", hint: "--vmm"},
	}
	checks := map[string]Check{}
	for _, c := range Checks() {
		checks[c.Name] = c
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tr := newTree(t)
			h := tr.host()
			if tt.modify != nil {
				tt.modify(tr, h)
			}
			c, ok := checks[tt.check]
			if !ok {
				t.Fatalf("no check %q", tt.check)
			}
			r := c.Run(context.Background(), h)
			if r.Status != tt.want || !strings.Contains(r.Detail, tt.detail) || !strings.Contains(r.Hint, tt.hint) {
				t.Errorf("%s: %+v; want %s, detail with %q, hint with %q", tt.check, r, tt.want, tt.detail, tt.hint)
			}
			if r.Status != OK && r.Hint == "" && r.Status != Warn {
				t.Errorf("%s failed without a hint: %+v", tt.check, r)
			}
			if r.Required == tt.notReq {
				t.Errorf("%s: required %v; want %v", tt.check, r.Required, !tt.notReq)
			}
		})
	}
}

// TestRun: a healthy fake host passes every check; one required failure
// fails the run, a warning does not.
func TestRun(t *testing.T) {
	tr := newTree(t)
	h := tr.host()
	rs := h.Run(context.Background())
	if len(rs) != len(Checks()) {
		t.Fatalf("%d results for %d checks", len(rs), len(Checks()))
	}
	for _, r := range rs {
		if r.Status != OK {
			t.Errorf("healthy host: %+v", r)
		}
	}
	if Failed(rs) {
		t.Error("a healthy host failed")
	}
	tr.write("proc/sys/net/ipv4/ip_forward", "0\n", 0o644)
	if rs := h.Run(context.Background()); Failed(rs) {
		t.Error("forwarding off failed the run; it is a warning")
	}
	h.ListTables = func() (int, error) { return 0, errors.New("no netlink") }
	if rs := h.Run(context.Background()); !Failed(rs) {
		t.Error("nftables failing did not fail the run")
	}
	b, err := json.Marshal(rs[0])
	if err != nil || !strings.Contains(string(b), `"status":"ok"`) {
		t.Errorf("JSON %s, %v", b, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if rs := h.Run(ctx); !Failed(rs) || !strings.Contains(rs[0].Detail, "not run") {
		t.Errorf("a cancelled run: %+v", rs)
	}
}

func TestParseProcCgroup(t *testing.T) {
	tests := []struct {
		in, want, wantErr string
	}{
		{in: "0::/\n", want: "/"},
		{in: "0::/system.slice/kilnd.service\n", want: "/system.slice/kilnd.service"},
		{in: "12:memory:/x\n0::/user.slice/user-0.slice/session-1.scope\n", want: "/user.slice/user-0.slice/session-1.scope"},
		{in: "4:memory:/x\n", wantErr: "no cgroup v2"},
		{in: "0::relative\n", wantErr: "not absolute"},
		{in: "0::/a/../../etc\n", wantErr: "not clean"},
		{in: "0::/gone (deleted)\n", wantErr: "deleted"},
		{in: "", wantErr: "no cgroup v2"},
	}
	for _, tt := range tests {
		got, err := ParseProcCgroup(strings.NewReader(tt.in))
		if tt.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("ParseProcCgroup(%q) = %q, %v; want an error with %q", tt.in, got, err, tt.wantErr)
			}
			continue
		}
		if err != nil || got != tt.want {
			t.Errorf("ParseProcCgroup(%q) = %q, %v; want %q", tt.in, got, err, tt.want)
		}
	}
}

func FuzzParseProcCgroup(f *testing.F) {
	for _, s := range []string{"0::/\n", "0::/a/b\n1:cpu:/\n", "0::../x", "0::/a//b", "0::/x (deleted)"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		p, err := ParseProcCgroup(strings.NewReader(s))
		if err != nil {
			return
		}
		// What parses is absolute and clean: joined under the mount it
		// stays under it.
		if !filepath.IsAbs(p) || filepath.Clean(p) != p {
			t.Fatalf("ParseProcCgroup(%q) = %q", s, p)
		}
		if j := filepath.Join("/sys/fs/cgroup", p); !strings.HasPrefix(j, "/sys/fs/cgroup") {
			t.Fatalf("ParseProcCgroup(%q) = %q escapes the mount: %s", s, p, j)
		}
	})
}

// TestThisHost runs every check on this host: each names what it found,
// and a failure comes with a hint.
func TestThisHost(t *testing.T) {
	h := Default()
	h.StateDir = t.TempDir()
	for _, r := range h.Run(context.Background()) {
		t.Logf("%-4s %-18s %s", r.Status, r.Name, r.Detail)
		if r.Detail == "" {
			t.Errorf("%s: no detail", r.Name)
		}
		if r.Status == Fail && r.Hint == "" && r.Name != "disk" {
			t.Errorf("%s failed without a hint: %+v", r.Name, r)
		}
	}
}
