package daemon_test

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// setupScript writes a file into the (test double's) root, as a
// template's setup would in the guest.
var setupScript = []string{"sh", "-c", `echo set-up > "$KILN_TEST_ROOT/setup"`}

func (e *env) createTemplate(req *kilnpb.CreateTemplateRequest) *kilnpb.Template {
	e.t.Helper()
	if req.RequestId == "" {
		req.RequestId = nextReq()
	}
	if req.Image == "" {
		req.Image = "busybox"
	}
	tp, err := e.c.CreateTemplate(ctxT(e.t), req)
	if err != nil {
		e.t.Fatalf("create template: %v", err)
	}
	return tp
}

func fromTemplate(id string) *kilnpb.CreateSandboxRequest {
	return &kilnpb.CreateSandboxRequest{Source: &kilnpb.CreateSandboxRequest_Template{Template: id}}
}

// TestTemplates: a template is built once (setup run, snapshot kept);
// sandboxes restore from it by ID or name with its resources; it survives
// a restart; deleting it is refused while sandboxes use it, or waits.
func TestTemplates(t *testing.T) {
	e := newEnv(t, nil)
	ctx := ctxT(t)
	req := &kilnpb.CreateTemplateRequest{Name: "py", Setup: setupScript,
		Resources: &kilnpb.Resources{Cpus: 2, MemoryMib: 256}, RequestId: nextReq()}
	tp := e.createTemplate(req)
	if !strings.HasPrefix(tp.Id, "tp-") || tp.Name != "py" || tp.ImageDigest == "" || tp.Resources.GetCpus() != 2 || tp.Resources.GetMemoryMib() != 256 {
		t.Fatalf("template: %v", tp)
	}
	if e.be.Live() != 0 {
		t.Errorf("the template's builder is still running: %d live", e.be.Live())
	}
	// A retry returns the same template; another request reusing the ID
	// or the name is refused.
	again := e.createTemplate(req)
	if again.Id != tp.Id {
		t.Errorf("retry made %s, first %s", again.Id, tp.Id)
	}
	_, err := e.c.CreateTemplate(ctx, &kilnpb.CreateTemplateRequest{Name: "other", Image: "busybox", RequestId: req.RequestId})
	wantCode(t, err, codes.AlreadyExists, "other parameters")
	_, err = e.c.CreateTemplate(ctx, &kilnpb.CreateTemplateRequest{Name: "py", Image: "busybox", RequestId: nextReq()})
	wantCode(t, err, codes.AlreadyExists, `named "py"`)

	for _, ref := range []string{tp.Id, "py"} {
		got, err := e.c.GetTemplate(ctx, &kilnpb.GetTemplateRequest{Id: ref})
		if err != nil || got.Id != tp.Id {
			t.Errorf("get %s: %v %v", ref, got, err)
		}
	}
	sb := e.create(fromTemplate("py"))
	if sb.Template != tp.Id || sb.Resources.GetCpus() != 2 || sb.Resources.GetMemoryMib() != 256 || sb.FromPool {
		t.Errorf("sandbox from the template: %v", sb)
	}
	if r := e.sh(sb.Id, `cat "$KILN_TEST_ROOT/setup"`); r.stdout != "set-up\n" {
		t.Errorf("the setup's file in the sandbox: %q", r.stdout)
	}
	bad := fromTemplate(tp.Id)
	bad.RequestId, bad.Resources = nextReq(), &kilnpb.Resources{MemoryMib: 512}
	_, err = e.c.CreateSandbox(ctx, bad)
	wantCode(t, err, codes.InvalidArgument, "resources.memory_mib 512")

	list, err := e.c.ListTemplates(ctx, &kilnpb.ListTemplatesRequest{})
	if err != nil || len(list.Templates) != 1 || list.Templates[0].Sandboxes != 1 {
		t.Fatalf("list: %v %v", list, err)
	}

	// A restart keeps it.
	e.stop()
	e.start()
	sb2 := e.create(fromTemplate(tp.Id))
	if r := e.sh(sb2.Id, `cat "$KILN_TEST_ROOT/setup"`); r.stdout != "set-up\n" {
		t.Errorf("after a restart: %q", r.stdout)
	}

	// Delete: refused while sandboxes use it; with wait, done once they
	// are gone, and creates are refused meanwhile.
	_, err = e.c.DeleteTemplate(ctx, &kilnpb.DeleteTemplateRequest{Id: "py"})
	wantCode(t, err, codes.FailedPrecondition, "2 live sandboxes")
	deleted := make(chan error, 1)
	go func() {
		_, err := e.c.DeleteTemplate(ctx, &kilnpb.DeleteTemplateRequest{Id: tp.Id, Wait: true})
		deleted <- err
	}()
	deadline := time.Now().Add(5 * time.Second)
	for {
		_, err := e.c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{RequestId: nextReq(), Source: &kilnpb.CreateSandboxRequest_Template{Template: tp.Id}})
		if err != nil {
			wantCode(t, err, codes.FailedPrecondition, "being deleted")
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("creates from a template being deleted still succeed")
		}
		time.Sleep(10 * time.Millisecond)
	}
	for _, id := range []string{sb.Id, sb2.Id} {
		select {
		case err := <-deleted:
			t.Fatalf("delete returned with sandboxes left: %v", err)
		default:
		}
		if _, err := e.c.DestroySandbox(ctx, &kilnpb.DestroySandboxRequest{Id: id}); err != nil {
			t.Fatal(err)
		}
	}
	// Destroy every sandbox the polling loop made before the delete began.
	all, _ := e.c.ListSandboxes(ctx, &kilnpb.ListSandboxesRequest{})
	for _, s := range all.Sandboxes {
		e.c.DestroySandbox(ctx, &kilnpb.DestroySandboxRequest{Id: s.Id})
	}
	if err := <-deleted; err != nil {
		t.Fatalf("delete with wait: %v", err)
	}
	_, err = e.c.GetTemplate(ctx, &kilnpb.GetTemplateRequest{Id: tp.Id})
	wantCode(t, err, codes.NotFound, tp.Id)
	if left, _ := os.ReadDir(filepath.Join(e.state, "templates")); len(left) != 0 {
		t.Errorf("left in the templates folder: %v", left)
	}
}

