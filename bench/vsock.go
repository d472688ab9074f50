package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmm"
)

// The vsock benchmark's guest and what the host does with it.
const (
	// VsockGuestCID is the guest's context ID on both VMMs.
	VsockGuestCID = 3
	// VsockEchoPort is the guest port the echo program listens on.
	VsockEchoPort = 1234
	// VsockEchoBytes is what the throughput test sends through one
	// connection (and reads back, concurrently).
	VsockEchoBytes = 8 << 20
	// VsockRoundTrips is how many 1-byte round trips the latency test
	// makes on one connection.
	VsockRoundTrips = 200
	// VsockReadyTimeout bounds the wait for the guest to accept a
	// connection after the VMM starts (a boot under emulation is slow).
	VsockReadyTimeout = 5 * time.Minute
)

// VsockEchoScript is the guest side of the vsock benchmark: the echo program
// (internal/testguest/vsockecho, at /vsockecho in the initramfs) serves
// until the host stops the VM. If it exits, the guest says so and powers
// off, so the host sees the failure instead of waiting.
const VsockEchoScript = `
/vsockecho -listen 1234
echo "KILN-VSOCK-ECHO-EXITED rc=$?"
poweroff -f
`

// VsockResult is one VMM's vsock figures from one boot.
type VsockResult struct {
	// Echo is the time to write VsockEchoBytes through one connection
	// while reading the echo concurrently, until the last byte came back.
	Echo time.Duration
	// RTTs are the VsockRoundTrips round trips of one byte, in order.
	RTTs []time.Duration
	// Ready is the time from the VMM's start to the first accepted
	// connection.
	Ready time.Duration
	// RTTCPU is where CPU time went during the round trips, per round
	// trip; RTTCPUKnown is false where /proc could not tell.
	RTTCPU      VsockCPU
	RTTCPUKnown bool
	// RTTExits is the VM's KVM exits (and interrupts injected) per round
	// trip by KVMExitKinds' names, where KVM's debugfs statistics were
	// there to read; nil otherwise.
	RTTExits map[string]float64
}

// rttSample is what the round trips are measured by: CPU times and, where
// readable, the VM's KVM counters.
type rttSample struct {
	cpu   VsockCPU
	exits map[string]uint64 // nil: not known
}

// perRoundTrip turns two samples n round trips apart into r's figures.
func (r *VsockResult) perRoundTrip(before, after rttSample, n int) {
	r.RTTCPU, r.RTTCPUKnown = after.cpu.sub(before.cpu).div(n), true
	if before.exits == nil || after.exits == nil || n <= 0 {
		return
	}
	r.RTTExits = make(map[string]float64, len(after.exits))
	for k, v := range after.exits {
		if b, ok := before.exits[k]; ok && v >= b {
			r.RTTExits[k] = float64(v-b) / float64(n)
		}
	}
}

// VsockCPU is CPU time by where it ran (from /proc/PID/stat), per round
// trip: what the round trips cost each party, beside how long they took.
type VsockCPU struct {
	// Guest is the VMM process's guest time: the guest's kernel and its
	// echo program, in KVM_RUN.
	Guest time.Duration
	// VMM is the VMM process outside its guest: device emulation and exit
	// handling, user and system. Kiln's includes the bench's own client,
	// which runs in the same process.
	VMM time.Duration
	// Vhost is the host kernel's vhost worker (QEMU's vhost-vsock).
	Vhost time.Duration
	// Client is the bench's client, where it is a process apart from the
	// VMM (QEMU's runs).
	Client time.Duration
}

// Sum is all the CPU time.
func (c VsockCPU) Sum() time.Duration { return c.Guest + c.VMM + c.Vhost + c.Client }

func (c VsockCPU) sub(d VsockCPU) VsockCPU {
	return VsockCPU{Guest: c.Guest - d.Guest, VMM: c.VMM - d.VMM, Vhost: c.Vhost - d.Vhost, Client: c.Client - d.Client}
}

func (c VsockCPU) div(n int) VsockCPU {
	if n <= 0 {
		return VsockCPU{}
	}
	d := time.Duration(n)
	return VsockCPU{Guest: c.Guest / d, VMM: c.VMM / d, Vhost: c.Vhost / d, Client: c.Client / d}
}

// kilnCPU samples the CPU of this process, which is Kiln's VMM and the
// bench's client at once, and its VM's KVM counters.
func kilnCPU() (rttSample, error) {
	self, err := readCPUTimes(0)
	if err != nil {
		return rttSample{}, err
	}
	exits, _ := readKVMStats(kvmDebugfs, "/proc", os.Getpid())
	return rttSample{cpu: VsockCPU{Guest: self.Guest, VMM: self.Host}, exits: exits}, nil
}

