package sandbox

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kilnvm/kiln/image"
	"github.com/kilnvm/kiln/initramfs"
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
