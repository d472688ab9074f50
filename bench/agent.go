package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/mdlayher/vsock"

	"github.com/kilnvm/kiln/guest/agentpb"
	"github.com/kilnvm/kiln/guest/client"
	"github.com/kilnvm/kiln/guestkernel"
	"github.com/kilnvm/kiln/sandbox"
	"github.com/kilnvm/kiln/vmm"
)

// The agent benchmarks: cold start (VM creation to the first exec's result)
// and exec round trips, on a Kiln sandbox (sandbox.Start) and on QEMU
// microvm booting the same kernel, agent initramfs and command line, with a
// vhost-vsock device through which the host reaches the same agent.

// SandboxCmdline is the kernel command line sandbox.Start gives a guest
// without a disk and with the default host name (sandbox's
// Options.vmConfig); QEMU gets the same, and CompareStart checks that both
// guests booted with it (/proc/cmdline).
const SandboxCmdline = vmm.DefaultCmdline + " quiet " + sandbox.IdleCmdline + " kiln.hostname=kiln"

// Defaults of StartSpec.
const (
	// DefaultStartExecs is how many execs of `true` are timed on each VM
	// after the first.
	DefaultStartExecs = 50
	// DefaultStartBootTimeout bounds the wait for the agent (a boot under
	// emulation takes minutes).
	DefaultStartBootTimeout = 5 * time.Minute
	// startExecTimeout bounds one exec.
	startExecTimeout = 2 * time.Minute
)

// VhostVsockDevice is the host device QEMU's vhost-vsock-device opens.
const VhostVsockDevice = "/dev/vhost-vsock"

// StartSpec is one sandbox guest to start on both VMMs.
type StartSpec struct {
	// Name labels the kernel in reports ("debian 6.1.0-57-amd64").
	Name string
	// Kernel is the kernel image; Initrd an agent initramfs for it
	// (sandbox.AgentInitrd).
	Kernel, Initrd string
	// Cmdline is appended to SandboxCmdline on both VMMs
	// (sandbox.Options.Cmdline).
	Cmdline string
	// CPUs and MemoryMiB size the VM (1 and 512 when zero, as sandbox).
	CPUs, MemoryMiB int
	// Execs is how many execs of `true` are timed after the first
	// (DefaultStartExecs when zero).
	Execs int
	// BootTimeout bounds the wait for the agent (DefaultStartBootTimeout
	// when zero).
	BootTimeout time.Duration
	// QEMUCID is the guest CID of QEMU's vhost-vsock device, which must be
	// unique on the host; zero picks one at random per boot. (Kiln's
	// device is in userspace: its CID is sandbox.GuestCID.)
	QEMUCID uint32
}

func (s StartSpec) withDefaults() StartSpec {
	if s.CPUs == 0 {
		s.CPUs = 1
	}
	if s.MemoryMiB == 0 {
		s.MemoryMiB = 512
	}
	if s.Execs == 0 {
		s.Execs = DefaultStartExecs
	}
	if s.BootTimeout <= 0 {
		s.BootTimeout = DefaultStartBootTimeout
	}
	return s
}

// KernelCmdline is the command line both VMMs give the guest.
func (s StartSpec) KernelCmdline() string {
	if s.Cmdline == "" {
		return SandboxCmdline
	}
	return SandboxCmdline + " " + s.Cmdline
}

func (s StartSpec) validate() error {
	if s.Kernel == "" || s.Initrd == "" {
		return errors.New("bench: start spec needs a kernel and an agent initramfs")
	}
	if s.CPUs < 0 || s.MemoryMiB < 0 || s.Execs < 0 {
		return fmt.Errorf("bench: start spec: negative size (%d vCPUs, %d MiB, %d execs)", s.CPUs, s.MemoryMiB, s.Execs)
	}
	return nil
}

// StartResult is one boot's figures.
type StartResult struct {
	// Ready is VM creation (Kiln) or process start (QEMU) to the agent's
	// first answer to Health.
	Ready time.Duration
	// ColdStart is the same start to the result of the first exec of
	// `true`: the headline.
	ColdStart time.Duration
	// RTTs are the round trips of the execs of `true` after the first, in
	// order.
	RTTs []time.Duration
	// GuestCmdline is the guest's /proc/cmdline, read after the timing.
	GuestCmdline string
}