// qemuCPU returns a sampler of QEMU process pid, its vhost worker
// (kernel thread vhost-PID, when there is one) and this process.
func qemuCPU(pid int) func() (rttSample, error) {
	vhost := -1
	return func() (rttSample, error) {
		if vhost < 0 {
			vhost = findTask("/proc", fmt.Sprintf("vhost-%d", pid))
		}
		q, err := readCPUTimes(pid)
		if err != nil {
			return rttSample{}, err
		}
		self, err := readCPUTimes(0)
		if err != nil {
			return rttSample{}, err
		}
		c := VsockCPU{Guest: q.Guest, VMM: q.Host, Client: self.Host}
		if vhost > 0 {
			v, err := readCPUTimes(vhost)
			if err != nil {
				return rttSample{}, fmt.Errorf("vhost worker: %w", err)
			}
			c.Vhost = v.Host + v.Guest
		}
		exits, _ := readKVMStats(kvmDebugfs, "/proc", pid)
		return rttSample{cpu: c, exits: exits}, nil
	}
}

// MiBps is the echo throughput in MiB/s each way.
func (r VsockResult) MiBps() float64 {
	if r.Echo <= 0 {
		return 0
	}
	return float64(VsockEchoBytes) / (1 << 20) / r.Echo.Seconds()
}

// vsockStream is a connected host-side stream to the guest's echo port.
type vsockStream interface {
	io.ReadWriteCloser
	SetDeadline(time.Time) error
}

// parseOKLine parses Kiln's answer to "CONNECT <port>\n": "OK <hostport>\n".
func parseOKLine(line string) (uint32, error) {
	rest, ok := strings.CutPrefix(line, "OK ")
	if !ok || !strings.HasSuffix(rest, "\n") {
		return 0, fmt.Errorf("vsock: answer %q to CONNECT is not \"OK <port>\\n\"", line)
	}
	port, err := strconv.ParseUint(strings.TrimSuffix(rest, "\n"), 10, 32)
	if err != nil {
		return 0, fmt.Errorf("vsock: answer %q to CONNECT: bad port: %w", line, err)
	}
	return uint32(port), nil
}

// maxOKLine bounds the answer to CONNECT ("OK " and a 32-bit port).
const maxOKLine = 32

// dialKilnVsock connects to guest port through a Kiln vsock device's Unix
// socket at path. It reads the answer byte by byte so that nothing of the
// stream after it is buffered here.
func dialKilnVsock(ctx context.Context, path string, port uint32) (vsockStream, error) {
	var d net.Dialer
	nc, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		return nil, fmt.Errorf("vsock: %w", err)
	}
	uc := nc.(*net.UnixConn)
	stop := context.AfterFunc(ctx, func() { uc.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	// Kiln bounds the wait for the guest's answer itself; this is a
	// backstop.
	uc.SetDeadline(time.Now().Add(30 * time.Second))
	if _, err := fmt.Fprintf(uc, "CONNECT %d\n", port); err != nil {
		uc.Close()
		return nil, fmt.Errorf("vsock: sending CONNECT: %w", err)
	}
	var line []byte
	b := make([]byte, 1)
	for len(line) < maxOKLine && (len(line) == 0 || line[len(line)-1] != '\n') {
		if _, err := uc.Read(b); err != nil {
			uc.Close()
			return nil, fmt.Errorf("vsock: connecting to guest port %d: got %q, then %w", port, line, err)
		}
		line = append(line, b[0])
	}
	if _, err := parseOKLine(string(line)); err != nil {
		uc.Close()
		return nil, err
	}
	if !stop() {
		uc.Close()
		return nil, ctx.Err()
	}
	uc.SetDeadline(time.Time{})
	return uc, nil
}

// vsockConnectTimeout bounds one AF_VSOCK connection attempt.
const vsockConnectTimeout = 10 * time.Second

// dialAFVsock connects to cid:port over the host kernel's AF_VSOCK (QEMU's
// vhost-vsock device is the other end) and returns the socket as a pollable
// file.
func dialAFVsock(ctx context.Context, cid, port uint32) (vsockStream, error) {
	fd, err := unix.Socket(unix.AF_VSOCK, unix.SOCK_STREAM|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
	if err != nil {
		return nil, fmt.Errorf("vsock: socket: %w", err)
	}
	if err := connectNonblock(ctx, fd, &unix.SockaddrVM{CID: cid, Port: port}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("vsock: connecting to %d:%d: %w", cid, port, err)
	}
	// The socket is non-blocking: os.NewFile registers it with the
	// runtime's poller, so reads, writes and deadlines work as on a
	// net.Conn (net.FileConn does not know AF_VSOCK).
	return os.NewFile(uintptr(fd), fmt.Sprintf("vsock:%d:%d", cid, port)), nil
}

// connectNonblock connects the non-blocking socket fd to sa, waiting for
// the outcome up to vsockConnectTimeout or until ctx ends.
func connectNonblock(ctx context.Context, fd int, sa unix.Sockaddr) error {
	err := unix.Connect(fd, sa)
	if err == nil {
		return nil
	}
	if !errors.Is(err, unix.EINPROGRESS) && !errors.Is(err, unix.EINTR) {
		return err
	}
	deadline := time.Now().Add(vsockConnectTimeout)
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		left := time.Until(deadline)
		if left <= 0 {
			return errors.New("connection timed out")
		}
		pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLOUT}}
		n, err := unix.Poll(pfd, int(min(left, 100*time.Millisecond)/time.Millisecond)+1)
		if errors.Is(err, unix.EINTR) || (err == nil && n == 0) {
			continue
		}
		if err != nil {
			return fmt.Errorf("poll: %w", err)
		}
		soerr, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ERROR)
		if err != nil {
			return fmt.Errorf("SO_ERROR: %w", err)
		}
		if soerr != 0 {
			return unix.Errno(soerr)
		}
		return nil
	}
}

