package e2b_test

import (
	"net/http"
	"strings"
	"testing"
)

// TestVolumes: the volume calls as E2B's schema has them, per tenant;
// names checked and unique; a mount path checked by kilnd; the volume
// content API answers that it is not served.
func TestVolumes(t *testing.T) {
	e := newEnv(t, nil)
	var v struct {
		VolumeID, Name, Token string
	}
	r := e.do("POST", "/volumes", keyA, map[string]string{"name": "ds"})
	if r.status != http.StatusCreated {
		t.Fatalf("create: %d %s", r.status, r.body)
	}
	r.json(t, &v)
	if v.VolumeID == "" || v.Name != "ds" || v.Token == "" {
		t.Fatalf("created %s", r.body)
	}
	for _, c := range []struct {
		name, method, path, key string
		body                    any
		status                  int
		msg                     string
	}{
		{"taken name", "POST", "/volumes", keyA, map[string]string{"name": "ds"}, 409, "already exists"},
		{"another tenant's name is free", "POST", "/volumes", keyB, map[string]string{"name": "ds"}, 201, ""},
		{"no name", "POST", "/volumes", keyA, map[string]string{}, 400, "volume name"},
		{"bad name", "POST", "/volumes", keyA, map[string]string{"name": "a b"}, 400, "only letters"},
		{"long name", "POST", "/volumes", keyA, map[string]string{"name": strings.Repeat("x", 64)}, 400, "1 to 63"},
		{"get", "GET", "/volumes/" + v.VolumeID, keyA, nil, 200, ""},
		{"get, another tenant", "GET", "/volumes/" + v.VolumeID, keyB, nil, 404, "not found"},
		{"get, unknown", "GET", "/volumes/vol-nope", keyA, nil, 404, "not found"},
		{"delete, another tenant", "DELETE", "/volumes/" + v.VolumeID, keyB, nil, 404, "not found"},
		{"mount at a relative path", "POST", "/v2/sandboxes", keyA, map[string]any{"templateID": "base", "volumeMounts": []map[string]string{{"name": "ds", "path": "data"}}}, 400, "absolute"},
		{"another tenant's volume", "POST", "/v2/sandboxes", keyB, map[string]any{"templateID": "base", "volumeMounts": []map[string]string{{"name": "nope", "path": "/d"}}}, 404, "not found"},
		{"no key", "GET", "/volumes", "", nil, 401, "X-API-KEY"},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := e.do(c.method, c.path, c.key, c.body)
			if r.status != c.status {
				t.Fatalf("status %d %s; want %d", r.status, r.body, c.status)
			}
			if c.msg != "" && !strings.Contains(r.errBody(t), c.msg) {
				t.Errorf("message %s; want it to say %q", r.body, c.msg)
			}
		})
	}
	var ls []map[string]string
	e.do("GET", "/volumes", keyA, nil).json(t, &ls)
	if len(ls) != 1 || ls[0]["volumeID"] != v.VolumeID || ls[0]["name"] != "ds" {
		t.Errorf("list: %v", ls)
	}
	r = e.do("GET", "/volumecontent/"+v.VolumeID+"/dir?path=/", "", nil)
	if r.status != http.StatusNotImplemented || !strings.Contains(r.errBody(t), "not served") {
		t.Errorf("volume content: %d %s", r.status, r.body)
	}
	if r := e.do("DELETE", "/volumes/"+v.VolumeID, keyA, nil); r.status != http.StatusNoContent {
		t.Errorf("delete: %d %s", r.status, r.body)
	}
	if r := e.do("DELETE", "/volumes/"+v.VolumeID, keyA, nil); r.status != http.StatusNotFound {
		t.Errorf("delete again: %d %s", r.status, r.body)
	}
}
