package e2b_test

import (
	"context"
	"log/slog"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/daemon/e2b"
	"github.com/kilnvm/kiln/daemon/kilnpb"
	"github.com/kilnvm/kiln/daemon/vmmbackend"
	"github.com/kilnvm/kiln/image"
	"github.com/kilnvm/kiln/image/imagetest"
	"github.com/kilnvm/kiln/internal/kvmtest"
	"github.com/kilnvm/kiln/sandbox"
	"github.com/kilnvm/kiln/vmmproc"
)

// TestMain lets the test binary serve as a VMM process (the real
// backend's Command in TestKVME2B).
func TestMain(m *testing.M) {
	if os.Getenv(vmmproc.SocketEnv) != "" {
		os.Exit(vmmproc.Main(context.Background(), nil))
	}
	os.Exit(m.Run())
}

// TestKVME2B runs every file of the npm SDK's suite, then the Python
// SDK's, (KILN_E2B_MODE=kvm) against the E2B server over a daemon.Server
// with real sandboxes: a template named base from the Debian test image
// (the SDKs run commands with /bin/bash), sandboxes restored from it. One
// kilnd serves both; each suite is a subtest, so that both run when one
// fails.
func TestKVME2B(t *testing.T) {
	kvmtest.Require(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	_, url, keys := kvmE2B(t, ctx)
	t.Run("npm", func(t *testing.T) { runSDK(t, ctx, url, keys.alpha, keys.beta, "kvm") })
	t.Run("python", func(t *testing.T) { runPySDK(t, ctx, url, keys.alpha, keys.beta, "kvm") })
}

// kvmE2B starts a daemon.Server with the real sandbox backend, a template
// named base from the Debian test image, and the E2B server over it on a
// loopback listener, with writeSuiteKeys's keys (keyA's and keyB's
// tenants alpha and beta, and a key of each in E2B's format); it returns
// the daemon's client, the E2B server's URL and the suites' keys. kilnd's
// and the E2B server's log is shown when the test fails.
func kvmE2B(tb testing.TB, ctx context.Context) (kilnpb.KilnClient, string, suiteKeys) {
	tb.Helper()
	_, refs := imagetest.ServeLayout(tb, kvmtest.TestImages(tb), "kiln/test")
	images := tb.TempDir()
	im, err := image.NewRoots(image.Options{}).Images(images)
	if err != nil {
		tb.Fatal(err)
	}
	if _, err := im.Pull(ctx, refs["debian"], image.PullOptions{}); err != nil {
		tb.Fatalf("pull debian: %v", err)
	}
	rt, err := sandbox.NewRuntime(sandbox.RuntimeConfig{Kernel: kvmtest.Kernel(tb), Agent: kvmtest.AgentBinary(tb)})
	if err != nil {
		tb.Fatal(err)
	}
	// A short state folder: the sandboxes' Unix sockets live in it.
	state, err := os.MkdirTemp("", "ke-")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { os.RemoveAll(state) })
	logPath := filepath.Join(tb.TempDir(), "kilnd.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		tb.Fatal(err)
	}
	logger := slog.New(slog.NewTextHandler(logFile, &slog.HandlerOptions{Level: slog.LevelDebug}))
	tb.Cleanup(func() {
		logFile.Close()
		if tb.Failed() {
			b, _ := os.ReadFile(logPath)
			if len(b) > 64<<10 {
				b = b[len(b)-64<<10:]
			}
			tb.Logf("kilnd's log (its end):\n%s", b)
		}
	})
	be, err := vmmbackend.New(vmmbackend.Options{StateDir: filepath.Join(state, "k"), Runtime: rt, Images: images,
		Command: []string{os.Args[0], "-test.run=^$"}, Logger: logger})
	if err != nil {
		tb.Fatal(err)
	}
	ds, err := daemon.New(daemon.Config{StateDir: filepath.Join(state, "k"), Backend: be,
		BootTimeout: 8 * time.Minute, MemoryOvercommit: 2, Logger: logger})
	if err != nil {
		tb.Fatal(err)
	}
	kc := serveDaemon(tb, ds)
	start := time.Now()
	tp, err := kc.CreateTemplate(ctx, &kilnpb.CreateTemplateRequest{Name: "base", Image: refs["debian"], RequestId: "kvm-e2b-base",
		Resources: &kilnpb.Resources{MemoryMib: 256}})
	if err != nil {
		tb.Fatalf("template base: %v", err)
	}
	tb.Logf("template %s (base) in %v", tp.Id, time.Since(start).Round(time.Millisecond))
	keys := writeSuiteKeys(tb, filepath.Join(tb.TempDir(), "keys"))
	k, err := e2b.LoadKeys(keys.file, nil, e2b.Quota{})
	if err != nil {
		tb.Fatal(err)
	}
	srv, err := e2b.New(e2b.Config{Kiln: kc, Keys: k, StateDir: filepath.Join(state, "e2b"), Logger: logger})
	if err != nil {
		tb.Fatal(err)
	}
	hs := httptest.NewServer(srv.Handler())
	tb.Cleanup(hs.Close)
	return kc, hs.URL, keys
}
