package e2b_test

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/daemon/e2b"
	"github.com/kilnvm/kiln/daemon/e2b/envd"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// TestCreate: what POST /v2/sandboxes takes and refuses, and what it
// returns, for every kind of body.
func TestCreate(t *testing.T) {
	lc := &lifeClient{}
	e := newEnv(t, func(c *e2b.Config) { c.Domain = "kiln.test"; lc.KilnClient = c.Kiln; c.Kiln = lc })
	tests := []struct {
		name   string
		body   any
		status int
		msg    string // in the error's message
	}{
		{"base", map[string]any{"templateID": "base", "timeout": 60}, 201, ""},
		{"by ID", map[string]any{"templateID": e.base.Id}, 201, ""},
		{"metadata, env, autoPause, unknown fields", map[string]any{"templateID": "base", "metadata": map[string]string{"k": "v"},
			"envVars": map[string]string{"A": "1"}, "autoPause": true, "secure": true, "future": []int{1}, "mcp": nil}, 201, ""},
		{"unknown template", map[string]any{"templateID": "nope"}, 404, `template "nope" not found`},
		{"no template", map[string]any{"timeout": 5}, 400, "templateID is required"},
		{"bad JSON", `{"templateID":`, 400, "bad request body"},
		{"timeout a string", `{"templateID":"base","timeout":"5"}`, 400, "timeout"},
		{"metadata a list", `{"templateID":"base","metadata":["a"]}`, 400, "metadata"},
		{"zero timeout", map[string]any{"templateID": "base", "timeout": 0}, 400, "timeout 0"},
		{"reserved metadata", map[string]any{"templateID": "base", "metadata": map[string]string{e2b.TenantLabel: "beta"}}, 400, "reserved"},
		{"env name with =", map[string]any{"templateID": "base", "envVars": map[string]string{"A=B": "1"}}, 400, "envVars"},
		{"no internet, no network pool", map[string]any{"templateID": "base", "allow_internet_access": false}, 400, "network settings"},
		{"rules", map[string]any{"templateID": "base", "network": map[string]any{"rules": map[string]any{"x": []any{}}}}, 400, "network.rules"},
		{"allow and partial deny", map[string]any{"templateID": "base", "network": map[string]any{"allowOut": []string{"a.com"}, "denyOut": []string{"10.0.0.0/8"}}}, 400, "not both"},
		{"autoResume", map[string]any{"templateID": "base", "autoResume": map[string]bool{"enabled": true}}, 400, "autoResume"},
		{"unknown volume", map[string]any{"templateID": "base", "volumeMounts": []map[string]string{{"name": "v", "path": "/v"}}}, 404, `volumeMounts[0]: volume "v" not found`},
		{"bad volume name", map[string]any{"templateID": "base", "volumeMounts": []map[string]string{{"name": "a/b", "path": "/v"}}}, 400, "volumeMounts[0]"},
		{"volume mount a string", `{"templateID":"base","volumeMounts":["v"]}`, 400, "volumeMounts[0]"},
		{"too big", `{"templateID":"base","metadata":{"k":"` + strings.Repeat("x", 1<<20) + `"}}`, 413, "over"},
		{"two values", `{"templateID":"base"} {}`, 400, "more than one"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r := e.do("POST", "/v2/sandboxes", keyA, tc.body)
			if r.status != tc.status {
				t.Fatalf("status %d %s; want %d", r.status, r.body, tc.status)
			}
			if tc.status != 201 {
				if msg := r.errBody(t); !strings.Contains(msg, tc.msg) {
					t.Errorf("message %q; want it to say %q", msg, tc.msg)
				}
				return
			}
			var c created
			r.json(t, &c)
			if c.ClientID != e2b.ClientID || c.EnvdVersion != envd.Version || c.Domain == nil || *c.Domain != "kiln.test" ||
				c.EnvdAccessToken != e.srv.AccessToken(c.SandboxID, "alpha", keyA) {
				t.Errorf("reply %s", r.body)
			}
			sb, err := e.kiln.GetSandbox(context.Background(), &kilnpb.GetSandboxRequest{Id: c.SandboxID})
			if err != nil {
				t.Fatal(err)
			}
			if sb.Labels[e2b.TenantLabel] != "alpha" || sb.Template != e.base.Id || sb.State != kilnpb.SandboxState_SANDBOX_STATE_RUNNING {
				t.Errorf("kiln's sandbox: %v", sb)
			}
			if tc.name == "base" && (c.TemplateID != "base" || sb.ExpiresUnixMs-sb.CreatedUnixMs < 59_000 || sb.ExpiresUnixMs-sb.CreatedUnixMs > 61_000) {
				t.Errorf("templateID %q, lifetime %d ms; want base, 60 s", c.TemplateID, sb.ExpiresUnixMs-sb.CreatedUnixMs)
			}
			creq := lc.creates[len(lc.creates)-1]
			if strings.HasPrefix(tc.name, "metadata") && (sb.Labels["k"] != "v" || creq.TimeoutAction != kilnpb.TimeoutAction_TIMEOUT_ACTION_HIBERNATE ||
				len(creq.Env) != 0 || len(creq.Secrets) != 1 || creq.Secrets[0].Name != "A" || string(creq.Secrets[0].Value) != "1" || !creq.Secrets[0].Plain) {
				t.Errorf("metadata/envVars/autoPause not passed on: %v", creq)
			}
		})
	}
}

