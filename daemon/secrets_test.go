package daemon_test

import (
	"bytes"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/encoding/prototext"
	"google.golang.org/protobuf/proto"

	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// syncBuffer is a log's output, written from many goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) Bytes() []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return bytes.Clone(s.b.Bytes())
}

// jsonLog has the server log JSON at debug level into the returned
// buffer.
func jsonLog(buf *syncBuffer) func(*daemon.Config) {
	return func(c *daemon.Config) {
		c.Logger = slog.New(slog.NewJSONHandler(buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
}

// findValue fails t where any file under dir but the double's guest roots
// (dir/sandboxes/*/root, what stands for the guest's own files) holds
// value.
func findValue(t *testing.T, dir string, value []byte) {
	t.Helper()
	n := 0
	filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		if d.IsDir() && d.Name() == "root" {
			return filepath.SkipDir
		}
		if !d.Type().IsRegular() {
			return nil
		}
		b, err := os.ReadFile(p)
		if err != nil {
			t.Errorf("read %s: %v", p, err)
			return nil
		}
		n++
		if bytes.Contains(b, value) {
			t.Errorf("%s holds a secret's value", p)
		}
		return nil
	})
	if n == 0 {
		t.Errorf("no files under %s to look in", dir)
	}
}

// TestSecrets: env secrets in every exec's environment and masked in its
// output (stdout, stderr, background), file secrets written before the
// sandbox is ready; their values nowhere on the host (state folder, log,
// events, replies); back after a restart from the VMM process; inherited
// by fork children, kept by a rollback; not given to a template's
// sandboxes.
func TestSecrets(t *testing.T) {
	var logs syncBuffer
	e := newEnv(t, jsonLog(&logs))
	ctx := ctxT(t)
	token := []byte("tok-5f1e2d3c4b5a")
	key := []byte("-----BEGIN KEY-----\x00\xffkey-material\n")
	events, err := e.c.WatchEvents(ctx, &kilnpb.WatchEventsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := events.Header(); err != nil {
		t.Fatal(err)
	}
	var evMu sync.Mutex
	var evs [][]byte
	go func() {
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

	req := &kilnpb.CreateSandboxRequest{Env: []string{"TOKEN=from-env", "OTHER=1"}, Secrets: []*kilnpb.Secret{
		{Name: "TOKEN", Value: token},
		{Name: "KEY", Value: key, File: "/run/secrets/key"},
	}}
	sb := e.create(req)
	if !slices.Equal(sb.SecretNames, []string{"TOKEN", "KEY"}) {
		t.Fatalf("secret_names %q", sb.SecretNames)
	}
	// A retry with the same request ID finds the same sandbox.
	if again := e.create(proto.Clone(req).(*kilnpb.CreateSandboxRequest)); again.Id != sb.Id {
		t.Fatalf("a retry made %s, not %s", again.Id, sb.Id)
	}
	root := filepath.Join(e.state, "sandboxes", sb.Id, "root")
	got, err := os.ReadFile(filepath.Join(root, "run/secrets/key"))
	if err != nil || !bytes.Equal(got, key) {
		t.Fatalf("the file secret: %q, %v", got, err)
	}
	if fi, _ := os.Stat(filepath.Join(root, "run/secrets/key")); fi.Mode().Perm() != 0o400 {
		t.Fatalf("the file secret's mode is %v, want 0400", fi.Mode())
	}

	checkExecs := func(id string) {
		t.Helper()
		for _, tc := range []struct {
			script, stdout, stderr string
		}{
			{`printenv TOKEN`, "***\n", ""},
			{`test "$TOKEN" = "` + string(token) + `" && echo match`, "match\n", ""},
			{`echo "stderr: $TOKEN" >&2`, "", "stderr: ***\n"},
			{`printf %s "$TOKEN" | dd bs=1 2>/dev/null; echo`, "***\n", ""},
			{`echo "$OTHER"`, "1\n", ""},
			{`cat "$KILN_TEST_ROOT/run/secrets/key"; echo`, "***\n", ""},
		} {
			r := e.sh(id, tc.script)
			if r.stdout != tc.stdout || r.stderr != tc.stderr || r.exit.GetExitCode() != 0 {
				t.Errorf("%s: %q: stdout %q stderr %q exit %v, want %q %q", id, tc.script, r.stdout, r.stderr, r.exit, tc.stdout, tc.stderr)
			}
		}
	}
	checkExecs(sb.Id)
	// A background exec's output is masked too.
	r := e.exec(ctx, &kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"sh", "-c", `echo "bg $TOKEN"`}, Background: true})
	if r.err != nil || r.stdout != "bg ***\n" {
		t.Errorf("background exec: %q, %v", r.stdout, r.err)
	}

	// Fork children have their parent's secrets.
	kids, err := e.fork(&kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_SandboxId{SandboxId: sb.Id}, Count: 2})
	if err != nil || len(kids) != 2 {
		t.Fatalf("fork: %v %v", kids, err)
	}
	for _, k := range kids {
		if !slices.Equal(k.SecretNames, sb.SecretNames) {
			t.Errorf("child %s: secret_names %q", k.Id, k.SecretNames)
		}
		checkExecs(k.Id)
	}
	// A rollback keeps them.
	ck := e.checkpoint(sb.Id, false)
	if _, err := e.c.Rollback(ctx, &kilnpb.RollbackRequest{SandboxId: sb.Id, CheckpointId: ck.Id}); err != nil {
		t.Fatalf("rollback: %v", err)
	}
	checkExecs(sb.Id)
	persisted, err := e.c.Checkpoint(ctx, &kilnpb.CheckpointRequest{SandboxId: sb.Id, Persist: true})
	if err != nil {
		t.Fatal(err)
	}

	// A restarted server has them back from the VMM processes.
	e.stop()
	e.start()
	checkExecs(sb.Id)
	checkExecs(kids[0].Id)
	if got := e.get(sb.Id).SecretNames; !slices.Equal(got, sb.SecretNames) {
		t.Errorf("after the restart: secret_names %q", got)
	}

	// A sandbox from the checkpoint has its own request's secrets only.
	fromCk := e.create(&kilnpb.CreateSandboxRequest{Source: &kilnpb.CreateSandboxRequest_Checkpoint{Checkpoint: persisted.Id}})
	// (Its env is the checkpointed sandbox's, as the request gave it.)
	if r := e.sh(fromCk.Id, `echo "[$TOKEN]"`); r.stdout != "[from-env]\n" || len(fromCk.SecretNames) != 0 {
		t.Errorf("a sandbox from a checkpoint has the env secret: %q %q", r.stdout, fromCk.SecretNames)
	}

	// The values are nowhere on the host: state folder, log, events,
	// replies.
	for _, v := range [][]byte{token, key[:20], []byte("key-material")} {
		findValue(t, e.state, v)
		if bytes.Contains(logs.Bytes(), v) {
			t.Errorf("the log holds a secret's value")
		}
		evMu.Lock()
		for _, ev := range evs {
			if bytes.Contains(ev, v) {
				t.Errorf("an event holds a secret's value")
			}
		}
		evMu.Unlock()
		for _, id := range []string{sb.Id, kids[0].Id} {
			b, _ := proto.Marshal(e.get(id))
			if bytes.Contains(b, v) {
				t.Errorf("GetSandbox %s holds a secret's value", id)
			}
		}
		list, _ := e.c.ListSandboxes(ctx, &kilnpb.ListSandboxesRequest{})
		if b, _ := proto.Marshal(list); bytes.Contains(b, v) {
			t.Errorf("ListSandboxes holds a secret's value")
		}
	}
	evMu.Lock()
	n := len(evs)
	evMu.Unlock()
	if n == 0 {
		t.Error("no events to look in")
	}

	// Gone with the sandbox.
	dir := filepath.Join(e.state, "sandboxes", sb.Id)
	if _, err := e.c.DestroySandbox(ctx, &kilnpb.DestroySandboxRequest{Id: sb.Id}); err != nil {
		t.Fatal(err)
	}
	if v := e.be.Kept(dir, "kiln.secrets"); v != nil {
		t.Errorf("the destroyed sandbox's VMM process still keeps its secrets")
	}
}

