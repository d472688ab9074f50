package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/daemon/client"
	"github.com/kilnvm/kiln/daemon/daemontest"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// TestE2BFlags: the E2B flags from the command line and the config file,
// and what is refused.
func TestE2BFlags(t *testing.T) {
	dir := t.TempDir()
	conf := filepath.Join(dir, "kilnd.toml")
	os.WriteFile(conf, []byte("e2b-listen = \"127.0.0.1:3000\"\ne2b-api-key = [\"key-conf-0001 alpha\", \"key-conf-0002 beta\"]\ne2b-domain = \"kiln.test\"\n"), 0o644)
	cfg, err := parseFlagsWith([]string{"--config", conf, "--vmm", "/bin/true"}, io.Discard, "")
	if err != nil {
		t.Fatal(err)
	}
	if cfg.e2bListen != "127.0.0.1:3000" || len(cfg.e2bKeys) != 2 || cfg.e2bKeys[1] != "key-conf-0002 beta" || cfg.e2bDomain != "kiln.test" {
		t.Errorf("from the config file: %+v", cfg)
	}
	for _, tc := range []struct {
		args []string
		msg  string
	}{
		{[]string{"--e2b-listen", "127.0.0.1:3000"}, "needs API keys"},
		{[]string{"--e2b-listen", "nowhere"}, "e2b-listen"},
		{[]string{"--e2b-listen", "127.0.0.1:3000", "--e2b-api-key", "key-0000001 a", "--e2b-domain", "a/b"}, "--e2b-domain"},
	} {
		if _, err := parseFlagsWith(append(tc.args, "--vmm", "/bin/true"), io.Discard, ""); err == nil || !strings.Contains(err.Error(), tc.msg) {
			t.Errorf("%v: %v; want %q", tc.args, err, tc.msg)
		}
	}
	// A bad keys file stops kilnd before it serves, naming the line.
	keys := filepath.Join(dir, "keys")
	os.WriteFile(keys, []byte("# k\nkey-file-0001\n"), 0o600)
	var stderr bytes.Buffer
	args := []string{"--config=", "--listen", "unix:" + filepath.Join(dir, "s.sock"), "--state-dir", filepath.Join(dir, "state"),
		"--vmm", "/bin/true", "--e2b-listen", "127.0.0.1:0", "--e2b-api-keys", keys}
	if code := run(context.Background(), args, &stderr, func(config, *slog.Logger) (service, error) {
		t.Error("kilnd made its service with a bad keys file")
		return &listOnly{}, nil
	}); code != 1 || !strings.Contains(stderr.String(), keys+":2") {
		t.Errorf("a bad keys file: exit %d, %q", code, stderr.String())
	}
}

// TestE2BListen runs kilnd over package daemon and its test backend with
// the E2B listener: the API answers with a key from the keys file or the
// command line, reaches the daemon in-process (a sandbox it creates is
// kilnd's), reports kilnd's health, and stops with kilnd.
func TestE2BListen(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "kilnd.sock")
	state := filepath.Join(dir, "state")
	keys := filepath.Join(dir, "keys")
	os.WriteFile(keys, []byte("key-file-0001 alpha\n"), 0o600)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	be := &daemontest.Backend{}
	newSvc := func(cfg config, log *slog.Logger) (service, error) {
		return daemon.New(daemon.Config{StateDir: cfg.stateDir, Backend: be, HostMemoryMiB: 16384, HostCPUs: 8, Logger: log})
	}
	args := []string{"--config=", "--listen", "unix:" + sock, "--state-dir", state, "--vmm", "/bin/true",
		"--e2b-listen", addr, "--e2b-api-keys", keys, "--e2b-api-key", "key-flag-0002 beta"}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int, 1)
	var stderr bytes.Buffer
	go func() { done <- run(ctx, args, &stderr, newSvc) }()

	dctx, dcancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer dcancel()
	var c *client.Client
	for {
		if c, err = client.Dial(dctx, "unix:"+sock); err == nil {
			break
		}
		if dctx.Err() != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	defer c.Close()
	if _, err := c.CreateTemplate(dctx, &kilnpb.CreateTemplateRequest{Name: "base", Image: "busybox"}); err != nil {
		t.Fatal(err)
	}
	do := func(method, path, key, body string) (int, []byte) {
		t.Helper()
		req, _ := http.NewRequestWithContext(dctx, method, "http://"+addr+path, strings.NewReader(body))
		if key != "" {
			req.Header.Set("X-API-KEY", key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, b
	}
	if code, b := do("GET", "/health", "", ""); code != 200 {
		t.Errorf("health: %d %s", code, b)
	}
	code, b := do("POST", "/v2/sandboxes", "key-file-0001", `{"templateID":"base","timeout":60}`)
	if code != 201 {
		t.Fatalf("create: %d %s", code, b)
	}
	var sb struct{ SandboxID, EnvdAccessToken string }
	json.Unmarshal(b, &sb)
	got, err := c.GetSandbox(dctx, sb.SandboxID)
	if err != nil || got.GetLabels()["e2b.kiln.dev/tenant"] != "alpha" {
		t.Errorf("kilnd's sandbox: %v %v", got, err)
	}
	if code, _ := do("GET", "/sandboxes/"+sb.SandboxID, "key-flag-0002", ""); code != 404 {
		t.Errorf("beta gets alpha's sandbox: %d", code)
	}
	if code, _ := do("GET", "/v2/sandboxes", "key-wrong-0003", ""); code != 401 {
		t.Errorf("a wrong key: %d", code)
	}
	if fi, err := os.Stat(filepath.Join(state, "e2b", "access-token.key")); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("the access-token key: %v %v", fi, err)
	}
	if code, _ := do("DELETE", "/sandboxes/"+sb.SandboxID, "key-file-0001", ""); code != 204 {
		t.Errorf("kill: %d", code)
	}
	cancel()
	if code := <-done; code != 0 {
		t.Fatalf("kilnd exited %d: %s", code, stderr.String())
	}
	for _, secret := range []string{"key-file-0001", "key-flag-0002", sb.EnvdAccessToken} {
		if strings.Contains(stderr.String(), secret) {
			t.Errorf("kilnd's log shows a key or token: %s", stderr.String())
		}
	}
	// Neither key is in E2B's format: kilnd says where they are, for the
	// Python SDK's sake.
	for _, where := range []string{keys + ":1", "--e2b-api-key 1"} {
		if !strings.Contains(stderr.String(), "Python SDK refuses") || !strings.Contains(stderr.String(), where) {
			t.Errorf("kilnd's log does not warn of the key at %s: %s", where, stderr.String())
		}
	}
	if _, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
		t.Error("the E2B listener still answers after kilnd stopped")
	}
}

