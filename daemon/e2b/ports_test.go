package e2b_test

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/daemon/e2b"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// guestServer stands for a server a sandbox of the test double runs (the
// double's ports are the host's loopback): it answers GET with what it
// was sent, and tunnels an Upgrade (a WebSocket's handshake) into an echo
// of raw bytes.
func guestServer(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Upgrade") == "websocket" {
			c, rw, err := http.NewResponseController(w).Hijack()
			if err != nil {
				t.Error(err)
				return
			}
			defer c.Close()
			rw.WriteString("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
			rw.Flush()
			io.Copy(c, rw) // echo until the client closes
			return
		}
		fmt.Fprintf(w, "host=%s path=%s token=%q xff=%t", r.Host, r.URL.RequestURI(), r.Header.Get(e2b.TrafficTokenHeader), r.Header.Get("X-Forwarded-For") != "")
	})}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return ln.Addr().(*net.TCPAddr).Port
}

// freePort is a loopback port nothing listens on (one just closed).
func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	return p
}

// TestPorts: a sandbox's ports through the API's listener, by host name
// and by E2B's headers: public by default, behind the sandbox's own
// traffic token with allowPublicTraffic false (none, a wrong one or
// another sandbox's: 401), the Host header kept or masked, the routing
// and token headers not passed on, an Upgrade tunnelled both ways; a port
// nothing listens on, an unknown, paused or killed sandbox: a 502 that
// says which.
func TestPorts(t *testing.T) {
	e := newEnv(t, func(c *e2b.Config) { c.Domain = "kiln.test" })
	port := guestServer(t)
	p := strconv.Itoa(port)
	pub := e.create(keyA, nil)
	if pub.TrafficAccessToken != "" {
		t.Errorf("a public sandbox got a traffic token")
	}
	priv := e.create(keyA, map[string]any{"network": map[string]any{"allowPublicTraffic": false}})
	other := e.create(keyB, map[string]any{"network": map[string]any{"allowPublicTraffic": false}})
	masked := e.create(keyA, map[string]any{"network": map[string]any{"maskRequestHost": "localhost:${PORT}"}})
	if priv.TrafficAccessToken == "" || other.TrafficAccessToken == "" || priv.TrafficAccessToken == other.TrafficAccessToken {
		t.Fatalf("traffic tokens %q, %q", priv.TrafficAccessToken, other.TrafficAccessToken)
	}
	host := func(c created, port string) string { return port + "-" + c.SandboxID + ".kiln.test" }
	tests := []struct {
		name   string
		hdr    []string
		status int
		want   string // in the body
	}{
		{"public by host", []string{"Host", host(pub, p)}, 200, "host=" + host(pub, p) + " path=/a/b?c=d token=\"\" xff=true"},
		{"public by host with the API's port", []string{"Host", host(pub, p) + ":3000"}, 200, "path=/a/b?c=d"},
		{"public by headers", []string{"E2b-Sandbox-Id", pub.SandboxID, "E2b-Sandbox-Port", p}, 200, "path=/a/b?c=d"},
		{"private without a token", []string{"Host", host(priv, p)}, 401, "missing " + e2b.TrafficTokenHeader},
		{"private with a wrong token", []string{"Host", host(priv, p), e2b.TrafficTokenHeader, "x" + priv.TrafficAccessToken}, 401, "wrong"},
		{"private with another sandbox's token", []string{"Host", host(priv, p), e2b.TrafficTokenHeader, other.TrafficAccessToken}, 401, "wrong"},
		{"private with its envd token", []string{"Host", host(priv, p), "X-Access-Token", priv.EnvdAccessToken}, 401, "missing"},
		{"private with its token", []string{"Host", host(priv, p), e2b.TrafficTokenHeader, priv.TrafficAccessToken}, 200, "token=\"\""},
		{"private by headers with its token", []string{"E2b-Sandbox-Id", priv.SandboxID, "E2b-Sandbox-Port", p, e2b.TrafficTokenHeader, priv.TrafficAccessToken}, 200, "path=/a/b"},
		{"masked host", []string{"Host", host(masked, p)}, 200, "host=localhost:" + p + " "},
		{"nothing listens", []string{"Host", host(pub, strconv.Itoa(freePort(t)))}, 502, "refused"},
		{"unknown sandbox", []string{"Host", host(created{SandboxID: "sb-none"}, p)}, 502, "sb-none not found"},
	}
	for _, tc := range tests {
		r := e.do("GET", "/a/b?c=d", "", nil, tc.hdr...)
		if r.status != tc.status || !strings.Contains(string(r.body), tc.want) {
			t.Errorf("%s: %d %s; want %d with %q", tc.name, r.status, r.body, tc.status, tc.want)
		}
		if tc.status != 200 {
			r.errBody(t)
		}
	}

	// An Upgrade: the connection is the guest's, both ways.
	c, err := net.Dial("tcp", strings.TrimPrefix(e.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(30 * time.Second))
	fmt.Fprintf(c, "GET /ws HTTP/1.1\r\nHost: %s\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n%s: %s\r\n\r\n", host(priv, p), e2b.TrafficTokenHeader, priv.TrafficAccessToken)
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil || resp.StatusCode != http.StatusSwitchingProtocols {
		t.Fatalf("upgrade: %v %v", resp, err)
	}
	for _, msg := range []string{"hello", strings.Repeat("x", 100_000)} {
		if _, err := io.WriteString(c, msg); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, len(msg))
		if _, err := io.ReadFull(br, got); err != nil || string(got) != msg {
			t.Fatalf("echo of %d bytes: %d bytes, %v", len(msg), len(got), err)
		}
	}

	// Paused, then killed: 502s that say so.
	if r := e.do("POST", "/sandboxes/"+pub.SandboxID+"/pause", keyA, nil); r.status != 204 {
		t.Fatalf("pause: %d %s", r.status, r.body)
	}
	if r := e.do("GET", "/", "", nil, "Host", host(pub, p)); r.status != 502 || !strings.Contains(r.errBody(t), "paused") {
		t.Errorf("a paused sandbox's port: %d %s", r.status, r.body)
	}
	e.do("DELETE", "/sandboxes/"+pub.SandboxID, keyA, nil)
	if r := e.do("GET", "/", "", nil, "Host", host(pub, p)); r.status != 502 || !strings.Contains(r.errBody(t), "not found") {
		t.Errorf("a killed sandbox's port: %d %s", r.status, r.body)
	}

	// What a create may not set, and what an update may not change.
	for _, n := range []map[string]any{{"maskRequestHost": "a b"}, {"maskRequestHost": ""}, {"httpsPorts": []int{0}}, {"httpsPorts": []int{65536}},
		{"httpsPorts": []int{e2b.EnvdPort}}, {"httpsPorts": make([]int, 65)}} {
		if r := e.do("POST", "/v2/sandboxes", keyA, map[string]any{"templateID": "base", "network": n}); r.status != 400 {
			t.Errorf("create with network %v: %d %s", n, r.status, r.body)
		}
	}
	if r := e.do("PUT", "/sandboxes/"+priv.SandboxID+"/network", keyA, map[string]any{"allowPublicTraffic": true}); r.status != 400 {
		t.Errorf("an update of allowPublicTraffic: %d %s", r.status, r.body)
	}
}

