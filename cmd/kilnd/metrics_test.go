package main

import (
	"context"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kilnvm/kiln/daemon/client"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// TestMetricsListen: kilnd with --metrics-listen serves the daemon's
// Prometheus metrics on their own port, and they count what a client did.
func TestMetricsListen(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "kilnd.sock")
	addr := freePort(t)
	startKilnd(t, []string{"--config=", "--listen", "unix:" + sock, "--state-dir", filepath.Join(dir, "state"),
		"--vmm", "/bin/true", "--metrics-listen", addr}, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var c *client.Client
	for {
		var err error
		if c, err = client.Dial(ctx, "unix:"+sock); err == nil {
			if _, err = c.ListSandboxes(ctx, client.ListOptions{}); err == nil {
				break
			}
			c.Close()
		}
		if ctx.Err() != nil {
			t.Fatalf("kilnd never served: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	defer c.Close()
	sb, err := c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{Source: &kilnpb.CreateSandboxRequest_Image{Image: "busybox"}})
	if err != nil {
		t.Fatal(err)
	}
	// kilnd leaves its sandboxes running when it stops: the stand-in VMM
	// process goes with the test, not after it.
	t.Cleanup(func() { syscall.Kill(int(sb.GetPid()), syscall.SIGKILL) })
	if _, err := c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{Source: &kilnpb.CreateSandboxRequest_Template{Template: "no-such-template"}}); err == nil {
		t.Fatal("a create from a missing template succeeded")
	}
	body := scrape(t, "http://"+addr+"/metrics")
	for _, want := range []string{
		`kiln_sandbox_creates_total{result="ok",source="image"} 1`,
		`kiln_sandboxes{state="running"} 1`,
	} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics has no %q:\n%s", want, body)
		}
	}
	if !strings.Contains(body, `kiln_failures_total{`) {
		t.Errorf("/metrics counts no failure:\n%s", body)
	}
	// Only /metrics is served there.
	resp, err := http.Get("http://" + addr + "/")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNotFound {
		t.Errorf("GET / on the metrics port: %s, want 404", resp.Status)
	}
}

// TestMetricsListenBusy: a port kilnd cannot listen on fails its start,
// naming the flag.
func TestMetricsListenBusy(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	dir := t.TempDir()
	k := startKilnd(t, []string{"--config=", "--listen", "unix:" + filepath.Join(dir, "k.sock"), "--state-dir", filepath.Join(dir, "state"),
		"--vmm", "/bin/true", "--metrics-listen", ln.Addr().String()}, nil)
	if err := k.wait(t, 30*time.Second); err == nil {
		t.Fatal("kilnd started on a busy metrics port")
	}
	if !strings.Contains(k.stderr.String(), "--metrics-listen") {
		t.Errorf("kilnd's error does not name --metrics-listen: %s", k.stderr.String())
	}
}

func freePort(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

func scrape(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s: %s", url, resp.Status, b)
	}
	return string(b)
}
