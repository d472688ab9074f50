package e2b

import (
	"crypto/sha256"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/daemon/e2b/apikey"
)

// TestParseKeys: good files and the line each bad one is refused at.
func TestParseKeys(t *testing.T) {
	tests := []struct {
		name, text string
		n          int
		line       int    // of the error; 0: no error
		msg        string // in the error
	}{
		{"empty", "", 0, 0, ""},
		{"comments and blanks", "# keys\n\n  \nkey-00000001 alpha\n\t# more\nkey-00000002 beta  \n", 2, 0, ""},
		{"one field", "key-00000001\n", 0, 1, "want KEY TENANT"},
		{"a field that is no quota", "# c\nkey-00000001 alpha x\n", 0, 2, `field "x"`},
		{"duplicate", "key-00000001 alpha\nkey-00000002 beta\nkey-00000001 gamma\n", 0, 3, "twice"},
		{"short key", "short alpha\n", 0, 1, "5 bytes"},
		{"bad tenant", "key-00000001 al/pha\n", 0, 1, "tenant"},
		{"control byte", "key-0000\x010001 alpha\n", 0, 1, "printable"},
		{"quotas", "key-00000001 alpha sandboxes=3 memory=2048\nkey-00000002 alpha sandboxes=3 hibernated=0 snapshots=9\nkey-00000003 beta\n", 3, 0, ""},
		{"unknown quota", "key-00000001 alpha cpus=3\n", 0, 1, `unknown quota "cpus"`},
		{"quota not a number", "key-00000001 alpha memory=2G\n", 0, 1, "memory="},
		{"quota negative", "key-00000001 alpha memory=-1\n", 0, 1, "memory="},
		{"quota with a sign", "key-00000001 alpha memory=+1\n", 0, 1, "memory="},
		{"quota too large", "key-00000001 alpha memory=99999999999999999999\n", 0, 1, "memory="},
		{"quota twice on a line", "key-00000001 alpha memory=1 memory=1\n", 0, 1, "twice"},
		{"quotas of a tenant disagree", "key-00000001 alpha memory=1\n# c\nkey-00000002 alpha memory=2\n", 0, 3, "at line 1"},
	}
	for _, tc := range tests {
		m, err := parseKeys("keys.txt", []byte(tc.text))
		if tc.line == 0 {
			if err != nil || len(m.tenants) != tc.n {
				t.Errorf("%s: %v, %d keys; want %d", tc.name, err, len(m.tenants), tc.n)
			}
			continue
		}
		var ke *KeysError
		if !errors.As(err, &ke) || ke.Line != tc.line || !strings.Contains(err.Error(), tc.msg) || !strings.Contains(err.Error(), "keys.txt:") {
			t.Errorf("%s: %v; want keys.txt:%d ... %q", tc.name, err, tc.line, tc.msg)
		}
		if err != nil && strings.Contains(err.Error(), "key-0000") {
			t.Errorf("%s: the error shows the key: %v", tc.name, err)
		}
	}
}