// TestPauseWithoutMemory: pause {memory:false} hibernates keeping files
// only (kilnd says files_only; a fork of it boots its files); connect, with or
// without memory:false, boots it again under the same ID and token with
// its files; autoPauseMemory false makes the timeout's pause the same.
func TestPauseWithoutMemory(t *testing.T) {
	e := newEnv(t, nil)
	sb := e.create(keyA, map[string]any{"timeout": 600})
	if r := e.do("POST", "/sandboxes/"+sb.SandboxID+"/pause", keyA, `{"memory":false}`); r.status != 204 {
		t.Fatalf("pause without memory: %d %s", r.status, r.body)
	}
	got, err := e.kiln.GetSandbox(t.Context(), &kilnpb.GetSandboxRequest{Id: sb.SandboxID})
	if err != nil || !got.Hibernated || !got.FilesOnly || got.Pid != 0 {
		t.Fatalf("paused without memory: %v %v", got, err)
	}
	if r := e.do("POST", "/sandboxes/"+sb.SandboxID+"/fork", keyA, `{"count":1}`); r.status != 200 && r.status != 201 {
		t.Errorf("fork of a sandbox paused without memory: %d %s", r.status, r.body)
	}
	r := e.do("POST", "/v2/sandboxes/"+sb.SandboxID+"/connect", keyA, `{"memory":false}`)
	var c created
	r.json(t, &c)
	if r.status != 201 || c.SandboxID != sb.SandboxID || c.EnvdAccessToken != sb.EnvdAccessToken {
		t.Fatalf("connect: %d %s", r.status, r.body)
	}
	if got, _ := e.kiln.GetSandbox(t.Context(), &kilnpb.GetSandboxRequest{Id: sb.SandboxID}); got.State != kilnpb.SandboxState_SANDBOX_STATE_RUNNING || got.FilesOnly {
		t.Errorf("after the connect: %v", got)
	}

	auto := e.create(keyA, map[string]any{"autoPause": true, "autoPauseMemory": false})
	if got, _ := e.kiln.GetSandbox(t.Context(), &kilnpb.GetSandboxRequest{Id: auto.SandboxID}); got.TimeoutAction != kilnpb.TimeoutAction_TIMEOUT_ACTION_HIBERNATE_FILES {
		t.Errorf("autoPauseMemory false: timeout action %v", got.TimeoutAction)
	}
}

// TestHTTPSPorts: a port listed in network.httpsPorts is reached over TLS
// with the sandbox's own (self-signed) certificate; one not listed is
// spoken to in plain HTTP, which a TLS server refuses.
func TestHTTPSPorts(t *testing.T) {
	e := newEnv(t, func(c *e2b.Config) { c.Domain = "kiln.test" })
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "tls=%v host=%s", r.TLS != nil, r.Host)
	}))
	t.Cleanup(srv.Close)
	_, p, _ := net.SplitHostPort(srv.Listener.Addr().String())
	port, _ := strconv.Atoi(p)
	tls := e.create(keyA, map[string]any{"network": map[string]any{"httpsPorts": []int{port, port, 8443}}})
	plain := e.create(keyA, nil)
	h := p + "-" + tls.SandboxID + ".kiln.test"
	var d struct {
		Network struct {
			AllowPublicTraffic *bool
			HTTPSPorts         []int
		}
	}
	e.do("GET", "/sandboxes/"+tls.SandboxID, keyA, nil).json(t, &d)
	if d.Network.AllowPublicTraffic == nil || !*d.Network.AllowPublicTraffic || len(d.Network.HTTPSPorts) != 2 || d.Network.HTTPSPorts[0] != port || d.Network.HTTPSPorts[1] != 8443 {
		t.Errorf("getInfo's network: %+v", d.Network)
	}
	if r := e.do("GET", "/", "", nil, "Host", h); r.status != 200 || string(r.body) != "tls=true host="+h {
		t.Errorf("an HTTPS port: %d %s", r.status, r.body)
	}
	if r := e.do("GET", "/", "", nil, "Host", p+"-"+plain.SandboxID+".kiln.test"); r.status != 400 || !strings.Contains(string(r.body), "HTTP request to an HTTPS server") {
		t.Errorf("an HTTPS port not listed: %d %s", r.status, r.body)
	}
}
