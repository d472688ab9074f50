package imagetest

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"testing"
	"time"

	"github.com/containerd/stargz-snapshotter/estargz"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/remote"
)

// get fetches a blob range from the registry.
func get(t *testing.T, r *Registry, repo string, d v1.Hash, rng string, timeout time.Duration) (int, []byte, error) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, fmt.Sprintf("%s/v2/%s/blobs/%s", r.URL, repo, d), nil)
	if rng != "" {
		req.Header.Set("Range", rng)
	}
	c := &http.Client{Timeout: timeout}
	resp, err := c.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, b, err
}

func TestRegistryFaults(t *testing.T) {
	r := NewRegistry(t)
	l, err := Estargz(Tar(BaseFiles()...))
	if err != nil {
		t.Fatal(err)
	}
	img, err := Image(l)
	if err != nil {
		t.Fatal(err)
	}
	r.Push(t, "x:v1", img)
	d, _ := l.Digest()
	blob := l.Blob
	for _, tc := range []struct {
		name   string
		fault  func() func()
		rng    string
		status int
		want   []byte // nil: the body is not checked
		fails  bool   // the client gives up (a stall)
	}{
		{"whole", nil, "", 200, blob, false},
		{"range", nil, "bytes=10-19", 206, blob[10:20], false},
		{"flip", func() func() { return r.FlipByte(d, 15) }, "bytes=10-19", 206,
			append(append(bytes.Clone(blob[10:15]), blob[15]^0xff), blob[16:20]...), false},
		{"flip outside the range", func() func() { return r.FlipByte(d, 5) }, "bytes=10-19", 206, blob[10:20], false},
		{"fail", func() func() { return r.Fail(d, 503) }, "", 503, nil, false},
		{"stall", func() func() { return r.Stall(d, 12) }, "bytes=10-19", 0, nil, true},
		{"stall past the range", func() func() { return r.Stall(d, 50) }, "bytes=10-19", 206, blob[10:20], false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.fault != nil {
				undo := tc.fault()
				defer undo()
			}
			r.Reset()
			status, body, err := get(t, r, "x", d, tc.rng, 500*time.Millisecond)
			if tc.fails {
				if err == nil {
					t.Fatalf("a stalled GET finished: %d %q", status, body)
				}
				if got := r.BlobStats(d).Bytes; got != 2 {
					t.Errorf("stalled after %d bytes, want 2", got)
				}
				return
			}
			if err != nil || status != tc.status || (tc.want != nil && !bytes.Equal(body, tc.want)) {
				t.Fatalf("got %d %q %v; want %d %q", status, body, err, tc.status, tc.want)
			}
			if st := r.BlobStats(d); st.Requests != 1 || (tc.want != nil && st.Bytes != int64(len(tc.want))) {
				t.Errorf("blob stats %+v", st)
			}
		})
	}
}

// Builds are deterministic, and a served layout keeps its annotations.
func TestBuildAndServeLayout(t *testing.T) {
	a, _, err := RandomImage(1, 1)
	if err != nil {
		t.Fatal(err)
	}
	b, _, err := RandomImage(1, 1)
	if err != nil {
		t.Fatal(err)
	}
	da, _ := a.Digest()
	db, _ := b.Digest()
	if da != db {
		t.Fatalf("two builds: %s and %s", da, db)
	}
	dir := filepath.Join(t.TempDir(), "layout")
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.AppendImage(a, layout.WithAnnotations(map[string]string{"org.opencontainers.image.ref.name": "small"})); err != nil {
		t.Fatal(err)
	}
	r, refs := ServeLayout(t, dir, "kiln/test")
	if refs["small"] != r.Host+"/kiln/test/small:latest" {
		t.Fatalf("refs %v", refs)
	}
	nr, _ := name.ParseReference(refs["small"])
	got, err := remote.Image(nr)
	if err != nil {
		t.Fatal(err)
	}
	if dg, _ := got.Digest(); dg != da {
		t.Errorf("served %s, built %s", dg, da)
	}
	m, _ := got.Manifest()
	for i, l := range m.Layers {
		if l.Annotations[estargz.TOCJSONDigestAnnotation] == "" {
			t.Errorf("layer %d lost its TOC annotation", i)
		}
	}
}