// startE2BKilnd runs kilnd over package daemon and its test backend with
// the E2B listener and the extra flags; it returns the listener's
// address once it answers, and stops kilnd at the test's end.
func startE2BKilnd(t *testing.T, extra ...string) string {
	t.Helper()
	dir := t.TempDir()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	be := &daemontest.Backend{}
	t.Cleanup(be.KillAll)
	newSvc := func(cfg config, log *slog.Logger) (service, error) {
		return daemon.New(daemon.Config{StateDir: cfg.stateDir, Backend: be, HostMemoryMiB: 16384, HostCPUs: 8, Logger: log})
	}
	args := append([]string{"--config=", "--listen", "unix:" + filepath.Join(dir, "kilnd.sock"), "--state-dir", filepath.Join(dir, "state"),
		"--vmm", "/bin/true", "--e2b-listen", addr, "--e2b-api-key", "key-flag-0001 alpha"}, extra...)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int, 1)
	var stderr bytes.Buffer
	go func() { done <- run(ctx, args, &stderr, newSvc) }()
	t.Cleanup(func() {
		cancel()
		if code := <-done; code != 0 {
			t.Errorf("kilnd exited %d: %s", code, stderr.String())
		}
	})
	// No keep-alive: the wait must not hold one of the tests' slots.
	hc := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := hc.Get("http://" + addr + "/health")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return addr
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("kilnd's E2B listener does not answer: %v; %s", err, stderr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// getHealth sends GET /health on the keep-alive connection c and reads the
// reply.
func getHealth(c net.Conn, br *bufio.Reader) (int, error) {
	c.SetDeadline(time.Now().Add(10 * time.Second))
	defer c.SetDeadline(time.Time{})
	if _, err := io.WriteString(c, "GET /health HTTP/1.1\r\nHost: kiln\r\n\r\n"); err != nil {
		return 0, err
	}
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		return 0, err
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode, nil
}

// closedWithin reports whether the server closes c (a read ends in EOF
// or a reset) within d.
func closedWithin(c net.Conn, br *bufio.Reader, d time.Duration) bool {
	c.SetReadDeadline(time.Now().Add(d))
	_, err := br.ReadByte()
	var ne net.Error
	return err != nil && !(errors.As(err, &ne) && ne.Timeout())
}

// TestE2BIdleTimeout: an unauthenticated keep-alive connection that sent
// one GET /health and then nothing is closed by kilnd within its
// --e2b-idle-timeout.
func TestE2BIdleTimeout(t *testing.T) {
	addr := startE2BKilnd(t, "--e2b-idle-timeout", "300ms")
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	br := bufio.NewReader(c)
	if code, err := getHealth(c, br); err != nil || code != 200 {
		t.Fatalf("GET /health: %d %v", code, err)
	}
	began := time.Now()
	if !closedWithin(c, br, 5*time.Second) {
		t.Fatal("kilnd kept an idle keep-alive connection open 5 s past its 300ms idle timeout")
	}
	if d := time.Since(began); d < 200*time.Millisecond {
		t.Errorf("closed after %v, before the idle timeout", d)
	}
}

// TestE2BConnsPerClient: one client address holds at most
// --e2b-conns-per-client connections: one more is closed at once, the
// ones it holds still serve, and a slot freed by a close is taken again.
func TestE2BConnsPerClient(t *testing.T) {
	addr := startE2BKilnd(t, "--e2b-conns-per-client", "2")
	type conn struct {
		c  net.Conn
		br *bufio.Reader
	}
	dial := func() conn {
		t.Helper()
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return conn{c, bufio.NewReader(c)}
	}
	// served dials until a connection is served: kilnd sees the close
	// of one before it (startE2BKilnd's, a freed one) a moment later.
	served := func() conn {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			c := dial()
			code, err := getHealth(c.c, c.br)
			if err == nil && code == 200 {
				return c
			}
			c.c.Close()
			if time.Now().After(deadline) {
				t.Fatalf("a connection within the cap is not served: %d %v", code, err)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	held := []conn{served(), served()}
	extra := dial()
	if !closedWithin(extra.c, extra.br, 5*time.Second) {
		t.Fatal("a third connection of a client capped at 2 was not closed")
	}
	for i, h := range held {
		if code, err := getHealth(h.c, h.br); err != nil || code != 200 {
			t.Errorf("connection %d after the refusal: %d %v", i, code, err)
		}
	}
	// A slot freed is the client's again (once kilnd sees the close).
	held[0].c.Close()
	served()
}