// TestAuth: no key or a wrong one is 401 (the SDK's AuthenticationError);
// another tenant's sandbox is not found on every by-ID call, as an
// unknown ID is, and nothing is done to it.
func TestAuth(t *testing.T) {
	e := newEnv(t, nil)
	sb := e.create(keyA, nil)
	for _, key := range []string{"", "key-wrong-000000"} {
		r := e.do("GET", "/v2/sandboxes", key, nil)
		if r.status != 401 {
			t.Fatalf("key %q: %d %s", key, r.status, r.body)
		}
		r.errBody(t)
	}
	calls := []struct{ method, path, body string }{
		{"GET", "/sandboxes/ID", ""},
		{"DELETE", "/sandboxes/ID", ""},
		{"POST", "/sandboxes/ID/timeout", `{"timeout":30}`},
		{"POST", "/sandboxes/ID/pause", `{}`},
		{"POST", "/v2/sandboxes/ID/connect", `{"timeout":30}`},
		{"POST", "/sandboxes/ID/fork", `{"count":1}`},
		{"POST", "/sandboxes/ID/snapshots", `{}`},
		{"GET", "/sandboxes/ID/metrics", ""},
		{"PUT", "/sandboxes/ID/network", `{}`},
	}
	for _, c := range calls {
		for _, id := range []string{sb.SandboxID, "sb-unknown"} {
			var body any
			if c.body != "" {
				body = c.body
			}
			r := e.do(c.method, strings.Replace(c.path, "ID", id, 1), keyB, body)
			if r.status != 404 {
				t.Errorf("%s %s as another tenant: %d %s; want 404", c.method, c.path, r.status, r.body)
				continue
			}
			if msg := r.errBody(t); msg != `sandbox "`+id+`" not found` {
				t.Errorf("%s %s: message %q", c.method, c.path, msg)
			}
		}
	}
	got, err := e.kiln.GetSandbox(context.Background(), &kilnpb.GetSandboxRequest{Id: sb.SandboxID})
	if err != nil || got.State != kilnpb.SandboxState_SANDBOX_STATE_RUNNING {
		t.Errorf("the sandbox after another tenant's calls: %v %v", got, err)
	}
	var l []map[string]any
	e.do("GET", "/v2/sandboxes", keyB, nil).json(t, &l)
	if len(l) != 0 {
		t.Errorf("beta lists alpha's sandboxes: %v", l)
	}
	r := e.do("GET", "/nowhere", keyA, nil)
	if r.status != 404 || !strings.Contains(r.errBody(t), "not part of the API") {
		t.Errorf("unknown path: %d %s", r.status, r.body)
	}
}

// TestGetKill: getInfo's detail, kill, a second kill and a get after it.
func TestGetKill(t *testing.T) {
	e := newEnv(t, nil)
	sb := e.create(keyA, map[string]any{"metadata": map[string]string{"owner": "me"}, "timeout": 120})
	r := e.do("GET", "/sandboxes/"+sb.SandboxID, keyA, nil)
	if r.status != 200 {
		t.Fatalf("get: %d %s", r.status, r.body)
	}
	var d struct {
		SandboxID, TemplateID, ClientID, EnvdVersion, StartedAt, EndAt, State, EnvdAccessToken string
		CPUCount, MemoryMB, DiskSizeMB                                                         int
		Metadata                                                                               map[string]string
		Lifecycle                                                                              struct{ OnTimeout string }
	}
	r.json(t, &d)
	if d.SandboxID != sb.SandboxID || d.TemplateID != "base" || d.State != "running" || d.CPUCount != 1 || d.MemoryMB != 512 ||
		d.DiskSizeMB != 256 || len(d.Metadata) != 1 || d.Metadata["owner"] != "me" || d.Lifecycle.OnTimeout != "kill" ||
		d.EnvdAccessToken != sb.EnvdAccessToken || d.StartedAt >= d.EndAt {
		t.Errorf("detail: %s", r.body)
	}
	if r := e.do("DELETE", "/sandboxes/"+sb.SandboxID, keyA, nil); r.status != 204 || len(r.body) != 0 {
		t.Fatalf("kill: %d %s", r.status, r.body)
	}
	for _, c := range []struct{ method, path string }{{"DELETE", ""}, {"GET", ""}, {"GET", "/metrics"}} {
		r := e.do(c.method, "/sandboxes/"+sb.SandboxID+c.path, keyA, nil)
		if r.status != 404 {
			t.Errorf("%s after the kill: %d %s", c.method, r.status, r.body)
		} else {
			r.errBody(t)
		}
	}
}

// TestList: the tenant's sandboxes, filtered by metadata, state and
// template, paged with x-next-token in a stable order.
func TestList(t *testing.T) {
	e := newEnv(t, nil)
	var ids []string
	for i, team := range []string{"red", "blue", "red", "red"} {
		ids = append(ids, e.create(keyA, map[string]any{"metadata": map[string]string{"team": team, "n": string(rune('0' + i))}}).SandboxID)
	}
	e.create(keyB, map[string]any{"metadata": map[string]string{"team": "red"}})
	list := func(q url.Values) ([]string, string, reply) {
		t.Helper()
		r := e.do("GET", "/v2/sandboxes?"+q.Encode(), keyA, nil)
		if r.status != 200 {
			return nil, "", r
		}
		var l []struct {
			SandboxID, State, TemplateID string
			Metadata                     map[string]string
		}
		r.json(t, &l)
		var out []string
		for _, s := range l {
			if s.State != "running" || s.TemplateID != "base" || s.Metadata["team"] == "" {
				t.Errorf("listed: %+v", s)
			}
			out = append(out, s.SandboxID)
		}
		return out, r.header.Get("X-Next-Token"), r
	}
	tests := []struct {
		name string
		q    url.Values
		want []string
	}{
		{"all", nil, ids},
		{"metadata", url.Values{"metadata": {"team=red"}}, []string{ids[0], ids[2], ids[3]}},
		{"metadata, two keys", url.Values{"metadata": {"team=red&n=2"}}, []string{ids[2]}},
		{"running", url.Values{"state": {"running"}}, ids},
		{"running and paused", url.Values{"state": {"running,paused"}}, ids},
		{"paused", url.Values{"state": {"paused"}}, nil},
		{"template", url.Values{"template": {"base"}}, ids},
		{"other template", url.Values{"template": {"other"}}, nil},
		{"desc", url.Values{"order": {"desc"}}, []string{ids[3], ids[2], ids[1], ids[0]}},
	}
	for _, tc := range tests {
		got, next, r := list(tc.q)
		if r.status != 0 && r.status != 200 {
			t.Errorf("%s: %d %s", tc.name, r.status, r.body)
			continue
		}
		if strings.Join(got, ",") != strings.Join(tc.want, ",") || next != "" {
			t.Errorf("%s: %v (next %q); want %v", tc.name, got, next, tc.want)
		}
	}
	// Pages of 3 then 1, in the same order.
	page1, next, _ := list(url.Values{"limit": {"3"}})
	if next == "" || strings.Join(page1, ",") != strings.Join(ids[:3], ",") {
		t.Fatalf("page 1: %v, next %q", page1, next)
	}
	page2, next2, _ := list(url.Values{"limit": {"3"}, "nextToken": {next}})
	if next2 != "" || strings.Join(page2, ",") != ids[3] {
		t.Errorf("page 2: %v, next %q", page2, next2)
	}
	for _, q := range []url.Values{{"state": {"dead"}}, {"limit": {"0"}}, {"limit": {"101"}}, {"nextToken": {"garbage!"}},
		{"order": {"up"}}, {"startedAfter": {"yesterday"}}, {"metadata": {e2b.TenantLabel + "=beta"}}} {
		if _, _, r := list(q); r.status != 400 {
			t.Errorf("%v: %d %s; want 400", q, r.status, r.body)
		} else {
			r.errBody(t)
		}
	}
}

