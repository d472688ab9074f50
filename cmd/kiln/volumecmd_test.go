package main

import (
	"encoding/json"
	"strings"
	"testing"
)

// TestVolumeCLI: a volume made, mounted by a sandbox (--volume), listed
// with who mounts it, refused for deletion until the sandbox is gone.
func TestVolumeCLI(t *testing.T) {
	startKilnd(t)
	code, out, errOut := kilnIn(t, "", "volume", "create", "ds", "--size", "32", "--label", "team=a")
	if code != 0 {
		t.Fatalf("volume create: exit %d: %s", code, errOut)
	}
	vol := oneID(t, "volume create", out)
	code, out, errOut = kilnIn(t, "", "sandbox", "create", "--image", "busybox", "-v", "ds:/data:ro")
	if code != 0 {
		t.Fatalf("sandbox create -v: exit %d: %s", code, errOut)
	}
	sb := oneID(t, "sandbox create", out)
	code, out, errOut = kilnIn(t, "", "volume", "ls", "--json", "--label", "team=a")
	var vs []struct {
		ID    string `json:"id"`
		Name  string `json:"name"`
		Users []struct {
			Sandbox  string `json:"sandbox"`
			Path     string `json:"path"`
			ReadOnly bool   `json:"read_only"`
		} `json:"users"`
	}
	if code != 0 || json.Unmarshal([]byte(out), &vs) != nil || len(vs) != 1 || vs[0].ID != vol || vs[0].Name != "ds" ||
		len(vs[0].Users) != 1 || vs[0].Users[0].Sandbox != sb || vs[0].Users[0].Path != "/data" || !vs[0].Users[0].ReadOnly {
		t.Fatalf("volume ls --json: exit %d, %q, %s", code, out, errOut)
	}
	if code, out, _ := kilnIn(t, "", "volume", "ls"); code != 0 || !strings.Contains(out, sb+":/data:ro") {
		t.Errorf("volume ls: exit %d, %q", code, out)
	}
	if code, _, errOut := kilnIn(t, "", "volume", "rm", "ds"); code == 0 || !strings.Contains(errOut, "mounted in sandbox "+sb) {
		t.Errorf("volume rm of a mounted volume: exit %d, %s", code, errOut)
	}
	for _, bad := range []string{"ds", "ds:data", "ds:/data:rx", ":/data"} {
		if code, _, errOut := kilnIn(t, "", "sandbox", "create", "--image", "busybox", "-v", bad); code != exitUsage || !strings.Contains(errOut, "--volume") {
			t.Errorf("-v %q: exit %d, %s", bad, code, errOut)
		}
	}
	if code, _, errOut := kilnIn(t, "", "sandbox", "rm", sb); code != 0 {
		t.Fatalf("sandbox rm: exit %d: %s", code, errOut)
	}
	if code, out, errOut := kilnIn(t, "", "volume", "rm", "ds"); code != 0 || out != "" {
		t.Fatalf("volume rm: exit %d, %q, %s", code, out, errOut)
	}
}