// TestTemplateSetupFails: a failing setup fails the create with its
// output, leaves nothing, and a retry tries again.
func TestTemplateSetupFails(t *testing.T) {
	e := newEnv(t, nil)
	req := &kilnpb.CreateTemplateRequest{Name: "broken", Image: "busybox", RequestId: nextReq(),
		Setup: []string{"sh", "-c", "echo pip: no such package >&2; exit 3"}}
	_, err := e.c.CreateTemplate(ctxT(t), req)
	wantCode(t, err, codes.FailedPrecondition, "pip: no such package")
	wantCode(t, err, codes.FailedPrecondition, "exit 3")
	if e.be.Live() != 0 {
		t.Errorf("%d sandboxes left", e.be.Live())
	}
	if left, _ := os.ReadDir(filepath.Join(e.state, "templates")); len(left) != 0 {
		t.Errorf("left in the templates folder: %v", left)
	}
	if left, _ := filepath.Glob(filepath.Join(e.state, "sandboxes", "*")); len(left) != 0 {
		t.Errorf("left in the sandboxes folder: %v", left)
	}
	// The failed request's ID is forgotten: a retry builds afresh.
	req.Setup = setupScript
	if _, err := e.c.CreateTemplate(ctxT(t), req); err != nil {
		t.Fatalf("retry with a setup that works: %v", err)
	}
}

