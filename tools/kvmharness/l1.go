package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/kilnvm/kiln/guestkernel"
	"github.com/kilnvm/kiln/initramfs"
)

// l1Modules returns the kernel modules L1's initramfs loads: the required
// ones give /dev/kvm (kvm_amd: TCG's -cpu max emulates AMD SVM) and the 9p
// shares; the optional ones are what a VMM's tests may use in L1: taps,
// veths, and the nf_tables expressions package hostnet's rules use
// (conntrack state, NAT masquerade, reject) with conntrack's netlink (its
// policy updates cut connections), and overlay, bridge and tc's ingress,
// u32 and mirred for containerd, its CNI bridge and the shim's pod
// network (the containerd shim's tests), and loop and ext4 for a file
// system with fs-verity (the snapshot tests). Dependencies (irqbypass, ccp,
// virtio_ring, netfs, fscache, nfnetlink, nf_conntrack, nf_nat...) follow;
// soft ones do not: crc32c_generic comes before nf_tables, whose libcrc32c
// asks the crypto API for crc32c (L1 has no modprobe to load it then).
func l1Modules() (required, optional []string) {
	return []string{"kvm_amd", "virtio_pci", "9pnet_virtio", "9p"},
		[]string{"tun", "veth", "vhost_net", "vhost_vsock",
			"crc32c_generic", "nf_tables", "nft_ct", "nft_chain_nat", "nft_nat", "nft_masq",
			"nft_reject", "nft_reject_inet", "nft_reject_ipv4", "nf_conntrack_netlink",
			"overlay", "bridge", "sch_ingress", "cls_u32", "act_mirred", "loop", "ext4"}
}

// l1Config describes one L1 VM.
type l1Config struct {
	qemu    string
	kernel  *guestkernel.Kernel
	memMiB  int
	cpus    int
	timeout time.Duration
	job     string // the job folder: shared read-write, mounted at the same path in L1
	// unit is this L1's own folder in the job folder (the job folder
	// itself when empty): its job script unit/run.sh, the done marker
	// unit/done, the heartbeat and the initramfs. L1 VMs that run at the
	// same time have folders of their own.
	unit string
	// shared, when set, is the folder shared read-write by every L1 of
	// one harness run (KILN_TEST_SHARED), mounted at the same path in L1.
	shared string
	// workdir, when set, is shared read-only and mounted at the same path
	// in L1: the checkout, when it lies under a folder L1 covers with a
	// fresh tmpfs (/tmp, /run, /var/tmp, /dev/shm), as a CI clone may.
	workdir string
	console io.Writer // receives L1's serial console, line by line
	// prefix starts each console line ("L1| " when empty), so that the
	// consoles of L1 VMs running at once can be told apart.
	prefix string
	log    *slog.Logger
	// hangAfter, when set, kills L1 once its job's heartbeat file
	// (unit/heartbeat, which testJobScript rewrites every few seconds) has
	// not changed for this long: L1's kernel has hung.
	hangAfter time.Duration
}

// dir is the folder of this L1's own files: c.unit, or the job folder.
func (c l1Config) dir() string {
	if c.unit != "" {
		return c.unit
	}
	return c.job
}

// errL1Hung is returned by runL1 when the L1 VM stopped answering.
var errL1Hung = errors.New("L1 VM hung: its heartbeat stopped")

// heartbeatFile is the file a test job in L1 keeps rewriting.
const heartbeatFile = "heartbeat"

// heartbeatWatch says what watchHeartbeat does about a silent heartbeat.
type heartbeatWatch struct {
	after, poll time.Duration
	// kickEvery, when set with kick, calls kick each time a silence
	// reaches another multiple of it (before after); resumed, when set,
	// is called when the heartbeat beats again after a kick.
	kickEvery     time.Duration
	kick, resumed func(silent time.Duration)
	hung          func()
}

