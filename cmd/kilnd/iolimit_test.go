package main

import (
	"io"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/kilnvm/kiln/cgroup"
)

func TestSandboxIOFlag(t *testing.T) {
	tests := []struct {
		args    []string
		want    []cgroup.IOLimit
		wantErr string
	}{
		{args: nil, want: nil},
		{args: []string{"--sandbox-io", "/dev/vda,rbps=100M,wbps=50M"}, want: []cgroup.IOLimit{{Device: "/dev/vda", ReadBPS: 100 << 20, WriteBPS: 50 << 20}}},
		{args: []string{"--sandbox-io", "8:0,riops=2000,wiops=1k", "--sandbox-io", "/var/lib/kiln,wbps=1G"},
			want: []cgroup.IOLimit{{Device: "8:0", ReadIOPS: 2000, WriteIOPS: 1024}, {Device: "/var/lib/kiln", WriteBPS: 1 << 30}}},
		{args: []string{"--sandbox-io", "/dev/vda"}, wantErr: "no limit given"},
		{args: []string{"--sandbox-io", ",rbps=1"}, wantErr: "device first"},
		{args: []string{"--sandbox-io", "/dev/vda,rbps"}, wantErr: "not KEY=N"},
		{args: []string{"--sandbox-io", "/dev/vda,rbps=0"}, wantErr: "not a positive count"},
		{args: []string{"--sandbox-io", "/dev/vda,rbps=-5"}, wantErr: "not a positive count"},
		{args: []string{"--sandbox-io", "/dev/vda,rbps=1,rbps=2"}, wantErr: "rbps given twice"},
		{args: []string{"--sandbox-io", "/dev/vda,speed=1"}, wantErr: `unknown key "speed"`},
		{args: []string{"--sandbox-io", "/dev/vda,wbps=99999999999999G"}, wantErr: "too large"},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			cfg, err := parseFlagsWith(append([]string{"--config="}, tt.args...), io.Discard, "")
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) || !strings.Contains(err.Error(), "sandbox-io") {
					t.Fatalf("err %v, want one naming -sandbox-io and %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(cfg.sandboxIO, tt.want) {
				t.Errorf("sandboxIO %+v, want %+v", cfg.sandboxIO, tt.want)
			}
		})
	}
}

// TestSandboxIOConfigFile: the config file gives --sandbox-io as an
// array, and its errors name the key.
func TestSandboxIOConfigFile(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "good.toml")
	os.WriteFile(good, []byte(`sandbox-io = ["/dev/vda,rbps=1M", "8:16,wiops=500"]`+"\n"), 0o644)
	cfg, err := parseFlagsWith([]string{"--config", good}, io.Discard, "")
	if err != nil {
		t.Fatal(err)
	}
	want := []cgroup.IOLimit{{Device: "/dev/vda", ReadBPS: 1 << 20}, {Device: "8:16", WriteIOPS: 500}}
	if !reflect.DeepEqual(cfg.sandboxIO, want) {
		t.Errorf("sandboxIO %+v, want %+v", cfg.sandboxIO, want)
	}
	bad := filepath.Join(dir, "bad.toml")
	os.WriteFile(bad, []byte(`sandbox-io = ["/dev/vda,fast=1"]`+"\n"), 0o644)
	if _, err := parseFlagsWith([]string{"--config", bad}, io.Discard, ""); err == nil || !strings.Contains(err.Error(), "sandbox-io") {
		t.Errorf("bad config: %v, want an error naming sandbox-io", err)
	}
}
