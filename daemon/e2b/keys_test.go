package e2b

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
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
		{"three fields", "# c\nkey-00000001 alpha x\n", 0, 2, "3 fields"},
		{"duplicate", "key-00000001 alpha\nkey-00000002 beta\nkey-00000001 gamma\n", 0, 3, "twice"},
		{"short key", "short alpha\n", 0, 1, "5 bytes"},
		{"bad tenant", "key-00000001 al/pha\n", 0, 1, "tenant"},
		{"control byte", "key-0000\x010001 alpha\n", 0, 1, "printable"},
	}
	for _, tc := range tests {
		m, err := ParseKeys("keys.txt", []byte(tc.text))
		if tc.line == 0 {
			if err != nil || len(m) != tc.n {
				t.Errorf("%s: %v, %d keys; want %d", tc.name, err, len(m), tc.n)
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
	if _, err := LoadKeys(p, nil); err == nil || !strings.Contains(err.Error(), "every user") {
		t.Errorf("a world-readable file: %v", err)
	}
	os.Chmod(p, 0o640)
	if _, err := LoadKeys(p, []string{"key-file-0001 beta"}); err == nil || !strings.Contains(err.Error(), "also given") {
		t.Errorf("a key in the file and inline: %v", err)
	}
	if _, err := LoadKeys(p, []string{"key-inline-01"}); err == nil || !strings.Contains(err.Error(), "--e2b-api-key:1") {
		t.Errorf("a bad inline key: %v", err)
	}
	if _, err := LoadKeys(filepath.Join(dir, "none"), nil); err == nil {
		t.Error("a missing file loads")
	}
	k, err := LoadKeys(p, []string{"key-inline-01 gamma"})
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
	if a.token("sb-1") != b.token("sb-1") || a.token("sb-1") == a.token("sb-2") {
		t.Error("tokens are not per sandbox and stable across loads")
	}
	if !a.check("sb-1", b.token("sb-1")) || a.check("sb-1", a.token("sb-2")) || a.check("sb-1", "") || a.check("sb-1", a.token("sb-1")+"x") {
		t.Error("check accepts what it should not or refuses the token")
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
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := ParseKeys("f", b)
		if err != nil {
			var ke *KeysError
			if !errors.As(err, &ke) || ke.Line < 1 {
				t.Fatalf("error without a line: %v", err)
			}
			return
		}
		for _, tenant := range m {
			if checkTenant(tenant) != nil {
				t.Fatalf("bad tenant %q accepted", tenant)
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