func TestSecretsInvalid(t *testing.T) {
	e := newEnv(t, nil)
	value := []byte("do-not-print-me")
	for _, tc := range []struct {
		name    string
		secrets []*kilnpb.Secret
		want    string
	}{
		{"twice", []*kilnpb.Secret{{Name: "A", Value: value}, {Name: "A", Value: value}}, "secret A is given twice"},
		{"bad name", []*kilnpb.Secret{{Name: "A=B", Value: value}}, "POSIX"},
		{"short", []*kilnpb.Secret{{Name: "A", Value: []byte("abc")}}, "at least 4"},
		{"relative file", []*kilnpb.Secret{{Name: "A", Value: value, File: "etc/a"}}, "relative"},
		{"plain with a file", []*kilnpb.Secret{{Name: "A", Value: value, File: "/etc/a", Plain: true}}, "environment variable only"},
		{"plain name with =", []*kilnpb.Secret{{Name: "A=B", Value: value, Plain: true}}, "without '='"},
		{"plain empty name", []*kilnpb.Secret{{Name: "", Value: value, Plain: true}}, "plain variable name"},
		{"plain NUL", []*kilnpb.Secret{{Name: "A", Value: []byte("do-not-print-me\x00"), Plain: true}}, "NUL"},
		{"plain and secret twice", []*kilnpb.Secret{{Name: "A", Value: value}, {Name: "A", Value: value, Plain: true}}, "given twice"},
	} {
		_, err := e.c.CreateSandbox(ctxT(t), &kilnpb.CreateSandboxRequest{RequestId: nextReq(),
			Source: &kilnpb.CreateSandboxRequest_Image{Image: "busybox"}, Secrets: tc.secrets})
		wantCode(t, err, codes.InvalidArgument, tc.want)
		if strings.Contains(err.Error(), string(value)) {
			t.Errorf("%s: the error quotes the value: %v", tc.name, err)
		}
		_, err = e.c.CreateTemplate(ctxT(t), &kilnpb.CreateTemplateRequest{RequestId: nextReq(), Image: "busybox", Secrets: tc.secrets})
		wantCode(t, err, codes.InvalidArgument, tc.want)
	}
}

