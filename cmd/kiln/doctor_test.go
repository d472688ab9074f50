package main

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	"github.com/kilnvm/kiln/hostcheck"
)

func TestWriteDoctor(t *testing.T) {
	tests := []struct {
		name    string
		results []hostcheck.Result
		want    []string // lines, spaces squeezed
		notWant string
	}{
		{name: "all ok", results: []hostcheck.Result{
			{Name: "kvm", Status: hostcheck.OK, Detail: "/dev/kvm: API 12", Required: true},
			{Name: "tun", Status: hostcheck.OK, Detail: "/dev/net/tun opens", Hint: "unused", Required: true},
		}, want: []string{"ok kvm /dev/kvm: API 12", "ok tun /dev/net/tun opens"}, notWant: "hint"},
		{name: "a failure and a warning", results: []hostcheck.Result{
			{Name: "cgroup2", Status: hostcheck.Fail, Detail: "tmpfs", Hint: "boot with unified", Required: true},
			{Name: "ip-forward", Status: hostcheck.Warn, Detail: "off", Hint: "sysctl"},
		}, want: []string{"FAIL cgroup2 tmpfs", "hint: boot with unified", "warn ip-forward off", "hint: sysctl",
			"kilnd cannot run sandboxes here until the FAIL lines above are fixed"}},
		{name: "a failure not required", results: []hostcheck.Result{
			{Name: "nftables", Status: hostcheck.Fail, Detail: "x", Hint: "y"},
		}, want: []string{"FAIL nftables x", "hint: y"}, notWant: "cannot run"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var buf bytes.Buffer
			writeDoctor(&buf, tt.results)
			var lines []string
			for _, l := range strings.Split(strings.TrimRight(buf.String(), "\n"), "\n") {
				lines = append(lines, strings.Join(strings.Fields(l), " "))
			}
			if strings.Join(lines, "\n") != strings.Join(tt.want, "\n") {
				t.Errorf("output:\n%s\nwant (spaces squeezed):\n%s", buf.String(), strings.Join(tt.want, "\n"))
			}
			if tt.notWant != "" && strings.Contains(buf.String(), tt.notWant) {
				t.Errorf("output has %q:\n%s", tt.notWant, buf.String())
			}
		})
	}
}

// TestDoctorJSON runs kiln doctor --json on this host: every check is
// reported, and the exit code agrees with "ok".
func TestDoctorJSON(t *testing.T) {
	var stdout, stderr bytes.Buffer
	code := run([]string{"doctor", "--json", "--state-dir", t.TempDir()}, strings.NewReader(""), &stdout, &stderr)
	var rep struct {
		OK     bool `json:"ok"`
		Checks []struct {
			Name, Status, Detail, Hint string
			Required                   bool
		} `json:"checks"`
	}
	if err := json.Unmarshal(stdout.Bytes(), &rep); err != nil {
		t.Fatalf("kiln doctor --json: %v:\n%s\n%s", err, stdout.String(), stderr.String())
	}
	if len(rep.Checks) != len(hostcheck.Checks()) {
		t.Errorf("%d checks reported; want %d", len(rep.Checks), len(hostcheck.Checks()))
	}
	failed := false
	for i, c := range rep.Checks {
		if c.Name != hostcheck.Checks()[i].Name || c.Detail == "" {
			t.Errorf("check %d: %+v", i, c)
		}
		switch c.Status {
		case "ok", "warn":
		case "fail":
			failed = failed || c.Required
		default:
			t.Errorf("check %s: status %q", c.Name, c.Status)
		}
	}
	if rep.OK == failed || (code == 0) != rep.OK {
		t.Errorf("exit %d, ok %v, a required check failed: %v", code, rep.OK, failed)
	}
	if code := run([]string{"doctor", "stray"}, strings.NewReader(""), &stdout, &stderr); code != exitUsage {
		t.Errorf("kiln doctor stray: exit %d; want %d", code, exitUsage)
	}
}
