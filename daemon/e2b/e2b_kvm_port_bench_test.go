package e2b_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/daemon/kilnpb"
	"github.com/kilnvm/kiln/internal/kvmtest"
)

// portRoundTrips is how many GETs each side of BenchmarkKVME2BPortRoundTrip
// makes.
const portRoundTrips = 200

// inGuestGets is run in the guest: portRoundTrips GETs of the server on
// its loopback over one kept-alive connection (http.client), then one
// connection each (urllib), printing each set's milliseconds as JSON.
const inGuestGets = `
import http.client, json, sys, time, urllib.request
n, port = int(sys.argv[1]), int(sys.argv[2])
c = http.client.HTTPConnection("127.0.0.1", port)
kept = []
for _ in range(n):
    t = time.perf_counter(); c.request("GET", "/hello.txt"); c.getresponse().read(); kept.append((time.perf_counter() - t) * 1000)
fresh = []
for _ in range(n):
    t = time.perf_counter(); urllib.request.urlopen("http://127.0.0.1:%d/hello.txt" % port).read(); fresh.append((time.perf_counter() - t) * 1000)
print(json.dumps({"kept": kept, "fresh": fresh}))
`

// BenchmarkKVME2BPortRoundTrip times a GET of a small file from a web
// server in a sandbox (python3 -m http.server on the guest's loopback)
// through the E2B listener with getHost's host name (kiln.v1 ForwardPort,
// the agent's forwarder over vsock), over a kept-alive connection and over
// a new one each, against the same GETs made inside the guest, and reports
// the medians and the ratios.
func BenchmarkKVME2BPortRoundTrip(b *testing.B) {
	if err := kvmtest.Usable(); err != nil {
		b.Skipf("needs /dev/kvm: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	kc, url, _ := kvmE2B(b, ctx)
	for b.Loop() {
		id := createE2B(b, url)
		defer kc.DestroySandbox(context.WithoutCancel(ctx), &kilnpb.DestroySandboxRequest{Id: id})
		const port = 8000
		execIn(b, ctx, kc, id, true, "mkdir -p /tmp/www && echo hello > /tmp/www/hello.txt && cd /tmp/www && exec python3 -m http.server 8000 --bind 127.0.0.1")
		host := fmt.Sprintf("%d-%s.kiln.test", port, id)
		get := func(c *http.Client) (float64, error) {
			req, _ := http.NewRequestWithContext(ctx, "GET", url+"/hello.txt", nil)
			req.Host = host
			start := time.Now()
			resp, err := c.Do(req)
			if err != nil {
				return 0, err
			}
			body, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil || resp.StatusCode != 200 || string(body) != "hello\n" {
				return 0, fmt.Errorf("GET: %d %q %v", resp.StatusCode, body, err)
			}
			return float64(time.Since(start).Microseconds()) / 1000, nil
		}
		kept := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1}}
		fresh := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
		for deadline := time.Now().Add(2 * time.Minute); ; {
			if _, err := get(kept); err == nil {
				break
			} else if time.Now().After(deadline) {
				b.Fatalf("the server in the sandbox never answered: %v", err)
			}
			time.Sleep(500 * time.Millisecond)
		}
		times := func(c *http.Client) []float64 {
			var out []float64
			for range portRoundTrips {
				ms, err := get(c)
				if err != nil {
					b.Fatal(err)
				}
				out = append(out, ms)
			}
			return out
		}
		hostKept, hostFresh := times(kept), times(fresh)
		out := execIn(b, ctx, kc, id, false, "cat > /tmp/gets.py <<'EOF'\n"+inGuestGets+"\nEOF\npython3 /tmp/gets.py "+strconv.Itoa(portRoundTrips)+" 8000")
		var guest struct{ Kept, Fresh []float64 }
		if err := json.Unmarshal(bytes.TrimSpace(out), &guest); err != nil {
			b.Fatalf("the guest's GETs printed %q: %v", out, err)
		}
		med := func(xs []float64) float64 {
			s := append([]float64(nil), xs...)
			sort.Float64s(s)
			return s[len(s)/2]
		}
		hk, hf, gk, gf := med(hostKept), med(hostFresh), med(guest.Kept), med(guest.Fresh)
		b.ReportMetric(hk, "port-kept-p50-ms")
		b.ReportMetric(hf, "port-new-p50-ms")
		b.ReportMetric(gk, "guest-kept-p50-ms")
		b.ReportMetric(gf, "guest-new-p50-ms")
		b.ReportMetric(hk/gk, "port/guest-kept")
		b.ReportMetric(hf/gf, "port/guest-new")
		b.Logf("GET of 6 bytes, medians of %d: through getHost %.2f ms kept-alive, %.2f ms a connection each; in the guest %.2f and %.2f ms; ratios %.2f and %.2f",
			portRoundTrips, hk, hf, gk, gf, hk/gk, hf/gf)
	}
}

// createE2B creates a sandbox of base through the E2B API with the
// benchmarks' key and returns its ID.
func createE2B(tb testing.TB, url string) string {
	tb.Helper()
	req, _ := http.NewRequest("POST", url+"/v2/sandboxes", strings.NewReader(`{"templateID":"base","timeout":1200}`))
	req.Header.Set("X-API-KEY", keyA)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		tb.Fatal(err)
	}
	defer resp.Body.Close()
	var c created
	if err := json.NewDecoder(resp.Body).Decode(&c); err != nil || resp.StatusCode != http.StatusCreated {
		tb.Fatalf("create: %d %v", resp.StatusCode, err)
	}
	return c.SandboxID
}

// execIn runs a bash script in sandbox id through kiln.v1: in the
// background (returning at once), or to its end, returning its stdout.
func execIn(tb testing.TB, ctx context.Context, kc kilnpb.KilnClient, id string, background bool, script string) []byte {
	tb.Helper()
	st, err := kc.Exec(ctx)
	if err != nil {
		tb.Fatal(err)
	}
	if err := st.Send(&kilnpb.ExecRequest{Kind: &kilnpb.ExecRequest_Start{Start: &kilnpb.ExecStart{SandboxId: id, Argv: []string{"/bin/bash", "-c", script}, Background: background}}}); err != nil {
		tb.Fatal(err)
	}
	st.CloseSend()
	var out bytes.Buffer
	for {
		r, err := st.Recv()
		if err != nil {
			tb.Fatalf("exec %q: %v (stdout %q)", script, err, out.Bytes())
		}
		if background && r.GetStarted() != nil {
			return nil
		}
		out.Write(r.GetStdout())
		if x := r.GetExit(); x != nil {
			if x.ExitCode != 0 {
				tb.Fatalf("exec %q: exit %d: %s", script, x.ExitCode, r.GetStderr())
			}
			return out.Bytes()
		}
	}
}