// watchHeartbeat calls w.hung once the heartbeat file has stayed the same
// (content and modification time) for w.after, checking every w.poll,
// until stop is closed. On the way it calls w.kick every w.kickEvery of
// silence.
func watchHeartbeat(path string, w heartbeatWatch, stop <-chan struct{}) {
	last, since := "", time.Now()
	kicks := 0
	t := time.NewTicker(w.poll)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
		}
		cur := ""
		if fi, err := os.Stat(path); err == nil {
			data, _ := os.ReadFile(path)
			cur = fmt.Sprintf("%d %s", fi.ModTime().UnixNano(), data)
		}
		if cur != last {
			if kicks > 0 && w.resumed != nil {
				w.resumed(time.Since(since))
			}
			last, since, kicks = cur, time.Now(), 0
			continue
		}
		silent := time.Since(since)
		if silent >= w.after {
			w.hung()
			return
		}
		if w.kick != nil && w.kickEvery > 0 && silent >= time.Duration(kicks+1)*w.kickEvery {
			kicks++
			w.kick(silent)
		}
	}
}

// buildL1Initramfs writes the L1 initramfs to path: busybox, the modules in
// dependency order, and an /init that mounts this machine's root, the job
// folder and the shared folder over 9p and runs c.dir()/run.sh chrooted
// into the root.
func buildL1Initramfs(c l1Config, path string) error {
	k := c.kernel
	required, optional := l1Modules()
	mods, err := k.ModuleLoadOrder(required...)
	if err != nil {
		return fmt.Errorf("L1 modules: %w", err)
	}
	have := map[string]bool{}
	for _, m := range mods {
		have[m.Name] = true
	}
	for _, name := range optional {
		extra, err := k.ModuleLoadOrder(name)
		if errors.Is(err, guestkernel.ErrModuleNotFound) {
			continue // optional: this kernel build lacks it
		}
		if err != nil {
			return fmt.Errorf("L1 modules: %w", err)
		}
		for _, m := range extra {
			if !have[m.Name] {
				have[m.Name] = true
				mods = append(mods, m)
			}
		}
	}
	names := make([]string, len(mods))
	for i, m := range mods {
		names[i] = m.Name
	}
	b, err := initramfs.BusyboxInit(l1InitScript(c, names))
	if err != nil {
		return err
	}
	for _, m := range mods {
		if err := b.AddHostFile("mod/"+m.Name+".ko", m.Path, 0o644); err != nil {
			return err
		}
	}
	return b.WriteFile(path, false)
}

// sharedCache is the 9p cache mode of the shared folder in L1. mmap keeps
// cache=none's uncached lookups and write-through writes (what one L1
// renamed into place, another finds at once: no stale negative dentry)
// but gives mappings a page cache with readahead: a big sparse file another L1 wrote maps
// MAP_PRIVATE under all three of none, mmap and loose, and its pages
// fault in about six times faster than under none (32 MiB in 0.2 s rather
// than 1.5 s), as fast as under loose. Shared products never change once
// in place, so the cached pages cannot go stale.
const sharedCache = "mmap"

// l1InitScript is L1's /init (after the #! line): allow huge pages for
// shmem where advised, bring up loopback, load
// the modules in order,
// mount the host's root read-only, fresh tmpfs on /tmp, /run, /var/tmp and
// /dev/shm, the job folder and the shared folder read-write over 9p, then
// run c.dir()/run.sh.
func l1InitScript(c l1Config, modules []string) string {
	const p9 = "mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000"
	var s strings.Builder
	fmt.Fprintf(&s, `export PATH=/bin
say() { echo "kvmharness-l1: $*"; }
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
# Guest RAM (a memfd, shmem) in 2 MiB pages where Kiln advises it, as
# kiln doctor asks of a host: in 4 KiB pages every page a guest first
# touches is a nested page fault, which emulated SVM makes very dear.
echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled || say "cannot allow shmem huge pages"
# Tests serve registries and other servers on loopback.
ip link set lo up || say "cannot bring up the loopback interface"
for m in %s; do
  args=
  # Every L1 calibrates its TSC anew, a little differently (2594316 kHz,
  # then 2596104: 689 ppm), and emulated nested SVM cannot scale a TSC:
  # a snapshot made in one L1 (the run's warm snapshot, say)
  # would not restore in another. KVM leaves a rate within its tolerance
  # unscaled: 1%% covers the calibrations, not real hosts' differences.
  [ $m = kvm ] && args=tsc_tolerance_ppm=10000
  insmod /mod/$m.ko $args || say "insmod $m failed"
done
mkdir -p /host
%s,ro,cache=loose host /host || { say "cannot mount the host's root over 9p"; poweroff -f; }
for p in dev proc sys; do mount --bind /$p /host/$p; done
mount -t cgroup2 none /host/sys/fs/cgroup 2>/dev/null
for p in tmp run var/tmp dev/shm; do mkdir -p /host/$p; mount -t tmpfs tmpfs /host/$p; done
mkdir -p %s
%s job %s || { say "cannot mount the job folder"; poweroff -f; }
%s
%s
say "up after $(cut -d' ' -f1 /proc/uptime)s, $(nproc) CPUs"
chroot /host /bin/sh %s
sync
poweroff -f
`, strings.Join(modules, " "), p9, shQuote("/host"+c.job), p9, shQuote("/host"+c.job),
		workMount(p9, c.workdir), sharedMount(p9, c.shared), shQuote(c.dir()+"/run.sh"))
	return s.String()
}

