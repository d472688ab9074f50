package sandbox

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/hostfs"
	"github.com/kilnvm/kiln/image"
	"github.com/kilnvm/kiln/initramfs"
	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmmproc"
)

// TestImageInitrd: the base, padded to 4 bytes, then the config's
// archive; one file per base and config, a new one when either changes.
func TestImageInitrd(t *testing.T) {
	dir := t.TempDir()
	base := filepath.Join(dir, "agent.cpio")
	os.WriteFile(base, []byte("0123456"), 0o644) // 7 bytes: padded by 1
	cfg := image.Config{Env: []string{"A=1"}, WorkingDir: "/w", User: "app"}
	p1, err := imageInitrd(base, cfg)
	if err != nil {
		t.Fatal(err)
	}
	data, _ := os.ReadFile(p1)
	tail, _ := initramfs.ImageConfigArchive([]byte(`{"Env":["A=1"],"WorkingDir":"/w","User":"app"}`))
	if want := append([]byte("0123456\x00"), tail...); !bytes.Equal(data, want) {
		t.Fatalf("initrd of %d bytes, want base + 1 byte of padding + the %d-byte config archive", len(data), len(tail))
	}
	if p2, err := imageInitrd(base, cfg); err != nil || p2 != p1 {
		t.Errorf("same base and config: %s, %v; want %s again", p2, err, p1)
	}
	if p3, _ := imageInitrd(base, image.Config{User: "other"}); p3 == p1 {
		t.Error("another config reused the file")
	}
	os.WriteFile(base, []byte("01234567"), 0o644)
	os.Chtimes(base, time.Now().Add(time.Hour), time.Now().Add(time.Hour))
	if p4, _ := imageInitrd(base, cfg); p4 == p1 {
		t.Error("a rebuilt base reused the file")
	}
	if _, err := imageInitrd(filepath.Join(dir, "missing"), cfg); err == nil {
		t.Error("a missing base: no error")
	}
}

// TestServeDirRefused: ServeDir and StopServingDir on sandboxes without a
// root directory of this process's fail with an error, never a panic.
func TestServeDirRefused(t *testing.T) {
	dirDev := virtio.DeviceSpec{ID: ImageDevice, Kind: virtio.KindFS, FS: &virtio.FSSpec{Tag: ImageTag, Dir: t.TempDir()}}
	tests := []struct {
		name string
		s    *Sandbox
		want string
	}{
		{"zero sandbox", &Sandbox{}, "Options.RootDir"},
		{"no root directory", &Sandbox{m: &processVM{}}, "Options.RootDir"},
		{"VMM process", &Sandbox{m: &processVM{specs: []virtio.DeviceSpec{dirDev}}}, "VMM process"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := tt.s.ServeDir("ctr2", t.TempDir()); err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("ServeDir: %v, want an error containing %q", err, tt.want)
			}
			if err := tt.s.StopServingDir("ctr2"); err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("StopServingDir: %v, want an error containing %q", err, tt.want)
			}
		})
	}
}

// TestServeDir: the trees the root directory's opener makes become the
// sandbox's (a fork child's open through the same opener does not replace
// them), and ServeDir and StopServingDir add and remove named trees.
func TestServeDir(t *testing.T) {
	s := &Sandbox{}
	open := s.keepTrees(vmmproc.OpenImageFS(nil))
	fs, closer, err := open(virtio.FSSpec{Tag: ImageTag, Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer closer.Close()
	trees, ok := fs.(*hostfs.Trees)
	if !ok || s.trees != trees {
		t.Fatalf("opened %T; the sandbox keeps %p", fs, s.trees)
	}
	for _, spec := range []virtio.FSSpec{{Tag: ImageTag, Dir: t.TempDir()}, {Tag: "other", Dir: t.TempDir()}} {
		_, c, err := open(spec)
		if err != nil {
			t.Fatal(err)
		}
		c.Close()
		if s.trees != trees {
			t.Fatalf("a second open (tag %s) replaced the sandbox's trees", spec.Tag)
		}
	}
	if _, _, err := open(virtio.FSSpec{Tag: ImageTag, Dir: filepath.Join(t.TempDir(), "missing")}); err == nil {
		t.Error("opening a missing directory succeeded")
	}

	ctr := t.TempDir()
	if err := s.ServeDir("ctr2", ctr); err != nil {
		t.Fatal(err)
	}
	if _, err := trees.AttachRoot("ctr2"); err != nil {
		t.Errorf("AttachRoot after ServeDir: %v", err)
	}
	for _, tt := range []struct {
		name, dir string
		want      error
	}{
		{"ctr2", ctr, unix.EEXIST},
		{"a/b", ctr, unix.EINVAL},
		{"ctr3", filepath.Join(ctr, "missing"), unix.ENOENT},
	} {
		if err := s.ServeDir(tt.name, tt.dir); !errors.Is(err, tt.want) || !strings.Contains(err.Error(), "sandbox: ServeDir") {
			t.Errorf("ServeDir(%q, %s): %v, want %v", tt.name, tt.dir, err, tt.want)
		}
	}
	if err := s.StopServingDir("ctr2"); err != nil {
		t.Fatal(err)
	}
	if _, err := trees.AttachRoot("ctr2"); !errors.Is(err, unix.ENOENT) {
		t.Errorf("AttachRoot after StopServingDir: %v", err)
	}
	if err := s.StopServingDir("ctr2"); !errors.Is(err, unix.ENOENT) {
		t.Errorf("StopServingDir twice: %v", err)
	}
	closer.Close()
	if err := s.ServeDir("ctr4", ctr); err == nil {
		t.Error("ServeDir after the device closed its trees succeeded")
	}
}
