package e2b_test

import (
	"context"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"testing"
	"time"

	"github.com/kilnvm/kiln/daemon/e2b"
)

// sdkDir is the SDK test suite's folder (make deps runs npm ci there).
const sdkDir = "sdktest"

// sdkTests are the suite's files: every sdktest/*.test.mjs, each
// self-contained.
func sdkTests(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(sdkDir, "*.test.mjs"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no %s/*.test.mjs: %v", sdkDir, err)
	}
	sort.Strings(files)
	return files
}

// runSDK runs node --test over the suite against the E2B API at url,
// with only the SDK's variables (and the suite's own) set, and fails the
// test with node's output when a test fails.
func runSDK(t *testing.T, ctx context.Context, url, key, otherKey, mode string) {
	t.Helper()
	node, err := exec.LookPath("node")
	if err != nil {
		t.Fatal("no node on PATH: make deps installs nodejs and the SDK")
	}
	if _, err := os.Stat(filepath.Join(sdkDir, "node_modules", "e2b", "package.json")); err != nil {
		t.Fatalf("the E2B SDK is not installed in %s: run make deps (npm ci there): %v", sdkDir, err)
	}
	files := sdkTests(t)
	rel := make([]string, len(files))
	for i, f := range files {
		rel[i] = filepath.Base(f)
	}
	args := append([]string{"--test", "--test-reporter=spec", "--test-concurrency=1"}, rel...)
	cmd := exec.CommandContext(ctx, node, args...)
	cmd.Dir = sdkDir
	cmd.Env = []string{
		"E2B_API_KEY=" + key,
		"E2B_API_URL=" + url,
		"E2B_SANDBOX_URL=" + url,
		"KILN_E2B_MODE=" + mode,
		"KILN_E2B_OTHER_KEY=" + otherKey,
	}
	start := time.Now()
	out, err := cmd.CombinedOutput()
	t.Logf("node --test %v (%v):\n%s", rel, time.Since(start).Round(time.Millisecond), out)
	if err != nil {
		t.Fatalf("the SDK suite failed: %v", err)
	}
}

// TestE2BSDK runs the unmodified E2B SDK's suite against the E2B server
// over a daemon.Server with the test double backend and a template named
// base, with its keys in a keys file.
func TestE2BSDK(t *testing.T) {
	keys := filepath.Join(t.TempDir(), "keys")
	writeFile(t, keys, "# the suite's tenants\n"+keyA+" alpha\n"+keyB+" beta\n", 0o600)
	e := newEnv(t, func(c *e2b.Config) {
		k, err := e2b.LoadKeys(keys, nil, e2b.Quota{})
		if err != nil {
			t.Fatal(err)
		}
		c.Keys = k
	})
	// The SDK's timeouts are seconds of real time: a fresh listener on
	// 127.0.0.1:0 (newEnv's httptest one is too).
	hs := httptest.NewServer(e.srv.Handler())
	defer hs.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	runSDK(t, ctx, hs.URL, keyA, keyB, "double")
}