// Percentile returns the nearest-rank p-th percentile (0 < p <= 100) of ds,
// 0 for none.
func Percentile(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 || !(p > 0) {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	rank := int(math.Ceil(float64(len(s)) * min(p, 100) / 100))
	return s[max(rank, 1)-1]
}

// agentVM is a booted VM whose agent answered.
type agentVM struct {
	client *client.Client
	start  time.Time     // VM creation or process start
	ready  time.Duration // start to the agent's answer
	// console returns the end of the guest's serial console.
	console func() string
	// stop stops the VM and releases it.
	stop func() error
}

// startKilnVM starts s as a Kiln sandbox; the clock starts just before
// sandbox.Start.
func startKilnVM(ctx context.Context, s StartSpec) (*agentVM, error) {
	opts := sandbox.Options{Runtime: sandbox.Runtime{Kernel: s.Kernel, Initrd: s.Initrd}, Cmdline: s.Cmdline,
		CPUs: s.CPUs, MemoryMiB: s.MemoryMiB, BootTimeout: s.BootTimeout}
	start := time.Now()
	sb, err := sandbox.Start(ctx, opts)
	if err != nil {
		return nil, fmt.Errorf("kiln: %w", err)
	}
	return &agentVM{
		client:  sb.Client(),
		start:   start,
		ready:   time.Since(start),
		console: func() string { return lastBytes(sb.Console(), 2000) },
		stop: func() error {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			return sb.Close(ctx)
		},
	}, nil
}

// EnsureVhostVsock makes sure VhostVsockDevice exists, loading the
// vhost_vsock module if it does not, and says how to fix it otherwise.
func EnsureVhostVsock() error {
	if _, err := os.Stat(VhostVsockDevice); err == nil {
		return nil
	}
	out, merr := exec.Command("modprobe", "vhost_vsock").CombinedOutput()
	// devtmpfs creates the node as the module registers it; give it a
	// moment all the same.
	for range 10 {
		if _, err := os.Stat(VhostVsockDevice); err == nil {
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	if merr != nil {
		return fmt.Errorf("bench: QEMU's vhost-vsock device needs %s, which is missing, and modprobe vhost_vsock failed (%w): %s",
			VhostVsockDevice, merr, strings.TrimSpace(string(out)))
	}
	return fmt.Errorf("bench: QEMU's vhost-vsock device needs %s, which is missing even after modprobe vhost_vsock", VhostVsockDevice)
}

// QEMUStartArgs is the peer's command line for s: QEMUArgs with the
// sandbox's command line, a vhost-vsock device with guest CID cid and a
// virtio RNG (sandbox gives Kiln's guest both).
func QEMUStartArgs(s StartSpec, cid uint32) []string {
	s = s.withDefaults()
	args := QEMUArgs(BootSpec{Kernel: s.Kernel, Initrd: s.Initrd, Cmdline: s.KernelCmdline(), CPUs: s.CPUs, MemoryMiB: s.MemoryMiB})
	return append(args,
		"-device", fmt.Sprintf("vhost-vsock-device,guest-cid=%d", cid),
		"-device", "virtio-rng-device")
}

// randomCID picks a vhost-vsock guest CID unlikely to be taken on the host
// (3 and up are guests'; other VMs tend to use small ones).
func randomCID() uint32 { return 1000 + rand.Uint32N(1<<30) }

// AFVsockDialer dials the agent's port at cid over the host kernel's
// AF_VSOCK (QEMU's vhost-vsock device is the other end).
func AFVsockDialer(cid uint32) client.DialFunc {
	return func(ctx context.Context) (net.Conn, error) {
		c, err := vsock.DialContext(ctx, cid, agentpb.Port, nil)
		if err != nil {
			return nil, fmt.Errorf("vsock %d:%d: %w", cid, agentpb.Port, err)
		}
		return c, nil
	}
}

// startQEMUVM starts s on QEMU microvm and waits for the agent over
// AF_VSOCK; the clock starts just before the process does.
func startQEMUVM(ctx context.Context, qemu string, s StartSpec) (*agentVM, error) {
	if err := EnsureVhostVsock(); err != nil {
		return nil, err
	}
	cid := s.QEMUCID
	if cid == 0 {
		cid = randomCID()
	}
	w := newMarkerWriter()
	cmd := exec.Command(qemu, QEMUStartArgs(s, cid)...)
	cmd.Stdout, cmd.Stderr = w, w
	start := time.Now()
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("qemu: start %s: %w", qemu, err)
	}
	var waitErr error
	stopped := make(chan struct{})
	go func() {
		waitErr = cmd.Wait()
		close(stopped)
	}()
	stop := func() error {
		select {
		case <-stopped:
			return fmt.Errorf("qemu exited before the host stopped it: %v", waitErr)
		default:
		}
		if err := cmd.Process.Kill(); err != nil {
			return fmt.Errorf("qemu: kill: %w", err)
		}
		<-stopped
		return nil
	}
	wctx, cancel := context.WithTimeout(ctx, s.BootTimeout)
	defer cancel()
	// A QEMU that exits (a bad flag, a CID in use) ends the wait.
	go func() {
		select {
		case <-stopped:
			cancel()
		case <-wctx.Done():
		}
	}()
	c, err := client.WaitReadyFunc(wctx, AFVsockDialer(cid))
	if err != nil {
		select {
		case <-stopped:
			return nil, fmt.Errorf("qemu exited before the agent answered (%v): %s", waitErr, w.tail())
		default:
		}
		stop()
		return nil, fmt.Errorf("qemu: agent did not answer within %v: %w; console: %s", s.BootTimeout, err, w.tail())
	}
	return &agentVM{
		client:  c,
		start:   start,
		ready:   time.Since(start),
		console: w.tail,
		stop: func() error {
			c.Close()
			return stop()
		},
	}, nil
}

// execTrue runs `true` in the guest and checks that it succeeded.
func execTrue(ctx context.Context, c *client.Client) error {
	ctx, cancel := context.WithTimeout(ctx, startExecTimeout)
	defer cancel()
	st, err := c.Exec(ctx, client.ExecOptions{Argv: []string{"true"}})
	if err != nil {
		return err
	}
	if !st.Success() {
		return fmt.Errorf("true: %v", st)
	}
	return nil
}

// guestCmdline reads the guest's /proc/cmdline.
func guestCmdline(ctx context.Context, c *client.Client) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, startExecTimeout)
	defer cancel()
	var out, errOut bytes.Buffer
	st, err := c.Exec(ctx, client.ExecOptions{Argv: []string{"cat", "/proc/cmdline"}, Stdout: &out, Stderr: &errOut})
	if err != nil {
		return "", fmt.Errorf("reading /proc/cmdline: %w", err)
	}
	if !st.Success() {
		return "", fmt.Errorf("reading /proc/cmdline: %v: %s", st, strings.TrimSpace(errOut.String()))
	}
	return strings.TrimSpace(out.String()), nil
}

