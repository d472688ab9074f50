package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kilnvm/kiln/daemon/client"
	"github.com/kilnvm/kiln/internal/kvmtest"
)

// TestKilndNetPool runs the real kilnd (not the test backend) with
// --net-pool inside a network namespace the test makes: it sets up the
// sandbox networks' host side there (forwarding on, kiln's own nftables
// table, hostnet's folder under the state dir) before it serves, and
// stops cleanly; a --net-uplink that does not exist fails its start,
// naming the flag. No sandbox is made: that needs KVM (TestKVMDaemonNetwork).
func TestKilndNetPool(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Fatal("needs root, for a network namespace")
	}
	ipBin, err := exec.LookPath("ip")
	if err != nil {
		t.Fatalf("needs iproute2's ip: %v", err)
	}
	b := make([]byte, 4)
	rand.Read(b)
	ns := "kdnet-" + hex.EncodeToString(b)
	ip := func(args ...string) {
		t.Helper()
		if out, err := exec.Command(ipBin, args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	ip("netns", "add", ns)
	t.Cleanup(func() { exec.Command(ipBin, "netns", "del", ns).Run() })
	ip("-n", ns, "link", "set", "lo", "up")
	// The uplink: a veth to a second namespace that plays the world.
	world := ns + "-w"
	ip("netns", "add", world)
	t.Cleanup(func() { exec.Command(ipBin, "netns", "del", world).Run() })
	ip("-n", ns, "link", "add", "up0", "type", "veth", "peer", "name", "wan0", "netns", world)
	ip("-n", world, "addr", "add", "10.251.0.254/24", "dev", "wan0")
	ip("-n", world, "link", "set", "wan0", "up")
	ip("-n", ns, "addr", "add", "10.251.0.1/24", "dev", "up0")
	ip("-n", ns, "link", "set", "up0", "up")
	ip("-n", ns, "route", "add", "default", "via", "10.251.0.254", "dev", "up0")

	kvmtest.Kernel(t) // kilnd finds the cached kernel itself
	agent := kvmtest.AgentBinary(t)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "kdn-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	state, sock := filepath.Join(dir, "state"), filepath.Join(dir, "kilnd.sock")
	run := func(uplink string) (*exec.Cmd, *bytes.Buffer) {
		cmd := exec.Command(ipBin, "netns", "exec", ns, self, "--config=", "--listen", "unix:"+sock,
			"--state-dir", state, "--agent", agent, "--vmm", self, "--cgroup-root", "none",
			"--net-pool", "10.213.0.0/24", "--net-uplink", uplink, "--net-dns", "10.251.0.1")
		cmd.Env = append(os.Environ(), testKilndEnv+"="+testKilndReal)
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		return cmd, &out
	}

	// A missing uplink: kilnd does not start, and says why.
	cmd, out := run("nosuch0")
	waited := make(chan error, 1)
	go func() { waited <- cmd.Wait() }()
	select {
	case err = <-waited:
	case <-time.After(time.Minute):
		cmd.Process.Kill()
		<-waited
		t.Fatalf("kilnd with a missing uplink still runs after a minute: %s", out)
	}
	if err == nil || !strings.Contains(out.String(), "--net-pool") || !strings.Contains(out.String(), "nosuch0") {
		t.Fatalf("kilnd with a missing uplink: %v: %s", err, out)
	}

	cmd, out = run("up0")
	t.Cleanup(func() { cmd.Process.Kill() })
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for {
		c, err := client.Dial(ctx, "unix:"+sock)
		if err == nil {
			_, err = c.ListSandboxes(ctx, client.ListOptions{})
			c.Close()
			if err == nil {
				break
			}
		}
		if ctx.Err() != nil {
			t.Fatalf("kilnd never served: %v: %s", err, out)
		}
		time.Sleep(50 * time.Millisecond)
	}
	fwd, err := exec.Command(ipBin, "netns", "exec", ns, "cat", "/proc/sys/net/ipv4/ip_forward").Output()
	if err != nil || strings.TrimSpace(string(fwd)) != "1" {
		t.Errorf("ip_forward in kilnd's netns: %q, %v; want 1", fwd, err)
	}
	if fi, err := os.Stat(filepath.Join(state, "net")); err != nil || !fi.IsDir() {
		t.Errorf("hostnet's folder under the state dir: %v", err)
	}
	if err := hasNftTable(ns, "kiln"); err != nil {
		t.Error(err)
	}
	cmd.Process.Signal(syscall.SIGTERM)
	go func() { waited <- cmd.Wait() }()
	select {
	case err := <-waited:
		if err != nil {
			t.Errorf("kilnd after SIGTERM: %v: %s", err, out)
		}
	case <-time.After(time.Minute):
		t.Fatalf("kilnd still runs a minute after SIGTERM: %s", out)
	}
	// The host table stays for the next kilnd (sandboxes run on).
	if err := hasNftTable(ns, "kiln"); err != nil {
		t.Errorf("after kilnd stopped: %v", err)
	}
}
