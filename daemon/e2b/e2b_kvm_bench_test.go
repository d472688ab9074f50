package e2b_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/kilnvm/kiln/daemon/kilnpb"
	"github.com/kilnvm/kiln/internal/kvmtest"
)

// createRunN and createRunC: Sandbox.create() + commands.run('true'),
// this many times, this many at once.
const (
	createRunN = 50
	createRunC = 10
)

// BenchmarkKVME2BCreateRun times Sandbox.create() + commands.run('true')
// + kill() through the unmodified npm SDK (sdktest/bench.mjs), E2B's
// Python SDK (pysdktest/bench.py) and the same
// through kiln.v1 (CreateSandbox from the template, Exec of bash -l -c
// true as the SDK runs it, DestroySandbox), 50 of each at concurrency 10, against one
// daemon.Server with real sandboxes. It reports p50 and p95 of create
// to the command's exit for both, and their ratio.
func BenchmarkKVME2BCreateRun(b *testing.B) {
	// Gated as the other benchmarks are (they are not tests the harness
	// counts): run it through the harness, where /dev/kvm works.
	if err := kvmtest.Usable(); err != nil {
		b.Skipf("needs /dev/kvm: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Minute)
	defer cancel()
	kc, url, keys := kvmE2B(b, ctx)
	for b.Loop() {
		// kiln.v1 first, then the SDKs, each logged as soon as it is in.
		grpcP50, grpcP95 := benchGRPC(b, ctx, kc)
		b.Logf("kiln.v1: p50 %.0f ms, p95 %.0f ms", grpcP50, grpcP95)
		sdk := benchSDK(b, ctx, url)
		b.Logf("SDK: %+v", sdk)
		py := benchPySDK(b, ctx, url, keys.alpha)
		b.Logf("Python SDK: %+v", py)
		b.ReportMetric(py.Total.P50, "py-p50-ms")
		b.ReportMetric(py.Total.P95, "py-p95-ms")
		b.ReportMetric(py.Total.P50/grpcP50, "py/grpc-p50")
		b.ReportMetric(float64(py.Failures), "py-failures")
		b.ReportMetric(sdk.Total.P50, "sdk-p50-ms")
		b.ReportMetric(sdk.Total.P95, "sdk-p95-ms")
		b.ReportMetric(grpcP50, "grpc-p50-ms")
		b.ReportMetric(grpcP95, "grpc-p95-ms")
		b.ReportMetric(sdk.Total.P50/grpcP50, "sdk/grpc-p50")
		b.ReportMetric(float64(sdk.Failures), "sdk-failures")
		b.Logf("SDK: create p50 %.0f p95 %.0f ms, run p50 %.0f p95 %.0f ms, total p50 %.0f p95 %.0f ms, %d failures; kiln.v1: total p50 %.0f p95 %.0f ms",
			sdk.Create.P50, sdk.Create.P95, sdk.Run.P50, sdk.Run.P95, sdk.Total.P50, sdk.Total.P95, sdk.Failures, grpcP50, grpcP95)
	}
}

type benchSummary struct {
	P50 float64 `json:"p50"`
	P95 float64 `json:"p95"`
}

type benchResult struct {
	OK       int          `json:"ok"`
	Failures int          `json:"failures"`
	Create   benchSummary `json:"create_ms"`
	Run      benchSummary `json:"run_ms"`
	Total    benchSummary `json:"total_ms"`
}

// benchSDK runs sdktest/bench.mjs against the E2B server at url.
func benchSDK(tb testing.TB, ctx context.Context, url string) benchResult {
	node, err := exec.LookPath("node")
	if err != nil {
		tb.Fatal("no node on PATH: make deps installs nodejs and the SDK")
	}
	cmd := exec.CommandContext(ctx, node, "bench.mjs")
	cmd.Dir = sdkDir
	cmd.Env = []string{"E2B_API_KEY=" + keyA, "BENCH_REQUEST_TIMEOUT_MS=600000"}
	return runBench(tb, cmd, url)
}

// benchPySDK runs pysdktest/bench.py (bench.mjs through E2B's Python SDK)
// against the E2B server at url with key, one in E2B's format.
func benchPySDK(tb testing.TB, ctx context.Context, url, key string) benchResult {
	py, err := filepath.Abs(filepath.Join(pySDKDir, pySDKVenv, "bin", "python"))
	if err != nil {
		tb.Fatal(err)
	}
	cmd := exec.CommandContext(ctx, py, "bench.py")
	cmd.Dir = pySDKDir
	cmd.Env = []string{"E2B_API_KEY=" + key, "PYTHONDONTWRITEBYTECODE=1", "BENCH_REQUEST_TIMEOUT_S=600"}
	return runBench(tb, cmd, url)
}

// runBench runs a benchmark script (cmd, its key in its environment)
// against the E2B server at url, createRunN at concurrency createRunC,
// and reads its JSON report. A script exits 1 after its report when some
// failed: the report counts them.
func runBench(tb testing.TB, cmd *exec.Cmd, url string) benchResult {
	name := filepath.Base(cmd.Args[len(cmd.Args)-1])
	cmd.Env = append(cmd.Env, "E2B_API_URL="+url, "E2B_SANDBOX_URL="+url,
		fmt.Sprintf("BENCH_N=%d", createRunN), fmt.Sprintf("BENCH_C=%d", createRunC))
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	var exit *exec.ExitError
	if err != nil && (!errors.As(err, &exit) || len(out) == 0) {
		tb.Fatalf("%s: %v\n%s", name, err, out)
	}
	var r benchResult
	if err := json.Unmarshal(out, &r); err != nil {
		tb.Fatalf("%s printed %q: %v", name, out, err)
	}
	if r.OK == 0 {
		tb.Fatalf("%s: none of %d ok, %d failures", name, createRunN, r.Failures)
	}
	return r
}

// benchGRPC does through kiln.v1 what bench.mjs does through the SDK and
// returns the p50 and p95 in milliseconds.
func benchGRPC(tb testing.TB, ctx context.Context, kc kilnpb.KilnClient) (p50, p95 float64) {
	var (
		mu    sync.Mutex
		times []float64
		errs  []error
		next  = 0
		wg    sync.WaitGroup
	)
	one := func(i int) error {
		start := time.Now()
		sb, err := kc.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{Source: &kilnpb.CreateSandboxRequest_Template{Template: "base"},
			RequestId: fmt.Sprintf("bench-grpc-%d-%d", start.UnixNano(), i)})
		if err != nil {
			return err
		}
		defer kc.DestroySandbox(context.WithoutCancel(ctx), &kilnpb.DestroySandboxRequest{Id: sb.Id})
		st, err := kc.Exec(ctx)
		if err != nil {
			return err
		}
		if err := st.Send(&kilnpb.ExecRequest{Kind: &kilnpb.ExecRequest_Start{Start: &kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"/bin/bash", "-l", "-c", "true"}}}}); err != nil {
			return err
		}
		st.CloseSend()
		for {
			r, err := st.Recv()
			if err == io.EOF {
				return fmt.Errorf("exec in %s: no exit", sb.Id)
			}
			if err != nil {
				return err
			}
			if x := r.GetExit(); x != nil {
				if x.ExitCode != 0 {
					return fmt.Errorf("true exited %d", x.ExitCode)
				}
				break
			}
		}
		mu.Lock()
		times = append(times, float64(time.Since(start).Microseconds())/1000)
		mu.Unlock()
		return nil
	}
	for range createRunC {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				mu.Lock()
				if next >= createRunN {
					mu.Unlock()
					return
				}
				next++
				i := next
				mu.Unlock()
				if err := one(i); err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	if len(errs) > 0 {
		tb.Fatalf("kiln.v1 create + exec: %d errors, the first: %v", len(errs), errs[0])
	}
	sort.Float64s(times)
	pct := func(p float64) float64 {
		i := int(p/100*float64(len(times))+0.999999) - 1
		return times[max(0, min(i, len(times)-1))]
	}
	return pct(50), pct(95)
}
