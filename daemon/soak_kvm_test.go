package daemon_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/daemon/kilnpb"
	"github.com/kilnvm/kiln/hostnet"
	"github.com/kilnvm/kiln/internal/kvmtest"
	"github.com/kilnvm/kiln/internal/leakcheck"
	"github.com/kilnvm/kiln/vmmproc"
)

// soakCyclesEnv sets how many create-exec?-destroy cycles
// TestKVMDaemonSoak runs (the figure is 1000; make test's
// default is sized for its budget).
const soakCyclesEnv = "KILN_SOAK_CYCLES"

// soakCycles reads soakCyclesEnv, else def.
func soakCycles(t *testing.T, def int) int {
	t.Helper()
	s := os.Getenv(soakCyclesEnv)
	if s == "" {
		return def
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 {
		t.Fatalf("%s=%q: want a positive number of cycles", soakCyclesEnv, s)
	}
	return n
}

// TestKVMDaemonSoak creates sandboxes from a template and destroys them,
// N times (KILN_SOAK_CYCLES, default 20), four in flight, through kilnd
// as production runs it: a VMM process per sandbox, a cgroup per sandbox
// and a network per sandbox (netns, veth, tap, nftables, DNS proxy). Every
// 25th sandbox runs an exec, so the sandboxes really work. After a
// warm-up, this process's descriptors, goroutines, threads and memfds,
// the host's kiln memfds and VMM processes, the links of both network
// namespaces, the cgroups under kilnd's, the mounts and every file under
// the test's TMPDIR (state folder, hostnet's netns pins and records) are
// counted; after the cycles each must be back where it started.
func TestKVMDaemonSoak(t *testing.T) {
	kvmtest.Require(t)
	n := soakCycles(t, 20)
	// Everything the test and its VMM processes make lands under a
	// TMPDIR of its own, so only this test's files are counted. Short:
	// the sandboxes' Unix sockets live under it.
	tmp, err := os.MkdirTemp("", "ks-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(tmp) })
	t.Setenv("TMPDIR", tmp)

	cg := testCgroupRoot(t)
	w := newNetWorld(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Hour)
	defer cancel()
	mgr, err := hostnet.New(ctx, hostnet.Config{Pool: netip.MustParsePrefix(netTestPool),
		DNS: []netip.AddrPort{netip.MustParseAddrPort(netTestAllowed + ":53")}, Dir: filepath.Join(tmp, "hostnet"), HostNetns: w.hostPath,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatalf("hostnet: %v", err)
	}
	t.Cleanup(func() {
		for _, id := range mgr.List() {
			mgr.Detach(context.Background(), id)
		}
		mgr.Close()
	})
	e := newKVMEnv(t)
	e.stop()
	e.cfg.Cgroups = cg
	e.cfg.VMMOverheadMiB = overheadMiB
	e.cfg.Network = daemon.HostNetwork(mgr)
	e.cfg.DefaultEgress = daemon.EgressPolicy{Mode: daemon.EgressDenyAll}
	e.cfg.MemoryOvercommit = 16
	e.startKVM()

	began := time.Now()
	tp, err := e.c.CreateTemplate(ctx, &kilnpb.CreateTemplateRequest{Name: "soak", Image: e.image, RequestId: nextReq(),
		Setup: []string{"sh", "-c", "echo ready > /setup"}, Resources: &kilnpb.Resources{MemoryMib: 128}})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("template %s ready in %v", tp.Id, time.Since(began).Round(time.Millisecond))

	const inFlight, execEvery = 4, 25
	cycle := func(i int) error {
		sb, err := e.c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{RequestId: nextReq(),
			Source: &kilnpb.CreateSandboxRequest_Template{Template: "soak"}})
		if err != nil {
			return fmt.Errorf("cycle %d: create: %w", i, err)
		}
		var errExec error
		if i < 0 || i%execEvery == 0 {
			r := e.exec(ctx, &kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"sh", "-c", "cat /setup; hostname"}})
			if want := "ready\n" + sb.Id + "\n"; r.err != nil || r.exit.GetExitCode() != 0 || r.stdout != want {
				errExec = fmt.Errorf("cycle %d: sandbox %s: exec: %+v, want %q", i, sb.Id, r, want)
			}
		}
		if _, err := e.c.DestroySandbox(ctx, &kilnpb.DestroySandboxRequest{Id: sb.Id}); err != nil {
			return fmt.Errorf("cycle %d: destroy %s: %w (%v)", i, sb.Id, err, errExec)
		}
		return errExec
	}
	// run runs cycles from..to-1, inFlight at a time, and stops at the
	// first few errors.
	run := func(from, to int) {
		t.Helper()
		var next atomic.Int64
		next.Store(int64(from))
		var failed atomic.Int32
		var wg sync.WaitGroup
		start := time.Now()
		for range inFlight {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for failed.Load() < 3 {
					i := int(next.Add(1) - 1)
					if i >= to {
						return
					}
					if err := cycle(i); err != nil {
						failed.Add(1)
						t.Error(err)
					}
					if d := i - from + 1; d%100 == 0 {
						t.Logf("%d cycles after %v", d, time.Since(start).Round(time.Second))
					}
				}
			}()
		}
		wg.Wait()
		if t.Failed() {
			t.FailNow()
		}
	}

	opts := leakcheck.Options{
		Trees:      map[string]string{"TMPDIR": tmp},
		Cgroups:    cg.Root(),
		Netns:      map[string]string{"kilnd's host netns": w.hostPath},
		ProcessEnv: vmmproc.SocketEnv,
	}
	// Warm-up: the first cycles make what lives on (the Go runtime's
	// threads, gRPC's connections, the template's page cache).
	run(-2*inFlight, 0)
	before, err := leakcheck.Take(opts)
	if err != nil {
		t.Fatal(err)
	}
	began = time.Now()
	run(0, n)
	elapsed := time.Since(began)
	t.Logf("%d cycles (create from a template, an exec every %d, destroy; %d in flight): %v, %v per cycle",
		n, execEvery, inFlight, elapsed.Round(time.Millisecond), (elapsed / time.Duration(n)).Round(time.Millisecond))
	sctx, scancel := context.WithTimeout(ctx, 2*time.Minute)
	defer scancel()
	after, diff, err := leakcheck.Settle(sctx, before, opts, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("after %d cycles:\n%s", n, leakcheck.Table(before, after))
	if diff != "" {
		t.Errorf("left after %d cycles:\n%s", n, strings.TrimSpace(diff))
	}
}
