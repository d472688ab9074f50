package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kilnvm/kiln/daemon/e2b"
)

// TestE2BKeyNew: kiln e2b key new prints a key in E2B's format and puts
// it in the keys file, where package e2b (kilnd) finds it for the tenant;
// bad input is a usage error naming what is wrong.
func TestE2BKeyNew(t *testing.T) {
	keys := filepath.Join(t.TempDir(), "keys")
	var out, errb bytes.Buffer
	if code := run([]string{"e2b", "key", "new", "--keys", keys, "team1"}, nil, &out, &errb); code != exitOK {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	key := strings.TrimSpace(out.String())
	if !e2b.PythonSDKAccepts(key) {
		t.Errorf("key %q is not in E2B's format", key)
	}
	k, err := e2b.LoadKeys(keys, nil, e2b.Quota{})
	if err != nil {
		t.Fatal(err)
	}
	if tenant, ok, _ := k.Tenant(key); !ok || tenant != "team1" {
		t.Errorf("the key's tenant: %q %v", tenant, ok)
	}
	if len(k.PythonSDKRefuses()) != 0 {
		t.Errorf("kilnd would warn of %v", k.PythonSDKRefuses())
	}
	for _, c := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"e2b"}, exitUsage, "usage"},
		{[]string{"e2b", "key", "new", "--keys", keys}, exitUsage, "usage"},
		{[]string{"e2b", "key", "new", "--keys", keys, "a", "b"}, exitUsage, "usage"},
		{[]string{"e2b", "key", "new", "--keys", keys, "bad tenant"}, exitUsage, "tenant"},
		{[]string{"e2b", "key", "new", "--keys", filepath.Join(keys, "x"), "t"}, exitInternal, "keys file"},
	} {
		var o, e bytes.Buffer
		if code := run(c.args, nil, &o, &e); code != c.code || !strings.Contains(e.String(), c.want) || o.Len() != 0 {
			t.Errorf("%q: exit %d, stdout %q, stderr %q; want %d naming %s", c.args, code, o.String(), e.String(), c.code, c.want)
		}
	}
	if b, _ := os.ReadFile(keys); strings.Count(string(b), "\n") != 1 {
		t.Errorf("keys file after refused calls: %q", b)
	}
}
