package volume

import (
	"os"
	"path/filepath"
	"testing"
)

// FuzzNeedsRecovery: whatever a guest leaves in an image's first bytes,
// NeedsRecovery answers or errs, never panics, and says dirty only for
// an ext4 magic with RECOVER set.
func FuzzNeedsRecovery(f *testing.F) {
	f.Add(make([]byte, 2048))
	sb := make([]byte, 2048)
	sb[superblock+sbMagic], sb[superblock+sbMagic+1] = 0x53, 0xef
	f.Add(sb)
	dirty := append([]byte(nil), sb...)
	dirty[superblock+sbFeatureIncompat] = incompatRecover
	f.Add(dirty)
	f.Add([]byte{1, 2, 3})
	f.Fuzz(func(t *testing.T, b []byte) {
		p := filepath.Join(t.TempDir(), "img")
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		got, err := NeedsRecovery(p)
		if err != nil {
			return
		}
		magic := len(b) >= superblock+sbFeatureIncompat+4 && b[superblock+sbMagic] == 0x53 && b[superblock+sbMagic+1] == 0xef
		if !magic {
			t.Fatalf("no ext4 magic, yet no error (dirty %v)", got)
		}
		if want := b[superblock+sbFeatureIncompat]&incompatRecover != 0; got != want {
			t.Fatalf("dirty %v, want %v", got, want)
		}
	})
}