// TestTemplateSecrets: a setup's secrets reach the setup, are masked in
// its failure's output and removed before the snapshot; the template's
// sandboxes do not get them.
func TestTemplateSecrets(t *testing.T) {
	var logs syncBuffer
	e := newEnv(t, jsonLog(&logs))
	value := []byte("setup-secret-9876")
	secrets := []*kilnpb.Secret{{Name: "SETUP_TOKEN", Value: value}, {Name: "SETUP_FILE", Value: value, File: "/etc/setup-key"}}
	_, err := e.c.CreateTemplate(ctxT(t), &kilnpb.CreateTemplateRequest{RequestId: nextReq(), Image: "busybox", Secrets: secrets,
		Setup: []string{"sh", "-c", `echo "token is $SETUP_TOKEN"; exit 3`}})
	wantCode(t, err, codes.FailedPrecondition, "token is ***")
	if strings.Contains(err.Error(), string(value)) {
		t.Fatalf("the setup's error quotes the secret: %v", err)
	}
	tp := e.createTemplate(&kilnpb.CreateTemplateRequest{Secrets: secrets, Setup: []string{"sh", "-c",
		`test "${#SETUP_TOKEN}" = 17 && printf %s "$SETUP_TOKEN" | cmp -s "$KILN_TEST_ROOT/etc/setup-key" - && echo ok > "$KILN_TEST_ROOT/setup"`}})
	sb := e.create(fromTemplate(tp.Id))
	if len(sb.SecretNames) != 0 {
		t.Errorf("a template's sandbox has secrets %q", sb.SecretNames)
	}
	r := e.sh(sb.Id, `cat "$KILN_TEST_ROOT/setup"; echo "[$SETUP_TOKEN]"; test -e "$KILN_TEST_ROOT/etc/setup-key" || echo removed`)
	if r.stdout != "ok\n[]\nremoved\n" {
		t.Fatalf("a template's sandbox: %q", r.stdout)
	}
	findValue(t, e.state, value)
	if bytes.Contains(logs.Bytes(), value) {
		t.Error("the log holds the setup's secret")
	}
}

