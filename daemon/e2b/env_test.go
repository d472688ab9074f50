package e2b_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/test/bufconn"

	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/daemon/daemontest"
	"github.com/kilnvm/kiln/daemon/e2b"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// The tenants' keys of every test.
const (
	keyA = "key-alpha-0000001"
	keyB = "key-beta-00000002"
)

// env is a daemon.Server over the test double, with a template named
// base, and the E2B server over it on loopback.
type env struct {
	t     *testing.T
	kiln  kilnpb.KilnClient // the daemon's
	srv   *e2b.Server
	url   string
	state string
	base  *kilnpb.Template
}

// newEnv starts it; mod changes the E2B server's config (its Kiln is
// the daemon's client, which mod may wrap).
func newEnv(t *testing.T, mod func(*e2b.Config)) *env {
	t.Helper()
	return newEnvDaemon(t, nil, mod)
}

// newEnvDaemon is newEnv with dmod changing the daemon's config too.
func newEnvDaemon(t *testing.T, dmod func(*daemon.Config), mod func(*e2b.Config)) *env {
	t.Helper()
	e := &env{t: t, state: t.TempDir()}
	be := &daemontest.Backend{}
	t.Cleanup(be.KillAll) // kilnd leaves its sandboxes' processes running
	dcfg := daemon.Config{StateDir: filepath.Join(e.state, "kiln"), Backend: be,
		HostMemoryMiB: 16384, HostCPUs: 8, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	if dmod != nil {
		dmod(&dcfg)
	}
	ds, err := daemon.New(dcfg)
	if err != nil {
		t.Fatal(err)
	}
	e.kiln = serveDaemon(t, ds)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	e.base, err = e.kiln.CreateTemplate(ctx, &kilnpb.CreateTemplateRequest{Name: "base", Image: "busybox", RequestId: "base-template"})
	if err != nil {
		t.Fatalf("template base: %v", err)
	}
	keys, err := e2b.LoadKeys("", []string{keyA + " alpha", keyB + " beta"}, e2b.Quota{})
	if err != nil {
		t.Fatal(err)
	}
	cfg := e2b.Config{Kiln: e.kiln, Keys: keys, StateDir: filepath.Join(e.state, "e2b"),
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	if mod != nil {
		mod(&cfg)
	}
	e.srv, err = e2b.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(e.srv.Handler())
	t.Cleanup(hs.Close)
	e.url = hs.URL
	return e
}

// serveDaemon serves ds over an in-memory connection and returns its
// client; at the test's end every sandbox is destroyed (the double's are
// host processes, the real ones VMM processes) and ds closed.
func serveDaemon(t testing.TB, ds *daemon.Server) kilnpb.KilnClient {
	lis := bufconn.Listen(1 << 20)
	gs := grpc.NewServer()
	ds.Register(gs)
	go gs.Serve(lis)
	conn, err := grpc.NewClient("passthrough:///bufnet",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	kc := kilnpb.NewKilnClient(conn)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		if l, err := kc.ListSandboxes(ctx, &kilnpb.ListSandboxesRequest{}); err == nil {
			for _, sb := range l.Sandboxes {
				kc.DestroySandbox(ctx, &kilnpb.DestroySandboxRequest{Id: sb.Id})
			}
		}
		conn.Close()
		gs.Stop()
		ds.Close(ctx)
	})
	return kc
}

// reply is one HTTP answer.
type reply struct {
	status int
	header http.Header
	body   []byte
}

// json decodes the body into v, failing the test when it is not JSON.
func (r reply) json(t *testing.T, v any) {
	t.Helper()
	if err := json.Unmarshal(r.body, v); err != nil {
		t.Fatalf("reply %d %q: %v", r.status, r.body, err)
	}
}

// errBody is the body of an error reply, which must be {"code","message"}
// with code the status.
func (r reply) errBody(t *testing.T) string {
	t.Helper()
	var b struct {
		Code    *int    `json:"code"`
		Message *string `json:"message"`
	}
	r.json(t, &b)
	if b.Code == nil || *b.Code != r.status || b.Message == nil || *b.Message == "" {
		t.Fatalf("error reply %d: body %s; want {code: %d, message}", r.status, r.body, r.status)
	}
	return *b.Message
}

// do sends a request with an API key (none when ""); body is JSON-encoded
// unless it is a string, sent as is.
func (e *env) do(method, path, key string, body any, hdr ...string) reply {
	e.t.Helper()
	var rd io.Reader
	switch b := body.(type) {
	case nil:
	case string:
		rd = strings.NewReader(b)
	default:
		j, err := json.Marshal(b)
		if err != nil {
			e.t.Fatal(err)
		}
		rd = bytes.NewReader(j)
	}
	req, err := http.NewRequest(method, e.url+path, rd)
	if err != nil {
		e.t.Fatal(err)
	}
	if rd != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if key != "" {
		req.Header.Set("X-API-KEY", key)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		if strings.EqualFold(hdr[i], "Host") {
			req.Host = hdr[i+1]
		} else {
			req.Header.Set(hdr[i], hdr[i+1])
		}
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		e.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return reply{status: resp.StatusCode, header: resp.Header, body: b}
}

// created is a create's (or connect's, or a fork child's) reply body.
type created struct {
	SandboxID          string  `json:"sandboxID"`
	TemplateID         string  `json:"templateID"`
	ClientID           string  `json:"clientID"`
	EnvdVersion        string  `json:"envdVersion"`
	EnvdAccessToken    string  `json:"envdAccessToken"`
	TrafficAccessToken string  `json:"trafficAccessToken"`
	Domain             *string `json:"domain"`
}

// create makes a sandbox of base for key's tenant.
func (e *env) create(key string, body map[string]any) created {
	e.t.Helper()
	if body == nil {
		body = map[string]any{}
	}
	if body["templateID"] == nil {
		body["templateID"] = "base"
	}
	r := e.do("POST", "/v2/sandboxes", key, body)
	if r.status != http.StatusCreated {
		e.t.Fatalf("create: %d %s", r.status, r.body)
	}
	var c created
	r.json(e.t, &c)
	if c.SandboxID == "" || c.EnvdAccessToken == "" || c.EnvdVersion == "" || c.ClientID == "" {
		e.t.Fatalf("create's reply lacks fields: %s", r.body)
	}
	return c
}

func writeFile(t testing.TB, p, s string, mode os.FileMode) {
	t.Helper()
	if err := os.WriteFile(p, []byte(s), mode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(p, mode); err != nil {
		t.Fatal(err)
	}
}
