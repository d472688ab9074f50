package agent

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
)

func TestDelegatedControllers(t *testing.T) {
	tests := []struct {
		name        string
		controllers *string // cgroup.controllers; nil: no such file
		want        []string
	}{
		{"no cgroup.controllers", nil, []string{"memory", "pids"}},
		{"empty", ptr("\n"), []string{"memory", "pids"}},
		{"a kernel's full set", ptr("cpuset cpu io memory hugetlb pids rdma misc\n"),
			[]string{"memory", "pids", "cpuset", "cpu", "io", "hugetlb", "rdma", "misc"}},
		{"memory only", ptr("memory"), []string{"memory", "pids"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			if tt.controllers != nil {
				if err := os.WriteFile(filepath.Join(dir, "cgroup.controllers"), []byte(*tt.controllers), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			if got := delegatedControllers(dir); !slices.Equal(got, tt.want) {
				t.Errorf("delegatedControllers = %q, want %q", got, tt.want)
			}
		})
	}
}

func ptr(s string) *string { return &s }