// workMount is the /init line that mounts the shared workdir, if any.
func workMount(p9, workdir string) string {
	if workdir == "" {
		return ""
	}
	w := shQuote("/host" + workdir)
	return fmt.Sprintf("mkdir -p %s; %s,ro work %s || { say \"cannot mount the work folder\"; poweroff -f; }", w, p9, w)
}

// sharedMount is the /init line that mounts the shared folder, if any.
func sharedMount(p9, shared string) string {
	if shared == "" {
		return ""
	}
	d := shQuote("/host" + shared)
	return fmt.Sprintf("mkdir -p %s; %s,cache=%s shared %s || { say \"cannot mount the shared folder\"; poweroff -f; }", d, p9, sharedCache, d)
}

// coveredByTmpfs reports whether dir lies under a folder that L1 covers
// with a fresh tmpfs, so that L1 would not see it through the root share.
func coveredByTmpfs(dir string) bool {
	for _, p := range []string{"/tmp", "/run", "/var/tmp", "/dev/shm"} {
		if dir == p || strings.HasPrefix(dir, p+"/") {
			return true
		}
	}
	return false
}

// qemuArgs is the command line of the L1 VM. It boots the uncompressed
// vmlinux when the cache has one: decompressing vmlinuz under emulation
// takes longer than booting.
func qemuArgs(c l1Config, initrd string) []string {
	kernel := c.kernel.Image
	if c.kernel.Vmlinux != "" {
		kernel = c.kernel.Vmlinux
	}
	args := []string{
		"-machine", "q35", "-accel", "tcg,thread=multi", "-cpu", "max",
		"-m", strconv.Itoa(c.memMiB), "-smp", strconv.Itoa(c.cpus),
		"-nodefaults", "-no-user-config", "-display", "none", "-serial", "mon:stdio", "-no-reboot",
		"-kernel", kernel, "-initrd", initrd,
		"-append", "console=ttyS0 quiet panic=-1 sysrq_always_enabled",
		"-virtfs", "local,path=/,mount_tag=host,security_model=none,readonly=on,multidevs=remap",
		"-virtfs", "local,path=" + qemuEscape(c.job) + ",mount_tag=job,security_model=none,multidevs=remap",
	}
	if c.workdir != "" {
		args = append(args, "-virtfs", "local,path="+qemuEscape(c.workdir)+",mount_tag=work,security_model=none,readonly=on,multidevs=remap")
	}
	if c.shared != "" {
		args = append(args, "-virtfs", "local,path="+qemuEscape(c.shared)+",mount_tag=shared,security_model=none,multidevs=remap")
	}
	return args
}

