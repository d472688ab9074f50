package main

import (
	"context"
	"strings"
	"testing"
	"time"

	kilnclient "github.com/kilnvm/kiln/daemon/client"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// TestSandboxUpdateHibernateCLI: kiln sandbox update and pause
// --hibernate, then resume.
func TestSandboxUpdateHibernateCLI(t *testing.T) {
	host := startKilnd(t)
	code, out, errOut := kilnIn(t, "", "sandbox", "create", "--image", "busybox", "--label", "team=a")
	if code != 0 {
		t.Fatalf("create: exit %d: %s", code, errOut)
	}
	id := oneID(t, "create", out)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c, err := kilnclient.Dial(ctx, host)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()

	before := time.Now()
	if code, _, errOut := kilnIn(t, "", "sandbox", "update", id, "--timeout", "1h", "--timeout-action", "hibernate", "--label", "team=b", "--label", "x=y"); code != 0 {
		t.Fatalf("update: exit %d: %s", code, errOut)
	}
	sb, err := c.GetSandbox(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if exp := time.UnixMilli(sb.ExpiresUnixMs); exp.Before(before.Add(time.Hour-time.Second)) || exp.After(time.Now().Add(time.Hour)) ||
		sb.TimeoutAction != kilnpb.TimeoutAction_TIMEOUT_ACTION_HIBERNATE || len(sb.Labels) != 2 || sb.Labels["team"] != "b" {
		t.Errorf("after update: %v", sb)
	}
	if code, _, errOut := kilnIn(t, "", "sandbox", "update", id, "--timeout", "never", "--clear-labels"); code != 0 {
		t.Fatalf("update never: exit %d: %s", code, errOut)
	}
	if sb, _ = c.GetSandbox(ctx, id); sb.ExpiresUnixMs != 0 || len(sb.Labels) != 0 {
		t.Errorf("after update never: %v", sb)
	}
	for _, bad := range [][]string{
		{"sandbox", "update", id},
		{"sandbox", "update", id, "--timeout", "0s"},
		{"sandbox", "update", id, "--timeout", "soon"},
		{"sandbox", "update", id, "--timeout-action", "explode"},
		{"sandbox", "update", id, "--label", "novalue"},
		{"sandbox", "update", id, "--label", "a=b", "--clear-labels"},
	} {
		if code, _, errOut := kilnIn(t, "", bad...); code != exitUsage || !strings.HasPrefix(errOut, "kiln: ") {
			t.Errorf("%v: exit %d (%q), want a usage error", bad, code, errOut)
		}
	}
	if code, _, errOut := kilnIn(t, "", "sandbox", "update", "sb-nope", "--timeout", "1m"); code != exitFailed || !strings.Contains(errOut, "sb-nope") {
		t.Errorf("update of an unknown sandbox: exit %d, %q", code, errOut)
	}

	if code, _, errOut := kilnIn(t, "", "sandbox", "pause", "--hibernate", id); code != 0 {
		t.Fatalf("pause --hibernate: exit %d: %s", code, errOut)
	}
	if sb, _ = c.GetSandbox(ctx, id); !sb.Hibernated || sb.State != kilnpb.SandboxState_SANDBOX_STATE_PAUSED {
		t.Errorf("after pause --hibernate: %v", sb)
	}
	if code, _, errOut := kilnIn(t, "", "sandbox", "resume", id); code != 0 {
		t.Fatalf("resume: exit %d: %s", code, errOut)
	}
	if code, out, _ := kilnIn(t, "", "sandbox", "exec", id, "echo", "back"); code != 0 || out != "back\n" {
		t.Errorf("exec after the resume: exit %d, %q", code, out)
	}
	// Keeping files only: a resume boots it again.
	if code, _, errOut := kilnIn(t, "", "sandbox", "pause", "--keep-files", id); code != 0 {
		t.Fatalf("pause --keep-files: exit %d: %s", code, errOut)
	}
	if sb, _ = c.GetSandbox(ctx, id); !sb.Hibernated || !sb.FilesOnly {
		t.Errorf("after pause --keep-files: %v", sb)
	}
	if code, _, errOut := kilnIn(t, "", "sandbox", "resume", id); code != 0 {
		t.Fatalf("resume: exit %d: %s", code, errOut)
	}
	if sb, _ = c.GetSandbox(ctx, id); sb.State != kilnpb.SandboxState_SANDBOX_STATE_RUNNING || sb.FilesOnly {
		t.Errorf("after resuming a files-only hibernation: %v", sb)
	}
}