// measure times the first exec (from the VM's start), then n more, then
// reads the guest's command line.
func (vm *agentVM) measure(ctx context.Context, n int) (StartResult, error) {
	r := StartResult{Ready: vm.ready}
	if err := execTrue(ctx, vm.client); err != nil {
		return r, fmt.Errorf("first exec: %w", err)
	}
	r.ColdStart = time.Since(vm.start)
	r.RTTs = make([]time.Duration, 0, n)
	for i := range n {
		t := time.Now()
		if err := execTrue(ctx, vm.client); err != nil {
			return r, fmt.Errorf("exec %d of %d: %w", i+1, n, err)
		}
		r.RTTs = append(r.RTTs, time.Since(t))
	}
	var err error
	r.GuestCmdline, err = guestCmdline(ctx, vm.client)
	return r, err
}

// measureAndStop measures vm and stops it.
func (vm *agentVM) measureAndStop(ctx context.Context, n int, who string) (StartResult, error) {
	r, err := vm.measure(ctx, n)
	serr := vm.stop()
	if err != nil {
		return r, fmt.Errorf("%s: %w; console: %s", who, err, vm.console())
	}
	if serr != nil {
		return r, fmt.Errorf("%s: stopping the VM: %w", who, serr)
	}
	return r, nil
}

// StartKiln starts s as a Kiln sandbox, times VM creation to the first
// exec's result and then s.Execs exec round trips, and closes it.
func StartKiln(ctx context.Context, s StartSpec) (StartResult, error) {
	s = s.withDefaults()
	if err := s.validate(); err != nil {
		return StartResult{}, err
	}
	vm, err := startKilnVM(ctx, s)
	if err != nil {
		return StartResult{}, err
	}
	return vm.measureAndStop(ctx, s.Execs, "kiln")
}

