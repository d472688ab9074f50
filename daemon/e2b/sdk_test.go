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
	"github.com/kilnvm/kiln/daemon/e2b/apikey"
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

// suiteKeys are the SDK suites' API keys: the keys file, a key of tenant
// alpha (the suites' own) and one of beta (KILN_E2B_OTHER_KEY).
type suiteKeys struct {
	file        string
	alpha, beta string
}

// writeSuiteKeys writes the SDK suites' keys file at path: keyA's and
// keyB's lines (the other tests' keys, which the benchmark uses too), then
// a key of alpha and one of beta appended as kiln e2b key new makes them
// (apikey.New, apikey.Append). Those are the suites' keys: E2B's format,
// which the Python SDK checks before it sends a key, and the npm SDK takes
// too.
func writeSuiteKeys(tb testing.TB, path string) suiteKeys {
	tb.Helper()
	writeFile(tb, path, "# the suites' tenants\n"+keyA+" alpha\n"+keyB+" beta\n", 0o600)
	k := suiteKeys{file: path, alpha: apikey.New(), beta: apikey.New()}
	if err := apikey.Append(path, k.alpha, "alpha"); err != nil {
		tb.Fatal(err)
	}
	if err := apikey.Append(path, k.beta, "beta"); err != nil {
		tb.Fatal(err)
	}
	return k
}

// sdkDouble starts what the SDK suites drive in the unit suite: the E2B
// server over a daemon.Server with the test double backend and a template
// named base, with writeSuiteKeys's keys file, on a fresh loopback
// listener. It returns the server's URL and the keys.
func sdkDouble(t *testing.T) (string, suiteKeys) {
	t.Helper()
	keys := writeSuiteKeys(t, filepath.Join(t.TempDir(), "keys"))
	e := newEnv(t, func(c *e2b.Config) {
		k, err := e2b.LoadKeys(keys.file, nil, e2b.Quota{})
		if err != nil {
			t.Fatal(err)
		}
		c.Keys = k
	})
	// The SDK's timeouts are seconds of real time: a fresh listener on
	// 127.0.0.1:0 (newEnv's httptest one is too).
	hs := httptest.NewServer(e.srv.Handler())
	t.Cleanup(hs.Close)
	return hs.URL, keys
}

// TestE2BSDK runs the unmodified E2B SDK's suite against the E2B server
// over a daemon.Server with the test double backend (sdkDouble).
func TestE2BSDK(t *testing.T) {
	url, keys := sdkDouble(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	runSDK(t, ctx, url, keys.alpha, keys.beta, "double")
}
