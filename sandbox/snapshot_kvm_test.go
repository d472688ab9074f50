package sandbox

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/guest/client"
	"github.com/kilnvm/kiln/internal/kvmtest"
	"github.com/kilnvm/kiln/virtio"
)

// TestKVMSnapshot boots one sandbox with a read-only root disk, a
// writable data disk and (as root) a network card, leaves a counting loop
// running in it, saves it, forks it, and restores the snapshot: once
// alone, then as 8 clones one after the other (4 with VMM processes). The loop counts on after
// restore; every clone writes only its own files, draws different random
// bytes and has the host's time; each child of a fork writes its own copy
// of the data disk.
func TestKVMSnapshot(t *testing.T) { testSnapshot(t, nil) }

// TestKVMSnapshotProcess is TestKVMSnapshot with every sandbox's VM in a
// VMM process of its own: the same checks hold across the process
// boundary, and a fork's children get the parent's frozen memory as a
// descriptor.
func TestKVMSnapshotProcess(t *testing.T) { testSnapshot(t, testProcess()) }

func testSnapshot(t *testing.T, proc *ProcessOptions) {
	kvmtest.Require(t)
	kvmtest.Kernel(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	// As root the sandbox has a network card on a tap, and every child
	// and clone needs a tap and a MAC address of its own.
	nic := func(name string, mac net.HardwareAddr) *virtio.NetSpec { return nil }
	if os.Geteuid() == 0 {
		prefix := fmt.Sprintf("ks%d", os.Getpid()%100000)
		nic = func(name string, mac net.HardwareAddr) *virtio.NetSpec {
			n := &virtio.NetSpec{Tap: prefix + name}
			if mac != nil {
				n.MAC = mac.String()
			}
			return n
		}
	} else {
		t.Log("not root: no network card (each clone's own tap and MAC address are not checked)")
	}
	// Each child of a fork writes a copy of the data disk made while
	// the parent is paused.
	tmp := t.TempDir()
	data := filepath.Join(tmp, "data.img")
	if err := os.WriteFile(data, make([]byte, 4<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	childDisks := map[string]string{}
	forkNIC := func(name string) ForkOptions {
		o := ForkOptions{Disks: func(i int, id string) (string, error) {
			if id != "data" {
				return "", fmt.Errorf("asked for disk %q", id)
			}
			p := filepath.Join(tmp, fmt.Sprintf("%s%d-data.img", name, i))
			childDisks[fmt.Sprintf("%s%d", name, i)] = p
			return p, copyFile(data, p)
		}}
		if nic("", nil) != nil {
			o.Net = func(i int) *virtio.NetSpec { return nic(fmt.Sprintf("%s%d", name, i), nil) }
		}
		return o
	}
	sb, err := Start(ctx, Options{
		Runtime: testRuntime(t), CPUs: 1, MemoryMiB: 256, Hostname: "snap", Net: nic("p", nil),
		Disk: rootImage(t), DiskReadOnly: true,
		Devices: []virtio.DeviceSpec{{ID: "data", Kind: virtio.KindBlock, Block: &virtio.BlockSpec{Path: data}}},
		Process: proc,
	})
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	defer sb.Close(context.Background())
	sh := func(t *testing.T, c *client.Client, script string) string {
		t.Helper()
		var out, errOut bytes.Buffer
		st, err := c.Exec(ctx, client.ExecOptions{Argv: []string{"sh", "-c", script}, Stdout: &out, Stderr: &errOut})
		if err != nil || !st.Success() {
			t.Fatalf("%q: %v %v; stderr %q", script, st, err, errOut.String())
		}
		return strings.TrimSpace(out.String())
	}
	counter := func(t *testing.T, c *client.Client) int {
		t.Helper()
		n, err := strconv.Atoi(sh(t, c, "cat /run/count"))
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	if proc != nil && (sb.PID() == os.Getpid() || sb.VM() != nil) {
		t.Fatalf("the sandbox's VM runs in this process (PID %d)", sb.PID())
	}
	if got := sh(t, sb.Client(), "grep -c '^/dev/vda / ext4 ro' /proc/mounts || cat /proc/mounts"); got != "1" {
		t.Errorf("the root is not the read-only disk: %q", got)
	}
	sh(t, sb.Client(), "printf 'parent-data\\n' | dd of=/dev/vdb conv=fsync 2>/dev/null")
	sh(t, sb.Client(), `echo before-save > /tmp/marker
(i=0; while :; do i=$((i+1)); echo $i > /run/count.new; mv /run/count.new /run/count; sleep 0.2; done) >/dev/null 2>&1 &
sleep 1`)
	dir := filepath.Join(t.TempDir(), "snap")
	begin := time.Now()
	if err := sb.Save(ctx, dir); err != nil {
		t.Fatalf("Save: %v", err)
	}
	t.Logf("saved in %v", time.Since(begin).Round(time.Millisecond))
	saved := counter(t, sb.Client()) // the original runs on: at least this
	// The same sandbox saved on a file system with fs-verity: restored
	// below by mapping its memory file, not copying it.
	var verityDirSaved string
	if vd := verityDir(t); vd != "" {
		verityDirSaved = filepath.Join(vd, "snap")
		begin := time.Now()
		if err := sb.Save(ctx, verityDirSaved); err != nil {
			t.Fatalf("Save on fs-verity: %v", err)
		}
		t.Logf("saved on fs-verity (the memory file sealed) in %v", time.Since(begin).Round(time.Millisecond))
	}

	t.Run("fork refuses a shared writable disk", func(t *testing.T) {
		o := forkNIC("x")
		o.Disks = nil
		if _, err := sb.Fork(ctx, 1, o); err == nil || !strings.Contains(err.Error(), `disk "data" is writable`) {
			t.Fatalf("Fork without ForkOptions.Disks: %v", err)
		}
	})
	t.Run("fork a running sandbox", func(t *testing.T) {
		begin := time.Now()
		kids, err := sb.Fork(ctx, 2, forkNIC("f"))
		if err != nil {
			t.Fatalf("Fork: %v", err)
		}
		t.Logf("2 children answering after %v", time.Since(begin).Round(time.Millisecond))
		for _, k := range kids {
			defer k.Close(context.Background())
		}
		if proc != nil && (kids[0].PID() == kids[1].PID() || kids[0].PID() == sb.PID() || kids[0].PID() == os.Getpid()) {
			t.Errorf("children's VMM processes %d and %d, parent's %d", kids[0].PID(), kids[1].PID(), sb.PID())
		}
		for i, k := range kids {
			sh(t, k.Client(), fmt.Sprintf("echo %d > /tmp/kid", i))
			if got := sh(t, k.Client(), "hostname"); got != fmt.Sprintf("snap-%d", i) {
				t.Errorf("child %d hostname %q", i, got)
			}
			if got := sh(t, k.Client(), "cat /tmp/marker"); got != "before-save" {
				t.Errorf("child %d lost the parent's file: %q", i, got)
			}
			checkMAC(t, k, sh)
			if got := sh(t, k.Client(), "head -n 1 /dev/vdb"); got != "parent-data" {
				t.Errorf("child %d's data disk starts %q, want the parent's", i, got)
			}
			sh(t, k.Client(), fmt.Sprintf("printf 'child-%d-data\\n' | dd of=/dev/vdb conv=fsync 2>/dev/null", i))
		}
		for i := range kids {
			if got := firstLine(t, childDisks[fmt.Sprintf("f%d", i)]); got != fmt.Sprintf("child-%d-data", i) {
				t.Errorf("child %d's own image starts %q", i, got)
			}
		}
		if got := firstLine(t, data); got != "parent-data" {
			t.Errorf("the parent's data image starts %q after the children wrote theirs", got)
		}
		if sb.MAC() != nil && (kids[0].MAC().String() == kids[1].MAC().String() || kids[0].MAC().String() == sb.MAC().String()) {
			t.Errorf("MAC addresses: parent %v, children %v and %v", sb.MAC(), kids[0].MAC(), kids[1].MAC())
		}
		for i, k := range kids {
			if got := sh(t, k.Client(), "cat /tmp/kid"); got != fmt.Sprint(i) {
				t.Errorf("child %d reads %q from its own file", i, got)
			}
		}
		// The parent runs on, and sees none of it.
		if got := sh(t, sb.Client(), "cat /tmp/kid 2>/dev/null || echo none"); got != "none" {
			t.Errorf("the parent sees a child's file: %q", got)
		}
		if a, b := counter(t, sb.Client()), counter(t, kids[0].Client()); a < saved || b < saved {
			t.Errorf("counters after fork: parent %d, child %d, saved %d", a, b, saved)
		}
		// A child forks in turn: the grandchild has its parent's file.
		grand, err := kids[0].Fork(ctx, 1, forkNIC("g"))
		if err != nil {
			t.Fatalf("Fork of a child: %v", err)
		}
		defer grand[0].Close(context.Background())
		if got := sh(t, grand[0].Client(), "cat /tmp/kid; hostname"); got != "0\nsnap-0-0" {
			t.Errorf("grandchild: %q", got)
		}
		checkMAC(t, grand[0], sh)
	})

	if err := sb.Close(ctx); err != nil {
		t.Fatalf("Close: %v", err)
	}

	t.Run("restore", func(t *testing.T) {
		begin := time.Now()
		copied := filepath.Join(tmp, "restore-data.img")
		if err := copyFile(data, copied); err != nil {
			t.Fatal(err)
		}
		r, err := Restore(ctx, dir, RestoreOptions{Net: nic("r", nil), Disks: map[string]string{"data": copied}, Process: proc})
		if err != nil {
			t.Fatalf("Restore: %v", err)
		}
		defer r.Close(context.Background())
		t.Logf("restored to a working agent in %v", time.Since(begin).Round(time.Millisecond))
		if got := sh(t, r.Client(), "cat /tmp/marker"); got != "before-save" {
			t.Fatalf("tmpfs file after restore: %q", got)
		}
		checkMAC(t, r, sh)
		if got := sh(t, r.Client(), "head -n 1 /dev/vdb"); got != "parent-data" {
			t.Errorf("restored data disk starts %q", got)
		}
		if ids := deviceIDs(r.Devices()); ids != "root net0 data modules vsock rng vol0 vol1 vol2 vol3" && ids != "root data modules vsock rng vol0 vol1 vol2 vol3" {
			t.Errorf("restored devices %s", ids)
		}
		first := counter(t, r.Client())
		time.Sleep(2 * time.Second)
		second := counter(t, r.Client())
		t.Logf("counter: %d when saved (or later), %d and %d after restore", saved, first, second)
		if first <= 0 || second <= first {
			t.Fatalf("the counting loop did not go on after restore: %d then %d", first, second)
		}
	})

	if verityDirSaved != "" {
		t.Run("restore over an fs-verity memory file", func(t *testing.T) {
			copied := filepath.Join(tmp, "verity-data.img")
			if err := copyFile(data, copied); err != nil {
				t.Fatal(err)
			}
			checkVerityRestore(t, ctx, verityDirSaved, RestoreOptions{Net: nic("v", nil), Disks: map[string]string{"data": copied}, Process: proc}, func(r *Sandbox) {
				if got := sh(t, r.Client(), "cat /tmp/marker"); got != "before-save" {
					t.Errorf("tmpfs file after the restore over fs-verity: %q", got)
				}
				if got := sh(t, r.Client(), "head -n 1 /dev/vdb"); got != "parent-data" {
					t.Errorf("restored data disk starts %q", got)
				}
			}, func(r *Sandbox) {
				// A fork freezes memory mapped over the file (a
				// template's first restore, then its pool's forks).
				kids, err := r.Fork(ctx, 1, forkNIC("vf"))
				if err != nil {
					t.Fatalf("Fork of the sandbox restored over fs-verity: %v", err)
				}
				defer kids[0].Close(context.Background())
				if got := sh(t, kids[0].Client(), "cat /tmp/marker; hostname"); !strings.HasPrefix(got, "before-save\n") {
					t.Errorf("the child of the sandbox restored over fs-verity: %q", got)
				}
			})
		})
	}

	// Eight clones of one snapshot in the library's own process, four in
	// VMM processes (the same checks across the process boundary; eight
	// there would add a minute and a half of emulated CPU and no check).
	n := 8
	if proc != nil {
		n = 4
	}
	t.Run(fmt.Sprintf("%d clones", n), func(t *testing.T) {
		// The clones one after the other: several guests restored and
		// torn down at once have crashed the emulated L1 the tests run
		// in, and uniqueness does not need them to overlap (kiln fork
		// runs clones at once; its test covers that).
		random := map[string]int{}
		for i := range n {
			begin := time.Now()
			mac := net.HardwareAddr{0x02, 0x6b, 0x69, 0x6c, 0x6e, byte(i)}
			c, err := Restore(ctx, dir, RestoreOptions{Hostname: fmt.Sprintf("clone-%d", i), Net: nic(fmt.Sprintf("c%d", i), mac), Process: proc})
			if err != nil {
				t.Fatalf("clone %d: %v", i, err)
			}
			t.Logf("clone %d answering after %v", i, time.Since(begin).Round(time.Millisecond))
			r, ok := func() (string, bool) {
				defer c.Close(context.Background())
				return checkClone(t, c, i, sh)
			}()
			if !ok {
				t.FailNow()
			}
			if k, dup := random[r]; dup {
				t.Errorf("clones %d and %d read the same bytes from /dev/urandom: %s", k, i, r)
			}
			random[r] = i
		}
		if len(random) != n {
			t.Errorf("%d different /dev/urandom readings from %d clones", len(random), n)
		}
	})
}

// checkClone checks clone i of the snapshot: it writes a file of its own
// and sees no other clone's, has its own host name and the host's time
// (within a second, busybox's date having whole seconds). It returns the
// first bytes the clone reads from /dev/urandom, and false when a check
// could not run.
func checkClone(t *testing.T, c *Sandbox, i int, sh func(*testing.T, *client.Client, string) string) (string, bool) {
	t.Helper()
	sh(t, c.Client(), fmt.Sprintf("echo %d > /tmp/mine-%d", i, i))
	if got := sh(t, c.Client(), "ls /tmp/ | grep mine- | tr '\\n' ' '"); got != fmt.Sprintf("mine-%d", i) {
		t.Errorf("clone %d sees %q", i, got)
	}
	if got := sh(t, c.Client(), "hostname"); got != fmt.Sprintf("clone-%d", i) {
		t.Errorf("clone %d hostname %q", i, got)
	}
	checkMAC(t, c, sh)
	r := sh(t, c.Client(), "head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'")
	before := time.Now()
	secs, err := strconv.ParseInt(sh(t, c.Client(), "date +%s"), 10, 64)
	after := time.Now()
	if err != nil {
		t.Errorf("clone %d: %v", i, err)
		return r, false
	}
	guest := time.Unix(secs, 0)
	if guest.Before(before.Add(-2*time.Second)) || guest.After(after.Add(time.Second)) {
		t.Errorf("clone %d: clock %v, host between %v and %v", i, guest, before, after)
	}
	return r, true
}

// checkMAC checks that the guest's network interface has the address of
// the sandbox's network card (a restored or forked guest takes over its
// new card's address). Without a card there is nothing to check.
func checkMAC(t *testing.T, c *Sandbox, sh func(*testing.T, *client.Client, string) string) {
	t.Helper()
	if c.MAC() == nil {
		return
	}
	got := sh(t, c.Client(), "cat /sys/class/net/*/address | grep -vx 00:00:00:00:00:00")
	if got != c.MAC().String() {
		t.Errorf("guest interface addresses %q, want the card's %v (tap %s)", got, c.MAC(), c.Tap())
	}
}

// rootImage returns a read-only ext4 root image with busybox and its
// applets, for a sandbox's root disk.
func rootImage(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	root := filepath.Join(dir, "root")
	for _, d := range []string{"bin", "dev", "proc", "sys", "run", "tmp", "etc"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := copyFile("/bin/busybox", filepath.Join(root, "bin", "busybox")); err != nil {
		t.Fatalf("busybox (busybox-static): %v", err)
	}
	if err := os.Chmod(filepath.Join(root, "bin", "busybox"), 0o755); err != nil {
		t.Fatal(err)
	}
	list, err := exec.Command("/bin/busybox", "--list").Output()
	if err != nil {
		t.Fatalf("busybox --list: %v", err)
	}
	for _, a := range strings.Fields(string(list)) {
		if a != "busybox" {
			if err := os.Symlink("busybox", filepath.Join(root, "bin", a)); err != nil {
				t.Fatal(err)
			}
		}
	}
	img := filepath.Join(dir, "root.img")
	if out, err := exec.Command("mke2fs", "-q", "-F", "-t", "ext4", "-d", root, img, "32M").CombinedOutput(); err != nil {
		t.Fatalf("mke2fs: %v: %s", err, out)
	}
	return img
}

func copyFile(from, to string) error {
	b, err := os.ReadFile(from)
	if err != nil {
		return err
	}
	return os.WriteFile(to, b, 0o600)
}

// firstLine returns the first line of the file at p.
func firstLine(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	line, _, _ := strings.Cut(string(b), "\n")
	return line
}

func deviceIDs(specs []virtio.DeviceSpec) string {
	var ids []string
	for _, d := range specs {
		ids = append(ids, d.ID)
	}
	return strings.Join(ids, " ")
}