// runL1 boots L1, which runs c.dir()/run.sh, and waits for it to power
// off. It streams the console to c.console and fails when L1 does not
// finish in c.timeout or does not write c.dir()/done.
func runL1(ctx context.Context, c l1Config) error {
	initrd := filepath.Join(c.dir(), "l1-initrd.cpio")
	if err := buildL1Initramfs(c, initrd); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, c.qemu, qemuArgs(c, initrd)...)
	cmd.WaitDelay = 10 * time.Second
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	cmd.Stderr = cmd.Stdout
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return err
	}
	start := time.Now()
	c.log.Info("booting L1 under QEMU TCG", "kernel", c.kernel.Version, "cpus", c.cpus, "mem_mib", c.memMiB, "timeout", c.timeout)
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting %s: %w", c.qemu, err)
	}
	var hung atomic.Bool
	stopWatch := make(chan struct{})
	if c.hangAfter > 0 {
		var kicks atomic.Int32
		go watchHeartbeat(filepath.Join(c.dir(), heartbeatFile), heartbeatWatch{
			after: c.hangAfter, poll: 2 * time.Second, kickEvery: kickEvery,
			kick: func(silent time.Duration) {
				kicks.Add(1)
				c.log.Warn("L1 is silent: kicking it with a serial break", "silent_for", silent.Round(time.Second))
				kickL1(stdin)
			},
			resumed: func(silent time.Duration) {
				c.log.Warn("L1 answers again after a kick", "silent_for", silent.Round(time.Second), "kicks_so_far", kicks.Load())
			},
			hung: func() {
				c.log.Warn("L1 stopped answering: dumping its state to the console, then killing it", "silent_for", c.hangAfter)
				hung.Store(true)
				postMortem(ctx, stdin, time.Second)
				cancel()
			},
		}, stopWatch)
	}
	prefix := c.prefix
	if prefix == "" {
		prefix = "L1| "
	}
	copyConsole(c.console, stdout, prefix)
	waitErr := cmd.Wait()
	close(stopWatch)
	elapsed := time.Since(start)
	// QEMU's CPU time against its wall time: how much of a host core
	// this L1 kept busy (its vCPU thread and its 9p and I/O threads), the
	// figure that says whether more L1s at once would run the suite
	// sooner.
	var cpu time.Duration
	if ps := cmd.ProcessState; ps != nil {
		cpu = ps.UserTime() + ps.SystemTime()
	}
	c.log.Info("L1 powered off", "elapsed", elapsed.Round(time.Millisecond),
		"qemu_cpu", cpu.Round(time.Millisecond), "cores_busy", fmt.Sprintf("%.2f", cpu.Seconds()/max(elapsed.Seconds(), 0.001)))
	switch {
	case hung.Load():
		return errL1Hung
	case errors.Is(ctx.Err(), context.DeadlineExceeded):
		return fmt.Errorf("L1 VM did not finish within %v: killed it", c.timeout)
	case ctx.Err() != nil:
		return fmt.Errorf("L1 VM: %w", ctx.Err())
	case waitErr != nil:
		return fmt.Errorf("L1 VM (%s): %w", c.qemu, waitErr)
	}
	if _, err := os.Stat(filepath.Join(c.dir(), "done")); err != nil {
		return errors.New("L1 VM powered off before its job finished (see its console above)")
	}
	return nil
}

// muxKey is QEMU's serial multiplexer escape (-serial mon:stdio): Ctrl-A c
// switches between the serial line and the monitor, Ctrl-A b sends a
// break.
const muxKey = "\x01"

// sendPaced writes each of steps to w, waiting step after each; it stops
// early when a write fails or ctx ends.
func sendPaced(ctx context.Context, w io.Writer, step time.Duration, steps ...string) {
	for _, s := range steps {
		if _, err := io.WriteString(w, s); err != nil {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(step):
		}
	}
}

// kickEvery is how long a heartbeat may stay silent before the harness
// kicks L1, and kicks it again: three missed beats (L1 beats every 2 s).
// A frozen L1 sits idle until kicked; a busy one that missed its beats
// takes no harm from a break.
const kickEvery = 6 * time.Second

// kickL1 sends L1 a serial break: an interrupt, nothing more (with
// sysrq_always_enabled the break only arms SysRq for a key that never
// comes, so no byte reaches a reader of the console). L1s have been found
// silent in HLT with interrupts enabled and their timer never firing (a
// lost wakeup in QEMU's emulation; the monitor's stop and cont did not
// wake them); any interrupt does, and the kernel goes on (reporting a
// soft lockup as long as the silence).
func kickL1(w io.Writer) { io.WriteString(w, muxKey+"b") }

