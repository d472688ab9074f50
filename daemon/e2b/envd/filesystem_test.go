package envd

import (
	"bytes"
	"compress/gzip"
	"crypto/rand"
	"encoding/json"
	"io"
	"mime/multipart"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	filesystempb "github.com/kilnvm/kiln/daemon/e2b/envd/envdpb/filesystem"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

func TestFilesystem(t *testing.T) {
	e := newEnv(t)
	id := e.sandbox()
	for _, cd := range codecs {
		t.Run(cd.name, func(t *testing.T) {
			c := e.fs(id, cd.opts)
			dir := "/data-" + cd.name
			mk, err := c.MakeDir(ctxT(t), connect.NewRequest(&filesystempb.MakeDirRequest{Path: dir + "/a/b"}))
			if err != nil {
				t.Fatal(err)
			}
			if e := mk.Msg.GetEntry(); e.GetType() != filesystempb.FileType_FILE_TYPE_DIRECTORY || e.GetPath() != dir+"/a/b" ||
				e.GetName() != "b" || !strings.HasPrefix(e.GetPermissions(), "d") {
				t.Errorf("make dir: %v", e)
			}
			_, err = c.MakeDir(ctxT(t), connect.NewRequest(&filesystempb.MakeDirRequest{Path: dir + "/a/b"}))
			wantCode(t, err, connect.CodeAlreadyExists)

			e.put(t, id, "", dir+"/a/f.txt", strings.NewReader("hello"), "")
			st, err := c.Stat(ctxT(t), connect.NewRequest(&filesystempb.StatRequest{Path: dir + "/a/f.txt"}))
			if err != nil {
				t.Fatal(err)
			}
			if e := st.Msg.GetEntry(); e.GetType() != filesystempb.FileType_FILE_TYPE_FILE || e.GetSize() != 5 ||
				e.GetPermissions() != "-rw-r--r--" || e.GetMode() != 0o644 || e.GetName() != "f.txt" ||
				e.GetOwner() == "" || time.Since(e.GetModifiedTime().AsTime()) > time.Hour {
				t.Errorf("stat: %v", e)
			}
			_, err = c.Stat(ctxT(t), connect.NewRequest(&filesystempb.StatRequest{Path: dir + "/nope"}))
			wantCode(t, err, connect.CodeNotFound)

			ls, err := c.ListDir(ctxT(t), connect.NewRequest(&filesystempb.ListDirRequest{Path: dir + "/a", Depth: 1}))
			if err != nil {
				t.Fatal(err)
			}
			var names []string
			for _, e := range ls.Msg.GetEntries() {
				names = append(names, e.GetName()+":"+e.GetType().String())
			}
			if got := strings.Join(names, ","); got != "b:FILE_TYPE_DIRECTORY,f.txt:FILE_TYPE_FILE" {
				t.Errorf("list: %s", got)
			}
			_, err = c.ListDir(ctxT(t), connect.NewRequest(&filesystempb.ListDirRequest{Path: dir + "/nope"}))
			wantCode(t, err, connect.CodeNotFound)
			_, err = c.ListDir(ctxT(t), connect.NewRequest(&filesystempb.ListDirRequest{Path: dir, Depth: 1000}))
			wantCode(t, err, connect.CodeInvalidArgument)

			if _, err := c.Remove(ctxT(t), connect.NewRequest(&filesystempb.RemoveRequest{Path: dir + "/a"})); err != nil {
				t.Fatal(err)
			}
			_, err = c.Stat(ctxT(t), connect.NewRequest(&filesystempb.StatRequest{Path: dir + "/a/f.txt"}))
			wantCode(t, err, connect.CodeNotFound)
			_, err = c.Remove(ctxT(t), connect.NewRequest(&filesystempb.RemoveRequest{Path: dir + "/a"}))
			wantCode(t, err, connect.CodeNotFound)

			// Relative paths are the user's home's: root's is /root.
			rel, err := c.MakeDir(ctxT(t), connect.NewRequest(&filesystempb.MakeDirRequest{Path: "rel-" + cd.name}))
			if err != nil {
				t.Fatal(err)
			}
			if rel.Msg.GetEntry().GetPath() != "/root/rel-"+cd.name {
				t.Errorf("relative make dir made %s", rel.Msg.GetEntry().GetPath())
			}
			req := connect.NewRequest(&filesystempb.StatRequest{Path: "x"})
			req.Header().Set("Authorization", "Basic !!")
			_, err = c.Stat(ctxT(t), req)
			wantCode(t, err, connect.CodeUnauthenticated)
		})
	}
}

// TestFilesystemAgent covers the file calls whose kiln.v1 side comes with
// the agent's part of the contract: Move, ListDir's depth, owners, watches.
func TestFilesystemAgent(t *testing.T) {
	e := newEnv(t)
	id := e.sandbox()
	c := e.fs(id, []connect.ClientOption{connect.WithProtoJSON()})
	e.put(t, id, "", "/m/src.txt", strings.NewReader("x"), "")
	e.put(t, id, "", "/m/d/e/deep.txt", strings.NewReader("x"), "")

	t.Run("move", func(t *testing.T) {
		mv, err := c.Move(ctxT(t), connect.NewRequest(&filesystempb.MoveRequest{Source: "/m/src.txt", Destination: "/m/dst.txt"}))
		needs(t, err, "Move")
		if err != nil {
			t.Fatal(err)
		}
		if mv.Msg.GetEntry().GetPath() != "/m/dst.txt" {
			t.Errorf("move: %v", mv.Msg.GetEntry())
		}
		_, err = c.Move(ctxT(t), connect.NewRequest(&filesystempb.MoveRequest{Source: "/m/src.txt", Destination: "/m/x"}))
		wantCode(t, err, connect.CodeNotFound)
	})
	t.Run("depth", func(t *testing.T) {
		ls, err := c.ListDir(ctxT(t), connect.NewRequest(&filesystempb.ListDirRequest{Path: "/m/d", Depth: 3}))
		if err != nil {
			t.Fatal(err)
		}
		var paths []string
		for _, e := range ls.Msg.GetEntries() {
			paths = append(paths, e.GetPath())
		}
		if got := strings.Join(paths, ","); got != "/m/d/e,/m/d/e/deep.txt" {
			t.Errorf("depth 3: %s", got)
		}
	})
	t.Run("owner", func(t *testing.T) {
		fi, err := e.kiln.Stat(ctxT(t), &kilnpb.StatRequest{SandboxId: id, Path: "/m/d"})
		if err != nil {
			t.Fatal(err)
		}
		if fi.GetOwner() == "" {
			t.Fatal("kilnd names no owner")
		}
		st, err := c.Stat(ctxT(t), connect.NewRequest(&filesystempb.StatRequest{Path: "/m/d"}))
		if err != nil {
			t.Fatal(err)
		}
		if st.Msg.GetEntry().GetOwner() != fi.GetOwner() || st.Msg.GetEntry().GetGroup() != fi.GetGroup() {
			t.Errorf("owner %v, want %s:%s", st.Msg.GetEntry(), fi.GetOwner(), fi.GetGroup())
		}
	})
	t.Run("watch", func(t *testing.T) {
		ws, err := c.WatchDir(ctxT(t), connect.NewRequest(&filesystempb.WatchDirRequest{Path: "/m", Recursive: true}))
		if err != nil {
			t.Fatal(err)
		}
		defer ws.Close()
		if !ws.Receive() {
			needs(t, ws.Err(), "WatchDir")
			t.Fatal(ws.Err())
		}
		if ws.Msg().GetStart() == nil {
			t.Fatalf("first watch event %v: want start", ws.Msg())
		}
		e.put(t, id, "", "/m/d/new.txt", strings.NewReader("x"), "")
		for ws.Receive() {
			if fe := ws.Msg().GetFilesystem(); fe != nil && strings.HasSuffix(fe.GetName(), "new.txt") {
				return
			}
		}
		t.Fatalf("no event for new.txt: %v", ws.Err())
	})
	t.Run("polling watcher", func(t *testing.T) {
		cw, err := c.CreateWatcher(ctxT(t), connect.NewRequest(&filesystempb.CreateWatcherRequest{Path: "/m"}))
		needs(t, err, "WatchDir")
		if err != nil {
			t.Fatal(err)
		}
		wid := cw.Msg.GetWatcherId()
		e.put(t, id, "", "/m/polled.txt", strings.NewReader("x"), "")
		deadline := time.Now().Add(20 * time.Second)
		for found := false; !found; {
			evs, err := c.GetWatcherEvents(ctxT(t), connect.NewRequest(&filesystempb.GetWatcherEventsRequest{WatcherId: wid}))
			if err != nil {
				t.Fatal(err)
			}
			for _, ev := range evs.Msg.GetEvents() {
				found = found || ev.GetName() == "polled.txt"
			}
			if time.Now().After(deadline) {
				t.Fatal("no event for polled.txt")
			}
			time.Sleep(20 * time.Millisecond)
		}
		if _, err := c.RemoveWatcher(ctxT(t), connect.NewRequest(&filesystempb.RemoveWatcherRequest{WatcherId: wid})); err != nil {
			t.Fatal(err)
		}
		_, err = c.GetWatcherEvents(ctxT(t), connect.NewRequest(&filesystempb.GetWatcherEventsRequest{WatcherId: wid}))
		wantCode(t, err, connect.CodeNotFound)
	})
}

func TestWatchErrors(t *testing.T) {
	e := newEnv(t)
	id := e.sandbox()
	c := e.fs(id, nil)
	_, err := c.GetWatcherEvents(ctxT(t), connect.NewRequest(&filesystempb.GetWatcherEventsRequest{WatcherId: "w-nope"}))
	wantCode(t, err, connect.CodeNotFound)
	_, err = c.RemoveWatcher(ctxT(t), connect.NewRequest(&filesystempb.RemoveWatcherRequest{WatcherId: "w-nope"}))
	wantCode(t, err, connect.CodeNotFound)
}

// put uploads r to path through /files as content type ct ("" is
// multipart with the path as the part's filename, no path parameter).
func (e *env) put(t *testing.T, id, ct, p string, r io.Reader, encoding string) []uploaded {
	t.Helper()
	resp := e.post(t, id, ct, p, r, encoding)
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("upload %s: %s: %s", p, resp.Status, readAll(t, resp.Body))
	}
	var out []uploaded
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		t.Fatal(err)
	}
	return out
}

