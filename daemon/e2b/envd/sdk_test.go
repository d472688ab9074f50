package envd

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// TestSDKEnvd runs daemon/e2b/sdktest/envd.test.mjs (the unmodified e2b
// SDK) against this package's Handler over the test double, behind a
// control plane of the test's own that only creates and kills
// sandboxes (package e2b serves the real one). It needs node and the
// SDK installed in daemon/e2b/sdktest (make deps: npm ci).
func TestSDKEnvd(t *testing.T) {
	dir, err := filepath.Abs("../sdktest")
	if err != nil {
		t.Fatal(err)
	}
	node, err := exec.LookPath("node")
	if err != nil {
		t.Skip("no node: the SDK's test needs it")
	}
	if _, err := os.Stat(filepath.Join(dir, "node_modules", "e2b")); err != nil {
		t.Skip("the e2b SDK is not installed in daemon/e2b/sdktest (make deps)")
	}
	e := newEnv(t)
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v2/sandboxes", func(w http.ResponseWriter, r *http.Request) {
		sb, err := e.kiln.CreateSandbox(r.Context(), &kilnpb.CreateSandboxRequest{
			Source:    &kilnpb.CreateSandboxRequest_Image{Image: "busybox"},
			RequestId: fmt.Sprintf("sdk-%d", reqSeq.Add(1))})
		if err != nil {
			httpError(w, http.StatusInternalServerError, err.Error())
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		json.NewEncoder(w).Encode(map[string]string{"sandboxID": sb.GetId(), "templateID": "base", "clientID": "kiln", "envdVersion": Version})
	})
	mux.HandleFunc("DELETE /sandboxes/{id}", func(w http.ResponseWriter, r *http.Request) {
		if _, err := e.kiln.DestroySandbox(r.Context(), &kilnpb.DestroySandboxRequest{Id: r.PathValue("id")}); err != nil {
			httpError(w, http.StatusNotFound, err.Error())
			return
		}
		w.WriteHeader(http.StatusNoContent)
	})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if id := r.Header.Get("E2b-Sandbox-Id"); id != "" {
			e.h.Serve(w, r, id)
			return
		}
		mux.ServeHTTP(w, r)
	}))
	defer srv.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, node, "--test", "--test-reporter=spec", "envd.test.mjs")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "E2B_API_KEY=test-key", "E2B_API_URL="+srv.URL, "E2B_SANDBOX_URL="+srv.URL, "KILN_E2B_MODE=double")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("node --test envd.test.mjs: %v\n%s", err, out)
	}
	t.Logf("%s", strings.TrimSpace(string(out)))
}