// postMortem writes a hung L1's state to its console before it is
// killed: the monitor's view of the vCPU twice, a second apart (a RIP that
// moves is a guest still running, one that does not is a stuck
// emulation), then the kernel's magic SysRq l (backtraces of the running
// CPUs) and w (blocked tasks) over a serial break, which answer only while
// L1's kernel still takes interrupts.
func postMortem(ctx context.Context, w io.Writer, step time.Duration) {
	sendPaced(ctx, w, step, muxKey+"c", "info registers\n", "info registers\n", muxKey+"c",
		muxKey+"b", "l", muxKey+"b", "w", "", "", "")
}

var consoleJunk = regexp.MustCompile(`\x1b\[[0-9;?]*[a-zA-Z]|\x1b[c()][0-9A-B]?|[\r\x16]`)

// copyConsole writes L1's console to w line by line (one Write a line),
// each prefixed with prefix, without terminal control sequences and
// test2json framing (its ^V bytes and bare "=== NAME" lines).
func copyConsole(w io.Writer, r io.Reader, prefix string) {
	br := bufio.NewReaderSize(r, 64*1024)
	for {
		line, err := br.ReadString('\n')
		if line != "" {
			line = consoleJunk.ReplaceAllString(line, "")
			if !strings.HasSuffix(line, "\n") {
				line += "\n"
			}
			if strings.TrimSpace(line) != "=== NAME" {
				io.WriteString(w, prefix+line)
			}
		}
		if err != nil {
			return
		}
	}
}

// shQuote quotes s for a POSIX shell.
func shQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// qemuEscape doubles the commas QEMU's option parser would split at.
func qemuEscape(s string) string { return strings.ReplaceAll(s, ",", ",,") }

// l1Env is the environment of the job in L1: PATH and HOME as here, the
// resolved Kiln cache, every other KILN_* variable, and set.
func l1Env(cache string, set ...string) []string {
	env := []string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME"), "KILN_CACHE=" + cache}
	for _, e := range os.Environ() {
		if strings.HasPrefix(e, "KILN_") && !strings.HasPrefix(e, "KILN_CACHE=") {
			env = append(env, e)
		}
	}
	env = append(env, set...)
	return env
}

// exportLine renders env as one shell export command.
func exportLine(env []string) string {
	var s strings.Builder
	s.WriteString("export")
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		if !validEnvName(k) {
			continue
		}
		s.WriteString(" " + k + "=" + shQuote(v))
	}
	return s.String()
}

func validEnvName(k string) bool {
	if k == "" || (k[0] >= '0' && k[0] <= '9') {
		return false
	}
	for _, c := range k {
		if !(c == '_' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9') {
			return false
		}
	}
	return true
}

// testBinary is one package's test binary in the job folder.
type testBinary struct {
	pkg  testPackage
	path string // job/bin/N.test
	out  string // job/out/N-M.out: its -test.v=test2json output
	rc   string // job/out/N-M.rc: its exit status
	// test is the one KVM test this run of the binary runs; "" runs them
	// all.
	test string
	// dir is the folder of the L1 that runs it: job/units/N-M.
	dir string
}

// runPattern is the -test.run pattern of b's run.
func (b testBinary) runPattern() string {
	if b.test == "" {
		return "^TestKVM"
	}
	return "^" + b.test + "$"
}

// name says what b runs, for logs.
func (b testBinary) name() string {
	if b.test == "" {
		return b.pkg.ImportPath
	}
	return b.pkg.ImportPath + " " + b.test
}

// attempt returns b with the output paths of the given L1 attempt (2 on).
func (b testBinary) attempt(n int) testBinary {
	b.out = strings.TrimSuffix(b.out, ".out") + fmt.Sprintf(".a%d.out", n)
	b.rc = strings.TrimSuffix(b.rc, ".rc") + fmt.Sprintf(".a%d.rc", n)
	return b
}

// retryOut and retryRC are where the rerun of a binary's failed KVM tests
// writes its output and exit status.
func (b testBinary) retryOut() string { return strings.TrimSuffix(b.out, ".out") + ".retry.out" }
func (b testBinary) retryRC() string  { return strings.TrimSuffix(b.rc, ".rc") + ".retry.rc" }