// StartQEMU does the same as StartKiln on QEMU microvm (qemu is the
// qemu-system-x86_64 binary) with a vhost-vsock device, reaching the agent
// over AF_VSOCK, and kills QEMU at the end. It needs VhostVsockDevice (see
// EnsureVhostVsock).
func StartQEMU(ctx context.Context, qemu string, s StartSpec) (StartResult, error) {
	s = s.withDefaults()
	if err := s.validate(); err != nil {
		return StartResult{}, err
	}
	vm, err := startQEMUVM(ctx, qemu, s)
	if err != nil {
		return StartResult{}, err
	}
	return vm.measureAndStop(ctx, s.Execs, "qemu")
}

// StartComparison is CompareStart's samples.
type StartComparison struct {
	Kiln, QEMU []StartResult
}

// ColdStart compares the cold starts, one sample per boot.
func (c StartComparison) ColdStart() Comparison {
	var r Comparison
	for _, k := range c.Kiln {
		r.Kiln = append(r.Kiln, k.ColdStart)
	}
	for _, q := range c.QEMU {
		r.Peer = append(r.Peer, q.ColdStart)
	}
	return r
}

// RTT compares the exec round trips of all boots together.
func (c StartComparison) RTT() Comparison {
	var r Comparison
	for _, k := range c.Kiln {
		r.Kiln = append(r.Kiln, k.RTTs...)
	}
	for _, q := range c.QEMU {
		r.Peer = append(r.Peer, q.RTTs...)
	}
	return r
}

// checkCmdline checks that a guest booted with want: its /proc/cmdline is
// want, or want followed by what the VMM adds itself (QEMU microvm names
// its virtio-mmio transports).
func checkCmdline(who, got, want string) error {
	if got == want || strings.HasPrefix(got, want+" ") {
		return nil
	}
	return fmt.Errorf("bench: the %s guest booted with %q, not %q: the VMMs' command lines differ (has sandbox's changed? see SandboxCmdline)", who, got, want)
}

// CompareStart starts s n times on each VMM, alternating (Kiln first in odd
// runs, QEMU first in even ones, so that neither always follows the
// other), after WarmUp, and writes one line per boot to progress (nil:
// none). It checks that both guests got the same command line.
func CompareStart(ctx context.Context, qemu string, s StartSpec, n int, progress io.Writer) (StartComparison, error) {
	var c StartComparison
	if n < 1 {
		return c, errors.New("bench: need at least one run")
	}
	if err := WarmUp(ctx, qemu, s); err != nil {
		return c, err
	}
	for i := range n {
		if err := c.Run(ctx, qemu, s, i, progress); err != nil {
			return c, err
		}
	}
	return c, nil
}

// WarmUp reads s's kernel and initramfs into the page cache and runs qemu
// -version once, so that the first timed boot does not pay for reading
// them (under kvmharness the files come over 9p) more than the others.
func WarmUp(ctx context.Context, qemu string, s StartSpec) error {
	for _, p := range []string{s.Kernel, s.Initrd} {
		f, err := os.Open(p)
		if err != nil {
			return fmt.Errorf("bench: warm-up: %w", err)
		}
		_, err = io.Copy(io.Discard, f)
		f.Close()
		if err != nil {
			return fmt.Errorf("bench: warm-up: reading %s: %w", p, err)
		}
	}
	if out, err := exec.CommandContext(ctx, qemu, "-version").CombinedOutput(); err != nil {
		return fmt.Errorf("bench: warm-up: %s -version: %w: %s", qemu, err, strings.TrimSpace(string(out)))
	}
	return nil
}

// Run adds run i (from 0) of CompareStart to c: one boot on each VMM,
// Kiln first when i is even.
func (c *StartComparison) Run(ctx context.Context, qemu string, s StartSpec, i int, progress io.Writer) error {
	s = s.withDefaults()
	if err := s.validate(); err != nil {
		return err
	}
	kiln := func() error {
		r, err := StartKiln(ctx, s)
		if err == nil {
			err = checkCmdline("kiln", r.GuestCmdline, s.KernelCmdline())
		}
		if err != nil {
			return fmt.Errorf("run %d: %w", i+1, err)
		}
		c.Kiln = append(c.Kiln, r)
		reportStart(progress, i, "kiln", r)
		return nil
	}
	peer := func() error {
		r, err := StartQEMU(ctx, qemu, s)
		if err == nil {
			err = checkCmdline("qemu", r.GuestCmdline, s.KernelCmdline())
		}
		if err != nil {
			return fmt.Errorf("run %d: %w", i+1, err)
		}
		c.QEMU = append(c.QEMU, r)
		reportStart(progress, i, "qemu", r)
		return nil
	}
	first, second := kiln, peer
	if i%2 == 1 {
		first, second = peer, kiln
	}
	if err := first(); err != nil {
		return err
	}
	return second()
}

