package e2b_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// The Python SDK's suite: pysdktest/test_sdk.py, run with pytest by the
// python of a venv in which E2B's Python SDK is installed (make deps makes
// it with ../shared/fixtures/e2b-python/setup.sh).
const (
	pySDKDir     = "pysdktest"
	pySDKFile    = "test_sdk.py"
	pySDKVenv    = ".venv"
	pySDKVersion = "2.34.0" // the Makefile's E2B_PY_VERSION
)

// runPySDK runs pytest over the Python SDK's suite against the E2B API at
// url, with only the SDK's variables (and the suite's own) set: the SDK's
// check of the key's format stays on. It fails the test with pytest's
// output when a test fails, and names make deps when the venv is missing
// or holds another version of the SDK.
func runPySDK(t *testing.T, ctx context.Context, url, key, otherKey, mode string) {
	t.Helper()
	py, err := filepath.Abs(filepath.Join(pySDKDir, pySDKVenv, "bin", "python"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(py); err != nil {
		t.Fatalf("no venv with E2B's Python SDK at %s: run make deps (it runs ../shared/fixtures/e2b-python/setup.sh there): %v", filepath.Dir(filepath.Dir(py)), err)
	}
	check := exec.CommandContext(ctx, py, "-c", "import importlib.metadata as m, pytest; print(m.version('e2b'))")
	check.Env = []string{"PYTHONDONTWRITEBYTECODE=1"}
	out, err := check.CombinedOutput()
	if v := strings.TrimSpace(string(out)); err != nil || v != pySDKVersion {
		t.Fatalf("the venv %s has not E2B's Python SDK %s and pytest (%v: %s): run make deps", filepath.Dir(filepath.Dir(py)), pySDKVersion, err, out)
	}
	cmd := exec.CommandContext(ctx, py, "-m", "pytest", "-v", "--tb=short", "-p", "no:cacheprovider", pySDKFile)
	cmd.Dir = pySDKDir
	cmd.Env = []string{
		"E2B_API_KEY=" + key,
		"E2B_API_URL=" + url,
		"E2B_SANDBOX_URL=" + url,
		"KILN_E2B_MODE=" + mode,
		"KILN_E2B_OTHER_KEY=" + otherKey,
		// The suite's folder may be read-only (the harness's L1 sees
		// the repository through a read-only share).
		"PYTHONDONTWRITEBYTECODE=1",
	}
	start := time.Now()
	out, err = cmd.CombinedOutput()
	t.Logf("pytest %s (%v):\n%s", pySDKFile, time.Since(start).Round(time.Millisecond), out)
	if err != nil {
		t.Fatalf("the Python SDK's suite failed: %v", err)
	}
}

// TestE2BPythonSDK runs E2B's Python SDK's suite against the E2B server
// over a daemon.Server with the test double backend (sdkDouble), with keys
// in E2B's format (the SDK's key check on).
func TestE2BPythonSDK(t *testing.T) {
	url, keys := sdkDouble(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	runPySDK(t, ctx, url, keys.alpha, keys.beta, "double")
}