// TestKeysFile: the file's mode is checked, inline keys join it, a
// change of the file (or Reload) is picked up, and a bad change keeps the
// keys read before.
func TestKeysFile(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "keys")
	os.WriteFile(p, []byte("key-file-0001 alpha\n"), 0o644)
	os.Chmod(p, 0o644)
	if _, err := LoadKeys(p, nil, Quota{}); err == nil || !strings.Contains(err.Error(), "every user") {
		t.Errorf("a world-readable file: %v", err)
	}
	os.Chmod(p, 0o640)
	if _, err := LoadKeys(p, []string{"key-file-0001 beta"}, Quota{}); err == nil || !strings.Contains(err.Error(), "also given") {
		t.Errorf("a key in the file and inline: %v", err)
	}
	if _, err := LoadKeys(p, []string{"key-inline-01"}, Quota{}); err == nil || !strings.Contains(err.Error(), "--e2b-api-key:1") {
		t.Errorf("a bad inline key: %v", err)
	}
	if _, err := LoadKeys(filepath.Join(dir, "none"), nil, Quota{}); err == nil {
		t.Error("a missing file loads")
	}
	k, err := LoadKeys(p, []string{"key-inline-01 gamma"}, Quota{})
	if err != nil {
		t.Fatal(err)
	}
	check := func(key, want string) {
		t.Helper()
		got, ok, _ := k.Tenant(key)
		if got != want || ok != (want != "") {
			t.Errorf("Tenant(%s) = %q, %v; want %q", key, got, ok, want)
		}
	}
	check("key-file-0001", "alpha")
	check("key-inline-01", "gamma")
	check("key-nobody-01", "")
	check("", "")

	// A change is read on the next lookup.
	os.WriteFile(p, []byte("key-file-0002 beta\n"), 0o640)
	os.Chtimes(p, time.Now(), time.Now().Add(time.Second))
	check("key-file-0001", "")
	check("key-file-0002", "beta")
	// A bad change: reported once, the old keys hold.
	os.WriteFile(p, []byte("key-file-0003 beta extra\n"), 0o640)
	os.Chtimes(p, time.Now(), time.Now().Add(2*time.Second))
	if _, _, err := k.Tenant("key-file-0002"); err == nil || !strings.Contains(err.Error(), p+":1") {
		t.Errorf("a bad change: %v", err)
	}
	if _, _, err := k.Tenant("key-file-0002"); err != nil {
		t.Errorf("the bad change reported twice: %v", err)
	}
	check("key-file-0002", "beta")
	// Reload (SIGHUP) reads it whatever its time.
	os.WriteFile(p, []byte("key-file-0004 delta\n"), 0o600)
	if err := k.Reload(); err != nil {
		t.Fatal(err)
	}
	check("key-file-0004", "delta")
	check("key-inline-01", "gamma")
}

// TestTokens: the key is made 0600 once and reused; tokens differ per
// sandbox and are checked exactly.
func TestTokens(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "e2b")
	a, err := loadTokens(dir)
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(filepath.Join(dir, tokenKeyFile))
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("key file: %v %v", fi, err)
	}
	b, err := loadTokens(dir)
	if err != nil {
		t.Fatal(err)
	}
	k1, k2 := sha256.Sum256([]byte("key-1")), sha256.Sum256([]byte("key-2"))
	tok := a.token("sb-1", "alpha", k1)
	if tok != b.token("sb-1", "alpha", k1) || tok == a.token("sb-2", "alpha", k1) || tok == a.token("sb-1", "alpha", k2) || tok == a.token("sb-1", "beta", k1) {
		t.Error("tokens are not per sandbox, tenant and key, or not stable across loads")
	}
	keys := [][sha256.Size]byte{k2, k1}
	if !a.check("sb-1", "alpha", keys, tok) || !a.check("sb-1", "alpha", keys, a.token("sb-1", "alpha", k2)) {
		t.Error("check refuses a token of one of the tenant's keys")
	}
	if a.check("sb-1", "alpha", keys, a.token("sb-2", "alpha", k1)) || a.check("sb-1", "alpha", keys, "") || a.check("sb-1", "alpha", keys, tok+"x") ||
		a.check("sb-1", "alpha", keys[:1], tok) || a.check("sb-1", "alpha", nil, tok) {
		t.Error("check accepts another sandbox's token, a bad one, or a revoked key's")
	}
	os.WriteFile(filepath.Join(dir, tokenKeyFile), []byte("short"), 0o600)
	if _, err := loadTokens(dir); err == nil {
		t.Error("a 5-byte key loads")
	}
}

