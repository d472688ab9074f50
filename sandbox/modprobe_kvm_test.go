package sandbox

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/internal/kvmtest"
)

// autoloadModules are the modules the autoload program and python3's
// AF_ALG socket make the kernel ask for (by alias), in /proc/modules
// order of the check below.
const autoloadModules = "veth bridge nf_tables nft_chain_nat overlay af_alg algif_hash"

// loadedOf prints which of the modules mods (space-separated) the guest's
// /proc/modules lists, one a line.
func loadedOf(mods string) string {
	return `for m in ` + mods + `; do grep -q "^$m " /proc/modules && echo $m; done; true`
}

// TestKVMModuleAutoload boots the Debian minbase disk of the image tests
// (debootstrap bookworm, python3 and git, no kmod: no /sbin/modprobe, no
// /lib/modules; the ext4 image make test-rootfs makes, read-only, so the
// modules disk goes to /run/kiln/modules) as the root, the agent process
// 1, and shows the kernel's module autoloading at work through
// Kiln's helper (/run/kiln/modprobe, the agent binary as modprobe): none
// of autoloadModules is loaded after boot; then the autoload program
// (internal/testguest/autoload, copied in: the root has no ip or nft)
// makes a veth pair, a bridge, an nftables table with a NAT chain and an
// overlay mount, and python3 an AF_ALG hash socket, each through
// request_module of an alias (rtnl-link-veth, rtnl-link-bridge,
// net-pf-16-proto-12, nfnetlink-subsys-10, nft-chain-2-nat, fs-overlay,
// net-pf-38, algif-hash), and every module is loaded after, with its
// dependencies; run by hand, the helper loads a module and fails on a
// name that is nothing, saying so. One boot: no other KVM test boots this
// disk, and the image root's and systemd's autoloading are checked in
// TestKVMImage's and TestKVMSystemd's boots.
func TestKVMModuleAutoload(t *testing.T) {
	kvmtest.Require(t)
	kvmtest.Kernel(t)
	disk := kvmtest.TestDisk(t, kvmtest.DebianDisk)
	prog := kvmtest.AutoloadBinary(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()

	began := time.Now()
	sb, err := Start(ctx, Options{Runtime: testRuntime(t), MemoryMiB: 512, Hostname: "autoload", Disk: disk, DiskReadOnly: true})
	if err != nil {
		t.Fatalf("Start on %s: %v", disk, err)
	}
	t.Cleanup(func() { sb.Close(context.Background()) })
	t.Logf("booted the Debian disk in %v", time.Since(began).Round(time.Millisecond))
	defer func() {
		if t.Failed() {
			c := sb.Console()
			t.Logf("console:\n%s", c[max(0, len(c)-4000):])
		}
	}()

	// The root: Debian's, read-only, without modprobe and without
	// /lib/modules, so the modules disk is on /run/kiln/modules; the
	// kernel's helper is Kiln's.
	if got := sh(t, ctx, sb, `. /etc/os-release; echo $ID; grep -c '^/dev/vda / ext4 ro' /proc/mounts
for p in /sbin/modprobe /usr/sbin/modprobe /bin/kmod /lib/modules; do test -e $p && echo has $p; done
grep -c ' /run/kiln/modules ext4 ro' /proc/mounts
cat /proc/sys/kernel/modprobe; test -x /run/kiln/modprobe && echo helper`); got != "debian\n1\n1\n/run/kiln/modprobe\nhelper" {
		t.Fatalf("the root and its helper: %q, want debian, read-only, no modprobe, no /lib/modules, the modules disk on /run/kiln/modules, the helper /run/kiln/modprobe", got)
	}
	if got := sh(t, ctx, sb, loadedOf(autoloadModules)); got != "" {
		t.Fatalf("loaded before anything asked for them: %q", got)
	}

	f, err := os.Open(prog)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := sb.Client().WriteFile(ctx, "/tmp/autoload", f, 0o755); err != nil {
		t.Fatalf("copying the autoload program in: %v", err)
	}
	began = time.Now()
	if out, errOut, st, err := shTry(ctx, sb, "/tmp/autoload /tmp/autoload-overlay"); err != nil || !st.Success() ||
		out != "ok veth\nok bridge\nok nftables\nok overlay" {
		t.Errorf("autoload: %v %v; stdout %q stderr %q", st, err, out, errOut)
	}
	sh(t, ctx, sb, `python3 -c 'import socket; s = socket.socket(socket.AF_ALG, socket.SOCK_SEQPACKET, 0); s.bind(("hash", "sha256"))'`)
	t.Logf("veth, bridge, nftables, overlay and AF_ALG with their modules autoloaded: %v", time.Since(began).Round(time.Millisecond))
	if got, want := sh(t, ctx, sb, loadedOf(autoloadModules)), strings.ReplaceAll(autoloadModules, " ", "\n"); got != want {
		t.Errorf("loaded after: %q, want %q", got, want)
	}
	// And the dependencies of the alias nft-chain-2-nat's module.
	if got := sh(t, ctx, sb, loadedOf("nf_nat nf_conntrack nfnetlink llc stp")); got != "nf_nat\nnf_conntrack\nnfnetlink\nllc\nstp" {
		t.Errorf("dependencies loaded: %q", got)
	}

	// By hand: the helper is a modprobe.
	if got := sh(t, ctx, sb, loadedOf("dummy")+"; /run/kiln/modprobe -v rtnl-link-dummy; "+loadedOf("dummy")); !strings.HasSuffix(got, "/dummy.ko\ndummy") || strings.HasPrefix(got, "dummy") {
		t.Errorf("/run/kiln/modprobe -v rtnl-link-dummy: %q, want it loaded (insmod .../dummy.ko)", got)
	}
	out, errOut, st, err := shTry(ctx, sb, "/run/kiln/modprobe no-such-module")
	if err != nil || st.Code != 1 || out != "" || !strings.Contains(errOut, "kernel module not found: no-such-module") {
		t.Errorf("/run/kiln/modprobe no-such-module: %v %v, stdout %q stderr %q; want status 1 and not found", st, err, out, errOut)
	}
	if out, errOut, st, err := shTry(ctx, sb, "/run/kiln/modprobe -q -- no-such-module"); err != nil || st.Code != 1 || out+errOut != "" {
		t.Errorf("/run/kiln/modprobe -q -- no-such-module: %v %v, stdout %q stderr %q; want status 1, silent", st, err, out, errOut)
	}
}
