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
	"strings"
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

// VsockEchoBinary returns a static build of internal/testguest/vsockecho
// (see guestBinary).
func VsockEchoBinary(tb testing.TB) string {
	tb.Helper()
	return guestBinary(tb, "vsockecho", vsockEchoPkg, "internal/testguest/vsockecho")
}

// autoloadPkg is the guest program of the module autoloading test.
const autoloadPkg = "github.com/kilnvm/kiln/internal/testguest/autoload"

// AutoloadBinary returns a static build of internal/testguest/autoload
// (see guestBinary).
func AutoloadBinary(tb testing.TB) string {
	tb.Helper()
	return guestBinary(tb, "autoload", autoloadPkg, "internal/testguest/autoload")
}

// agentPkg is the guest agent's command.
const agentPkg = "github.com/kilnvm/kiln/cmd/kiln-agent"

// agentSrcDirs are the folders of every package of this module the agent
// uses (TestGuestBinarySources holds it to go list -deps).
var agentSrcDirs = []string{"cmd/kiln-agent", "guest/agent", "guest/agentpb", "guest/modprobe", "guest/pid1", "guestkernel",
	"accounts", "dirwatch", "filetree", "stmode"}

// AgentBinary returns a static build of the guest agent, cmd/kiln-agent
// (see guestBinary).
func AgentBinary(tb testing.TB) string {
	tb.Helper()
	return guestBinary(tb, "kiln-agent", agentPkg, agentSrcDirs...)
}

// guestBinary returns a static (CGO_ENABLED=0) build of the Go program pkg,
// for a guest. Builds are shared between test packages in
// bin/testguest/<name>-<hash>, where the hash covers the Go version, the
// .go files of srcDirs (relative to the module root, naming every package
// of this module the program uses), go.mod and go.sum. In the emulated L1
// the tree is read-only and go build is slow: build it on the host first
// (the TestXxxBinary tests do, in the run that precedes L1's). When it is
// missing this builds it into tb.TempDir and keeps it if the tree is
// writable.
func guestBinary(tb testing.TB, name, pkg string, srcDirs ...string) string {
	tb.Helper()
	root, err := moduleRoot()
	if err != nil {
		tb.Fatal(err)
	}
	h := sha256.New()
	io.WriteString(h, runtime.Version()+"\n")
	var files []string
	for _, d := range srcDirs {
		srcs, err := filepath.Glob(filepath.Join(root, d, "*.go"))
		if err != nil || len(srcs) == 0 {
			tb.Fatalf("%s sources in %s: %v (%d files)", name, d, err, len(srcs))
		}
		files = append(files, srcs...)
	}
	for _, p := range append(files, filepath.Join(root, "go.mod"), filepath.Join(root, "go.sum")) {
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
	kept := filepath.Join(root, "bin", "testguest", fmt.Sprintf("%s-%x", name, h.Sum(nil)[:8]))
	if fi, err := os.Stat(kept); err == nil && fi.Mode().IsRegular() {
		return kept
	}
	out := filepath.Join(tb.TempDir(), name)
	cmd := exec.Command("go", "build", "-buildvcs=false", "-trimpath", "-o", out, pkg)
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		tb.Fatalf("building %s: %v: %s", name, err, b)
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

// vmmPkg is cmd/kiln-vmm, a VMM process and nothing else.
const vmmPkg = "github.com/kilnvm/kiln/cmd/kiln-vmm"

// VMMBinary returns a build of kiln-vmm without cgo, for tests whose VMM
// processes are jailed: package jail changes every thread through the Go
// runtime, which a cgo binary cannot (and a test binary links cgo when
// the toolchain's CGO_ENABLED is 1, as the harness builds them). Run it
// as [VMMBinary(t)] (ProcessOptions.Command, kilnd --vmm, $KILN_VMM).
// Shared and kept as the guest binaries are, keyed by every package of
// the module; TestVMMBinary builds it on the host before L1's run.
func VMMBinary(tb testing.TB) string {
	tb.Helper()
	return moduleBinary(tb, "kiln-vmm", vmmPkg)
}

// KilnBinary returns a build of the kiln command without cgo, for tests
// that run the CLI as a program of its own (with $KILN_VMM set to
// VMMBinary's, as it finds no kiln-vmm beside it); kept as VMMBinary's is
// (TestKilnBinary builds it on the host).
func KilnBinary(tb testing.TB) string {
	tb.Helper()
	return moduleBinary(tb, "kiln", "github.com/kilnvm/kiln/cmd/kiln")
}

// ShimBinary returns a build of containerd-shim-kiln-v2 (without cgo),
// for the tests that start a containerd; kept as VMMBinary's is
// (TestShimBinary builds it on the host, where the Go build cache is
// writable).
func ShimBinary(tb testing.TB) string {
	tb.Helper()
	return moduleBinary(tb, "containerd-shim-kiln-v2", "github.com/kilnvm/kiln/cmd/containerd-shim-kiln-v2")
}

// moduleBinary builds pkg as name, keyed by every package of the module.
func moduleBinary(tb testing.TB, name, pkg string) string {
	tb.Helper()
	root, err := moduleRoot()
	if err != nil {
		tb.Fatal(err)
	}
	var dirs []string
	err = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() {
			return nil
		}
		switch name := d.Name(); {
		case p == root:
		case name == "testdata" || name == "bin" || name == "node_modules" || strings.HasPrefix(name, ".") || strings.HasPrefix(name, "_"):
			return filepath.SkipDir
		}
		if srcs, _ := filepath.Glob(filepath.Join(p, "*.go")); len(srcs) > 0 {
			rel, err := filepath.Rel(root, p)
			if err != nil {
				return err
			}
			dirs = append(dirs, rel)
		}
		return nil
	})
	if err != nil {
		tb.Fatalf("the module's packages: %v", err)
	}
	return guestBinary(tb, name, pkg, dirs...)
}