// TestParseSandboxHost: the PORT-ID.DOMAIN host names.
func TestParseSandboxHost(t *testing.T) {
	tests := []struct {
		host, domain, id string
		port             int
	}{
		{"49983-sb-1.kiln.test", "kiln.test", "sb-1", 49983},
		{"49983-sb-1.kiln.test:443", "kiln.test", "sb-1", 49983},
		{"8080-fork-ab.kiln.test", "", "fork-ab", 8080},
		{"49983-sb-1.other.test", "kiln.test", "", 0},
		{"127.0.0.1:3000", "", "", 0},
		{"localhost", "", "", 0},
		{"api.kiln.test", "kiln.test", "", 0},
		{"0-sb.kiln.test", "", "", 0},
		{"070-sb.kiln.test", "", "", 0},
		{"99999-sb.kiln.test", "", "", 0},
		{"[::1]:3000", "", "", 0},
	}
	for _, tc := range tests {
		id, port, ok := parseSandboxHost(tc.host, tc.domain)
		if id != tc.id || port != tc.port || ok != (tc.id != "") {
			t.Errorf("%s (domain %q): %q %d %v; want %q %d", tc.host, tc.domain, id, port, ok, tc.id, tc.port)
		}
	}
}

// FuzzParseKeys: any file parses or fails with a line, never panics, and
// what parses has tenants of the allowed characters.
func FuzzParseKeys(f *testing.F) {
	f.Add([]byte("# c\nkey-00000001 alpha\n\nkey-00000002 beta\n"))
	f.Add([]byte("key-00000001 alpha\nkey-00000001 alpha\n"))
	f.Add([]byte("\xff\xfe x y z\r\n"))
	f.Add([]byte("key-00000001 alpha sandboxes=3 memory=2048\nkey-00000002 alpha hibernated=0 snapshots=9\n"))
	f.Add([]byte("key-00000001 alpha sandboxes=3\nkey-00000002 alpha sandboxes=4\n"))
	f.Add([]byte("key-00000001 alpha memory=-1 memory=+2 sandboxes=99999999999999999999\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := parseKeys("f", b)
		if err != nil {
			var ke *KeysError
			if !errors.As(err, &ke) || ke.Line < 1 {
				t.Fatalf("error without a line: %v", err)
			}
			return
		}
		for _, tenant := range m.tenants {
			if apikey.CheckTenant(tenant) != nil {
				t.Fatalf("bad tenant %q accepted", tenant)
			}
			if _, ok := m.quotas[tenant]; !ok {
				t.Fatalf("tenant %q has no quota entry", tenant)
			}
		}
		for tenant, qs := range m.quotas {
			for k, v := range qs {
				if v > MaxQuotaValue {
					t.Fatalf("tenant %q: %s=%d accepted, over %d", tenant, k, v, uint64(MaxQuotaValue))
				}
			}
			q := qs.over(Quota{Sandboxes: 1, MemoryMiB: 2, HibernatedMiB: 3, Snapshots: 4})
			if n, ok := qs["sandboxes"]; ok && q.Sandboxes != n || !ok && q.Sandboxes != 1 {
				t.Fatalf("tenant %q: sandboxes %d from %v", tenant, q.Sandboxes, qs)
			}
		}
	})
}

// FuzzDecodeRequests: any body decodes into each request type or is a
// 400/413 naming what is wrong; a create's network settings map or are
// refused; nothing panics.
func FuzzDecodeRequests(f *testing.F) {
	f.Add([]byte(`{"templateID":"base","timeout":60,"metadata":{"a":"b"},"envVars":{"X":"1"}}`))
	f.Add([]byte(`{"templateID":"base","allow_internet_access":false,"network":{"allowOut":["1.1.1.1","a.com"],"denyOut":["0.0.0.0/0"]}}`))
	f.Add([]byte(`{"network":{"denyOut":["10.0.0.0/8",""]}}`))
	f.Add([]byte(`{"count":4,"timeout":30}`))
	f.Add([]byte(`{"timeout":1e400}`))
	f.Add([]byte(`[`))
	f.Fuzz(func(t *testing.T, b []byte) {
		for _, v := range []any{&newSandbox{}, &timeoutRequest{}, &connectRequest{}, &forkRequest{}, &networkConfig{}, &snapshotRequest{}} {
			if err := decodeJSON(b, v); err != nil {
				code, msg := statusOf(err)
				if code != 400 || msg == "" {
					t.Fatalf("decode error %d %q", code, msg)
				}
				continue
			}
			switch r := v.(type) {
			case *newSandbox:
				egressFrom(r.AllowInternetAccess, r.Network)
				checkMetadata("metadata", r.Metadata)
				lifetimeMS("timeout", r.Timeout, 0)
			case *networkConfig:
				egressFrom(nil, r)
			case *forkRequest:
				lifetimeMS("timeout", r.Timeout, 0)
			}
		}
		json.Valid(b)
	})
}