// dialUntilReady retries dial until it connects, ctx ends, stopped is
// closed (the VM ended) or VsockReadyTimeout passes.
func dialUntilReady(ctx context.Context, dial func(context.Context) (vsockStream, error), stopped <-chan struct{}) (vsockStream, error) {
	ctx, cancel := context.WithTimeout(ctx, VsockReadyTimeout)
	defer cancel()
	var last error
	for {
		c, err := dial(ctx)
		if err == nil {
			return c, nil
		}
		last = err
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("guest not accepting on vsock port %d (%w); last try: %w", VsockEchoPort, ctx.Err(), last)
		case <-stopped:
			return nil, fmt.Errorf("the VM stopped before the guest accepted on vsock port %d; last try: %w", VsockEchoPort, last)
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// vsockIOTimeout bounds each measurement on a connection.
const vsockIOTimeout = 5 * time.Minute

// measureEcho writes n pseudo-random bytes to c while reading the echo
// concurrently, checks what came back and returns the time from the first
// write to the last byte read.
func measureEcho(ctx context.Context, c vsockStream, n int) (time.Duration, error) {
	data := make([]byte, n)
	rng := rand.NewChaCha8([32]byte{'k', 'i', 'l', 'n'})
	rng.Read(data)
	c.SetDeadline(time.Now().Add(vsockIOTimeout))
	defer c.SetDeadline(time.Time{})
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Unix(1, 0)) })
	defer stop()

	got := make([]byte, n)
	start := time.Now()
	werr := make(chan error, 1)
	go func() {
		const chunk = 64 << 10
		for off := 0; off < n; off += chunk {
			if _, err := c.Write(data[off:min(off+chunk, n)]); err != nil {
				werr <- fmt.Errorf("writing at byte %d: %w", off, err)
				return
			}
		}
		werr <- nil
	}()
	read, rerr := io.ReadFull(c, got)
	d := time.Since(start)
	if err := <-werr; err != nil {
		return 0, err
	}
	if rerr != nil {
		return 0, fmt.Errorf("reading the echo: %w after %d of %d bytes", rerr, read, n)
	}
	if !bytes.Equal(got, data) {
		return 0, fmt.Errorf("the echo of %d bytes differs from what was sent", n)
	}
	return d, nil
}

// measureRTT makes n round trips of one byte on c and returns their times.
func measureRTT(ctx context.Context, c vsockStream, n int) ([]time.Duration, error) {
	c.SetDeadline(time.Now().Add(vsockIOTimeout))
	defer c.SetDeadline(time.Time{})
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	rtts := make([]time.Duration, 0, n)
	out, in := []byte{0}, []byte{0}
	for i := range n {
		out[0] = byte(i)
		start := time.Now()
		if _, err := c.Write(out); err != nil {
			return rtts, fmt.Errorf("round trip %d: write: %w", i+1, err)
		}
		if _, err := io.ReadFull(c, in); err != nil {
			return rtts, fmt.Errorf("round trip %d: read: %w", i+1, err)
		}
		rtts = append(rtts, time.Since(start))
		if in[0] != out[0] {
			return rtts, fmt.Errorf("round trip %d: sent %#x, got %#x back", i+1, out[0], in[0])
		}
	}
	return rtts, nil
}

