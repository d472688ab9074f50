package vmm_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/internal/kvmtest"
	"github.com/kilnvm/kiln/memory"
	"github.com/kilnvm/kiln/snapshot"
	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmm"
)

// counterScript counts in a tmpfs file every 100 ms and prints each count;
// once it reaches 5 it prints the marker. The count is replaced by a rename,
// so that the loop waiting for 5 never reads the file empty (it then
// failed "bad number" and printed the marker at count 1). It never ends by itself. (The
// shell starts a background job with stdin from /dev/null: devtmpfs.)
const counterScript = `
mount -t devtmpfs devtmpfs /dev
mount -t proc proc /proc
mount -t tmpfs tmpfs /mnt
echo 0 > /mnt/count
(
  while true; do
    n=$(( $(cat /mnt/count) + 1 ))
    echo $n > /mnt/count.new
    mv /mnt/count.new /mnt/count
    echo "count $n"
    sleep 0.1
  done
) &
while [ "$(cat /mnt/count)" -lt 5 ]; do sleep 0.1; done
echo KILN-SNAPSHOT-READY
wait
`

var countRE = regexp.MustCompile(`count (\d+)\r?\n`)

// counts returns the counts a console shows, in order.
func counts(console string) []int {
	var out []int
	for _, m := range countRE.FindAllStringSubmatch(console, -1) {
		n, err := strconv.Atoi(m[1])
		if err == nil {
			out = append(out, n)
		}
	}
	return out
}

func lastCount(console string) int {
	c := counts(console)
	if len(c) == 0 {
		return 0
	}
	return c[len(c)-1]
}

// running runs vm until ctx ends and delivers how it ended.
func running(t *testing.T, vm *vmm.VM, ctx context.Context) <-chan vmm.Exit {
	ch := make(chan vmm.Exit, 1)
	go func() {
		exit, err := vm.Run(ctx)
		if err != nil {
			t.Errorf("Run: %v", err)
		}
		ch <- exit
	}()
	return ch
}

// waitConsole waits until cond holds for the console, failing the test
// when the VM stops or ctx ends first.
func waitConsole(t *testing.T, ctx context.Context, out *kvmtest.Console, exited <-chan vmm.Exit, what string, cond func(string) bool) {
	t.Helper()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for !cond(out.String()) {
		select {
		case exit := <-exited:
			t.Fatalf("VM stopped (%v) before %s; console:\n%s", exit, what, out.String())
		case <-ctx.Done():
			t.Fatalf("no %s within the time allowed; console:\n%s", what, out.String())
		case <-tick.C:
		}
	}
}

// echoConsole copies console output, line by line and timed, to stderr
// when KILN_TEST_CONSOLE is set: a slow emulated boot can be watched.
func echoConsole(c *kvmtest.Console, name string) io.Writer {
	if os.Getenv("KILN_TEST_CONSOLE") == "" {
		return c
	}
	return &lineEcho{c: c, name: name, start: time.Now()}
}

type lineEcho struct {
	c     *kvmtest.Console
	name  string
	start time.Time
	line  []byte
}

func (e *lineEcho) Write(p []byte) (int, error) {
	for _, b := range p {
		if b == '\n' {
			fmt.Fprintf(os.Stderr, "[%s +%.1fs] %s\n", e.name, time.Since(e.start).Seconds(), e.line)
			e.line = e.line[:0]
		} else if b != '\r' {
			e.line = append(e.line, b)
		}
	}
	return e.c.Write(p)
}

// copyMemory copies guest memory (a VM's own, on a shared memfd) into a
// new memfd: only the memfd's data (SEEK_DATA), and of that only the pages
// that are not zeros.
func copyMemory(t *testing.T, src *memory.Memory) *memory.Memory {
	t.Helper()
	var layout memory.Layout
	for _, r := range src.Regions() {
		layout = append(layout, struct{ GuestAddr, Size uint64 }{r.GuestAddr, r.Size})
	}
	dst, err := memory.New("kiln-test-snapshot", layout)
	if err != nil {
		t.Fatal(err)
	}
	zero := make([]byte, 4096)
	for i, r := range src.Regions() {
		s, d := src.Host(i), dst.Host(i)
		for off := int64(0); off < int64(len(s)); {
			data, err := unix.Seek(src.FD(), int64(r.Offset)+off, unix.SEEK_DATA)
			if err != nil || data >= int64(r.Offset)+int64(len(s)) {
				break // ENXIO: no data past off
			}
			hole, err := unix.Seek(src.FD(), data, unix.SEEK_HOLE)
			if err != nil {
				t.Fatal(err)
			}
			start := (data - int64(r.Offset)) &^ 4095
			end := min(hole-int64(r.Offset), int64(len(s)))
			for p := start; p < end; p += 4096 {
				if page := s[p : p+4096]; !bytes.Equal(page, zero) {
					copy(d[p:], page)
				}
			}
			off = end
		}
	}
	return dst
}