// TestKeysQuota: a tenant's quota is the default with what its keys'
// lines set over it, inline keys' too; a file that disagrees with an
// inline key's quota is refused.
func TestKeysQuota(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "keys")
	os.WriteFile(p, []byte("key-file-0001 alpha sandboxes=2\nkey-file-0002 alpha memory=1024\nkey-file-0003 beta\n"), 0o600)
	def := Quota{Sandboxes: 10, MemoryMiB: 8192, HibernatedMiB: 100, Snapshots: 5}
	k, err := LoadKeys(p, []string{"key-inline-01 gamma snapshots=0"}, def)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		tenant string
		want   Quota
	}{
		{"alpha", Quota{Sandboxes: 2, MemoryMiB: 1024, HibernatedMiB: 100, Snapshots: 5}},
		{"beta", def},
		{"gamma", Quota{Sandboxes: 10, MemoryMiB: 8192, HibernatedMiB: 100}},
		{"nobody", def},
	} {
		if got := k.Quota(tc.tenant); got != tc.want {
			t.Errorf("Quota(%s) = %+v; want %+v", tc.tenant, got, tc.want)
		}
	}
	os.WriteFile(p, []byte("key-file-0004 gamma snapshots=3\n"), 0o600)
	if err := k.Reload(); err == nil || !strings.Contains(err.Error(), "gamma's snapshots quota") {
		t.Errorf("a file quota against an inline one: %v", err)
	}
	if got := k.Quota("alpha"); got.Sandboxes != 2 {
		t.Errorf("a refused reload changed the quotas: %+v", got)
	}
}

// TestPythonSDKKeys: the keys whose format E2B's Python SDK refuses
// before sending them are named by where they are given, never by value;
// E2B-format keys are not.
func TestPythonSDKKeys(t *testing.T) {
	for _, c := range []struct {
		key  string
		want bool
	}{
		{"e2b_0123456789abcdef", true},
		{"e2b_ab", true},
		{"e2b_", false},
		{"e2b_ABCDEF0123", false},
		{"E2B_abcdef0123", false},
		{"e2b_abcdefg123", false},
		{"my-key-0123456789", false},
		{"e2b_abcdef0123\n", false},
		{"xe2b_abcdef0123", false},
	} {
		if got := PythonSDKAccepts(c.key); got != c.want {
			t.Errorf("PythonSDKAccepts(%q) = %v, want %v", c.key, got, c.want)
		}
	}
	p := filepath.Join(t.TempDir(), "keys")
	text := "# keys\ne2b_0123456789abcdef alpha\nmy-key-0123456789 beta\n\ne2b_ABCDEF0123456789 gamma\n"
	if err := os.WriteFile(p, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	k, err := LoadKeys(p, []string{"e2b_fedcba9876543210 delta", "inline-key-0001 delta"}, Quota{})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"--e2b-api-key 2", p + ":3", p + ":5"}
	if got := k.PythonSDKRefuses(); !slices.Equal(got, want) {
		t.Errorf("PythonSDKRefuses = %q, want %q", got, want)
	}
	for _, w := range k.PythonSDKRefuses() {
		if strings.Contains(w, "my-key") || strings.Contains(w, "ABCDEF") {
			t.Errorf("%q names a key", w)
		}
	}
}
