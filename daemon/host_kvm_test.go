package daemon_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"io/fs"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/encoding/prototext"
	"google.golang.org/protobuf/proto"

	"github.com/kilnvm/kiln/daemon/kilnpb"
	"github.com/kilnvm/kiln/internal/kvmtest"
	"github.com/kilnvm/kiln/snapshot"
)

// TestKVMDaemonHost: secrets and metrics over the real backend. A
// template whose setup has secrets of its own; a sandbox restored from it
// with an env secret and a file secret: the guest has them (the env's
// value compared in the guest, the file's digest), exec output shows ***;
// a fork child inherits them; their values are nowhere on the host (every
// file of the state folder but snapshots' memory files, the server's JSON
// log, the events, the replies, a checkpoint's metadata); after a restart
// of the server (the VMM processes run on) the values come back from the
// VMM processes and masking still works. Then /metrics shows the creates,
// the execs and the failures the test caused.
func TestKVMDaemonHost(t *testing.T) {
	kvmtest.Require(t)
	e := newKVMEnv(t)
	var logs syncBuffer
	e.stop()
	e.cfg.Logger = slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	e.startKVM()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	began := time.Now()

	events, err := e.c.WatchEvents(ctx, &kilnpb.WatchEventsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := events.Header(); err != nil {
		t.Fatal(err)
	}
	var evMu sync.Mutex
	var evs [][]byte
	evDone := make(chan struct{})
	go func() {
		defer close(evDone)
		for {
			ev, err := events.Recv()
			if err != nil {
				return
			}
			b, _ := proto.Marshal(ev)
			evMu.Lock()
			evs = append(evs, b, []byte(prototext.Format(ev)))
			evMu.Unlock()
		}
	}()

	setupValue := []byte("setup-only-4c1d9e")
	token := []byte("tok-kvm-7d3a9b21e5")
	key := []byte("-----BEGIN TEST KEY-----\nkvm-key-material-0042\n-----END TEST KEY-----\n")
	values := [][]byte{setupValue, token, key, []byte("kvm-key-material-0042")}
	keyDigest := sha256.Sum256(key)

	// The template's setup gets its secrets: env and file (removed
	// before the snapshot).
	tp, err := e.c.CreateTemplate(ctx, &kilnpb.CreateTemplateRequest{Name: "host", Image: e.image, RequestId: nextReq(),
		Resources: &kilnpb.Resources{MemoryMib: 256},
		Secrets:   []*kilnpb.Secret{{Name: "SETUP_TOKEN", Value: setupValue}, {Name: "SETUP_KEY", Value: setupValue, File: "/etc/setup-key"}},
		Setup:     []string{"sh", "-c", `test "${#SETUP_TOKEN}" = 17 && printf %s "$SETUP_TOKEN" | cmp -s /etc/setup-key - && echo ok > /setup`}})
	if err != nil {
		t.Fatalf("template: %v", err)
	}
	t.Logf("template ready after %v", time.Since(began).Round(time.Millisecond))

	sb, err := e.c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{RequestId: nextReq(),
		Source:  &kilnpb.CreateSandboxRequest_Template{Template: tp.Id},
		Secrets: []*kilnpb.Secret{{Name: "TOKEN", Value: token}, {Name: "KEY", Value: key, File: "/run/secrets/key"}}})
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	if !slices.Equal(sb.SecretNames, []string{"TOKEN", "KEY"}) {
		t.Fatalf("secret_names %q", sb.SecretNames)
	}
	t.Logf("sandbox %s from the template ready in %d ms", sb.Id, sb.ReadyMs)

	checkGuest := func(id string) {
		t.Helper()
		for _, c := range []struct{ script, want string }{
			{`echo "$TOKEN"`, "***"},
			{`test "$TOKEN" = "` + string(token) + `" && echo match`, "match"},
			{`sha256sum < /run/secrets/key | cut -d' ' -f1`, hex.EncodeToString(keyDigest[:])},
			{`stat -c %a /run/secrets/key`, "400"},
			{`cat /run/secrets/key`, "***"},
			{`cat /setup; echo "[$SETUP_TOKEN]"; test -e /etc/setup-key || echo no-setup-key`, "ok\n[]\nno-setup-key"},
		} {
			if got := e.shOut(id, c.script); got != c.want {
				t.Errorf("sandbox %s: %q printed %q, want %q", id, c.script, got, c.want)
			}
		}
	}
	checkGuest(sb.Id)
	// stderr is masked too, and a value the guest prints in pieces.
	r := e.exec(ctx, &kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"sh", "-c", `echo "$TOKEN" >&2; printf %s "$TOKEN" | dd bs=3 2>/dev/null`}})
	if r.err != nil || r.stderr != "***\n" || r.stdout != "***" {
		t.Errorf("stderr %q stdout %q err %v, want *** on both", r.stderr, r.stdout, r.err)
	}

	kids, err := e.forkCtx(ctx, &kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_SandboxId{SandboxId: sb.Id}, Count: 1})
	if err != nil || len(kids) != 1 {
		t.Fatalf("fork: %v %v", kids, err)
	}
	checkGuest(kids[0].Id)
	ck, err := e.c.Checkpoint(ctx, &kilnpb.CheckpointRequest{SandboxId: sb.Id, Persist: true})
	if err != nil {
		t.Fatalf("checkpoint: %v", err)
	}

	// What the first server counted (a restart starts the counters
	// afresh).
	scrapeWant(t, e, "before the restart", []string{
		`kiln_sandbox_creates_total{result="ok",source="template"} 1`,
		`kiln_sandbox_create_seconds_count{source="template"} 1`,
		`kiln_template_builds_total{result="ok"} 1`,
		`kiln_sandbox_forks_total{result="ok"} 1`,
		`kiln_execs_total{result="ok"} 13`,
		`kiln_exec_start_seconds_count 13`,
		`kiln_sandboxes{state="running"} 2`,
	})

	// A restart: the values come back from the VMM processes.
	e.stop()
	e.startKVM()
	for _, id := range []string{sb.Id, kids[0].Id} {
		if got := e.shOut(id, `echo "$TOKEN"; test "$TOKEN" = "`+string(token)+`" && echo match`); got != "***\nmatch" {
			t.Errorf("sandbox %s after the restart: %q", id, got)
		}
	}

	// Failures the metrics must show: a create from a template that is
	// not there, an exec of a binary that is not there.
	_, err = e.c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{RequestId: nextReq(), Source: &kilnpb.CreateSandboxRequest_Template{Template: "no-such-template"}})
	if err == nil {
		t.Error("a create from a missing template succeeded")
	}
	if r := e.exec(ctx, &kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"/no/such/binary"}}); r.err == nil {
		t.Error("an exec of a missing binary succeeded")
	}

	// The values are nowhere on the host.
	replies := [][]byte{}
	for _, id := range []string{sb.Id, kids[0].Id} {
		got, err := e.c.GetSandbox(ctx, &kilnpb.GetSandboxRequest{Id: id})
		if err != nil {
			t.Fatal(err)
		}
		b, _ := proto.Marshal(got)
		replies = append(replies, b)
	}
	list, _ := e.c.ListSandboxes(ctx, &kilnpb.ListSandboxesRequest{})
	b, _ := proto.Marshal(list)
	replies = append(replies, b)
	files := 0
	ckFiles := 0
	var looked []string
	filepath.WalkDir(e.state, func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() || d.Name() == snapshot.MemoryFile {
			return nil
		}
		data, err := os.ReadFile(p)
		if err != nil {
			t.Errorf("read %s: %v", p, err)
			return nil
		}
		files++
		rel, _ := filepath.Rel(e.state, p)
		looked = append(looked, rel)
		if strings.Contains(p, ck.Id) {
			ckFiles++
		}
		for _, v := range values {
			if bytes.Contains(data, v) {
				t.Errorf("%s holds a secret's value", p)
			}
		}
		return nil
	})
	if files < 5 || ckFiles == 0 {
		t.Errorf("looked in %d files (%d of checkpoint %s): too few", files, ckFiles, ck.Id)
	}
	evMu.Lock()
	nEvents := len(evs) / 2
	for _, v := range values {
		if bytes.Contains(logs.Bytes(), v) {
			t.Errorf("the server's log holds a secret's value")
		}
		for _, ev := range evs {
			if bytes.Contains(ev, v) {
				t.Errorf("an event holds a secret's value")
			}
		}
		for _, r := range replies {
			if bytes.Contains(r, v) {
				t.Errorf("a reply holds a secret's value")
			}
		}
	}
	evMu.Unlock()
	t.Logf("no secret's value in %d files of the state folder (%s), %d bytes of log, %d events, %d replies", files, strings.Join(looked, " "), len(logs.Bytes()), nEvents, len(replies))

	// The second server's counters, and the gauges of every live
	// sandbox.
	scrapeWant(t, e, "after the restart", []string{
		`kiln_sandbox_creates_total{result="error",source="template"} 1`,
		`kiln_execs_total{result="ok"} 2`,
		`kiln_execs_total{result="error"} 1`,
		`kiln_failures_total{op="create",reason="not_found"} 1`,
		`kiln_sandboxes{state="running"} 2`,
		`kiln_template_sandboxes{template="` + tp.Id + `"} 1`,
		`kiln_checkpoints{kind="persisted"} 1`,
		`kiln_host_memory_committed_bytes 5.36870912e+08`,
	})
	if _, err := e.c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{RequestId: nextReq(), Source: &kilnpb.CreateSandboxRequest_Image{Image: e.image},
		Secrets: []*kilnpb.Secret{{Name: "A", Value: []byte("abc")}}}); !strings.Contains(err.Error(), "at least 4") || !strings.Contains(err.Error(), codes.InvalidArgument.String()) {
		t.Errorf("a short secret: %v", err)
	}

	for _, id := range []string{sb.Id, kids[0].Id} {
		if _, err := e.c.DestroySandbox(ctx, &kilnpb.DestroySandboxRequest{Id: id}); err != nil {
			t.Errorf("destroy %s: %v", id, err)
		}
	}
	e.stop()
	<-evDone
	t.Logf("all in %v", time.Since(began).Round(time.Millisecond))
}

// scrapeWant scrapes the server's /metrics through its handler and fails
// t for each line of want it lacks; it logs the kiln_ lines that count
// sandboxes, calls and failures.
func scrapeWant(t *testing.T, e *kvmEnv, when string, want []string) {
	t.Helper()
	hs := httptest.NewServer(e.srv.MetricsHandler())
	defer hs.Close()
	resp, err := http.Get(hs.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, w := range want {
		if !bytes.Contains(body, []byte(w)) {
			t.Errorf("/metrics %s has no %s", when, w)
		}
	}
	for _, line := range strings.Split(string(body), "\n") {
		if strings.HasPrefix(line, "kiln_") && !strings.Contains(line, "_bucket") && !strings.HasPrefix(line, "kiln_process_") {
			t.Logf("/metrics %s: %s", when, line)
		}
	}
}
