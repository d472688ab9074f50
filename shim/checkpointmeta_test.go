package shim

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kilnvm/kiln/guest/agentpb"
)

func TestParseCheckpointMeta(t *testing.T) {
	long := strings.Repeat("a", agentpb.MaxDetachedIDLen+1)
	tests := []struct {
		name, in string
		want     checkpointMeta
		err      string // "" for none; else a part of the error
	}{
		{name: "init", in: `{"init":"init:c1"}`, want: checkpointMeta{Init: "init:c1"}},
		{name: "no init", in: `{}`},
		{name: "empty init", in: `{"init":""}`},
		{name: "spaces around", in: " \n{\"init\": \"init:c1\"}\n", want: checkpointMeta{Init: "init:c1"}},
		{name: "empty", in: ``, err: "not a JSON object"},
		{name: "not json", in: `{`, err: "not a JSON object"},
		{name: "array", in: `[]`, err: "not a JSON object"},
		{name: "null init", in: `{"init":null}`},
		{name: "init not a string", in: `{"init":7}`, err: "not a JSON object"},
		{name: "unknown field", in: `{"init":"init:c1","pid":1}`, err: `unknown field "pid"`},
		{name: "two objects", in: `{}{}`, err: "more after its JSON object"},
		{name: "trailing junk", in: `{"init":"init:c1"} x`, err: "more after its JSON object"},
		{name: "path in init", in: `{"init":"../x"}`, err: "is not a detached process ID"},
		{name: "space in init", in: `{"init":"init c1"}`, err: "is not a detached process ID"},
		{name: "init too long", in: `{"init":"` + long + `"}`, err: "is not a detached process ID"},
		{name: "too large", in: `{"init":"init:c1"}` + strings.Repeat(" ", maxCheckpointMeta), err: "more than the 4096 bytes"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m, err := parseCheckpointMeta([]byte(tt.in))
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) || !strings.HasPrefix(err.Error(), checkpointMetaFile+": ") {
					t.Fatalf("parse = %+v, %v; want an error naming %s and saying %q", m, err, checkpointMetaFile, tt.err)
				}
				if m != (checkpointMeta{}) {
					t.Errorf("a refused parse returned %+v", m)
				}
				return
			}
			if err != nil || m != tt.want {
				t.Fatalf("parse = %+v, %v; want %+v", m, err, tt.want)
			}
		})
	}
}

func TestCheckpointMetaMarshal(t *testing.T) {
	tests := []struct {
		m    checkpointMeta
		want string // "" for a refusal
	}{
		{checkpointMeta{Init: "init:c1"}, `{"init":"init:c1"}`},
		{checkpointMeta{}, `{}`},
		{checkpointMeta{Init: initDetachID(strings.Repeat("f", 64))}, `{"init":"init:` + strings.Repeat("f", 64) + `"}`},
		{checkpointMeta{Init: initDetachID(strings.Repeat("f", agentpb.MaxDetachedIDLen))}, ""},
		{checkpointMeta{Init: "init:a/b"}, ""},
	}
	for _, tt := range tests {
		b, err := tt.m.marshal()
		if tt.want == "" {
			if err == nil || !strings.Contains(err.Error(), "not a detached process ID") {
				t.Errorf("marshal(%+v) = %s, %v; want a refusal", tt.m, b, err)
			}
			continue
		}
		if err != nil || string(b) != tt.want {
			t.Errorf("marshal(%+v) = %s, %v; want %s", tt.m, b, err, tt.want)
			continue
		}
		if back, err := parseCheckpointMeta(b); err != nil || back != tt.m {
			t.Errorf("parse(marshal(%+v)) = %+v, %v", tt.m, back, err)
		}
	}
}

// TestCheckpointMetaFile: write and read through a checkpoint's folder;
// a folder without the file is a checkpoint whose task ran nothing.
func TestCheckpointMetaFile(t *testing.T) {
	dir := t.TempDir()
	if m, err := readCheckpointMeta(dir); err != nil || m != (checkpointMeta{}) {
		t.Errorf("read of a folder without %s = %+v, %v; want the zero value", checkpointMetaFile, m, err)
	}
	want := checkpointMeta{Init: "init:c1"}
	if err := writeCheckpointMeta(dir, want); err != nil {
		t.Fatal(err)
	}
	if m, err := readCheckpointMeta(dir); err != nil || m != want {
		t.Errorf("read = %+v, %v; want %+v", m, err, want)
	}
	big := filepath.Join(t.TempDir(), checkpointMetaFile)
	if err := os.WriteFile(big, []byte(strings.Repeat(" ", 1<<20)), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := readCheckpointMeta(filepath.Dir(big)); err == nil || !strings.HasPrefix(err.Error(), "checkpoint "+checkpointMetaFile+": more than") {
		t.Errorf("read of a 1 MiB file: %v", err)
	}
}

// FuzzCheckpointMeta: a checkpoint's kiln-shim.json is untrusted: it is
// refused, or it names a valid detached ID and marshals back to what
// parses the same.
func FuzzCheckpointMeta(f *testing.F) {
	for _, s := range []string{`{"init":"init:c1"}`, `{"init":""}`, `{}`, `{"init":"../x"}`, `[]`, `{"init":null}`, `{}{}`, `{"Init":"a"}`, "\ufeff{}"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := parseCheckpointMeta(b)
		if err != nil {
			if m != (checkpointMeta{}) || !strings.HasPrefix(err.Error(), checkpointMetaFile+": ") {
				t.Fatalf("parse(%q) = %+v, %v", b, m, err)
			}
			return
		}
		if len(b) > maxCheckpointMeta || m.Init != "" && !agentpb.ValidDetachedID(m.Init) {
			t.Fatalf("parse(%q) accepted %+v", b, m)
		}
		out, err := m.marshal()
		if err != nil {
			t.Fatalf("marshal(%+v) of an accepted parse: %v", m, err)
		}
		if back, err := parseCheckpointMeta(out); err != nil || back != m {
			t.Fatalf("parse(marshal(%+v)) = %+v, %v", m, back, err)
		}
	})
}