func TestTemplateBadRequests(t *testing.T) {
	e := newEnv(t, nil)
	tests := []struct {
		name string
		req  *kilnpb.CreateTemplateRequest
		code codes.Code
		msg  string
	}{
		{"no request ID", &kilnpb.CreateTemplateRequest{Image: "busybox"}, codes.InvalidArgument, "request_id is empty"},
		{"no image", &kilnpb.CreateTemplateRequest{RequestId: "t1"}, codes.InvalidArgument, "image"},
		{"bad name", &kilnpb.CreateTemplateRequest{RequestId: "t2", Image: "busybox", Name: "../x"}, codes.InvalidArgument, "template name"},
		{"ID-like name", &kilnpb.CreateTemplateRequest{RequestId: "t3", Image: "busybox", Name: "tp-1"}, codes.InvalidArgument, "tp-"},
		{"empty setup command", &kilnpb.CreateTemplateRequest{RequestId: "t4", Image: "busybox", Setup: []string{""}}, codes.InvalidArgument, "setup[0]"},
		{"NUL in setup", &kilnpb.CreateTemplateRequest{RequestId: "t5", Image: "busybox", Setup: []string{"sh", "a\x00b"}}, codes.InvalidArgument, "setup[1]"},
		{"huge pool", &kilnpb.CreateTemplateRequest{RequestId: "t6", Image: "busybox", PoolSize: 100000}, codes.InvalidArgument, "pool_size"},
		{"negative-ish memory", &kilnpb.CreateTemplateRequest{RequestId: "t7", Image: "busybox", Resources: &kilnpb.Resources{MemoryMib: 1 << 30}}, codes.InvalidArgument, "more than the host has"},
		{"unknown image", &kilnpb.CreateTemplateRequest{RequestId: "t8", Image: "nope"}, codes.NotFound, "nope"},
	}
	e.be.Images = []string{"busybox"}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := e.c.CreateTemplate(ctxT(t), tc.req)
			wantCode(t, err, tc.code, tc.msg)
		})
	}
	for _, id := range []string{"nope", "", "a/b"} {
		_, err := e.c.GetTemplate(ctxT(t), &kilnpb.GetTemplateRequest{Id: id})
		if err == nil {
			t.Errorf("get %q succeeded", id)
		}
		_, err = e.c.DeleteTemplate(ctxT(t), &kilnpb.DeleteTemplateRequest{Id: id})
		if err == nil {
			t.Errorf("delete %q succeeded", id)
		}
	}
}

// poolMembers returns the host names of the pool's sandboxes not handed
// out (their folders are the test double's).
func (e *env) poolMembers() []string {
	e.t.Helper()
	metas, _ := filepath.Glob(filepath.Join(e.state, "sandboxes", "pl-*", "meta.json"))
	var out []string
	for _, m := range metas {
		b, err := os.ReadFile(m)
		if err != nil {
			continue
		}
		var v struct{ Hostname string }
		json.Unmarshal(b, &v)
		out = append(out, v.Hostname)
	}
	return out
}