// testJobScript runs each test binary's KVM tests in its package folder,
// tees their output to the console and to the job folder, and marks the job
// done (dir/done; dir is the L1's own folder, where it also beats its
// heartbeat). A binary whose KVM tests failed runs those tests once more (Linux
// boots in L2 under TCG-nested KVM occasionally hang); the harness reports
// a test that passes only then as flaky.
func testJobScript(dir string, env []string, bins []testBinary, timeout time.Duration) string {
	var s strings.Builder
	s.WriteString("# generated by kvmharness: runs in L1, chrooted into the host's root\n")
	s.WriteString(exportLine(env) + "\n")
	s.WriteString(`[ -c /dev/kvm ] || echo "kvmharness-l1: no /dev/kvm in L1"` + "\n")
	// The heartbeat tells the harness that L1 is alive.
	fmt.Fprintf(&s, "( while :; do cut -d' ' -f1 /proc/uptime > %s; sleep 2; done ) >/dev/null 2>&1 &\nhb=$!\n", shQuote(dir+"/"+heartbeatFile))
	for _, b := range bins {
		fmt.Fprintf(&s, "echo %s\n", shQuote("kvmharness-l1: "+b.name()))
		fmt.Fprintf(&s, "cd %s && ( %s -test.run %s -test.v=test2json -test.timeout=%s 2>&1; echo $? > %s ) | tee %s\n",
			shQuote(b.pkg.Dir), shQuote(b.path), shQuote(b.runPattern()), timeout, shQuote(b.rc), shQuote(b.out))
		fmt.Fprintf(&s, "if [ -f %s ] && [ \"$(cat %s)\" != 0 ]; then\n", shQuote(b.rc), shQuote(b.rc))
		// Failed tests, and those running when the binary timed out.
		fmt.Fprintf(&s, "  failed=$(grep -aoE -- '(--- FAIL: |^[[:space:]]+)TestKVM[A-Za-z0-9_]*' %s | grep -aoE 'TestKVM[A-Za-z0-9_]*' | sort -u | paste -sd'|' -)\n", shQuote(b.out))
		s.WriteString("  if [ -n \"$failed\" ]; then\n")
		fmt.Fprintf(&s, "    echo \"kvmharness-l1: retrying $failed\"\n")
		fmt.Fprintf(&s, "    ( %s -test.run \"^($failed)\\$\" -test.v=test2json -test.timeout=%s 2>&1; echo $? > %s ) | tee %s\n",
			shQuote(b.path), timeout, shQuote(b.retryRC()), shQuote(b.retryOut()))
		s.WriteString("  fi\nfi\n")
	}
	s.WriteString("kill $hb 2>/dev/null\n")
	fmt.Fprintf(&s, "echo ok > %s\n", shQuote(dir+"/done"))
	return s.String()
}

// execJobScript runs argv in dir and records its exit status and its
// duration in L1.
func execJobScript(job, dir string, env, argv []string) string {
	quoted := make([]string, len(argv))
	for i, a := range argv {
		quoted[i] = shQuote(a)
	}
	var s strings.Builder
	s.WriteString("# generated by kvmharness: runs in L1, chrooted into the host's root\n")
	s.WriteString(exportLine(env) + "\n")
	fmt.Fprintf(&s, "cd %s || { echo 97 > %s; echo ok > %s; exit; }\n", shQuote(dir), shQuote(job+"/rc"), shQuote(job+"/done"))
	// The heartbeat, as testJobScript's: a frozen L1 is kicked, then
	// killed, instead of holding the command until -l1-timeout.
	fmt.Fprintf(&s, "( while :; do cut -d' ' -f1 /proc/uptime > %s; sleep 2; done ) >/dev/null 2>&1 &\nhb=$!\n", shQuote(job+"/"+heartbeatFile))
	s.WriteString("start=$(cut -d' ' -f1 /proc/uptime)\n")
	fmt.Fprintf(&s, "%s </dev/null\n", strings.Join(quoted, " "))
	fmt.Fprintf(&s, "echo $? > %s\n", shQuote(job+"/rc"))
	s.WriteString("kill $hb 2>/dev/null\n")
	fmt.Fprintf(&s, "echo \"$start $(cut -d' ' -f1 /proc/uptime)\" > %s\n", shQuote(job+"/time"))
	fmt.Fprintf(&s, "echo ok > %s\n", shQuote(job+"/done"))
	return s.String()
}
