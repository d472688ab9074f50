package modprobe

import (
	"bytes"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/guestkernel"
)

// fakeTree is a depmod'd modules tree in the layout of Debian's 6.1: each
// module file holds its own name, so the fake kernel knows what it loads.
var fakeTree = map[string]string{
	"modules.dep": `kernel/drivers/net/veth.ko:
kernel/net/bridge/bridge.ko: kernel/net/802/stp.ko kernel/net/llc/llc.ko
kernel/net/802/stp.ko: kernel/net/llc/llc.ko
kernel/net/llc/llc.ko:
kernel/net/netfilter/nf_tables.ko: kernel/net/netfilter/nfnetlink.ko kernel/lib/libcrc32c.ko
kernel/net/netfilter/nfnetlink.ko:
kernel/net/netfilter/nf_conntrack.ko: kernel/lib/libcrc32c.ko
kernel/lib/libcrc32c.ko:
kernel/crypto/crc32c_generic.ko:
kernel/fs/overlayfs/overlay.ko:
kernel/drivers/usb/storage/uas.ko: kernel/drivers/usb/storage/usb-storage.ko
kernel/drivers/usb/storage/usb-storage.ko:
kernel/x/cyc_a.ko: kernel/x/cyc_b.ko
kernel/x/cyc_b.ko: kernel/x/cyc_a.ko
kernel/x/orphan.ko: kernel/x/gone.ko
kernel/x/soft_a.ko:
kernel/x/soft_b.ko:
kernel/x/gzipped.ko.gz:
kernel/x/xzed.ko.xz:
kernel/x/zstded.ko.zst:
kernel/x/fifo.ko:
`,
	"modules.alias": `# Aliases extracted from modules themselves.
alias rtnl-link-veth veth
alias rtnl-link-bridge bridge
alias fs-overlay overlay
alias net-pf-16-proto-12 nfnetlink
alias nfnetlink-subsys-10 nf_tables
alias crypto-crc32c crc32c_generic
alias usb:v13FDp3940d0[0-2]*dc*dsc*dp*ic*isc*ip*in* uas
alias usb:v13FDp3940d0[0-2]*dc*dsc*dp*ic*isc*ip*in* usb_storage
alias stale-alias not_in_dep
this line is malformed
alias
`,
	"modules.symbols":         "alias symbol:nf_conntrack_in nf_conntrack\n",
	"modules.builtin":         "kernel/fs/ext4/ext4.ko\nkernel/net/unix/unix.ko\n",
	"modules.builtin.modinfo": "ext4.alias=fs-ext4\x00ext4.alias=ext3\x00ext4.license=GPL\x00unix.alias=net-pf-1\x00",
	"modules.softdep": `# Soft dependencies extracted from modules themselves.
softdep nf_tables pre: crypto-crc32c
softdep soft_a pre: soft_b post: veth
softdep soft_b pre: soft_a
softdep overlay pre: no-such-module
`,
}

