package agent

import (
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/kilnvm/kiln/guest/agentpb"
)

func TestExecDefaults(t *testing.T) {
	root := t.TempDir() + "/"
	os.MkdirAll(filepath.Join(root, "etc"), 0o755)
	os.WriteFile(filepath.Join(root, "etc/passwd"), []byte("root:x:0:0:root:/root:/bin/sh\n# comment\nbroken line\napp:x:1000:1001:App:/home/app:/bin/sh\n"), 0o644)
	os.WriteFile(filepath.Join(root, "etc/group"), []byte("root:x:0:\nstaff:x:50:\n"), 0o644)
	u32 := func(v uint32) *uint32 { return &v }
	tmp := t.TempDir()
	tests := []struct {
		name     string
		start    *agentpb.ExecStart
		d        *ExecDefaults
		env      []string
		dir      string
		uid, gid *uint32
		wantErr  bool
	}{
		{name: "no defaults", start: &agentpb.ExecStart{Argv: []string{"/bin/sh"}}, env: DefaultEnv(), dir: "/"},
		{name: "image env and cwd", start: &agentpb.ExecStart{Argv: []string{"/bin/sh"}},
			d:   &ExecDefaults{Env: []string{"PATH=/opt/bin:/usr/bin", "LANG=C.UTF-8"}, Cwd: tmp},
			env: []string{"PATH=/opt/bin:/usr/bin", "LANG=C.UTF-8", "HOME=/root"}, dir: tmp},
		{name: "request env merges over image env", start: &agentpb.ExecStart{Argv: []string{"/bin/sh"}, Env: []string{"LANG=fr", "X=1"}, Cwd: "/"},
			d:   &ExecDefaults{Env: []string{"LANG=C.UTF-8"}},
			env: []string{"PATH=" + DefaultPath, "LANG=fr", "HOME=/root", "X=1"}, dir: "/"},
		{name: "user by name", start: &agentpb.ExecStart{Argv: []string{"/bin/sh"}},
			d:   &ExecDefaults{User: "app"},
			env: []string{"PATH=" + DefaultPath, "HOME=/home/app"}, dir: "/", uid: u32(1000), gid: u32(1001)},
		{name: "user and group names", start: &agentpb.ExecStart{Argv: []string{"/bin/sh"}},
			d:   &ExecDefaults{User: "app:staff"},
			env: []string{"PATH=" + DefaultPath, "HOME=/home/app"}, dir: "/", uid: u32(1000), gid: u32(50)},
		{name: "numeric user not in passwd", start: &agentpb.ExecStart{Argv: []string{"/bin/sh"}},
			d:   &ExecDefaults{User: "4242:4243"},
			env: []string{"PATH=" + DefaultPath, "HOME=/"}, dir: "/", uid: u32(4242), gid: u32(4243)},
		{name: "request uid wins over image user", start: &agentpb.ExecStart{Argv: []string{"/bin/sh"}, Uid: u32(7)},
			d:   &ExecDefaults{User: "nosuchuser"},
			env: []string{"PATH=" + DefaultPath, "HOME=/root"}, dir: "/", uid: u32(7)},
		{name: "unknown user", start: &agentpb.ExecStart{Argv: []string{"/bin/sh"}}, d: &ExecDefaults{User: "ghost"}, wantErr: true},
		{name: "unknown group", start: &agentpb.ExecStart{Argv: []string{"/bin/sh"}}, d: &ExecDefaults{User: "app:ghosts"}, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			spec, err := newExecSpec(tt.start, tt.d, root)
			if tt.wantErr {
				if err == nil {
					t.Fatalf("no error; spec %+v", spec)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(spec.env, tt.env) {
				t.Errorf("env = %q, want %q", spec.env, tt.env)
			}
			if spec.dir != tt.dir {
				t.Errorf("dir = %q, want %q", spec.dir, tt.dir)
			}
			eq := func(a, b *uint32) bool { return (a == nil) == (b == nil) && (a == nil || *a == *b) }
			if !eq(spec.uid, tt.uid) || !eq(spec.gid, tt.gid) {
				t.Errorf("uid/gid = %v/%v, want %v/%v", spec.uid, spec.gid, tt.uid, tt.gid)
			}
		})
	}
}

func TestExecDefaultsValidate(t *testing.T) {
	for _, d := range []*ExecDefaults{{Env: []string{"NOEQUALS"}}, {Cwd: "relative"}, {User: "a\x00b"}} {
		if err := d.Validate(); err == nil {
			t.Errorf("%+v: no error", d)
		}
	}
	if err := (&ExecDefaults{Env: []string{"A=1"}, Cwd: "/w", User: "1:2"}).Validate(); err != nil {
		t.Error(err)
	}
}