// pyQuote is Python's urllib.parse.quote: every byte but letters, digits,
// "_.-~" and '/' as %XX.
func pyQuote(s string) string {
	var b strings.Builder
	for _, c := range []byte(s) {
		if c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.IndexByte("_.-~/", c) >= 0 {
			b.WriteByte(c)
		} else {
			fmt.Fprintf(&b, "%%%02X", c)
		}
	}
	return b.String()
}

// TestListMetadataEncodings: a metadata filter as each SDK encodes it
// matches values with characters that need escaping. The npm SDK
// form-encodes the pairs (URLSearchParams); the Python SDK quotes each key
// and value first (quote, then urlencode), and says so with its lang
// header.
func TestListMetadataEncodings(t *testing.T) {
	e := newEnv(t, nil)
	odd := "a b&c=d/é%2F+x"
	want := e.create(keyA, map[string]any{"metadata": map[string]string{"odd": odd, "mail": "me@kiln.test"}}).SandboxID
	e.create(keyA, map[string]any{"metadata": map[string]string{"odd": "other", "mail": "me@kiln.test"}})
	list := func(filter string, hdr ...string) reply {
		t.Helper()
		return e.do("GET", "/v2/sandboxes?"+url.Values{"metadata": {filter}}.Encode(), keyA, nil, hdr...)
	}
	ids := func(r reply) string {
		t.Helper()
		if r.status != 200 {
			t.Fatalf("%d %s", r.status, r.body)
		}
		var l []struct{ SandboxID string }
		r.json(t, &l)
		var out []string
		for _, s := range l {
			out = append(out, s.SandboxID)
		}
		return strings.Join(out, ",")
	}
	npm := url.Values{"odd": {odd}, "mail": {"me@kiln.test"}}.Encode()
	py := url.Values{pyQuote("odd"): {pyQuote(odd)}, pyQuote("mail"): {pyQuote("me@kiln.test")}}.Encode()
	if got := ids(list(npm, "lang", "js")); got != want {
		t.Errorf("the npm SDK's filter: %q, want %q", got, want)
	}
	if got := ids(list(py, "lang", "python")); got != want {
		t.Errorf("the Python SDK's filter: %q, want %q", got, want)
	}
	// The same bytes from another client are values with a '%' in them.
	if got := ids(list(py)); got != "" {
		t.Errorf("the Python SDK's filter without its lang header: %q, want none", got)
	}
	if r := list("k=%25zz", "lang", "python"); r.status != 400 {
		t.Errorf("a bad escape from the Python SDK: %d %s, want 400", r.status, r.body)
	}
}

// TestPauseConnect: pause, a second pause (409, the SDK's false), the
// paused state in get and list, connect (201 resumed, then 200).
func TestPauseConnect(t *testing.T) {
	e := newEnv(t, nil)
	sb := e.create(keyA, nil)
	if r := e.do("POST", "/sandboxes/"+sb.SandboxID+"/pause", keyA, `{}`); r.status != 204 {
		t.Fatalf("pause: %d %s", r.status, r.body)
	}
	r := e.do("POST", "/sandboxes/"+sb.SandboxID+"/pause", keyA, nil)
	if r.status != 409 || !strings.Contains(r.errBody(t), "already paused") {
		t.Errorf("second pause: %d %s", r.status, r.body)
	}
	var d struct{ State string }
	e.do("GET", "/sandboxes/"+sb.SandboxID, keyA, nil).json(t, &d)
	if d.State != "paused" {
		t.Errorf("state %q after pause", d.State)
	}
	var l []struct{ SandboxID string }
	e.do("GET", "/v2/sandboxes?state=paused", keyA, nil).json(t, &l)
	if len(l) != 1 || l[0].SandboxID != sb.SandboxID {
		t.Errorf("paused list: %v", l)
	}
	// envd of a paused sandbox answers as not running.
	r = e.do("GET", "/health", "", nil, "E2b-Sandbox-Id", sb.SandboxID, "X-Access-Token", sb.EnvdAccessToken)
	if r.status != 502 {
		t.Errorf("envd of a paused sandbox: %d %s", r.status, r.body)
	}
	// A paused sandbox forks from its saved state, and stays paused.
	if r := e.do("POST", "/sandboxes/"+sb.SandboxID+"/fork", keyA, `{"count":2}`); r.status != 201 || strings.Count(string(r.body), `"sandboxID"`) != 2 {
		t.Errorf("fork of a paused sandbox: %d %s", r.status, r.body)
	}
	e.do("GET", "/sandboxes/"+sb.SandboxID, keyA, nil).json(t, &d)
	if d.State != "paused" {
		t.Errorf("state %q after a fork of the paused sandbox", d.State)
	}
	r = e.do("POST", "/v2/sandboxes/"+sb.SandboxID+"/connect", keyA, `{}`)
	var c created
	if r.status != 201 {
		t.Fatalf("connect to the paused: %d %s", r.status, r.body)
	}
	r.json(t, &c)
	if c.SandboxID != sb.SandboxID || c.EnvdAccessToken != sb.EnvdAccessToken {
		t.Errorf("connect: %s", r.body)
	}
	if r := e.do("POST", "/v2/sandboxes/"+sb.SandboxID+"/connect", keyA, nil); r.status != 200 {
		t.Errorf("connect to the running: %d %s", r.status, r.body)
	}
	r = e.do("POST", "/v2/sandboxes/"+sb.SandboxID+"/connect", keyA, `{"memory":false}`)
	if r.status != 400 || !strings.Contains(r.errBody(t), "memory=false") {
		t.Errorf("connect with reboot: %d %s", r.status, r.body)
	}
}