// writeTree writes files (and a module file for each modules.dep entry)
// under a fresh folder and returns it.
func writeTree(t *testing.T, files map[string]string) string {
	t.Helper()
	dir := t.TempDir()
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for line := range strings.SplitSeq(files["modules.dep"], "\n") {
		path, _, ok := strings.Cut(line, ":")
		if !ok || strings.HasPrefix(path, "/") || !strings.Contains(path, ".ko") {
			continue
		}
		p := filepath.Join(dir, path)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		name := filepath.Base(path)
		name = strings.ReplaceAll(name[:strings.Index(name, ".ko")], "-", "_")
		switch {
		case strings.HasSuffix(p, "fifo.ko"):
			if err := unix.Mkfifo(p, 0o644); err != nil {
				t.Fatal(err)
			}
			continue
		case strings.HasSuffix(p, ".gz"):
			var b bytes.Buffer
			zw := gzip.NewWriter(&b)
			zw.Write([]byte(name))
			zw.Close()
			name = b.String()
		}
		if err := os.WriteFile(p, []byte(name), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// fakeKernel loads fake modules: it records each load as "NAME" (a plain
// finit_module), "NAME+c" (finit_module of a compressed file) or
// "NAME(init)" (init_module), with " PARAMS" when there are any, and
// lists the module in its /sys/module.
type fakeKernel struct {
	sys        string
	loads      []string
	errs       map[string]error // module -> what loading it returns
	decompress bool             // the kernel decompresses modules
}

func (k *fakeKernel) kernel() Kernel {
	return Kernel{
		FinitModule: func(f *os.File, params string, flags int) error {
			if flags&^unix.MODULE_INIT_COMPRESSED_FILE != 0 {
				return unix.EINVAL
			}
			name := strings.TrimSuffix(filepath.Base(f.Name()), filepath.Ext(f.Name()))
			if flags != 0 {
				if !k.decompress {
					return unix.EOPNOTSUPP
				}
				name = strings.TrimSuffix(name, ".ko") + "+c"
			} else {
				b, err := io.ReadAll(f)
				if err != nil {
					return err
				}
				name = string(b)
			}
			return k.load(name, strings.TrimSuffix(name, "+c"), params)
		},
		InitModule: func(image []byte, params string) error {
			return k.load(string(image)+"(init)", string(image), params)
		},
	}
}

func (k *fakeKernel) load(what, mod, params string) error {
	if params != "" {
		what += " " + params
	}
	k.loads = append(k.loads, what)
	if err := k.errs[mod]; err != nil {
		return err
	}
	return os.MkdirAll(filepath.Join(k.sys, mod), 0o755)
}

func TestLoad(t *testing.T) {
	tests := []struct {
		name       string
		load       string
		params     string
		loaded     []string // in /sys/module before
		errs       map[string]error
		decompress bool
		want       []string
		wantErr    string
		notFound   bool
	}{
		{name: "module", load: "veth", want: []string{"veth"}},
		{name: "alias", load: "rtnl-link-veth", want: []string{"veth"}},
		{name: "alias spelled with underscores", load: "fs_overlay", want: []string{"overlay"}},
		{name: "alias, dependency chain", load: "rtnl-link-bridge", want: []string{"llc", "stp", "bridge"}},
		{name: "dash for underscore", load: "usb-storage", want: []string{"usb_storage"}},
		{name: "dependencies and a soft dependency first", load: "nfnetlink-subsys-10",
			want: []string{"crc32c_generic", "nfnetlink", "libcrc32c", "nf_tables"}},
		{name: "a failed soft dependency is no failure", load: "overlay", want: []string{"overlay"}},
		{name: "soft dependency cycle", load: "soft_a", want: []string{"soft_b", "soft_a"}},
		{name: "glob with a bracket range, every match", load: "usb:v13FDp3940d01dc00dsc00dp00ic08isc06ip50in00",
			want: []string{"usb_storage", "uas"}},
		{name: "glob outside the range", load: "usb:v13FDp3940d05dc00dsc00dp00ic08isc06ip50in00", notFound: true},
		{name: "symbol", load: "symbol:nf_conntrack_in", want: []string{"libcrc32c", "nf_conntrack"}},
		{name: "already loaded", load: "veth", loaded: []string{"veth"}},
		{name: "alias of a loaded module", load: "rtnl-link-veth", loaded: []string{"veth"}},
		{name: "dependency already loaded", load: "bridge", loaded: []string{"llc"}, want: []string{"stp", "bridge"}},
		{name: "built in", load: "ext4"},
		{name: "alias of a built-in module", load: "fs-ext4"},
		{name: "builtin alias glob", load: "net-pf-1"},
		{name: "missing", load: "no-such-module", notFound: true, wantErr: "kernel module not found: no-such-module in "},
		{name: "alias of a module not in modules.dep", load: "stale-alias", notFound: true, wantErr: "not_in_dep (named by an alias)"},
		{name: "missing dependency", load: "orphan", notFound: true, wantErr: "module orphan not loaded: kernel module not found: gone (needed by orphan)"},
		{name: "dependency cycle", load: "cyc_a", wantErr: "dependency cycle"},
		{name: "loaded meanwhile (EEXIST)", load: "bridge", errs: map[string]error{"stp": unix.EEXIST}, want: []string{"llc", "stp", "bridge"}},
		{name: "a dependency fails", load: "bridge", errs: map[string]error{"llc": unix.ENOEXEC},
			want: []string{"llc"}, wantErr: "module bridge not loaded: module stp not loaded: loading module llc: exec format error"},
		{name: "params go to the module named", load: "bridge", params: "a=1 b=2", want: []string{"llc", "stp", "bridge a=1 b=2"}},
		{name: "compressed, the kernel decompresses", load: "gzipped", decompress: true, want: []string{"gzipped+c"}},
		{name: "gzip, decompressed here", load: "gzipped", params: "x=y", want: []string{"gzipped(init) x=y"}},
		{name: "xz the kernel cannot decompress", load: "xzed", wantErr: "the kernel cannot decompress it"},
		{name: "zstd, the kernel decompresses", load: "zstded", decompress: true, want: []string{"zstded+c"}},
		{name: "a FIFO, not a module file", load: "fifo", wantErr: "not a regular file"},
		{name: "NUL in the name", load: "veth\x00", wantErr: "no NUL"},
		{name: "empty name", load: "", wantErr: "want 1 to"},
		{name: "a path is no module", load: "../../../etc/passwd", notFound: true},
	}
	dir := writeTree(t, fakeTree)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			k := &fakeKernel{sys: t.TempDir(), errs: tt.errs, decompress: tt.decompress}
			for _, l := range tt.loaded {
				if err := os.Mkdir(filepath.Join(k.sys, l), 0o755); err != nil {
					t.Fatal(err)
				}
			}
			m := &Modprobe{Dir: dir, SysModule: k.sys, Kernel: k.kernel()}
			err := m.Load(tt.load, tt.params)
			switch {
			case tt.wantErr == "" && !tt.notFound && err != nil:
				t.Fatalf("Load(%q): %v", tt.load, err)
			case (tt.wantErr != "" || tt.notFound) && err == nil:
				t.Fatalf("Load(%q) succeeded, want an error", tt.load)
			case err != nil && !strings.Contains(err.Error(), tt.wantErr):
				t.Errorf("Load(%q) = %v, want %q", tt.load, err, tt.wantErr)
			}
			if got := errors.Is(err, ErrNotFound); got != tt.notFound {
				t.Errorf("Load(%q) = %v: errors.Is(ErrNotFound) = %v, want %v", tt.load, err, got, tt.notFound)
			}
			if !slices.Equal(k.loads, tt.want) {
				t.Errorf("Load(%q) loaded %q, want %q", tt.load, k.loads, tt.want)
			}
		})
	}
}

