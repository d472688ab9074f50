package main

import "testing"

func TestUnifiedCgroup(t *testing.T) {
	for _, tt := range []struct {
		in, want string
		ok       bool
	}{
		{"0::/system.slice/kiln-agent.service\n", "/system.slice/kiln-agent.service", true},
		{"1:name=systemd:/x\n0::/system.slice/kiln-agent.service/agent\n", "/system.slice/kiln-agent.service/agent", true},
		{"0::/\n", "/", true},
		{"0::/a/../b\n", "/b", true},
		{"1:memory:/x\n", "", false},
		{"0::relative\n", "", false},
		{"", "", false},
	} {
		got, err := unifiedCgroup(tt.in)
		if (err == nil) != tt.ok || got != tt.want {
			t.Errorf("unifiedCgroup(%q) = %q, %v; want %q (ok %v)", tt.in, got, err, tt.want, tt.ok)
		}
	}
}
