package apikey

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestNew(t *testing.T) {
	a, b := New(), New()
	if a == b || !PythonSDKAccepts(a) || len(a) != len("e2b_")+2*keyBytes {
		t.Errorf("New() = %q, %q", a, b)
	}
}

// TestAppend: a new file is 0600 with the line; an existing one is
// extended after a newline of its own; bad tenants, bad keys and files
// others may read are refused and left as they were.
func TestAppend(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "keys")
	k1, k2 := New(), New()
	if err := Append(p, k1, "alpha"); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(p); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("new keys file: %v %v", fi, err)
	}
	// A file whose last line has no newline.
	f, _ := os.OpenFile(p, os.O_APPEND|os.O_WRONLY, 0)
	f.WriteString("# no newline")
	f.Close()
	if err := Append(p, k2, "beta.team-1"); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(p)
	if want := k1 + " alpha\n# no newline\n" + k2 + " beta.team-1\n"; string(b) != want {
		t.Errorf("keys file %q, want %q", b, want)
	}
	for _, c := range []struct {
		key, tenant, want string
	}{
		{New(), "a b", "tenant"},
		{New(), "", "tenant"},
		{New(), strings.Repeat("x", MaxTenantLen+1), "tenant"},
		{"my-key-0123456789", "gamma", "E2B's format"},
	} {
		if err := Append(p, c.key, c.tenant); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("Append(%q, %q) = %v, want an error naming %s", c.key, c.tenant, err, c.want)
		}
	}
	os.Chmod(p, 0o644)
	if err := Append(p, New(), "gamma"); err == nil || !strings.Contains(err.Error(), "every user") {
		t.Errorf("a world-readable file: %v", err)
	}
	if b2, _ := os.ReadFile(p); string(b2) != string(b) {
		t.Errorf("refused appends changed the file: %q", b2)
	}
	if err := Append(dir, New(), "alpha"); err == nil {
		t.Error("appending to a folder succeeded")
	}
}