func (e *env) post(t *testing.T, id, ct, p string, r io.Reader, encoding string) *http.Response {
	t.Helper()
	u := e.url(id) + "/files"
	body := r
	if ct == "" {
		pr, pw := io.Pipe()
		mw := multipart.NewWriter(pw)
		go func() {
			fw, err := mw.CreateFormFile("file", p)
			if err == nil {
				_, err = io.Copy(fw, r)
			}
			if err == nil {
				err = mw.Close()
			}
			pw.CloseWithError(err)
		}()
		body, ct = pr, mw.FormDataContentType()
	} else {
		u += "?path=" + url.QueryEscape(p)
	}
	req, err := http.NewRequestWithContext(ctxT(t), http.MethodPost, u, body)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", ct)
	if encoding != "" {
		req.Header.Set("Content-Encoding", encoding)
	}
	resp, err := e.srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

func (e *env) get(t *testing.T, id, query string) *http.Response {
	t.Helper()
	req, err := http.NewRequestWithContext(ctxT(t), http.MethodGet, e.url(id)+"/files?"+query, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := e.srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	return resp
}

func TestFiles(t *testing.T) {
	e := newEnv(t)
	id := e.sandbox()
	big := make([]byte, 5<<20)
	rand.Read(big)
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write([]byte("squeezed"))
	zw.Close()

	tests := []struct {
		name, ct, path, encoding string
		body                     []byte
	}{
		{"multipart text", "", "/up/a.txt", "", []byte("hello\n")},
		{"multipart 5 MiB binary", "", "/up/big.bin", "", big},
		{"octet-stream", "application/octet-stream", "/up/o.txt", "", []byte("octets")},
		{"octet-stream 5 MiB binary", "application/octet-stream", "/up/deep/er/big2.bin", "", big},
		{"gzip", "application/octet-stream", "/up/z.txt", "gzip", gz.Bytes()},
		{"empty", "application/octet-stream", "/up/empty", "", nil},
		{"relative to home", "application/octet-stream", "rel.txt", "", []byte("home")},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			out := e.put(t, id, tc.ct, tc.path, bytes.NewReader(tc.body), tc.encoding)
			want := tc.path
			if !strings.HasPrefix(want, "/") {
				want = "/root/" + want
			}
			if len(out) != 1 || out[0].Path != want || out[0].Type != "file" || !strings.HasSuffix(want, "/"+out[0].Name) {
				t.Fatalf("reply %+v, want %s", out, want)
			}
			resp := e.get(t, id, "path="+url.QueryEscape(tc.path))
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("download: %s", resp.Status)
			}
			if ct := resp.Header.Get("Content-Type"); ct != "application/octet-stream" {
				t.Errorf("Content-Type %q", ct)
			}
			if cd := resp.Header.Get("Content-Disposition"); !strings.Contains(cd, out[0].Name) {
				t.Errorf("Content-Disposition %q", cd)
			}
			got, err := io.ReadAll(resp.Body)
			if err != nil {
				t.Fatal(err)
			}
			wantBody := tc.body
			if tc.encoding == "gzip" {
				wantBody = []byte("squeezed")
			}
			if !bytes.Equal(got, wantBody) {
				t.Fatalf("downloaded %d bytes, want the %d uploaded", len(got), len(wantBody))
			}
		})
	}

	t.Run("several files in one multipart body", func(t *testing.T) {
		var b bytes.Buffer
		mw := multipart.NewWriter(&b)
		for _, p := range []string{"/multi/one", "/multi/two"} {
			fw, _ := mw.CreateFormFile("file", p)
			fw.Write([]byte(p))
		}
		mw.WriteField("other", "ignored")
		mw.Close()
		resp := e.post(t, id, mw.FormDataContentType(), "", &b, "")
		defer resp.Body.Close()
		var out []uploaded
		json.NewDecoder(resp.Body).Decode(&out)
		if resp.StatusCode != http.StatusOK || len(out) != 2 || out[1].Path != "/multi/two" {
			t.Fatalf("%s %+v", resp.Status, out)
		}
		if got := readAll(t, e.get(t, id, "path=/multi/two").Body); got != "/multi/two" {
			t.Fatalf("two holds %q", got)
		}
	})

	errs := []struct {
		name, ct, path, encoding string
		body                     string
		code                     int
	}{
		{"octet-stream without a path", "application/octet-stream", "", "", "x", http.StatusBadRequest},
		{"bad gzip", "application/octet-stream", "/up/bad", "gzip", "not gzip", http.StatusBadRequest},
		{"truncated gzip", "application/octet-stream", "/up/bad", "gzip", gz.String()[:gz.Len()/2], http.StatusBadRequest},
		{"unknown encoding", "application/octet-stream", "/up/bad", "br", "x", http.StatusUnsupportedMediaType},
		{"multipart without a boundary", "multipart/form-data", "/up/bad", "", "x", http.StatusBadRequest},
		{"truncated multipart", "multipart/form-data; boundary=XX", "", "", "--XX\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/up/bad\"\r\n\r\nabc", http.StatusBadRequest},
		{"onto a directory", "application/octet-stream", "/up", "", "x", 0},
	}
	for _, tc := range errs {
		t.Run(tc.name, func(t *testing.T) {
			u := e.url(id) + "/files"
			if tc.path != "" {
				u += "?path=" + url.QueryEscape(tc.path)
			}
			req, _ := http.NewRequestWithContext(ctxT(t), http.MethodPost, u, strings.NewReader(tc.body))
			req.Header.Set("Content-Type", tc.ct)
			if tc.encoding != "" {
				req.Header.Set("Content-Encoding", tc.encoding)
			}
			resp, err := e.srv.Client().Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			var body struct {
				Code    int    `json:"code"`
				Message string `json:"message"`
			}
			json.NewDecoder(resp.Body).Decode(&body)
			if resp.StatusCode < 400 || (tc.code != 0 && resp.StatusCode != tc.code) || body.Code != resp.StatusCode || body.Message == "" {
				t.Fatalf("%s %+v, want %d and a JSON error", resp.Status, body, tc.code)
			}
		})
	}
	if _, err := e.kiln.Stat(ctxT(t), &kilnpb.StatRequest{SandboxId: id, Path: "/up/bad"}); err == nil {
		t.Error("a failed upload left its file")
	}

	t.Run("missing file", func(t *testing.T) {
		resp := e.get(t, id, "path=/nope")
		var body struct {
			Code    int    `json:"code"`
			Message string `json:"message"`
		}
		json.NewDecoder(resp.Body).Decode(&body)
		if resp.StatusCode != http.StatusNotFound || body.Code != 404 || !strings.Contains(body.Message, "/nope") {
			t.Fatalf("%s %+v", resp.Status, body)
		}
	})
	t.Run("no path", func(t *testing.T) {
		if resp := e.get(t, id, ""); resp.StatusCode != http.StatusBadRequest {
			t.Fatal(resp.Status)
		}
	})
	t.Run("upload too large", func(t *testing.T) {
		small := newEnv(t, WithLimits(Limits{MaxUpload: 1000}))
		sid := small.sandbox()
		resp := small.post(t, sid, "application/octet-stream", "/big", bytes.NewReader(big[:2000]), "")
		resp.Body.Close()
		if resp.StatusCode != http.StatusRequestEntityTooLarge {
			t.Fatal(resp.Status)
		}
		var zb bytes.Buffer
		zw := gzip.NewWriter(&zb)
		zw.Write(make([]byte, 1<<20))
		zw.Close()
		resp = small.post(t, sid, "application/octet-stream", "/bomb", &zb, "gzip")
		resp.Body.Close()
		if resp.StatusCode != http.StatusRequestEntityTooLarge {
			t.Fatalf("a gzip bomb: %s", resp.Status)
		}
	})
}

func TestHealthAndRoutes(t *testing.T) {
	e := newEnv(t)
	id := e.sandbox()
	for _, tc := range []struct {
		method, path string
		code         int
	}{
		{http.MethodGet, "/health", http.StatusNoContent},
		{http.MethodGet, "/nope", http.StatusNotFound},
		{http.MethodDelete, "/files", http.StatusMethodNotAllowed},
	} {
		req, _ := http.NewRequestWithContext(ctxT(t), tc.method, e.url(id)+tc.path, nil)
		resp, err := e.srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != tc.code {
			t.Errorf("%s %s: %s, want %d", tc.method, tc.path, resp.Status, tc.code)
		}
	}
}