// measureVsock waits for the guest's echo port, then runs the throughput
// test on the first connection and the latency test on a second, sampling
// cpu (when not nil) before and after the round trips.
func measureVsock(ctx context.Context, start time.Time, dial func(context.Context) (vsockStream, error), stopped <-chan struct{}, cpu func() (rttSample, error)) (VsockResult, error) {
	var r VsockResult
	c, err := dialUntilReady(ctx, dial, stopped)
	if err != nil {
		return r, err
	}
	r.Ready = time.Since(start)
	r.Echo, err = measureEcho(ctx, c, VsockEchoBytes)
	c.Close()
	if err != nil {
		return r, fmt.Errorf("throughput: %w", err)
	}
	c, err = dial(ctx)
	if err != nil {
		return r, fmt.Errorf("latency: %w", err)
	}
	defer c.Close()
	var before rttSample
	known := cpu != nil
	if known {
		before, err = cpu()
		known = err == nil
	}
	r.RTTs, err = measureRTT(ctx, c, VsockRoundTrips)
	if err != nil {
		return r, fmt.Errorf("latency: %w", err)
	}
	if known {
		if after, err := cpu(); err == nil {
			r.perRoundTrip(before, after, len(r.RTTs))
		}
	}
	return r, nil
}

// VsockKiln boots s on Kiln with a vsock device (guest CID VsockGuestCID,
// host socket in dir), measures the guest's echo program through it, and
// stops the VM. s.Initrd must run VsockEchoScript with /vsockecho.
func VsockKiln(ctx context.Context, s BootSpec, dir string) (VsockResult, error) {
	path := filepath.Join(dir, "vsock.sock")
	dev := virtio.DeviceSpec{ID: "vsock", Kind: virtio.KindVsock, Vsock: &virtio.VsockSpec{CID: VsockGuestCID, Path: path}}
	w := newMarkerWriter()
	start := time.Now()
	vm, err := vmm.New(vmm.Config{
		Spec:      vmm.Spec{Kernel: s.Kernel, Initrd: s.Initrd, Cmdline: s.Cmdline, CPUs: s.CPUs, MemoryMiB: s.MemoryMiB, Devices: []virtio.DeviceSpec{dev}},
		Logger:    slog.New(slog.DiscardHandler),
		Console:   w,
		HoldProcs: s.HoldProcs,
	})
	if err != nil {
		return VsockResult{}, err
	}
	defer vm.Close()
	runCtx, stopVM := context.WithCancel(ctx)
	defer stopVM()
	type result struct {
		exit vmm.Exit
		err  error
	}
	ran := make(chan result, 1)
	stopped := make(chan struct{})
	go func() {
		e, err := vm.Run(runCtx)
		ran <- result{e, err}
		close(stopped)
	}()
	r, err := measureVsock(ctx, start, func(ctx context.Context) (vsockStream, error) {
		return dialKilnVsock(ctx, path, VsockEchoPort)
	}, stopped, kilnCPU)
	stopVM()
	res := <-ran
	if err != nil {
		return r, fmt.Errorf("%w (VM: %v, %v); console: %s", err, res.exit, res.err, w.tail())
	}
	if res.err != nil || res.exit.Reason != vmm.ReasonCancelled {
		return r, fmt.Errorf("kiln guest ended with %v, %v before the host stopped it: %s", res.exit, res.err, w.tail())
	}
	return r, nil
}

// QEMUVsockArgs is the peer's command line for the vsock benchmark:
// QEMUArgs with a virtio-mmio vhost-vsock device (needs /dev/vhost-vsock).
func QEMUVsockArgs(s BootSpec) []string {
	return append(QEMUArgs(s), "-device", fmt.Sprintf("vhost-vsock-device,guest-cid=%d", VsockGuestCID))
}

// VsockQEMU does the same as VsockKiln on QEMU microvm with vhost-vsock;
// the host side is the host kernel's AF_VSOCK.
func VsockQEMU(ctx context.Context, qemu string, s BootSpec) (VsockResult, error) {
	w := newMarkerWriter()
	cmd := exec.CommandContext(ctx, qemu, QEMUVsockArgs(s)...)
	cmd.Stdout, cmd.Stderr = w, w
	start := time.Now()
	if err := cmd.Start(); err != nil {
		return VsockResult{}, fmt.Errorf("start %s: %w", qemu, err)
	}
	var waitErr error
	stopped := make(chan struct{})
	go func() {
		waitErr = cmd.Wait()
		close(stopped)
	}()
	r, err := measureVsock(ctx, start, func(ctx context.Context) (vsockStream, error) {
		return dialAFVsock(ctx, VsockGuestCID, VsockEchoPort)
	}, stopped, qemuCPU(cmd.Process.Pid))
	select {
	case <-stopped:
		if err == nil {
			err = fmt.Errorf("qemu exited before the host stopped it: %v", waitErr)
		}
	default:
		cmd.Process.Kill()
		<-stopped
	}
	if err != nil {
		return r, fmt.Errorf("%w; qemu console: %s", err, w.tail())
	}
	return r, nil
}