// TestPoolSecrets: a sandbox handed out of a warm pool gets its own
// request's secrets (env and file) before it is reported ready, and the
// metrics count it as a create from the pool.
func TestPoolSecrets(t *testing.T) {
	e := newEnv(t, nil)
	tp := e.createTemplate(&kilnpb.CreateTemplateRequest{Setup: setupScript, PoolSize: 1})
	e.waitPool(tp.Id, 1)
	req := fromTemplate(tp.Id)
	req.Secrets = []*kilnpb.Secret{{Name: "POOL_TOKEN", Value: []byte("pool-token-1")}, {Name: "F", Value: []byte("file-value"), File: "/f"}}
	sb := e.create(req)
	if !sb.FromPool {
		t.Fatalf("not from the pool: %v", sb)
	}
	if r := e.sh(sb.Id, `echo "$POOL_TOKEN"; test "$POOL_TOKEN" = pool-token-1 && echo match; cat "$KILN_TEST_ROOT/f"`); r.stdout != "***\nmatch\n***" {
		t.Fatalf("a pool's sandbox: %q", r.stdout)
	}
	if got := metricValue(t, e.srv, "kiln_sandbox_creates_total", map[string]string{"source": "pool", "result": "ok"}); got != 1 {
		t.Errorf("creates from the pool: %v", got)
	}
	if got := metricValue(t, e.srv, "kiln_template_pool_size", map[string]string{"template": tp.Id}); got != 1 {
		t.Errorf("pool size: %v", got)
	}
}

// TestPlainSecrets: plain secrets (E2B's envVars) are every exec's
// environment like the sandbox's env (an exec's own env overrides them),
// unmasked in output, of any value (empty, short, with '*'), inherited by
// fork children and back after a restart, and their values nowhere in
// the state folder (records, checkpoints, hibernated state).
func TestPlainSecrets(t *testing.T) {
	e := newEnv(t, nil)
	const value = "plain-api-key-7f3e*x"
	sb := e.create(&kilnpb.CreateSandboxRequest{Secrets: []*kilnpb.Secret{
		{Name: "API_KEY", Value: []byte(value), Plain: true},
		{Name: "SHORT", Value: []byte("1"), Plain: true},
		{Name: "EMPTY", Plain: true},
	}})
	if !slices.Equal(sb.SecretNames, []string{"API_KEY", "SHORT", "EMPTY"}) {
		t.Errorf("secret names %v", sb.SecretNames)
	}
	want := value + " 1 [] set\n"
	script := `echo "$API_KEY $SHORT [$EMPTY] ${EMPTY+set}"`
	if r := e.sh(sb.Id, script); r.stdout != want {
		t.Errorf("exec sees %q; want %q (unmasked)", r.stdout, want)
	}
	r := e.exec(ctxT(t), &kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"sh", "-c", "echo $SHORT"}, Env: []string{"SHORT=2"}})
	if r.err != nil || r.stdout != "2\n" {
		t.Errorf("an exec's env over a plain secret: %q %v; want 2", r.stdout, r.err)
	}
	kids, err := e.fork(&kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_SandboxId{SandboxId: sb.Id}, Count: 1})
	if err != nil || len(kids) != 1 {
		t.Fatalf("fork: %v %v", kids, err)
	}
	if r := e.sh(kids[0].Id, script); r.stdout != want {
		t.Errorf("a fork child sees %q; want %q", r.stdout, want)
	}
	e.checkpoint(sb.Id, true)
	e.stop()
	e.start()
	if r := e.sh(sb.Id, script); r.stdout != want {
		t.Errorf("after a restart: %q; want %q", r.stdout, want)
	}
	if _, err := e.c.PauseSandbox(ctxT(t), &kilnpb.PauseSandboxRequest{Id: sb.Id, Hibernate: true}); err != nil {
		t.Fatal(err)
	}
	findValue(t, e.state, []byte(value))
	if _, err := e.c.ResumeSandbox(ctxT(t), &kilnpb.ResumeSandboxRequest{Id: sb.Id}); err != nil {
		t.Fatal(err)
	}
	if r := e.sh(sb.Id, script); r.stdout != want {
		t.Errorf("after a hibernation: %q; want %q", r.stdout, want)
	}
}