func reportStart(w io.Writer, i int, who string, r StartResult) {
	if w == nil {
		return
	}
	fmt.Fprintf(w, "run %d: %-4s cold start %v (agent ready %v), exec round trip median %v, p90 %v (%d execs)\n",
		i+1, who, r.ColdStart.Round(time.Millisecond), r.Ready.Round(time.Millisecond),
		Median(r.RTTs).Round(10*time.Microsecond), Percentile(r.RTTs, 90).Round(10*time.Microsecond), len(r.RTTs))
}

// The kernels CompareStart is run on.
const (
	// KernelDebian is the cached Debian kernel (make kernel), whose agent
	// initramfs carries its virtio and vsock modules.
	KernelDebian = "debian"
	// KernelMinimal is the minimal kernel (make guest-kernel), with
	// everything built in.
	KernelMinimal = "minimal"
)

// ErrNoMinimalKernel is returned (wrapped) when make guest-kernel has not
// been run.
var ErrNoMinimalKernel = errors.New("no minimal guest kernel (make guest-kernel)")

// MinimalKernel returns the minimal kernel's image, its ELF vmlinux when
// there is one (both VMMs enter it through PVH, skipping the decompressor),
// else its bzImage, and its release (the folder <cache>/guest-kernel/current
// points to).
func MinimalKernel() (image, release string, err error) {
	cache, err := guestkernel.CacheDir()
	if err != nil {
		return "", "", fmt.Errorf("bench: %w", err)
	}
	dir, err := filepath.EvalSymlinks(filepath.Join(cache, "guest-kernel", "current"))
	if err != nil {
		return "", "", fmt.Errorf("bench: %w: %w", ErrNoMinimalKernel, err)
	}
	for _, name := range []string{"vmlinux", "bzImage"} {
		p := filepath.Join(dir, name)
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() {
			return p, filepath.Base(dir), nil
		}
	}
	return "", "", fmt.Errorf("bench: %w: %s has neither vmlinux nor bzImage", ErrNoMinimalKernel, dir)
}

// StartSpecFor returns the spec for kernel: KernelDebian, KernelMinimal or
// the path of a kernel image (which then gets no modules: it must have
// virtio-mmio, vsock and virtio-rng built in), with an agent initramfs
// built from agent (sandbox.AgentInitrd, cached).
func StartSpecFor(kernel, agent string) (StartSpec, error) {
	var s StartSpec
	var k *guestkernel.Kernel
	switch kernel {
	case "":
		return s, errors.New("bench: no kernel named")
	case KernelDebian:
		var err error
		if k, err = guestkernel.Find(); err != nil {
			return s, fmt.Errorf("bench: %w", err)
		}
		s.Name, s.Kernel = KernelDebian+" "+k.Version, k.Image
		if k.Vmlinux != "" {
			s.Kernel = k.Vmlinux
		}
	case KernelMinimal:
		img, release, err := MinimalKernel()
		if err != nil {
			return s, err
		}
		s.Name, s.Kernel = KernelMinimal+" "+release, img
	default:
		fi, err := os.Stat(kernel)
		if err != nil {
			return s, fmt.Errorf("bench: kernel: %w", err)
		}
		if !fi.Mode().IsRegular() {
			return s, fmt.Errorf("bench: kernel %s is not a file", kernel)
		}
		s.Name, s.Kernel = kernel, kernel
	}
	initrd, err := sandbox.AgentInitrd(agent, k, initrdCache())
	if err != nil {
		return s, err
	}
	s.Initrd = initrd
	return s, nil
}

// lastBytes returns the end of s, at most n bytes.
func lastBytes(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}

// initrdCache is where the benchmarks keep agent initramfs images: under
// the kernel cache, as the kiln command does; "" (a temporary folder)
// without one.
func initrdCache() string {
	if cache, err := guestkernel.CacheDir(); err == nil {
		return filepath.Join(cache, "initramfs")
	}
	return ""
}
