package client

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// TestDaemonLifecycle: hibernate and resume, an update of lifetime,
// timeout action and labels, and metrics, through the client.
func TestDaemonLifecycle(t *testing.T) {
	c, be := serveDaemon(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	sb, err := c.CreateSandbox(ctx, image())
	if err != nil {
		t.Fatal(err)
	}
	life := 90 * time.Second
	hib := kilnpb.TimeoutAction_TIMEOUT_ACTION_HIBERNATE
	up, err := c.UpdateSandbox(ctx, sb.Id, UpdateOptions{Lifetime: &life, TimeoutAction: &hib, Labels: map[string]string{"team": "a"}})
	if err != nil {
		t.Fatal(err)
	}
	if up.ExpiresUnixMs == 0 || up.TimeoutAction != hib || up.Labels["team"] != "a" {
		t.Errorf("updated: %v", up)
	}
	samples, err := c.SandboxMetrics(ctx, sb.Id, time.Time{})
	if err != nil || len(samples) == 0 || samples[len(samples)-1].MemTotalBytes == 0 {
		t.Fatalf("metrics: %v, %v", samples, err)
	}
	h, err := c.HibernateSandbox(ctx, sb.Id)
	if err != nil || !h.Hibernated || be.Live() != 0 {
		t.Fatalf("hibernated: %v, %v (%d live)", h, err, be.Live())
	}
	if _, err := c.SandboxMetrics(ctx, sb.Id, time.Now()); err != nil {
		t.Errorf("metrics of a hibernated sandbox: %v", err)
	}
	r, err := c.ResumeSandbox(ctx, sb.Id)
	if err != nil || r.Hibernated || r.State != kilnpb.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("resumed: %v, %v", r, err)
	}
	zero := time.Duration(0)
	_, err = c.UpdateSandbox(ctx, sb.Id, UpdateOptions{Lifetime: &zero})
	if e, ok := err.(*Error); !ok || e.Code != codes.InvalidArgument {
		t.Errorf("update with a zero lifetime: %v", err)
	}
}
