package main

import (
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

func TestEgressFlags(t *testing.T) {
	tests := []struct {
		name string
		e    egressFlags
		want *kilnpb.EgressPolicy
	}{
		{"none", egressFlags{}, nil},
		{"deny-all", egressFlags{mode: "deny-all"}, &kilnpb.EgressPolicy{Mode: kilnpb.EgressPolicy_MODE_DENY_ALL}},
		{"allow implies allow-list", egressFlags{allow: []string{"10.0.0.0/8", "192.0.2.7", "*.example.com", "pypi.test"}},
			&kilnpb.EgressPolicy{Mode: kilnpb.EgressPolicy_MODE_ALLOW_LIST, Cidrs: []string{"10.0.0.0/8", "192.0.2.7"}, Domains: []string{"*.example.com", "pypi.test"}}},
		{"deny implies deny-list", egressFlags{deny: []string{"169.254.169.254"}},
			&kilnpb.EgressPolicy{Mode: kilnpb.EgressPolicy_MODE_DENY_LIST, Cidrs: []string{"169.254.169.254"}}},
		{"explicit allow-list", egressFlags{mode: "allow-list", allow: []string{"a.test"}},
			&kilnpb.EgressPolicy{Mode: kilnpb.EgressPolicy_MODE_ALLOW_LIST, Domains: []string{"a.test"}}},
		{"empty allow-list", egressFlags{mode: "allow-list"}, &kilnpb.EgressPolicy{Mode: kilnpb.EgressPolicy_MODE_ALLOW_LIST}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := tt.e.policy()
			if err != nil {
				t.Fatal(err)
			}
			if !proto.Equal(got, tt.want) {
				t.Errorf("policy %v, want %v", got, tt.want)
			}
		})
	}
	if s := egressString(&kilnpb.EgressPolicy{Mode: kilnpb.EgressPolicy_MODE_ALLOW_LIST, Cidrs: []string{"10.0.0.0/8"}, Domains: []string{"a.test"}}); s != "allow-list 10.0.0.0/8,a.test" {
		t.Errorf("egressString = %q", s)
	}
}

func TestSecretFlags(t *testing.T) {
	env := map[string]string{"TOKEN": "abcd1234"}
	files := map[string][]byte{"/host/key": []byte("key-bytes")}
	s := secretFlags{
		env:      []string{"TOKEN", "FROMFILE=@/host/key"},
		files:    []string{"SSH=/root/.ssh/id:/host/key", "CFG=/etc/c:/host/key:0440"},
		getenv:   func(k string) (string, bool) { v, ok := env[k]; return v, ok },
		readFile: func(p string) ([]byte, error) { return files[p], nil },
	}
	got, err := s.secrets()
	if err != nil {
		t.Fatal(err)
	}
	want := []*kilnpb.Secret{
		{Name: "TOKEN", Value: []byte("abcd1234")},
		{Name: "FROMFILE", Value: []byte("key-bytes")},
		{Name: "SSH", Value: []byte("key-bytes"), File: "/root/.ssh/id"},
		{Name: "CFG", Value: []byte("key-bytes"), File: "/etc/c", FileMode: 0o440},
	}
	if len(got) != len(want) {
		t.Fatalf("%d secrets, want %d", len(got), len(want))
	}
	for i := range want {
		if !proto.Equal(got[i], want[i]) {
			t.Errorf("secret %d: %v, want %v", i, got[i], want[i])
		}
	}
	bad := secretFlags{files: []string{"X=/a:/host/key:9z"}, readFile: s.readFile}
	if _, err := bad.secrets(); err == nil {
		t.Error("a mode that is not octal was taken")
	}
}