// TestLoadOncePerRun: one Modprobe loading several names loads a shared
// dependency once, and a failed one is not tried again.
func TestLoadOncePerRun(t *testing.T) {
	dir := writeTree(t, fakeTree)
	k := &fakeKernel{sys: t.TempDir()}
	m := &Modprobe{Dir: dir, SysModule: k.sys, Kernel: k.kernel()}
	for _, n := range []string{"nf_conntrack", "nf_tables"} {
		if err := m.Load(n, ""); err != nil {
			t.Fatal(err)
		}
	}
	if want := []string{"libcrc32c", "nf_conntrack", "crc32c_generic", "nfnetlink", "nf_tables"}; !slices.Equal(k.loads, want) {
		t.Errorf("loaded %q, want %q", k.loads, want)
	}

	k = &fakeKernel{sys: t.TempDir(), errs: map[string]error{"llc": unix.EPERM}}
	m = &Modprobe{Dir: dir, SysModule: k.sys, Kernel: k.kernel()}
	for _, n := range []string{"bridge", "stp"} {
		if err := m.Load(n, ""); !errors.Is(err, unix.EPERM) {
			t.Errorf("Load(%s) = %v, want EPERM", n, err)
		}
	}
	if want := []string{"llc"}; !slices.Equal(k.loads, want) {
		t.Errorf("loaded %q, want %q", k.loads, want)
	}
}

// TestLoadBrokenTree: a tree without modules.dep, with a bad one, or with
// an index file too big fails with an error that says so, loading
// nothing; a tree of too many modules stops at MaxModules.
func TestLoadBrokenTree(t *testing.T) {
	without := func(name string) map[string]string {
		files := map[string]string{}
		for k, v := range fakeTree {
			if k != name {
				files[k] = v
			}
		}
		return files
	}
	var chain strings.Builder
	for i := range MaxModules + 1 {
		fmt.Fprintf(&chain, "kernel/m%d.ko: kernel/m%d.ko\n", i, i+1)
	}
	fmt.Fprintf(&chain, "kernel/m%d.ko:\n", MaxModules+1)
	tests := []struct {
		name    string
		files   map[string]string
		big     string // an index file made bigger than MaxIndexBytes
		load    string
		wantErr string
	}{
		{name: "no modules.dep", files: without("modules.dep"), load: "veth", wantErr: "has no modules.dep"},
		{name: "no modules.dep, built in", files: without("modules.dep"), load: "fs-ext4"},
		{name: "no modules.alias", files: without("modules.alias"), load: "rtnl-link-veth", wantErr: "not found"},
		{name: "no modules.alias, a module", files: without("modules.alias"), load: "veth"},
		{name: "bad modules.dep", files: map[string]string{"modules.dep": "/etc/passwd: x.ko\n"}, load: "veth", wantErr: "modules.dep: line 1"},
		{name: "modules.dep too big", files: fakeTree, big: "modules.dep", load: "veth", wantErr: "more than the"},
		{name: "modules.alias too big", files: fakeTree, big: "modules.alias", load: "fs-overlay", wantErr: "more than the"},
		{name: "too many modules", files: map[string]string{"modules.dep": chain.String()}, load: "m0", wantErr: fmt.Sprintf("more than %d modules", MaxModules)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := writeTree(t, tt.files)
			if tt.big != "" {
				if err := os.Truncate(filepath.Join(dir, tt.big), MaxIndexBytes+1); err != nil {
					t.Fatal(err)
				}
			}
			k := &fakeKernel{sys: t.TempDir()}
			m := &Modprobe{Dir: dir, SysModule: k.sys, Kernel: k.kernel()}
			err := m.Load(tt.load, "")
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("Load(%q): %v", tt.load, err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("Load(%q) = %v, want %q", tt.load, err, tt.wantErr)
			}
			if len(k.loads) != 0 {
				t.Errorf("loaded %q from a broken tree", k.loads)
			}
		})
	}
}

