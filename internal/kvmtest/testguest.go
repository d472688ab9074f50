package kvmtest

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"
)

// vsockEchoPkg is the guest program of the vsock tests and benchmark.
const vsockEchoPkg = "github.com/kilnvm/kiln/internal/testguest/vsockecho"

// moduleRoot returns the directory of go.mod above the working directory
// (the package directory under go test, the repository root under
// kvmharness -exec).
func moduleRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("no go.mod above the working directory")
		}
		dir = parent
	}
}

// vsockEchoBinary returns a static build of internal/testguest/vsockecho.
// It shares virtio's KVM test's cache: bin/testguest/vsockecho-<hash>,
// where the hash covers the Go version and the program's sources, go.mod
// and go.sum, named as seen from a package directory one level down (as
// virtio's and bench's both are), so both find the same build. In the
// emulated L1 the tree is read-only and go build is slow: build it on the
// host first (TestVsockEchoBinary does). When it is missing this builds it
// into b.TempDir and keeps it if the tree is writable.
func VsockEchoBinary(tb testing.TB) string {
	tb.Helper()
	root, err := moduleRoot()
	if err != nil {
		tb.Fatal(err)
	}
	h := sha256.New()
	io.WriteString(h, runtime.Version()+"\n")
	srcs, err := filepath.Glob(filepath.Join(root, "internal", "testguest", "vsockecho", "*.go"))
	if err != nil || len(srcs) == 0 {
		tb.Fatalf("vsockecho sources: %v (%d files)", err, len(srcs))
	}
	for _, p := range append(srcs, filepath.Join(root, "go.mod"), filepath.Join(root, "go.sum")) {
		data, err := os.ReadFile(p)
		if err != nil {
			tb.Fatal(err)
		}
		rel, err := filepath.Rel(root, p)
		if err != nil {
			tb.Fatal(err)
		}
		fmt.Fprintf(h, "%s %d\n", "../"+filepath.ToSlash(rel), len(data))
		h.Write(data)
	}
	kept := filepath.Join(root, "bin", "testguest", fmt.Sprintf("vsockecho-%x", h.Sum(nil)[:8]))
	if fi, err := os.Stat(kept); err == nil && fi.Mode().IsRegular() {
		return kept
	}
	out := filepath.Join(tb.TempDir(), "vsockecho")
	cmd := exec.Command("go", "build", "-buildvcs=false", "-o", out, vsockEchoPkg)
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		tb.Fatalf("building vsockecho: %v: %s", err, b)
	}
	// Keep it for the next run; a read-only tree just means no reuse.
	if err := os.MkdirAll(filepath.Dir(kept), 0o755); err == nil {
		if data, err := os.ReadFile(out); err == nil {
			tmp := kept + fmt.Sprintf(".%d", os.Getpid())
			if os.WriteFile(tmp, data, 0o755) == nil && os.Rename(tmp, kept) != nil {
				os.Remove(tmp)
			}
		}
	}
	return out
}
