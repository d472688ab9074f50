package kvmtest

import (
	"bytes"
	"compress/gzip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kilnvm/kiln/guestkernel"
)

func TestModulesInit(t *testing.T) {
	order := []guestkernel.Module{{Name: "virtio"}, {Name: "virtio_ring"}, {Name: "virtio_mmio", Depends: []string{"virtio", "virtio_ring"}}}
	s, err := modulesInit(order, "echo done\n")
	if err != nil {
		t.Fatal(err)
	}
	i1 := strings.Index(s, "insmod /lib/modules/virtio.ko ")
	i2 := strings.Index(s, "insmod /lib/modules/virtio_ring.ko ")
	i3 := strings.Index(s, "insmod /lib/modules/virtio_mmio.ko ")
	mount := strings.Index(s, "mount -t devtmpfs devtmpfs /dev")
	if mount < 0 || i1 < mount || i2 < i1 || i3 < i2 || !strings.HasSuffix(s, "\necho done\n") {
		t.Fatalf("init script out of order:\n%s", s)
	}
	if _, err := modulesInit([]guestkernel.Module{{Name: "x;reboot"}}, ""); err == nil {
		t.Fatal("a module name with shell syntax was accepted")
	}
}

func TestReadModule(t *testing.T) {
	dir := t.TempDir()
	want := []byte("\x7fELF module body")
	write := func(name string, b []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write(want)
	zw.Close()
	paths := []string{write("a.ko", want), write("b.ko.gz", gz.Bytes())}
	for _, tool := range []string{"xz", "zstd"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Logf("%s not installed: not testing it", tool)
			continue
		}
		ext := map[string]string{"xz": ".xz", "zstd": ".zst"}[tool]
		p := write("c"+tool+".ko", want)
		if out, err := exec.Command(tool, "-q", p).CombinedOutput(); err != nil {
			t.Fatalf("%s: %v: %s", tool, err, out)
		}
		paths = append(paths, p+ext)
	}
	for _, p := range paths {
		got, err := readModule(p)
		if err != nil || !bytes.Equal(got, want) {
			t.Errorf("readModule(%s) = %q, %v", filepath.Base(p), got, err)
		}
	}
	for _, p := range []string{write("d.txt", want), write("e.ko.xz", want), filepath.Join(dir, "missing.ko")} {
		if _, err := readModule(p); err == nil {
			t.Errorf("readModule(%s) succeeded", filepath.Base(p))
		}
	}
}

func TestModulesInitrd(t *testing.T) {
	if _, err := guestkernel.Find(); err != nil {
		t.Skipf("no cached kernel: %v", err)
	}
	if _, err := os.Stat("/bin/busybox"); err != nil {
		t.Skip("busybox-static not installed")
	}
	p := ModulesInitrd(t, []string{"virtio_mmio", "virtio-rng"}, "echo hi\n")
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	// newc headers carry the names in the clear; the init script is stored
	// uncompressed.
	for _, want := range []string{"lib/modules/virtio.ko", "lib/modules/virtio_ring.ko", "lib/modules/virtio_mmio.ko", "lib/modules/virtio_rng.ko", "insmod /lib/modules/virtio_rng.ko"} {
		if !bytes.Contains(b, []byte(want)) {
			t.Errorf("initrd lacks %q", want)
		}
	}
}
