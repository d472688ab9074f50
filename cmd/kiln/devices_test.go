package main

import (
	"strings"
	"testing"
)

func TestParseDisk(t *testing.T) {
	tests := []struct {
		in      string
		path    string
		ro      bool
		queues  int
		wantErr string
	}{
		{"disk.img", "disk.img", false, 0, ""},
		{"/a/b.img,ro", "/a/b.img", true, 0, ""},
		{"/a/b.img,rw", "/a/b.img", false, 0, ""},
		{"/a/b.img,ro,queues=4", "/a/b.img", true, 4, ""},
		{",ro", "", false, 0, "no path"},
		{"x.img,readonly", "", false, 0, `unknown option "readonly"`},
		{"x.img,queues=0", "", false, 0, "queues=0: want 1 to 16"},
		{"x.img,queues=99", "", false, 0, "queues=99: want 1 to 16"},
		{"x.img,queues=many", "", false, 0, "queues=many"},
	}
	for _, tt := range tests {
		cfg, err := parseDisk(tt.in)
		if tt.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("parseDisk(%q) error %v, want %q", tt.in, err, tt.wantErr)
			}
			continue
		}
		if err != nil || cfg.Path != tt.path || cfg.ReadOnly != tt.ro || cfg.Queues != tt.queues {
			t.Errorf("parseDisk(%q) = %+v, %v", tt.in, cfg, err)
		}
	}
}

func TestParseNet(t *testing.T) {
	tests := []struct {
		in      string
		tap     string
		mac     string
		netns   string
		wantErr string
	}{
		{"tap0", "tap0", "", "", ""},
		{"tap0,mac=02:00:00:00:00:01", "tap0", "02:00:00:00:00:01", "", ""},
		{"tap1,netns=sb1,mac=02:aa:bb:cc:dd:ee", "tap1", "02:aa:bb:cc:dd:ee", "sb1", ""},
		{"", "", "", "", "no tap name"},
		{"a/b", "", "", "", "not a valid interface name"},
		{"waytoolonginterfacename", "", "", "", "not a valid interface name"},
		{"tap0,mac=zz", "", "", "", "bad MAC"},
		{"tap0,speed=10", "", "", "", "unknown option"},
	}
	for _, tt := range tests {
		cfg, err := parseNet(tt.in)
		if tt.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("parseNet(%q) error %v, want %q", tt.in, err, tt.wantErr)
			}
			continue
		}
		if err != nil || cfg.Tap != tt.tap || cfg.MAC != tt.mac || cfg.Netns != tt.netns {
			t.Errorf("parseNet(%q) = %+v, %v", tt.in, cfg, err)
		}
	}
}

func FuzzParseDeviceFlags(f *testing.F) {
	for _, s := range []string{"disk.img,ro", "tap0,mac=02:00:00:00:00:01,netns=x", ",", "a,b,c"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if cfg, err := parseDisk(s); err == nil && cfg.Path == "" {
			t.Fatalf("parseDisk(%q) accepted an empty path", s)
		}
		if cfg, err := parseNet(s); err == nil && (cfg.Tap == "" || len(cfg.Tap) > 15) {
			t.Fatalf("parseNet(%q) accepted tap %q", s, cfg.Tap)
		}
	})
}
