package daemon_test

import (
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

func TestUpdateSandbox(t *testing.T) {
	e := newEnv(t, nil)
	sb := e.create(&kilnpb.CreateSandboxRequest{LifetimeMs: 10_000, Labels: map[string]string{"a": "1"}})
	e.waitPending(1)
	e.clock.Advance(5 * time.Second)
	// A lifetime from now, and new labels.
	up, err := e.c.UpdateSandbox(ctxT(t), &kilnpb.UpdateSandboxRequest{Id: sb.Id, LifetimeMs: proto.Int64(30_000),
		SetLabels: true, Labels: map[string]string{"b": "2"}})
	if err != nil {
		t.Fatal(err)
	}
	if want := e.clock.Now().UnixMilli() + 30_000; up.ExpiresUnixMs != want || len(up.Labels) != 1 || up.Labels["b"] != "2" {
		t.Errorf("updated: expires %d (want %d), labels %v", up.ExpiresUnixMs, want, up.Labels)
	}
	e.waitPending(1) // re-armed, not a second timer
	e.clock.Advance(10 * time.Second)
	if got := e.get(sb.Id); got.State != kilnpb.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("ended at its old lifetime: %v", got)
	}
	// The update is in the record: a restart keeps it.
	e.stop()
	e.start()
	got := e.get(sb.Id)
	if got.ExpiresUnixMs != up.ExpiresUnixMs || got.Labels["b"] != "2" {
		t.Errorf("after a restart: %v", got)
	}
	// Never, and the timeout action; labels cleared.
	up, err = e.c.UpdateSandbox(ctxT(t), &kilnpb.UpdateSandboxRequest{Id: sb.Id, LifetimeMs: proto.Int64(-1),
		TimeoutAction: kilnpb.TimeoutAction_TIMEOUT_ACTION_HIBERNATE.Enum(), SetLabels: true})
	if err != nil {
		t.Fatal(err)
	}
	if up.ExpiresUnixMs != 0 || up.TimeoutAction != kilnpb.TimeoutAction_TIMEOUT_ACTION_HIBERNATE || len(up.Labels) != 0 {
		t.Errorf("updated: %v", up)
	}
	e.waitPending(0)
	e.clock.Advance(time.Hour)
	if got := e.get(sb.Id); got.State != kilnpb.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("a sandbox without a lifetime ended: %v", got)
	}
	// A hibernated one: the lifetime is what its resume arms.
	e.hibernate(sb.Id)
	if _, err := e.c.UpdateSandbox(ctxT(t), &kilnpb.UpdateSandboxRequest{Id: sb.Id, LifetimeMs: proto.Int64(7_000)}); err != nil {
		t.Fatal(err)
	}
	e.clock.Advance(time.Hour)
	res := e.resume(sb.Id)
	if want := e.clock.Now().UnixMilli() + 7_000; res.ExpiresUnixMs != want {
		t.Errorf("expires at %d after the resume, want %d", res.ExpiresUnixMs, want)
	}
	e.clock.Advance(7 * time.Second)
	got = e.waitState(sb.Id, kilnpb.SandboxState_SANDBOX_STATE_PAUSED)
	if !got.Hibernated {
		t.Errorf("timed out with the hibernate action: %v", got)
	}

	long := strings.Repeat("k", 200)
	for _, c := range []struct {
		name string
		req  *kilnpb.UpdateSandboxRequest
		code codes.Code
		msg  string
	}{
		{"unknown", &kilnpb.UpdateSandboxRequest{Id: "sb-nope"}, codes.NotFound, "sb-nope"},
		{"bad id", &kilnpb.UpdateSandboxRequest{Id: "../x"}, codes.InvalidArgument, "sandbox ID"},
		{"zero lifetime", &kilnpb.UpdateSandboxRequest{Id: sb.Id, LifetimeMs: proto.Int64(0)}, codes.InvalidArgument, "lifetime_ms 0"},
		{"bad action", &kilnpb.UpdateSandboxRequest{Id: sb.Id, TimeoutAction: kilnpb.TimeoutAction(7).Enum()}, codes.InvalidArgument, "timeout_action 7"},
		{"long label", &kilnpb.UpdateSandboxRequest{Id: sb.Id, SetLabels: true, Labels: map[string]string{long: "v"}}, codes.InvalidArgument, "label key"},
		{"labels unset", &kilnpb.UpdateSandboxRequest{Id: sb.Id, Labels: map[string]string{"a": "b"}}, codes.InvalidArgument, "set_labels"},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := e.c.UpdateSandbox(ctxT(t), c.req)
			wantCode(t, err, c.code, c.msg)
		})
	}
	e.c.DestroySandbox(ctxT(t), &kilnpb.DestroySandboxRequest{Id: sb.Id})
	_, err = e.c.UpdateSandbox(ctxT(t), &kilnpb.UpdateSandboxRequest{Id: sb.Id, LifetimeMs: proto.Int64(1000)})
	wantCode(t, err, codes.FailedPrecondition, "ended")
}

func TestCreateTimeoutActionInvalid(t *testing.T) {
	e := newEnv(t, func(c *daemon.Config) {})
	_, err := e.c.CreateSandbox(ctxT(t), &kilnpb.CreateSandboxRequest{RequestId: nextReq(),
		Source: &kilnpb.CreateSandboxRequest_Image{Image: "busybox"}, TimeoutAction: kilnpb.TimeoutAction(9)})
	wantCode(t, err, codes.InvalidArgument, "timeout_action 9")
}