func (e *env) waitPool(id string, ready uint32) *kilnpb.Template {
	e.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		tp, err := e.c.GetTemplate(ctxT(e.t), &kilnpb.GetTemplateRequest{Id: id})
		if err != nil {
			e.t.Fatal(err)
		}
		if tp.PoolReady == ready {
			return tp
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("template %s: %d of its pool ready, want %d", id, tp.PoolReady, ready)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestTemplatePool: a pool keeps its sandboxes ready, hands them out
// under new identities, refills, counts against the host's limits, and
// goes with its template; a restart refills it with sandboxes of its own.
func TestTemplatePool(t *testing.T) {
	e := newEnv(t, func(c *daemon.Config) { c.MaxSandboxes = 3 })
	tp := e.createTemplate(&kilnpb.CreateTemplateRequest{Name: "warm", Setup: setupScript, PoolSize: 2})
	e.waitPool(tp.Id, 2)
	if e.be.Live() != 2 {
		t.Fatalf("%d live sandboxes, want the pool's 2", e.be.Live())
	}
	sb := e.create(fromTemplate("warm"))
	if !sb.FromPool || sb.Template != tp.Id {
		t.Fatalf("not from the pool: %v", sb)
	}
	if r := e.sh(sb.Id, `cat "$KILN_TEST_ROOT/setup"`); r.stdout != "set-up\n" {
		t.Errorf("the setup's file: %q", r.stdout)
	}
	// Handed out with a new identity: its host name is its ID's.
	handed := false
	metas, _ := filepath.Glob(filepath.Join(e.state, "sandboxes", "pl-*", "meta.json"))
	for _, m := range metas {
		b, _ := os.ReadFile(m)
		var v struct {
			Hostname  string
			Refreshes int
		}
		json.Unmarshal(b, &v)
		if v.Hostname == sb.Id && v.Refreshes == 1 {
			handed = true
		}
	}
	if !handed {
		t.Errorf("no pool sandbox was refreshed as %s: %v", sb.Id, e.poolMembers())
	}
	e.waitPool(tp.Id, 2) // refilled
	// The host's limit (3) counts the pool: one more sandbox comes from
	// the pool, and the refill waits for room.
	sb2 := e.create(fromTemplate(tp.Id))
	if !sb2.FromPool {
		t.Errorf("second create not from the pool: %v", sb2)
	}
	time.Sleep(50 * time.Millisecond)
	if got := e.waitPool(tp.Id, 1); got.Sandboxes != 2 {
		t.Errorf("template: %v", got)
	}
	_, err := e.c.CreateSandbox(ctxT(t), &kilnpb.CreateSandboxRequest{RequestId: nextReq(), Source: &kilnpb.CreateSandboxRequest_Image{Image: "busybox"}})
	wantCode(t, err, codes.ResourceExhausted, "limit is 3")
	if _, err := e.c.DestroySandbox(ctxT(t), &kilnpb.DestroySandboxRequest{Id: sb2.Id}); err != nil {
		t.Fatal(err)
	}
	e.waitPool(tp.Id, 2)

	// A restart stops the old pool's sandboxes and refills with new ones;
	// the handed-out sandbox runs on.
	before, _ := filepath.Glob(filepath.Join(e.state, "sandboxes", "pl-*"))
	e.stop()
	e.start()
	e.waitPool(tp.Id, 2)
	if got := e.get(sb.Id); got.State != kilnpb.SandboxState_SANDBOX_STATE_RUNNING {
		t.Errorf("handed-out sandbox after the restart: %v", got)
	}
	after, _ := filepath.Glob(filepath.Join(e.state, "sandboxes", "pl-*"))
	kept := 0
	for _, d := range after {
		for _, o := range before {
			if d == o {
				kept++
			}
		}
	}
	if len(after) != 3 || kept != 1 {
		t.Errorf("pool folders before the restart %v, after %v: want the handed-out one kept and two new", before, after)
	}
	// Deleting the template closes its pool.
	if _, err := e.c.DestroySandbox(ctxT(t), &kilnpb.DestroySandboxRequest{Id: sb.Id}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.c.DeleteTemplate(ctxT(t), &kilnpb.DeleteTemplateRequest{Id: tp.Id}); err != nil {
		t.Fatal(err)
	}
	// The handed-out sandbox's first instance, detached by the stopped
	// server, learns of its process's end on its own watcher: wait for it.
	deadline := time.Now().Add(10 * time.Second)
	for e.be.Live() != 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if e.be.Live() != 0 {
		t.Errorf("%d sandboxes left after the template's delete", e.be.Live())
	}
	if left, _ := filepath.Glob(filepath.Join(e.state, "sandboxes", "pl-*")); len(left) != 0 {
		t.Errorf("pool folders left: %v", left)
	}
}

// TestMaxStarting: a burst of creates starts at most Config.MaxStarting
// sandboxes at once; the rest wait their turn and succeed.
func TestMaxStarting(t *testing.T) {
	var mu sync.Mutex
	now, peak := 0, 0
	e := newEnv(t, func(c *daemon.Config) { c.MaxStarting = 2 })
	e.be.CreateHook = func(ctx context.Context, spec daemon.CreateSpec) error {
		mu.Lock()
		now++
		peak = max(peak, now)
		mu.Unlock()
		time.Sleep(20 * time.Millisecond)
		mu.Lock()
		now--
		mu.Unlock()
		return nil
	}
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() { defer wg.Done(); e.create(nil) }()
	}
	wg.Wait()
	if peak != 2 {
		t.Errorf("%d sandboxes started at once, want 2", peak)
	}
	if e.be.Live() != 8 {
		t.Errorf("%d live, want 8", e.be.Live())
	}
}

// TestQueuedStartKeepsItsBootTime: the wait for a start slot does not
// count against Config.BootTimeout. Six creates, one slot, each start
// 150 ms under a 400 ms boot timeout: the last waits 750 ms for its
// turn, and all six start.
func TestQueuedStartKeepsItsBootTime(t *testing.T) {
	e := newEnv(t, func(c *daemon.Config) { c.MaxStarting, c.BootTimeout = 1, 400*time.Millisecond })
	e.be.CreateHook = func(ctx context.Context, spec daemon.CreateSpec) error {
		select {
		case <-time.After(150 * time.Millisecond):
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	errs := make([]error, 6)
	var wg sync.WaitGroup
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = e.c.CreateSandbox(ctxT(t), &kilnpb.CreateSandboxRequest{RequestId: nextReq(),
				Source: &kilnpb.CreateSandboxRequest_Image{Image: "busybox"}})
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("create %d: %v", i, err)
		}
	}
	if e.be.Live() != 6 {
		t.Errorf("%d live, want 6", e.be.Live())
	}
}
