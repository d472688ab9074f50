package sandbox

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kilnvm/kiln/virtio"
	"github.com/opencontainers/go-digest"
)

// serveChunks: an images folder a jailed uid cannot read is refused,
// naming it; otherwise the sandbox folder becomes searchable (0711, not
// listable) and the socket is the jail uid's alone, removed on Close.
func TestServeChunks(t *testing.T) {
	fs := func(dir string) virtio.FSSpec {
		return virtio.FSSpec{Tag: ImageTag, Image: string(digest.FromString("img")), Images: dir}
	}
	closed, sbDir := t.TempDir(), t.TempDir()
	for _, d := range []string{closed, sbDir} {
		if err := os.Chmod(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	sock := filepath.Join(sbDir, "vmm.sock.chunks")
	if _, err := serveChunks(sock, os.Getuid(), os.Getgid(), nil, fs(closed), nil); err == nil || !strings.Contains(err.Error(), "cannot read it") || !strings.Contains(err.Error(), closed) {
		t.Fatalf("an images folder of mode 0700: %v, want a refusal naming it", err)
	}
	if _, err := os.Lstat(sock); !os.IsNotExist(err) {
		t.Fatalf("a socket after the refusal: %v", err)
	}
	open := t.TempDir()
	if err := os.Chmod(open, 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := serveChunks(sock, os.Getuid(), os.Getgid(), nil, fs(filepath.Join(open, "missing")), nil); err == nil || !strings.Contains(err.Error(), "images folder") {
		t.Fatalf("a missing images folder: %v", err)
	}
	c, err := serveChunks(sock, os.Getuid(), os.Getgid(), nil, fs(open), nil)
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(sbDir); err != nil || fi.Mode().Perm() != 0o711 {
		t.Errorf("sandbox folder: %v %v, want 0711", fi.Mode(), err)
	}
	if fi, err := os.Lstat(sock); err != nil || fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != 0o600 {
		t.Errorf("chunk socket: %v %v, want a socket of mode 0600", fi.Mode(), err)
	}
	if err := c.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	if _, err := os.Lstat(sock); !os.IsNotExist(err) {
		t.Errorf("socket after Close: %v", err)
	}
}