func TestMain(t *testing.T) {
	dir := writeTree(t, fakeTree)
	tests := []struct {
		name       string
		args       []string
		loaded     []string
		want       []string
		wantStatus int
		wantOut    string
		wantErr    string // in stderr; "" for none
	}{
		{name: "the kernel's call", args: []string{"-q", "--", "rtnl-link-veth"}, want: []string{"veth"}},
		{name: "several names", args: []string{"-b", "veth", "fs-overlay"}, want: []string{"veth", "overlay"}},
		{name: "-a", args: []string{"-a", "veth", "llc"}, want: []string{"veth", "llc"}},
		{name: "combined flags", args: []string{"-qb", "veth"}, want: []string{"veth"}},
		{name: "parameters", args: []string{"bridge", "a=1", "b=2"}, want: []string{"llc", "stp", "bridge a=1 b=2"}},
		{name: "option after --", args: []string{"--", "-v"}, wantStatus: 1, wantErr: "not found: -v"},
		{name: "not found", args: []string{"nope"}, wantStatus: 1, wantErr: "modprobe: kernel module not found: nope in " + dir},
		{name: "not found, quiet", args: []string{"-q", "nope"}, wantStatus: 1},
		{name: "one of two not found", args: []string{"nope", "veth"}, want: []string{"veth"}, wantStatus: 1, wantErr: "not found: nope"},
		{name: "loaded already", args: []string{"veth"}, loaded: []string{"veth"}},
		{name: "built in", args: []string{"-q", "fs-ext4"}},
		{name: "show depends", args: []string{"-D", "rtnl-link-bridge"}, wantOut: "insmod " + dir + "/kernel/net/llc/llc.ko\ninsmod " +
			dir + "/kernel/net/802/stp.ko\ninsmod " + dir + "/kernel/net/bridge/bridge.ko\n"},
		{name: "show depends, built in", args: []string{"--show-depends", "ext3"}, wantOut: "builtin ext3\n"},
		{name: "dry run", args: []string{"-n", "bridge"}},
		{name: "verbose", args: []string{"-v", "veth"}, want: []string{"veth"}, wantOut: "insmod " + dir + "/kernel/drivers/net/veth.ko\n", wantErr: "loaded module"},
		{name: "no name", args: []string{"-q"}, wantStatus: 1, wantErr: "no module named"},
		{name: "unknown option", args: []string{"-r", "veth"}, wantStatus: 1, wantErr: "unknown option -r"},
		{name: "unknown long option", args: []string{"--remove", "veth"}, wantStatus: 1, wantErr: "unknown option --remove"},
		{name: "parameters with two names", args: []string{"veth", "llc", "a=1"}, wantStatus: 1, wantErr: "give parameters with one"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			k := &fakeKernel{sys: t.TempDir()}
			for _, l := range tt.loaded {
				if err := os.Mkdir(filepath.Join(k.sys, l), 0o755); err != nil {
					t.Fatal(err)
				}
			}
			m := &Modprobe{Dir: dir, SysModule: k.sys, Kernel: k.kernel()}
			var stdout, stderr bytes.Buffer
			status := m.Main(tt.args, &stdout, &stderr)
			if status != tt.wantStatus {
				t.Errorf("status %d, want %d; stderr %q", status, tt.wantStatus, stderr.String())
			}
			if !slices.Equal(k.loads, tt.want) {
				t.Errorf("loaded %q, want %q", k.loads, tt.want)
			}
			if stdout.String() != tt.wantOut {
				t.Errorf("stdout %q, want %q", stdout.String(), tt.wantOut)
			}
			if tt.wantErr == "" && stderr.Len() > 0 || !strings.Contains(stderr.String(), tt.wantErr) {
				t.Errorf("stderr %q, want %q", stderr.String(), tt.wantErr)
			}
		})
	}
}