// TestFork: count children, each a sandbox of the tenant with the
// parent's metadata; bad counts are refused.
func TestFork(t *testing.T) {
	e := newEnv(t, nil)
	sb := e.create(keyA, map[string]any{"metadata": map[string]string{"role": "parent"}})
	r := e.do("POST", "/sandboxes/"+sb.SandboxID+"/fork", keyA, `{"count":3,"timeout":60}`)
	if r.status != 201 {
		t.Fatalf("fork: %d %s", r.status, r.body)
	}
	var kids []struct {
		Sandbox *created
		Error   any
	}
	r.json(t, &kids)
	if len(kids) != 3 {
		t.Fatalf("fork: %s", r.body)
	}
	for _, k := range kids {
		if k.Sandbox == nil || k.Error != nil || k.Sandbox.EnvdAccessToken != e.srv.AccessToken(k.Sandbox.SandboxID, "alpha", keyA) {
			t.Fatalf("child: %s", r.body)
		}
		var d struct {
			State    string
			Metadata map[string]string
		}
		e.do("GET", "/sandboxes/"+k.Sandbox.SandboxID, keyA, nil).json(t, &d)
		if d.State != "running" || d.Metadata["role"] != "parent" {
			t.Errorf("child %s: %+v", k.Sandbox.SandboxID, d)
		}
		if r := e.do("GET", "/sandboxes/"+k.Sandbox.SandboxID, keyB, nil); r.status != 404 {
			t.Errorf("another tenant sees a child: %d", r.status)
		}
	}
	if r := e.do("POST", "/sandboxes/"+sb.SandboxID+"/fork", keyA, nil); r.status != 201 {
		t.Errorf("fork with no body (one child): %d %s", r.status, r.body)
	}
	for _, body := range []string{`{"count":0}`, `{"count":257}`, `{"count":"2"}`, `{"timeout":-1}`} {
		if r := e.do("POST", "/sandboxes/"+sb.SandboxID+"/fork", keyA, body); r.status != 400 {
			t.Errorf("fork %s: %d %s", body, r.status, r.body)
		}
	}
}

// TestSnapshots: a snapshot is a kept checkpoint, listed for its tenant
// only, a template for creates (by ID or name), deleted through
// DELETE /templates/{id}.
func TestSnapshots(t *testing.T) {
	e := newEnv(t, nil)
	sb := e.create(keyA, nil)
	r := e.do("POST", "/sandboxes/"+sb.SandboxID+"/snapshots", keyA, `{"name":"first"}`)
	if r.status != 201 {
		t.Fatalf("snapshot: %d %s", r.status, r.body)
	}
	var snap struct {
		SnapshotID string
		Names      []string
	}
	r.json(t, &snap)
	if snap.SnapshotID == "" || len(snap.Names) != 1 || snap.Names[0] != "first" {
		t.Fatalf("snapshot: %s", r.body)
	}
	if r := e.do("POST", "/sandboxes/"+sb.SandboxID+"/snapshots", keyA, `{"name":"first"}`); r.status != 409 {
		t.Errorf("a second snapshot of that name: %d %s", r.status, r.body)
	}
	r = e.do("POST", "/sandboxes/"+sb.SandboxID+"/snapshots", keyA, nil)
	var snap2 struct{ SnapshotID string }
	r.json(t, &snap2)
	if r.status != 201 {
		t.Fatalf("unnamed snapshot: %d %s", r.status, r.body)
	}
	var l []struct{ SnapshotID string }
	e.do("GET", "/snapshots", keyA, nil).json(t, &l)
	if len(l) != 2 || l[0].SnapshotID != snap.SnapshotID || l[1].SnapshotID != snap2.SnapshotID {
		t.Errorf("list: %v", l)
	}
	r = e.do("GET", "/snapshots?limit=1", keyA, nil)
	if next := r.header.Get("X-Next-Token"); next == "" {
		t.Errorf("a page of 1 of 2 has no x-next-token")
	} else if r2 := e.do("GET", "/snapshots?limit=1&nextToken="+next, keyA, nil); !strings.Contains(string(r2.body), snap2.SnapshotID) {
		t.Errorf("page 2: %s", r2.body)
	}
	// The SDKs' name filter: a snapshot's name or ID.
	for q, want := range map[string]string{"first": snap.SnapshotID, snap.SnapshotID: snap.SnapshotID, snap2.SnapshotID: snap2.SnapshotID} {
		e.do("GET", "/snapshots?name="+url.QueryEscape(q), keyA, nil).json(t, &l)
		if len(l) != 1 || l[0].SnapshotID != want {
			t.Errorf("list name=%s: %v, want %s", q, l, want)
		}
	}
	e.do("GET", "/snapshots", keyB, nil).json(t, &l)
	if len(l) != 0 {
		t.Errorf("beta lists alpha's snapshots: %v", l)
	}
	for _, tmpl := range []string{snap.SnapshotID, "first"} {
		c := e.create(keyA, map[string]any{"templateID": tmpl})
		got, err := e.kiln.GetSandbox(context.Background(), &kilnpb.GetSandboxRequest{Id: c.SandboxID})
		if err != nil || got.Checkpoint != snap.SnapshotID {
			t.Errorf("created from %s: %v %v", tmpl, got, err)
		}
	}
	if r := e.do("POST", "/v2/sandboxes", keyB, map[string]any{"templateID": snap.SnapshotID}); r.status != 404 {
		t.Errorf("another tenant creates from the snapshot: %d %s", r.status, r.body)
	}
	// A fork of the snapshot (by ID or name): count sandboxes restored
	// from it, the tenant's, with their own tokens.
	for _, id := range []string{snap.SnapshotID, "first"} {
		r := e.do("POST", "/snapshots/"+id+"/fork", keyA, `{"count":3,"timeout":60}`)
		var kids []struct {
			Sandbox *created
			Error   any
		}
		r.json(t, &kids)
		if r.status != 201 || len(kids) != 3 {
			t.Fatalf("fork of snapshot %s: %d %s", id, r.status, r.body)
		}
		for _, k := range kids {
			if k.Sandbox == nil || k.Error != nil || k.Sandbox.TemplateID != snap.SnapshotID || k.Sandbox.EnvdAccessToken != e.srv.AccessToken(k.Sandbox.SandboxID, "alpha", keyA) {
				t.Fatalf("child: %s", r.body)
			}
			got, err := e.kiln.GetSandbox(context.Background(), &kilnpb.GetSandboxRequest{Id: k.Sandbox.SandboxID})
			if err != nil || got.Checkpoint != snap.SnapshotID || got.Labels[e2b.TenantLabel] != "alpha" {
				t.Errorf("child of snapshot %s: %v %v", id, got, err)
			}
		}
	}
	for key, body := range map[string]string{keyB: `{"count":1}`, keyA: `{"count":0}`} {
		if r := e.do("POST", "/snapshots/"+snap.SnapshotID+"/fork", key, body); r.status != map[string]int{keyA: 400, keyB: 404}[key] {
			t.Errorf("fork of the snapshot %s with %s: %d %s", body, key, r.status, r.body)
		}
	}
	if r := e.do("DELETE", "/templates/"+snap2.SnapshotID, keyB, nil); r.status != 404 {
		t.Errorf("another tenant deletes the snapshot: %d", r.status)
	}
	if r := e.do("DELETE", "/templates/base", keyA, nil); r.status != 404 {
		t.Errorf("DELETE /templates/base: %d; Kiln's templates are not the tenants' to delete", r.status)
	}
	if r := e.do("DELETE", "/templates/"+snap2.SnapshotID, keyA, nil); r.status != 204 {
		t.Errorf("delete: %d %s", r.status, r.body)
	}
	if r := e.do("DELETE", "/templates/"+snap2.SnapshotID, keyA, nil); r.status != 404 {
		t.Errorf("second delete: %d %s", r.status, r.body)
	}
	if _, err := e.kiln.ListCheckpoints(context.Background(), &kilnpb.ListCheckpointsRequest{SandboxId: sb.SandboxID}); err != nil {
		t.Fatal(err)
	}
	// The index survives a restart of the E2B server.
	e2, err := e2b.New(e2b.Config{Kiln: e.kiln, Keys: mustKeys(t), StateDir: e.state + "/e2b"})
	if err != nil {
		t.Fatal(err)
	}
	if e2.AccessToken(sb.SandboxID, "alpha", keyA) != sb.EnvdAccessToken {
		t.Error("a restarted server gives another access token")
	}
}

