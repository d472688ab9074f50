package virtio_test

import (
	"bufio"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kilnvm/kiln/initramfs"
	"github.com/kilnvm/kiln/internal/kvmtest"
	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmm"
)

// vsockConnect connects a host process to guest port through the device's
// socket: it returns the connection and a reader past the "OK" line, or the
// error when the guest refused.
func vsockConnect(path string, port uint32) (*net.UnixConn, *bufio.Reader, error) {
	nc, err := net.Dial("unix", path)
	if err != nil {
		return nil, nil, err
	}
	uc := nc.(*net.UnixConn)
	if _, err := fmt.Fprintf(uc, "CONNECT %d\n", port); err != nil {
		uc.Close()
		return nil, nil, err
	}
	r := bufio.NewReaderSize(uc, 64<<10)
	uc.SetReadDeadline(time.Now().Add(30 * time.Second))
	line, err := r.ReadString('\n')
	uc.SetReadDeadline(time.Time{})
	if err != nil || !strings.HasPrefix(line, "OK ") {
		uc.Close()
		return nil, nil, fmt.Errorf("connecting to guest port %d: got %q, %v", port, line, err)
	}
	return uc, r, nil
}

// vsockEcho sends data through a guest echo connection and returns the
// sha256 of what comes back.
func vsockEcho(path string, port uint32, data []byte) ([32]byte, int, error) {
	uc, r, err := vsockConnect(path, port)
	if err != nil {
		return [32]byte{}, 0, err
	}
	defer uc.Close()
	werr := make(chan error, 1)
	go func() {
		_, err := uc.Write(data)
		if err == nil {
			err = uc.CloseWrite()
		}
		werr <- err
	}()
	h := sha256.New()
	n, err := io.Copy(h, r)
	if err != nil {
		return [32]byte{}, int(n), fmt.Errorf("reading the echo: %w", err)
	}
	if err := <-werr; err != nil {
		return [32]byte{}, int(n), fmt.Errorf("writing: %w", err)
	}
	var sum [32]byte
	copy(sum[:], h.Sum(nil))
	return sum, int(n), nil
}

