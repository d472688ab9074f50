package vmmproc

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/internal/seccomptest"
	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmm"
	"github.com/kilnvm/kiln/vmmproc/vmmpb"
)

// TestMain lets the test binary serve as a VMM process: Start runs it
// with SocketEnv set.
func TestMain(m *testing.M) {
	if os.Getenv(SocketEnv) != "" {
		if trigger := os.Getenv(seccomptest.TriggerEnv); trigger != "" {
			go seccomptest.Watch(context.Background(), trigger)
		}
		os.Exit(ServeMain(context.Background(), "", nil))
	}
	os.Exit(m.Run())
}

// startSelf starts the test binary as a VMM process in a new folder.
func startSelf(t *testing.T) *Process {
	t.Helper()
	dir, err := os.MkdirTemp("", "vmmproc-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p, err := Start(ctx, StartConfig{Command: []string{os.Args[0], "-test.run=^$"}, Dir: dir})
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(func() { p.Close(context.Background()) })
	return p
}

func TestFDChannel(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "fd.sock")
	ln, err := listenUnix(path)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	store := newFDStore()
	defer store.closeAll()
	go store.serveFDs(ln)
	ctx := context.Background()

	fd, err := unix.MemfdCreate("vmmproc-test", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), "memfd")
	defer f.Close()
	if _, err := f.WriteString("frozen memory"); err != nil {
		t.Fatal(err)
	}
	token, _ := newToken()
	if err := putFD(ctx, path, token, f); err != nil {
		t.Fatalf("PUT: %v", err)
	}
	if err := putFD(ctx, path, token, f); err == nil || !strings.Contains(err.Error(), "taken") {
		t.Fatalf("second PUT of one token: %v", err)
	}
	got, err := getFD(ctx, path, token)
	if err != nil {
		t.Fatalf("GET: %v", err)
	}
	defer got.Close()
	b := make([]byte, 13)
	if _, err := got.ReadAt(b, 0); err != nil || string(b) != "frozen memory" {
		t.Fatalf("read %q, %v through the passed descriptor", b, err)
	}
	if _, err := getFD(ctx, path, token); err == nil || !strings.Contains(err.Error(), "no descriptor") {
		t.Fatalf("second GET: %v", err)
	}
	if _, err := getFD(ctx, path, "../../etc"); err == nil || !strings.Contains(err.Error(), "bad token") {
		t.Fatalf("bad token: %v", err)
	}
}

func TestProcessRefusesBadRequests(t *testing.T) {
	p := startSelf(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := p.Describe(ctx); err == nil || !strings.Contains(err.Error(), "no VM yet") {
		t.Fatalf("Describe before Create: %v", err)
	}
	if err := p.Pause(ctx); err == nil || !strings.Contains(err.Error(), "no VM yet") {
		t.Fatalf("Pause before Create: %v", err)
	}
	img, err := os.Create(filepath.Join(t.TempDir(), "vol.img"))
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	if err := p.InsertDisk(ctx, "vol0", img, false); err == nil || !strings.Contains(err.Error(), "no VM yet") {
		t.Fatalf("InsertDisk before Create: %v", err)
	}
	if err := p.InsertDisk(ctx, "vol0", nil, false); err == nil || !strings.Contains(err.Error(), "no image file") {
		t.Fatalf("InsertDisk without a file: %v", err)
	}
	if _, err := p.api.InsertDisk(ctx, &vmmpb.InsertDiskRequest{DeviceId: "vol0"}); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("InsertDisk without a path: %v, want InvalidArgument", err)
	}
	bad := vmm.Spec{Kernel: "/nonexistent/kernel", CPUs: 1, MemoryMiB: 64}
	if err := p.Boot(ctx, bad); err == nil || !strings.Contains(err.Error(), "/nonexistent/kernel") {
		t.Fatalf("Boot of a missing kernel: %v", err)
	}
	// A failed Create leaves the process without a VM: its one VM is
	// spent, so a second Create is refused too.
	mfd, err := unix.MemfdCreate("restore-memory", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	mem := os.NewFile(uintptr(mfd), "memfd")
	defer mem.Close()
	if err := p.Restore(ctx, t.TempDir(), [32]byte{}, mem, []virtio.DeviceSpec{{ID: "x"}}); err == nil {
		t.Fatal("second Create accepted")
	}
	exit, err := p.Wait(ctx)
	if err == nil || !strings.Contains(err.Error(), "/nonexistent/kernel") {
		t.Fatalf("Wait after a failed Create: %v %v", exit, err)
	}
}

// TestProcessDeath kills a VMM process: the parent learns its exit status
// and its log's tail, and another process goes on.
func TestProcessDeath(t *testing.T) {
	a, b := startSelf(t), startSelf(t)
	if err := syscall.Kill(a.PID(), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-a.Exited()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, err := a.Wait(ctx)
	var pe *ProcessError
	if !errors.As(err, &pe) || pe.PID != a.PID() || !strings.Contains(pe.Status, "signal: killed") {
		t.Fatalf("Wait of a killed process: %v", err)
	}
	if _, err := b.Describe(ctx); err == nil || !strings.Contains(err.Error(), "no VM yet") {
		t.Fatalf("the other process: %v", err)
	}
	// Attaching to the live one by its socket works; to the dead one not.
	c, err := Attach(ctx, b.Socket(), nil)
	if err != nil {
		t.Fatalf("Attach: %v", err)
	}
	c.Close(ctx)
	actx, acancel := context.WithTimeout(ctx, 2*time.Second)
	defer acancel()
	if _, err := Attach(actx, a.Socket(), nil); err == nil {
		t.Fatal("Attach to a dead process succeeded")
	}
}

func TestDecodeStrict(t *testing.T) {
	var spec vmm.Spec
	if err := decodeStrict([]byte(`{"cpus":1,"memory_mib":64,"surprise":1}`), &spec); err == nil {
		t.Fatal("unknown field accepted")
	}
	if err := decodeStrict([]byte(`{"cpus":1} {}`), &spec); err == nil {
		t.Fatal("trailing data accepted")
	}
	if err := decodeStrict([]byte(`{"cpus":2,"memory_mib":64}`), &spec); err != nil || spec.CPUs != 2 {
		t.Fatalf("%+v %v", spec, err)
	}
}

// TestProcessRestoreNeedsVerifiedSnapshot: a VMM process, which holds no
// host key, restores a snapshot only with the manifest digest and sealed
// memory its parent checked; a bare directory is refused.
func TestProcessRestoreNeedsVerifiedSnapshot(t *testing.T) {
	p := startSelf(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, err := p.api.Create(ctx, &vmmpb.CreateRequest{Source: &vmmpb.CreateRequest_SnapshotDir{SnapshotDir: t.TempDir()}})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "needs the manifest's digest and the sealed memory") {
		t.Fatalf("Create of an unverified snapshot: %v", err)
	}
}
