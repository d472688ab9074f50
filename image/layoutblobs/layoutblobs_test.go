package layoutblobs

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
)

// TestHandler serves a blob from its file and refuses names that are not
// a sha256 digest (a request path could otherwise leave the folder).
func TestHandler(t *testing.T) {
	dir := t.TempDir()
	hex := strings.Repeat("ab", 32)
	os.MkdirAll(filepath.Join(dir, "sha256"), 0o755)
	os.WriteFile(filepath.Join(dir, "sha256", hex), []byte("blob"), 0o644)
	h := Handler{Dir: dir}
	ctx := context.Background()
	if n, err := h.Stat(ctx, "r", v1.Hash{Algorithm: "sha256", Hex: hex}); err != nil || n != 4 {
		t.Fatalf("Stat = %d, %v", n, err)
	}
	rc, err := h.Get(ctx, "r", v1.Hash{Algorithm: "sha256", Hex: hex})
	if err != nil {
		t.Fatal(err)
	}
	data, _ := io.ReadAll(rc)
	rc.Close()
	if string(data) != "blob" {
		t.Fatalf("Get read %q", data)
	}
	for _, bad := range []v1.Hash{
		{Algorithm: "sha256", Hex: strings.Repeat("cd", 32)}, // absent
		{Algorithm: "sha512", Hex: hex},
		{Algorithm: "sha256", Hex: "../../etc/passwd"},
		{Algorithm: "sha256", Hex: strings.Repeat(".", 64)},
	} {
		if _, err := h.Stat(ctx, "r", bad); !errors.Is(err, registry.ErrNotFound) {
			t.Errorf("Stat(%v) = %v, want ErrNotFound", bad, err)
		}
		if _, err := h.Get(ctx, "r", bad); !errors.Is(err, registry.ErrNotFound) {
			t.Errorf("Get(%v) = %v, want ErrNotFound", bad, err)
		}
	}
}