func TestFirstTree(t *testing.T) {
	root := t.TempDir()
	lib, run, none := filepath.Join(root, "lib"), filepath.Join(root, "run"), filepath.Join(root, "none")
	for _, d := range []string{lib, run} {
		if err := os.MkdirAll(filepath.Join(d, "modules.dep"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if got := firstTree(lib, run); got != lib {
		t.Errorf("modules.dep a folder in both: %s, want the first", got)
	}
	if err := os.WriteFile(filepath.Join(root, "run.dep"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	os.Remove(filepath.Join(run, "modules.dep"))
	if err := os.Rename(filepath.Join(root, "run.dep"), filepath.Join(run, "modules.dep")); err != nil {
		t.Fatal(err)
	}
	if got := firstTree(none, lib, run); got != run {
		t.Errorf("firstTree = %s, want %s, the one with a modules.dep file", got, run)
	}
	if got := firstTree(none, lib); got != none {
		t.Errorf("firstTree without any = %s, want the first", got)
	}
}

func TestIsInvokedAs(t *testing.T) {
	for _, tt := range []struct {
		args []string
		want bool
	}{
		{[]string{"/run/kiln/modprobe", "-q", "--", "fs-overlay"}, true},
		{[]string{"modprobe"}, true},
		{[]string{"/init"}, false},
		{[]string{"/usr/lib/kiln/kiln-agent", "--service"}, false},
		{[]string{"/sbin/modprobe.real"}, false},
		{nil, false},
	} {
		if got := IsInvokedAs(tt.args); got != tt.want {
			t.Errorf("IsInvokedAs(%q) = %v, want %v", tt.args, got, tt.want)
		}
	}
}

// TestDebianTree resolves the autoloading requests of the KVM test
// (TestKVMModuleAutoload) against the cached Debian kernel's real tree
// (make kernel), loading nothing: each alias names the module it should,
// after the modules it needs.
func TestDebianTree(t *testing.T) {
	k, err := guestkernel.Find()
	if err != nil {
		t.Skipf("no cached kernel (make kernel): %v", err)
	}
	tests := []struct {
		name string
		want []string // base names of the files, in load order
	}{
		{"rtnl-link-veth", []string{"veth.ko"}},
		{"rtnl-link-bridge", []string{"llc.ko", "stp.ko", "bridge.ko"}},
		{"fs-overlay", []string{"overlay.ko"}},
		{"net-pf-16-proto-12", []string{"nfnetlink.ko"}},
		// libcrc32c's soft dependency "pre: crc32c" is an alias of two.
		{"nfnetlink-subsys-10", []string{"nfnetlink.ko", "crc32c-intel.ko", "crc32c_generic.ko", "libcrc32c.ko", "nf_tables.ko"}},
		{"nft-chain-2-nat", nil}, // checked below: ends with nft_chain_nat.ko
		{"net-pf-38", []string{"af_alg.ko"}},
		{"algif-hash", []string{"af_alg.ko", "algif_hash.ko"}},
		{"fs-ext4", nil}, // built in? then nothing; else ext4 last
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var got []string
			m := &Modprobe{Dir: k.ModulesDir, SysModule: t.TempDir(), DryRun: true, Kernel: Kernel{
				FinitModule: func(*os.File, string, int) error { return errors.New("loaded in a dry run") },
				InitModule:  func([]byte, string) error { return errors.New("loaded in a dry run") },
			}, Report: func(line string) {
				if p, ok := strings.CutPrefix(line, "insmod "); ok {
					got = append(got, filepath.Base(p))
				}
			}}
			if err := m.Load(tt.name, ""); err != nil {
				t.Fatal(err)
			}
			switch tt.name {
			case "nft-chain-2-nat":
				if len(got) < 2 || got[len(got)-1] != "nft_chain_nat.ko" || !slices.Contains(got, "nf_tables.ko") || !slices.Contains(got, "nf_nat.ko") {
					t.Errorf("%s: %q, want nf_tables, nf_nat ... nft_chain_nat", tt.name, got)
				}
			case "fs-ext4":
				if len(got) > 0 && got[len(got)-1] != "ext4.ko" {
					t.Errorf("%s: %q", tt.name, got)
				}
			default:
				if !slices.Equal(got, tt.want) {
					t.Errorf("%s: %q, want %q", tt.name, got, tt.want)
				}
			}
			t.Logf("%s: %q", tt.name, got)
		})
	}
}