// TestKVMVirtioVsock boots Debian's kernel with a vsock device; the guest
// runs vsockecho, which echoes on port 1234 and dials the host on port
// 5000. The host echoes 16 MiB through one connection and 64 KiB through
// each of 32 concurrent ones, checks that a connection to a port nobody
// listens on fails fast, and that the guest's connection reached the host
// listener on <path>_5000.
func TestKVMVirtioVsock(t *testing.T) {
	kvmtest.Require(t)
	k := kvmtest.Kernel(t)
	if k.Vmlinux == "" {
		t.Fatal("the kernel cache has no vmlinux (make kernel extracts it)")
	}
	t0 := time.Now()
	echoBin := kvmtest.VsockEchoBinary(t)
	t.Logf("vsockecho ready in %v", time.Since(t0).Round(time.Millisecond))
	initrd := kvmtest.ModulesInitrd(t, []string{"virtio_mmio", "vmw_vsock_virtio_transport"}, `
/vsockecho -listen 1234 -exit-port 1235 -dial 5000 -msg hello-from-guest
echo "KILN-VSOCK-DONE rc=$?"
poweroff -f
`)
	// ModulesInitrd takes no extra files: append a second cpio archive
	// with the program (Linux unpacks concatenated archives).
	b := initramfs.New()
	if err := b.AddHostFile("vsockecho", echoBin, 0o755); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(initrd, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.WriteTo(f); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}

	dir, err := os.MkdirTemp("", "kiln-vsock")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "v.sock")
	dev := virtio.DeviceSpec{ID: "vsock", Kind: virtio.KindVsock, Vsock: &virtio.VsockSpec{CID: 3, Path: path}}

	// The guest dials port 5000: a host listener on path_5000 answers.
	ln, err := net.Listen("unix", path+"_5000")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	fromGuest := make(chan string, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			fromGuest <- "accept: " + err.Error()
			return
		}
		defer c.Close()
		msg, err := io.ReadAll(io.LimitReader(c, 4096))
		if err != nil {
			fromGuest <- "read: " + err.Error()
			return
		}
		fmt.Fprintf(c, "hello-from-host:%s", msg)
		fromGuest <- string(msg)
	}()

	var out kvmtest.Console
	start := time.Now()
	vm, err := vmm.New(vmm.Config{
		Spec:    vmm.Spec{Kernel: k.Vmlinux, Initrd: initrd, CPUs: 1, MemoryMiB: 256, Devices: []virtio.DeviceSpec{dev}},
		Console: &out,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer vm.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	type result struct {
		exit vmm.Exit
		err  error
	}
	done := make(chan result, 1)
	go func() {
		exit, err := vm.Run(ctx)
		done <- result{exit, err}
	}()
	stopGuest := func() {
		cancel()
		<-done
	}

	for !strings.Contains(out.String(), "vsockecho: listening") {
		select {
		case r := <-done:
			t.Fatalf("guest stopped (%v, %v) before vsockecho listened; console:\n%s", r.exit, r.err, out.String())
		case <-time.After(50 * time.Millisecond):
		}
	}
	t.Logf("guest ready after %v", time.Since(start).Round(time.Millisecond))

	// A guest-initiated connection reaches the host listener.
	select {
	case msg := <-fromGuest:
		if msg != "hello-from-guest" {
			t.Errorf("host listener got %q", msg)
		}
	case <-time.After(60 * time.Second):
		t.Errorf("no guest connection to %s_5000", path)
	}

	// A port nobody listens on fails fast.
	t0 = time.Now()
	if uc, _, err := vsockConnect(path, 4444); err == nil {
		uc.Close()
		t.Error("connected to guest port 4444, where nobody listens")
	}
	refuse := time.Since(t0)
	if refuse > 5*time.Second {
		t.Errorf("refusal took %v", refuse)
	}
	t.Logf("connection to an unlistened port failed in %v", refuse.Round(time.Millisecond))

	// 16 MiB through one connection.
	big := make([]byte, 16<<20)
	rand.Read(big)
	t0 = time.Now()
	sum, n, err := vsockEcho(path, 1234, big)
	if err != nil {
		stopGuest()
		t.Fatalf("16 MiB echo: %v after %d bytes; console:\n%s", err, n, out.String())
	}
	if sum != sha256.Sum256(big) {
		t.Errorf("16 MiB echo: %d bytes came back with a different sha256", n)
	}
	d := time.Since(t0)
	t.Logf("16 MiB echoed in %v (%.1f MiB/s each way)", d.Round(time.Millisecond), 16/d.Seconds())

	// 32 concurrent connections.
	t0 = time.Now()
	var wg sync.WaitGroup
	errs := make(chan error, 32)
	for i := range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			data := make([]byte, 64<<10+i*1000)
			rand.Read(data)
			sum, n, err := vsockEcho(path, 1234, data)
			if err != nil {
				errs <- fmt.Errorf("connection %d: %w after %d bytes", i, err, n)
			} else if sum != sha256.Sum256(data) {
				errs <- fmt.Errorf("connection %d: %d bytes came back different", i, n)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	t.Logf("32 concurrent echoes in %v", time.Since(t0).Round(time.Millisecond))

	if !strings.Contains(out.String(), `vsockecho: dial reply "hello-from-host:hello-from-guest"`) {
		t.Errorf("the guest did not print the host's reply; console:\n%s", out.String())
	}

	// Make the guest exit and power off.
	if uc, _, err := vsockConnect(path, 1235); err == nil {
		uc.Close()
	}
	var r result
	select {
	case r = <-done:
	case <-time.After(60 * time.Second):
		stopGuest()
		t.Fatalf("guest did not power off; console:\n%s", out.String())
	}
	t.Logf("guest ran %v", time.Since(start).Round(time.Millisecond))
	if r.err != nil || r.exit.Reason != vmm.ReasonPowerOff || !strings.Contains(out.String(), "KILN-VSOCK-DONE rc=0") {
		t.Fatalf("stopped with %v, %v; console:\n%s", r.exit, r.err, out.String())
	}
	if t.Failed() {
		t.Logf("console:\n%s", out.String())
	}
}