func mustKeys(t *testing.T) *e2b.Keys {
	k, err := e2b.LoadKeys("", []string{keyA + " alpha"}, e2b.Quota{})
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// lifeClient records the creates, lifetime and metrics calls the E2B
// layer makes; it answers the last two from the daemon's sandbox (UpdateSandbox: its new
// expiry; metrics: fixed samples), so that their translation is tested
// on its own.
type lifeClient struct {
	kilnpb.KilnClient
	creates []*kilnpb.CreateSandboxRequest
	updates []*kilnpb.UpdateSandboxRequest
	metrics []*kilnpb.GetSandboxMetricsRequest
}

func (c *lifeClient) CreateSandbox(ctx context.Context, in *kilnpb.CreateSandboxRequest, opts ...grpc.CallOption) (*kilnpb.Sandbox, error) {
	c.creates = append(c.creates, in)
	return c.KilnClient.CreateSandbox(ctx, in, opts...)
}

func (c *lifeClient) UpdateSandbox(ctx context.Context, in *kilnpb.UpdateSandboxRequest, _ ...grpc.CallOption) (*kilnpb.Sandbox, error) {
	c.updates = append(c.updates, in)
	sb, err := c.KilnClient.GetSandbox(ctx, &kilnpb.GetSandboxRequest{Id: in.Id})
	if err != nil {
		return nil, err
	}
	sb.ExpiresUnixMs = sb.CreatedUnixMs + in.GetLifetimeMs()
	return sb, nil
}

func (c *lifeClient) GetSandboxMetrics(ctx context.Context, in *kilnpb.GetSandboxMetricsRequest, _ ...grpc.CallOption) (*kilnpb.GetSandboxMetricsResponse, error) {
	c.metrics = append(c.metrics, in)
	if in.Id == "sb-gone" {
		return nil, status.Error(codes.NotFound, "no sandbox")
	}
	var out []*kilnpb.SandboxMetrics
	for _, ms := range []int64{1_800_000_000_000, 1_800_000_005_000, 1_800_000_010_000} {
		if ms >= in.SinceUnixMs {
			out = append(out, &kilnpb.SandboxMetrics{UnixMs: ms, CpuCount: 2, CpuUsedPct: 12.5, MemUsedBytes: 100 << 20,
				MemTotalBytes: 512 << 20, DiskUsedBytes: 10 << 20, DiskTotalBytes: 256 << 20})
		}
	}
	return &kilnpb.GetSandboxMetricsResponse{Samples: out}, nil
}

// TestTimeoutMetrics: setTimeout's and metrics' translation onto
// UpdateSandbox and GetSandboxMetrics.
func TestTimeoutMetrics(t *testing.T) {
	lc := &lifeClient{}
	e := newEnv(t, func(c *e2b.Config) { lc.KilnClient = c.Kiln; c.Kiln = lc })
	sb := e.create(keyA, nil)
	tests := []struct {
		body   string
		status int
		life   int64
	}{
		{`{"timeout":30}`, 204, 30_000},
		{`{"timeout":86400}`, 204, 86_400_000},
		{`{}`, 400, 0},
		{`{"timeout":0}`, 400, 0},
		{`{"timeout":-5}`, 400, 0},
		{`{"timeout":1.5}`, 400, 0},
	}
	for _, tc := range tests {
		n := len(lc.updates)
		r := e.do("POST", "/sandboxes/"+sb.SandboxID+"/timeout", keyA, tc.body)
		if r.status != tc.status {
			t.Errorf("timeout %s: %d %s; want %d", tc.body, r.status, r.body, tc.status)
			continue
		}
		if tc.status != 204 {
			r.errBody(t)
			if len(lc.updates) != n {
				t.Errorf("timeout %s: UpdateSandbox called", tc.body)
			}
			continue
		}
		if len(lc.updates) != n+1 || lc.updates[n].Id != sb.SandboxID || lc.updates[n].GetLifetimeMs() != tc.life {
			t.Errorf("timeout %s: UpdateSandbox %v; want lifetime %d", tc.body, lc.updates[n:], tc.life)
		}
	}

	var m []struct {
		Timestamp                              string
		TimestampUnix                          int64
		CPUCount                               int
		CPUUsedPct                             float64
		MemUsed, MemTotal, DiskUsed, DiskTotal int64
	}
	r := e.do("GET", "/sandboxes/"+sb.SandboxID+"/metrics", keyA, nil)
	r.json(t, &m)
	if r.status != 200 || len(m) != 3 || m[0].TimestampUnix != 1_800_000_000 || m[0].Timestamp != "2027-01-15T08:00:00Z" ||
		m[0].CPUCount != 2 || m[0].CPUUsedPct != 12.5 || m[0].MemUsed != 100<<20 || m[0].MemTotal != 512<<20 ||
		m[0].DiskUsed != 10<<20 || m[0].DiskTotal != 256<<20 {
		t.Errorf("metrics: %d %s", r.status, r.body)
	}
	r = e.do("GET", "/sandboxes/"+sb.SandboxID+"/metrics?start=1800000005&end=1800000005", keyA, nil)
	r.json(t, &m)
	if len(m) != 1 || m[0].TimestampUnix != 1_800_000_005 || lc.metrics[len(lc.metrics)-1].SinceUnixMs != 1_800_000_005_000 {
		t.Errorf("metrics from 5 to 5: %s", r.body)
	}
	if r := e.do("GET", "/sandboxes/"+sb.SandboxID+"/metrics?start=x", keyA, nil); r.status != 400 {
		t.Errorf("bad start: %d", r.status)
	}
}

// recordEnvd stands in for envd: which sandbox each request reached.
type recordEnvd struct{ ids []string }

func (h *recordEnvd) Serve(w http.ResponseWriter, r *http.Request, id string) {
	h.ids = append(h.ids, id)
	w.WriteHeader(http.StatusNoContent)
}

// TestEnvdRouting: envd requests by header or host name reach envd only
// with the sandbox's access token, and only while it runs (other ports:
// TestPorts); the rest is the control plane.
func TestEnvdRouting(t *testing.T) {
	rec := &recordEnvd{}
	e := newEnv(t, func(c *e2b.Config) { c.Envd = rec; c.Domain = "kiln.test" })
	sb := e.create(keyA, nil)
	other := e.create(keyB, nil)
	tests := []struct {
		name   string
		hdr    []string
		status int
		code   string // Connect error code
	}{
		{"header", []string{"E2b-Sandbox-Id", sb.SandboxID, "X-Access-Token", sb.EnvdAccessToken}, 204, ""},
		{"header with port", []string{"E2b-Sandbox-Id", sb.SandboxID, "E2b-Sandbox-Port", "49983", "X-Access-Token", sb.EnvdAccessToken}, 204, ""},
		{"host", []string{"Host", "49983-" + sb.SandboxID + ".kiln.test", "X-Access-Token", sb.EnvdAccessToken}, 204, ""},
		{"host with port", []string{"Host", "49983-" + sb.SandboxID + ".kiln.test:3000", "X-Access-Token", sb.EnvdAccessToken}, 204, ""},
		{"no token", []string{"E2b-Sandbox-Id", sb.SandboxID}, 401, "unauthenticated"},
		{"wrong token", []string{"E2b-Sandbox-Id", sb.SandboxID, "X-Access-Token", "x" + sb.EnvdAccessToken}, 401, "unauthenticated"},
		{"another's token", []string{"E2b-Sandbox-Id", sb.SandboxID, "X-Access-Token", other.EnvdAccessToken}, 401, "unauthenticated"},
		{"token of an unknown ID", []string{"E2b-Sandbox-Id", "sb-none", "X-Access-Token", e.srv.AccessToken("sb-none", "alpha", keyA)}, 401, "unauthenticated"},
	}
	for _, tc := range tests {
		n := len(rec.ids)
		r := e.do("POST", "/process.Process/List", "", `{}`, tc.hdr...)
		if r.status != tc.status {
			t.Errorf("%s: %d %s; want %d", tc.name, r.status, r.body, tc.status)
			continue
		}
		if tc.status == 204 {
			if len(rec.ids) != n+1 || rec.ids[n] != sb.SandboxID {
				t.Errorf("%s: envd got %v", tc.name, rec.ids[n:])
			}
			continue
		}
		if len(rec.ids) != n {
			t.Errorf("%s: reached envd", tc.name)
		}
		var b struct{ Code, Message string }
		r.json(t, &b)
		if b.Code != tc.code || b.Message == "" {
			t.Errorf("%s: body %s; want code %q", tc.name, r.body, tc.code)
		}
	}
	// A host name of another domain is the control plane's.
	r := e.do("GET", "/v2/sandboxes", keyA, nil, "Host", "49983-"+sb.SandboxID+".elsewhere.test")
	if r.status != 200 {
		t.Errorf("another domain's host name: %d %s", r.status, r.body)
	}
	e.do("DELETE", "/sandboxes/"+sb.SandboxID, keyA, nil)
	n := len(rec.ids)
	if r := e.do("POST", "/process.Process/List", "", `{}`, "E2b-Sandbox-Id", sb.SandboxID, "X-Access-Token", sb.EnvdAccessToken); r.status != 502 || len(rec.ids) != n {
		t.Errorf("envd of a killed sandbox: %d %s", r.status, r.body)
	}
	if r := e.do("GET", "/health", "", nil); r.status != 200 {
		t.Errorf("the control plane's health: %d", r.status)
	}
}

// TestNew: what New refuses.
func TestNew(t *testing.T) {
	keys := mustKeys(t)
	none, _ := e2b.LoadKeys("", nil, e2b.Quota{})
	k := (&lifeClient{}).KilnClient
	for _, c := range []e2b.Config{
		{Keys: keys, StateDir: t.TempDir()},
		{Kiln: &lifeClient{KilnClient: k}, Keys: none, StateDir: t.TempDir()},
		{Kiln: &lifeClient{KilnClient: k}, Keys: keys},
		{Kiln: &lifeClient{KilnClient: k}, Keys: keys, StateDir: t.TempDir(), Domain: "a b"},
	} {
		if _, err := e2b.New(c); err == nil {
			t.Errorf("New(%+v) succeeded", c)
		}
	}
}

// TestRevokedKeyTokens: an envd access token is bound to the API key it
// was given to: each of a tenant's keys gets its own token for a sandbox,
// and removing a key from the keys file (and reloading, as SIGHUP does)
// makes that key's tokens 401 while the tenant's other key's still work.
func TestRevokedKeyTokens(t *testing.T) {
	const key1, key2 = "key-alpha-rotate-1", "key-alpha-rotate-2"
	file := filepath.Join(t.TempDir(), "keys")
	if err := os.WriteFile(file, []byte(key1+" alpha\n"+key2+" alpha\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	keys, err := e2b.LoadKeys(file, nil, e2b.Quota{})
	if err != nil {
		t.Fatal(err)
	}
	rec := &recordEnvd{}
	e := newEnv(t, func(c *e2b.Config) { c.Envd = rec; c.Keys = keys })
	sb := e.create(key1, nil)
	r := e.do("POST", "/v2/sandboxes/"+sb.SandboxID+"/connect", key2, `{"timeout":30}`)
	if r.status != 200 {
		t.Fatalf("connect with the second key: %d %s", r.status, r.body)
	}
	var viaKey2 created
	r.json(t, &viaKey2)
	if viaKey2.EnvdAccessToken == sb.EnvdAccessToken || viaKey2.EnvdAccessToken == "" {
		t.Errorf("two keys of a tenant get one token: %q", viaKey2.EnvdAccessToken)
	}
	envdStatus := func(tok string) int {
		return e.do("POST", "/process.Process/List", "", `{}`, "E2b-Sandbox-Id", sb.SandboxID, "X-Access-Token", tok).status
	}
	if a, b := envdStatus(sb.EnvdAccessToken), envdStatus(viaKey2.EnvdAccessToken); a != 204 || b != 204 {
		t.Fatalf("envd with either key's token: %d, %d; want 204", a, b)
	}
	// key1 revoked.
	if err := os.WriteFile(file, []byte(key2+" alpha\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := e.srv.ReloadKeys(); err != nil {
		t.Fatal(err)
	}
	n := len(rec.ids)
	if got := envdStatus(sb.EnvdAccessToken); got != 401 {
		t.Errorf("envd with a revoked key's token: %d; want 401", got)
	}
	if len(rec.ids) != n {
		t.Error("a revoked key's token reached envd")
	}
	if got := envdStatus(viaKey2.EnvdAccessToken); got != 204 {
		t.Errorf("envd with the tenant's remaining key's token: %d; want 204", got)
	}
	if r := e.do("GET", "/sandboxes/"+sb.SandboxID, key1, nil); r.status != 401 {
		t.Errorf("the control plane with a revoked key: %d", r.status)
	}
	// Every key of the tenant revoked: no token of its sandbox works.
	if err := os.WriteFile(file, []byte("key-beta-only-0001 beta\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := e.srv.ReloadKeys(); err != nil {
		t.Fatal(err)
	}
	if got := envdStatus(viaKey2.EnvdAccessToken); got != 401 {
		t.Errorf("envd once the tenant has no key: %d; want 401", got)
	}
}

// TestControlPlaneReadTimeout: a control-plane request whose body stalls
// is answered 408 once Config.ReadTimeout passes, and envd's requests
// are not held to it (a slow envd handler still answers).
func TestControlPlaneReadTimeout(t *testing.T) {
	slow := envdFunc(func(w http.ResponseWriter, r *http.Request, id string) {
		time.Sleep(400 * time.Millisecond) // past the read and write timeouts
		w.WriteHeader(http.StatusNoContent)
	})
	e := newEnv(t, func(c *e2b.Config) {
		c.ReadTimeout, c.WriteTimeout = 200*time.Millisecond, 300*time.Millisecond
		c.Envd = slow
	})
	sb := e.create(keyA, nil)
	c, err := net.Dial("tcp", strings.TrimPrefix(e.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	io.WriteString(c, "POST /v2/sandboxes HTTP/1.1\r\nHost: kiln\r\nX-API-KEY: "+keyA+"\r\nContent-Length: 100\r\n\r\n{\"templ")
	began := time.Now()
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("a stalled body: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestTimeout || time.Since(began) > 5*time.Second {
		t.Errorf("a stalled body: %d after %v; want 408 after the read timeout", resp.StatusCode, time.Since(began))
	}
	if r := e.do("POST", "/process.Process/List", "", `{}`, "E2b-Sandbox-Id", sb.SandboxID, "X-Access-Token", sb.EnvdAccessToken); r.status != 204 {
		t.Errorf("envd past the control plane's timeouts: %d %s", r.status, r.body)
	}
}

// envdFunc is an EnvdHandler of a function.
type envdFunc func(w http.ResponseWriter, r *http.Request, id string)

func (f envdFunc) Serve(w http.ResponseWriter, r *http.Request, id string) { f(w, r, id) }

// TestTenantQuota: a tenant at its quota is refused (429, "capacity",
// naming its own quota and nothing of the host's or others' counts)
// while another tenant still creates; each kind of quota holds (live
// sandboxes on create and fork, memory, hibernated state on pause,
// snapshots); the host's own limit is refused without its numbers.
func TestTenantQuota(t *testing.T) {
	const keyC = "key-gamma-0000003"
	var mem uint32
	e := newEnvDaemon(t, func(c *daemon.Config) { c.MaxSandboxes = 5 }, func(c *e2b.Config) {
		keys, err := e2b.LoadKeys("", []string{keyA + " alpha sandboxes=2 hibernated=1 snapshots=1", keyB + " beta", keyC + " gamma memory=1"}, e2b.Quota{Sandboxes: 4})
		if err != nil {
			t.Fatal(err)
		}
		c.Keys = keys
	})
	mem = e.base.GetResources().GetMemoryMib()
	if mem == 0 {
		t.Fatal("the base template has no memory size")
	}
	refused := func(r reply, status int, want string) {
		t.Helper()
		if r.status != status {
			t.Fatalf("status %d %s; want %d", r.status, r.body, status)
		}
		msg := r.errBody(t)
		if !strings.Contains(msg, "capacity") || !strings.Contains(msg, want) {
			t.Errorf("refusal %q; want capacity and %q", msg, want)
		}
		for _, leak := range []string{"host runs", "the host's", "of 5", "runs 5", "limit is", "1024", "beta", "16384"} {
			if strings.Contains(msg, leak) {
				t.Errorf("refusal %q tells of the host or another tenant (%q)", msg, leak)
			}
		}
	}
	b1 := e.create(keyB, nil)
	a1 := e.create(keyA, nil)
	e.create(keyA, nil)
	// alpha is at its 2 sandboxes: refused, naming its quota.
	refused(e.do("POST", "/v2/sandboxes", keyA, map[string]any{"templateID": "base"}), 429, "alpha is at its sandboxes quota of 2")
	refused(e.do("POST", "/sandboxes/"+a1.SandboxID+"/fork", keyA, `{"count":1}`), 429, "sandboxes quota of 2")
	// beta, under the default quota of 4, still creates.
	e.create(keyB, nil)
	// gamma's memory quota (1 MiB) is below one sandbox's.
	refused(e.do("POST", "/v2/sandboxes", keyC, map[string]any{"templateID": "base"}), 429, "gamma is at its memory quota of 1 MiB")
	// alpha's hibernated quota (1 MiB) refuses a pause; its snapshot
	// quota a second snapshot.
	refused(e.do("POST", "/sandboxes/"+a1.SandboxID+"/pause", keyA, `{}`), 429, "hibernated quota of 1 MiB")
	if r := e.do("POST", "/sandboxes/"+a1.SandboxID+"/snapshots", keyA, `{}`); r.status != 201 {
		t.Fatalf("snapshot: %d %s", r.status, r.body)
	}
	refused(e.do("POST", "/sandboxes/"+a1.SandboxID+"/snapshots", keyA, `{}`), 429, "snapshots quota of 1")
	// A freed place is the tenant's again.
	if r := e.do("DELETE", "/sandboxes/"+a1.SandboxID, keyA, nil); r.status != 204 {
		t.Fatalf("kill: %d", r.status)
	}
	e.create(keyA, nil)
	// The host's limit (5 live sandboxes): beta, under its quota, is
	// refused for the host, told nothing of the host's counts.
	if r := e.do("DELETE", "/sandboxes/"+b1.SandboxID, keyB, nil); r.status != 204 {
		t.Fatalf("kill: %d", r.status)
	}
	e.create(keyB, nil)
	e.create(keyB, nil)
	refused(e.do("POST", "/v2/sandboxes", keyB, map[string]any{"templateID": "base"}), 503, "capacity")
}

// TestEnvVarsNotOnDisk: a create's envVars reach every process of the
// sandbox (and of its fork children), and their values are in no file of
// the state folder (kilnd's records, checkpoints, hibernated state, the
// E2B layer's index) after a snapshot, a fork and a pause.
func TestEnvVarsNotOnDisk(t *testing.T) {
	e := newEnv(t, nil)
	const value = "sk-e2b-envvar-distinctive-91c2"
	sb := e.create(keyA, map[string]any{"envVars": map[string]string{"OPENAI_API_KEY": value, "DEBUG": "1"}})
	printEnv := func(id string) string {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		st, err := e.kiln.Exec(ctx)
		if err != nil {
			t.Fatal(err)
		}
		st.Send(&kilnpb.ExecRequest{Kind: &kilnpb.ExecRequest_Start{Start: &kilnpb.ExecStart{SandboxId: id, Argv: []string{"sh", "-c", `echo "$OPENAI_API_KEY $DEBUG"`}}}})
		var out strings.Builder
		for {
			resp, err := st.Recv()
			if err == io.EOF {
				return out.String()
			}
			if err != nil {
				t.Fatalf("exec in %s: %v", id, err)
			}
			out.Write(resp.GetStdout())
		}
	}
	if got := printEnv(sb.SandboxID); got != value+" 1\n" {
		t.Fatalf("the sandbox's process sees %q", got)
	}
	if r := e.do("POST", "/sandboxes/"+sb.SandboxID+"/snapshots", keyA, `{}`); r.status != 201 {
		t.Fatalf("snapshot: %d %s", r.status, r.body)
	}
	r := e.do("POST", "/sandboxes/"+sb.SandboxID+"/fork", keyA, `{"count":1}`)
	var kids []struct{ Sandbox *created }
	if r.status != 201 {
		t.Fatalf("fork: %d %s", r.status, r.body)
	}
	r.json(t, &kids)
	if len(kids) != 1 || kids[0].Sandbox == nil {
		t.Fatalf("fork: %s", r.body)
	}
	if got := printEnv(kids[0].Sandbox.SandboxID); got != value+" 1\n" {
		t.Errorf("a fork child's process sees %q", got)
	}
	if r := e.do("POST", "/sandboxes/"+sb.SandboxID+"/pause", keyA, `{}`); r.status != 204 {
		t.Fatalf("pause: %d %s", r.status, r.body)
	}
	// Every file of the state folder but the double's guest roots (what
	// stands for the guest's own memory and disk).
	files := 0
	err := filepath.WalkDir(e.state, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && d.Name() == "root" {
			return filepath.SkipDir
		}
		if !d.Type().IsRegular() {
			return nil
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		files++
		if bytes.Contains(b, []byte(value)) {
			t.Errorf("%s holds an envVar's value", p)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if files < 5 {
		t.Errorf("only %d files in the state folder: not the records, checkpoints and hibernated state looked for", files)
	}
	if r := e.do("POST", "/v2/sandboxes/"+sb.SandboxID+"/connect", keyA, `{}`); r.status != 201 {
		t.Fatalf("connect: %d %s", r.status, r.body)
	}
	if got := printEnv(sb.SandboxID); got != value+" 1\n" {
		t.Errorf("after a pause and connect the process sees %q", got)
	}
}