// TestKVMSaveRestore boots Linux once with a guest that counts, pauses it,
// saves its state and memory (through vmm.SaveState and a memory copy, and
// through snapshot.Save), lets the original go on, and then restores new
// VMs from the saved state, twice from the copy (mapped copy-on-write) and
// once with snapshot.Load: each must continue counting from where the
// original was paused, on its own console, without booting again.
func TestKVMSaveRestore(t *testing.T) {
	kvmtest.Require(t)
	k := kvmtest.Kernel(t)
	if k.Vmlinux == "" {
		t.Fatal("the kernel cache has no vmlinux (make kernel extracts it)")
	}
	initrd := kvmtest.BusyboxInitrd(t, counterScript)
	const memMiB = 512
	config := func(out *kvmtest.Console, name string) vmm.Config {
		return vmm.Config{Spec: vmm.Spec{CPUs: 1, MemoryMiB: memMiB, Devices: []virtio.DeviceSpec{{ID: "rng", Kind: virtio.KindRNG, RNG: &virtio.RNGSpec{}}}}, Console: echoConsole(out, name)}
	}

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	var out kvmtest.Console
	cfg := config(&out, "original")
	cfg.Kernel, cfg.Initrd = k.Vmlinux, initrd
	vm, err := vmm.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer vm.Close()
	origCtx, origCancel := context.WithCancel(ctx)
	defer origCancel()
	bootStart := time.Now()
	exited := running(t, vm, origCtx)
	waitConsole(t, ctx, &out, exited, "marker", func(s string) bool { return strings.Contains(s, "KILN-SNAPSHOT-READY") })
	t.Logf("booted to the marker in %v", time.Since(bootStart).Round(time.Millisecond))

	saveStart := time.Now()
	if err := vm.Pause(ctx); err != nil {
		t.Fatalf("Pause: %v", err)
	}
	saved := lastCount(out.String())
	dir := filepath.Join(t.TempDir(), "snap")
	key, err := snapshot.LoadKey(filepath.Join(t.TempDir(), "snapshot.key")) // made on first use
	if err != nil {
		t.Fatalf("snapshot key: %v", err)
	}
	if err := snapshot.Save(ctx, vm, dir, snapshot.WithKey(key)); err != nil {
		t.Fatalf("snapshot.Save: %v", err)
	}
	t.Logf("snapshot.Save took %v", time.Since(saveStart).Round(time.Millisecond))
	st, err := vm.SaveState(ctx)
	if err != nil {
		t.Fatalf("SaveState: %v", err)
	}
	// Through JSON, as a snapshot keeps it.
	b, err := json.Marshal(st)
	if err != nil {
		t.Fatal(err)
	}
	st = new(vmm.State)
	if err := json.Unmarshal(b, st); err != nil {
		t.Fatal(err)
	}
	image := copyMemory(t, vm.Memory())
	defer image.Close()
	t.Logf("paused at count %d; saved (state %d bytes, %d MSRs, %d CPUID entries) and copied the memory in %v",
		saved, len(b), len(st.VCPUs[0].MSRs), len(st.VCPUs[0].CPUID), time.Since(saveStart).Round(time.Millisecond))
	if saved < 5 {
		t.Fatalf("paused at count %d, after the marker; console:\n%s", saved, out.String())
	}
	if m, err := snapshot.Info(dir); err != nil || m.CPUs != 1 || m.MemoryMiB != memMiB || len(m.Devices) != 1 {
		t.Fatalf("snapshot.Info = %+v, %v", m, err)
	}

	// The original goes on, devices resumed with it, then stops.
	if err := vm.Resume(); err != nil {
		t.Fatalf("Resume: %v", err)
	}
	waitConsole(t, ctx, &out, exited, fmt.Sprintf("count past %d in the original", saved), func(s string) bool { return lastCount(s) > saved+1 })
	origCancel()
	if exit := <-exited; exit.Reason != vmm.ReasonCancelled {
		t.Fatalf("original stopped with %v", exit)
	}

	restore := func(name string, build func(cfg vmm.RestoreConfig) (*vmm.VM, error)) {
		t.Run(name, func(t *testing.T) {
			var rout kvmtest.Console
			start := time.Now()
			rvm, err := build(vmm.RestoreConfig{Console: echoConsole(&rout, name)})
			if err != nil {
				t.Fatal(err)
			}
			defer rvm.Close()
			built := time.Since(start)
			rctx, rcancel := context.WithTimeout(ctx, 4*time.Minute)
			defer rcancel()
			rexited := running(t, rvm, rctx)
			waitConsole(t, rctx, &rout, rexited, fmt.Sprintf("count past %d", saved), func(s string) bool { return lastCount(s) > saved+1 })
			c := counts(rout.String())
			t.Logf("restored in %v; counted %v in %v", built.Round(time.Millisecond), c, time.Since(start).Round(time.Millisecond))
			if c[0] < saved || c[0] > saved+2 {
				t.Errorf("restored guest's first count is %d, the original was paused at %d", c[0], saved)
			}
			if strings.Contains(rout.String(), "Linux version") || strings.Contains(rout.String(), "KILN-SNAPSHOT-READY") {
				t.Errorf("restored guest booted again; console:\n%s", rout.String())
			}
			rcancel()
			if exit := <-rexited; exit.Reason != vmm.ReasonCancelled {
				t.Errorf("restored VM stopped with %v; console:\n%s", exit, rout.String())
			}
		})
	}
	fromCopy := func(cfg vmm.RestoreConfig) (*vmm.VM, error) {
		fd, err := unix.FcntlInt(uintptr(image.FD()), unix.F_DUPFD_CLOEXEC, 0)
		if err != nil {
			return nil, err
		}
		mem, err := memory.MapFile(fd, st.Layout(), true)
		if err != nil {
			unix.Close(fd)
			return nil, err
		}
		return vmm.Restore(cfg, st, mem)
	}
	restore("restore", fromCopy)
	restore("restore again", fromCopy)
	restore("snapshot.Load", func(cfg vmm.RestoreConfig) (*vmm.VM, error) { return snapshot.Load(dir, cfg, snapshot.WithKey(key)) })
}
