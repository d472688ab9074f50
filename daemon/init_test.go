package daemon_test

import (
	"context"
	"sync"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// TestInit: CreateSandboxRequest.init and CreateTemplateRequest.init are
// checked, reach the backend's CreateSpec, are recorded and reported; a
// template's sandboxes keep the template's.
func TestInit(t *testing.T) {
	e := newEnv(t, nil)
	var mu sync.Mutex
	var inits []string
	e.be.CreateHook = func(_ context.Context, spec daemon.CreateSpec) error {
		if spec.Image != "" {
			mu.Lock()
			inits = append(inits, spec.Init)
			mu.Unlock()
		}
		return nil
	}
	img := func(init string) *kilnpb.CreateSandboxRequest {
		return &kilnpb.CreateSandboxRequest{Source: &kilnpb.CreateSandboxRequest_Image{Image: "busybox"}, Init: init}
	}
	for _, tt := range []struct{ init, spec, reported string }{
		{"", "", "agent"}, {"agent", "", "agent"}, {"systemd", "systemd", "systemd"},
	} {
		sb := e.create(img(tt.init))
		if sb.GetInit() != tt.reported {
			t.Errorf("init %q: reported %q, want %q", tt.init, sb.GetInit(), tt.reported)
		}
		mu.Lock()
		got := inits[len(inits)-1]
		mu.Unlock()
		if got != tt.spec {
			t.Errorf("init %q: CreateSpec.Init %q, want %q", tt.init, got, tt.spec)
		}
		if g, err := e.c.GetSandbox(ctxT(t), &kilnpb.GetSandboxRequest{Id: sb.GetId()}); err != nil || g.GetInit() != tt.reported {
			t.Errorf("GetSandbox: init %q, %v", g.GetInit(), err)
		}
	}
	bad := []*kilnpb.CreateSandboxRequest{img("openrc"), img("SYSTEMD"), img("systemd\x00")}
	for _, req := range bad {
		req.RequestId = nextReq()
		if _, err := e.c.CreateSandbox(ctxT(t), req); status.Code(err) != codes.InvalidArgument {
			t.Errorf("init %q: %v, want InvalidArgument", req.GetInit(), err)
		}
	}
	if _, err := e.c.CreateTemplate(ctxT(t), &kilnpb.CreateTemplateRequest{Name: "bad", Image: "busybox", Init: "runit", RequestId: nextReq()}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("template init runit: %v, want InvalidArgument", err)
	}

	tp := e.createTemplate(&kilnpb.CreateTemplateRequest{Name: "sd", Init: "systemd"})
	if tp.GetInit() != "systemd" {
		t.Errorf("template init %q", tp.GetInit())
	}
	mu.Lock()
	got := inits[len(inits)-1]
	mu.Unlock()
	if got != "systemd" {
		t.Errorf("the template's builder got CreateSpec.Init %q", got)
	}
	sb := e.create(fromTemplate(tp.GetId()))
	if sb.GetInit() != "systemd" {
		t.Errorf("a sandbox from the template: init %q", sb.GetInit())
	}
	req := fromTemplate(tp.GetId())
	req.Init, req.RequestId = "agent", nextReq()
	if _, err := e.c.CreateSandbox(ctxT(t), req); status.Code(err) != codes.InvalidArgument {
		t.Errorf("init agent from a systemd template: %v, want InvalidArgument", err)
	}
}
