package image

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/opencontainers/go-digest"
)

// testRegistry is an in-memory registry on a loopback httptest server that
// counts blob GETs by digest.
type testRegistry struct {
	srv  *httptest.Server
	host string
	mu   sync.Mutex
	gets map[string]int
}

func newRegistry(t *testing.T) *testRegistry {
	t.Helper()
	r := &testRegistry{gets: map[string]int{}}
	h := registry.New(registry.Logger(log.New(io.Discard, "", 0)))
	r.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.Method == http.MethodGet && strings.Contains(req.URL.Path, "/blobs/") {
			r.mu.Lock()
			r.gets[req.URL.Path[strings.LastIndex(req.URL.Path, "/")+1:]]++
			r.mu.Unlock()
		}
		h.ServeHTTP(w, req)
	}))
	t.Cleanup(r.srv.Close)
	r.host = strings.TrimPrefix(r.srv.URL, "http://")
	return r
}

func (r *testRegistry) blobGets(d v1.Hash) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.gets[d.String()]
}

func (r *testRegistry) push(t *testing.T, ref string, img v1.Image) string {
	t.Helper()
	full := r.host + "/" + ref
	if err := remote.Write(mustRef(t, full), img); err != nil {
		t.Fatal(err)
	}
	return full
}

func openImages(t *testing.T) *Images {
	t.Helper()
	im, err := Open(t.TempDir(), Options{GCGrace: -1})
	if err != nil {
		t.Fatal(err)
	}
	return im
}

// layerOf is a gzip layer of one file.
func layerOf(t *testing.T, seed int64, size int64) v1.Layer {
	t.Helper()
	l, err := random.Layer(size, types.DockerLayer)
	if err != nil {
		t.Fatal(err)
	}
	_ = seed
	return l
}

// imageWith builds an image from layers, with a config the tests check.
func imageWith(t *testing.T, layers ...v1.Layer) v1.Image {
	t.Helper()
	img, err := mutate.AppendLayers(empty.Image, layers...)
	if err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", "amd64"
	cf.Config.Env = []string{"PATH=/usr/bin", "K=V"}
	cf.Config.WorkingDir = "/work"
	cf.Config.User = "1000:1000"
	cf.Config.Entrypoint = []string{"/bin/sh", "-c"}
	cf.Config.Cmd = []string{"echo hi"}
	img, err = mutate.ConfigFile(img, cf)
	if err != nil {
		t.Fatal(err)
	}
	return img
}

func digestOf(t *testing.T, x interface{ Digest() (v1.Hash, error) }) v1.Hash {
	t.Helper()
	h, err := x.Digest()
	if err != nil {
		t.Fatal(err)
	}
	return h
}

func TestPullSharedBaseAndInspect(t *testing.T) {
	reg := newRegistry(t)
	base := layerOf(t, 1, 4096)
	a := imageWith(t, base, layerOf(t, 2, 1000))
	b := imageWith(t, base, layerOf(t, 3, 2000))
	refA := reg.push(t, "app-a:v1", a)
	refB := reg.push(t, "app-b:v1", b)

	im := openImages(t)
	ctx := context.Background()
	var out bytes.Buffer
	p := NewProgress(&out)
	recA, err := im.Pull(ctx, refA, PullOptions{Progress: p})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := im.Pull(ctx, refB, PullOptions{Progress: p}); err != nil {
		t.Fatal(err)
	}
	bd := digestOf(t, base)
	if n := reg.blobGets(bd); n != 1 {
		t.Errorf("base layer fetched %d times, want 1", n)
	}
	if !strings.Contains(out.String(), "already stored") || !strings.Contains(out.String(), "pulling "+bd.Hex[:12]) {
		t.Errorf("progress output:\n%s", out.String())
	}
	if recA.Manifest != digest.Digest(digestOf(t, a).String()) || len(recA.Layers) != 2 {
		t.Errorf("record %+v", recA)
	}
	// Plain layers are indexed: the blobs are not kept, their TOCs and
	// chunks are, the base layer's once.
	if im.Store().Has(digest.Digest(bd.String())) {
		t.Error("the compressed base layer was kept")
	}
	if recA.Layers[0].Chunks != ChunksStore || recA.Layers[0].TOC == "" || !im.Store().Has(recA.Layers[0].TOC) {
		t.Errorf("base layer record %+v", recA.Layers[0])
	}
	ents, _ := os.ReadDir(filepath.Join(im.Dir(), "store", "blobs", "sha256"))
	// 2 manifests + 2 configs + 3 TOCs + 3 chunks (one file per layer).
	if len(ents) != 10 {
		t.Errorf("%d blobs stored, want 10", len(ents))
	}

	d, err := im.Inspect(refA)
	if err != nil {
		t.Fatal(err)
	}
	if d.Config.WorkingDir != "/work" || d.Config.User != "1000:1000" || d.Config.Cmd[0] != "echo hi" ||
		d.Config.Entrypoint[0] != "/bin/sh" || len(d.Config.Env) != 2 || d.Platform != "linux/amd64" {
		t.Errorf("inspect: %+v", d)
	}
	list, err := im.List()
	if err != nil || len(list) != 2 {
		t.Fatalf("list: %v %v", list, err)
	}

	// Pulling again fetches no layers.
	before := reg.blobGets(bd)
	if _, err := im.Pull(ctx, refA, PullOptions{}); err != nil {
		t.Fatal(err)
	}
	if reg.blobGets(bd) != before {
		t.Error("a stored layer was fetched again")
	}

	// rm A, GC: A's own blobs go, the shared base stays, B still inspects.
	if _, err := im.Remove(refA); err != nil {
		t.Fatal(err)
	}
	res, err := im.GC(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Removed) != 4 { // A's manifest, config, top layer's TOC and chunk
		t.Errorf("GC removed %v, want 4 blobs", res.Removed)
	}
	if !im.Store().Has(recA.Layers[0].TOC) {
		t.Error("GC removed the shared base layer's TOC")
	}
	recB, _ := im.Get(refB)
	if ls, err := im.Layers(ctx, recB); err != nil || len(ls) != 2 {
		t.Errorf("layers of B after GC: %v", err)
	} else if _, err := ls[0].Chunks.ReadChunk(ctx, ls[0].TOC.Entries[len(ls[0].TOC.Entries)-1], make([]byte, 10), 0); err != nil {
		t.Errorf("reading B's base layer after GC: %v", err)
	}
	if _, err := im.Inspect(refB); err != nil {
		t.Error(err)
	}
	if _, err := im.Inspect(refA); !errors.Is(err, ErrNotFound) {
		t.Errorf("inspect after rm: %v", err)
	}
}

func TestPullIndexPicksLinuxAmd64(t *testing.T) {
	reg := newRegistry(t)
	arm := imageWith(t, layerOf(t, 1, 100))
	amd := imageWith(t, layerOf(t, 2, 100))
	idx := mutate.AppendManifests(empty.Index,
		mutate.IndexAddendum{Add: arm, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: "arm64"}}},
		mutate.IndexAddendum{Add: amd, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: "amd64"}}},
	)
	full := reg.host + "/multi:latest"
	if err := remote.WriteIndex(mustRef(t, full), idx); err != nil {
		t.Fatal(err)
	}
	im := openImages(t)
	rec, err := im.Pull(context.Background(), full, PullOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if rec.Manifest != digest.Digest(digestOf(t, amd).String()) {
		t.Errorf("picked %s, want the amd64 image %s", rec.Manifest, digestOf(t, amd))
	}
	if rec.Index != digest.Digest(digestOf(t, idx).String()) || !im.Store().Has(rec.Index) {
		t.Errorf("index %s not recorded or stored", rec.Index)
	}
	// By digest, as users name them.
	byDigest := reg.host + "/multi@" + digestOf(t, idx).String()
	if _, err := im.Pull(context.Background(), byDigest, PullOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := im.Get(byDigest); err != nil {
		t.Error(err)
	}
}

func TestPullErrors(t *testing.T) {
	reg := newRegistry(t)
	reg.push(t, "there:v1", imageWith(t, layerOf(t, 1, 10)))
	im := openImages(t)
	for _, tc := range []struct {
		ref  string
		is   error
		want string
	}{
		{"UPPER/Case:bad", ErrInvalid, "image reference"},
		{"", ErrInvalid, "empty"},
		{reg.host + "/absent:v1", ErrNotFound, "absent"},
		{reg.host + "/there:v2", ErrNotFound, "there:v2"},
	} {
		_, err := im.Pull(context.Background(), tc.ref, PullOptions{})
		if !errors.Is(err, tc.is) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Pull(%q) = %v, want %v naming %q", tc.ref, err, tc.is, tc.want)
		}
	}
}

func TestConcurrentPulls(t *testing.T) {
	reg := newRegistry(t)
	ref := reg.push(t, "c:v1", imageWith(t, layerOf(t, 1, 50000), layerOf(t, 2, 50000)))
	im := openImages(t)
	im2, err := Open(im.Dir(), Options{}) // another handle: the lock is the file's
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var fails atomic.Int32
	for i, h := range []*Images{im, im, im2, im2} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := h.Pull(context.Background(), ref, PullOptions{}); err != nil {
				t.Errorf("pull %d: %v", i, err)
				fails.Add(1)
			}
		}()
	}
	wg.Wait()
	list, err := im.List()
	if err != nil || len(list) != 1 {
		t.Fatalf("list: %v %v", list, err)
	}
	must, _, err := im.needs(&list[0])
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range must {
		if err := im.Store().Verify(d); err != nil {
			t.Error(err)
		}
	}
}

func TestImport(t *testing.T) {
	base := layerOf(t, 1, 3000)
	img := imageWith(t, base, layerOf(t, 2, 500))
	dir := t.TempDir()

	// docker save tarball
	dockerTar := filepath.Join(dir, "save.tar")
	if err := tarball.WriteToFile(dockerTar, mustRef(t, "example.com/saved:v1"), img); err != nil {
		t.Fatal(err)
	}
	// OCI layout directory, with a multi-platform index
	other := imageWith(t, layerOf(t, 3, 100))
	idx := mutate.AppendManifests(empty.Index,
		mutate.IndexAddendum{Add: other, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: "arm64"}}},
		mutate.IndexAddendum{Add: img, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: "amd64"}}},
	)
	layoutDir := filepath.Join(dir, "layout")
	if _, err := layout.Write(layoutDir, idx); err != nil {
		t.Fatal(err)
	}
	// The same layout as a tar.
	layoutTar := filepath.Join(dir, "layout.tar")
	tarDir(t, layoutDir, layoutTar)

	im := openImages(t)
	for _, tc := range []struct{ path, name, wantName string }{
		{dockerTar, "", "example.com/saved:v1"},
		{layoutDir, "layout:dir", "layout:dir"},
		{layoutTar, "layout:tar", "layout:tar"},
	} {
		rec, err := im.Import(context.Background(), tc.path, ImportOptions{Name: tc.name})
		if err != nil {
			t.Fatalf("import %s: %v", tc.path, err)
		}
		if rec.Name != tc.wantName || len(rec.Layers) != 2 {
			t.Errorf("import %s: %+v", tc.path, rec)
		}
		// Imported layers are indexed: readable with no registry.
		if ls, err := im.Layers(context.Background(), rec); err != nil {
			t.Errorf("import %s: layers: %v", tc.path, err)
		} else {
			for _, l := range ls {
				if l.Layer.Chunks != ChunksStore {
					t.Errorf("import %s: layer %+v", tc.path, l.Layer)
				}
				for _, c := range l.Chunks.ix.chunks {
					if _, err := l.Chunks.ReadChunk(context.Background(), c.ent, make([]byte, 1), 0); err != nil {
						t.Errorf("import %s: %v", tc.path, err)
					}
				}
			}
		}
		if tc.path != dockerTar && rec.Manifest != digest.Digest(digestOf(t, img).String()) {
			t.Errorf("import %s picked %s, want amd64 %s", tc.path, rec.Manifest, digestOf(t, img))
		}
		d, err := im.Inspect(tc.wantName)
		if err != nil || d.Config.WorkingDir != "/work" {
			t.Errorf("inspect %s: %+v %v", tc.wantName, d, err)
		}
	}
}

func TestImportMalformed(t *testing.T) {
	dir := t.TempDir()
	img := imageWith(t, layerOf(t, 1, 300))
	write := func(n string, data []byte) string {
		p := filepath.Join(dir, n)
		if err := os.WriteFile(p, data, 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	// A layout whose index.json names a manifest by the wrong digest.
	badManifest := filepath.Join(dir, "badmanifest")
	if _, err := layout.Write(badManifest, mutate.AppendManifests(empty.Index, mutate.IndexAddendum{Add: img})); err != nil {
		t.Fatal(err)
	}
	md := digestOf(t, img)
	raw, _ := img.RawManifest()
	os.WriteFile(filepath.Join(badManifest, "blobs", "sha256", md.Hex), append(raw, ' '), 0o644)
	// A layout with a corrupted layer.
	badLayer := filepath.Join(dir, "badlayer")
	if _, err := layout.Write(badLayer, mutate.AppendManifests(empty.Index, mutate.IndexAddendum{Add: img})); err != nil {
		t.Fatal(err)
	}
	ls, _ := img.Layers()
	ld := digestOf(t, ls[0])
	os.WriteFile(filepath.Join(badLayer, "blobs", "sha256", ld.Hex), []byte("not the layer"), 0o644)
	// A docker save tarball whose manifest.json is not JSON.
	badJSON := filepath.Join(dir, "badjson.tar")
	tarFiles(t, badJSON, map[string]string{"manifest.json": "{not json"})
	noLayout := filepath.Join(dir, "empty")
	os.Mkdir(noLayout, 0o755)

	for _, tc := range []struct{ path, want string }{
		{write("garbage.tar", []byte("this is not a tar archive at all, just text.............")), "not a tar archive"},
		{badJSON, "manifest.json"},
		{noLayout, "no oci-layout"},
		{badManifest, "manifest " + md.String()},
		{badLayer, "layer " + ld.String()},
	} {
		im := openImages(t)
		_, err := im.Import(context.Background(), tc.path, ImportOptions{Name: "x:y"})
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("import %s: %v, want ErrInvalid naming %q", filepath.Base(tc.path), err, tc.want)
		}
		if list, _ := im.List(); len(list) != 0 {
			t.Errorf("import %s added %v", filepath.Base(tc.path), list)
		}
	}
}

func TestUnknownName(t *testing.T) {
	im := openImages(t)
	for _, f := range []func(string) error{
		func(n string) error { _, err := im.Inspect(n); return err },
		func(n string) error { _, err := im.Remove(n); return err },
	} {
		err := f("debian:bookworm")
		if !errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), `"debian:bookworm"`) {
			t.Errorf("got %v", err)
		}
	}
}

func TestNormalize(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"debian:bookworm", "index.docker.io/library/debian:bookworm"},
		{"debian", "index.docker.io/library/debian:latest"},
		{"docker.io/library/debian:bookworm", "index.docker.io/library/debian:bookworm"},
		{"localhost:5000/task-123@sha256:" + strings.Repeat("a", 64), "localhost:5000/task-123@sha256:" + strings.Repeat("a", 64)},
		{"sha256:" + strings.Repeat("b", 64), "sha256:" + strings.Repeat("b", 64)},
		{"Bad:Name", ""},
	} {
		got, err := Normalize(tc.in)
		if (err != nil) != (tc.want == "") || got != tc.want {
			t.Errorf("Normalize(%q) = %q, %v; want %q", tc.in, got, err, tc.want)
		}
	}
	for h, want := range map[string]bool{
		"localhost": true, "localhost:5000": true, "127.0.0.1:80": true, "127.9.9.9": true,
		"[::1]:5000": true, "10.0.0.1:5000": false, "example.com": false, "localhost.example.com": false,
	} {
		if isLoopback(h) != want {
			t.Errorf("isLoopback(%q) = %v", h, !want)
		}
	}
}

func TestGuardRefusesPlainHTTP(t *testing.T) {
	// The base transport must never be reached: no packet leaves for an
	// address that is not loopback.
	reached := false
	g := &guard{base: roundTripFunc(func(*http.Request) (*http.Response, error) {
		reached = true
		return nil, errors.New("the guard let a plain HTTP request through")
	})}
	req, _ := http.NewRequest("GET", "http://10.1.2.3:5000/v2/", nil)
	if _, err := g.RoundTrip(req); err == nil || !strings.Contains(err.Error(), "--insecure") || reached {
		t.Errorf("got %v (base transport reached: %v)", err, reached)
	}
}

func TestIndexBad(t *testing.T) {
	im := openImages(t)
	os.WriteFile(filepath.Join(im.Dir(), "index.json"), []byte(`{"version":2,"images":[{"name":"a","ref":"a","manifest":"sha256:../../x"}]}`), 0o644)
	if _, err := im.List(); err == nil || !strings.Contains(err.Error(), "index.json") {
		t.Errorf("got %v", err)
	}
}

func FuzzParseIndex(f *testing.F) {
	d := "sha256:" + strings.Repeat("a", 64)
	f.Add([]byte(fmt.Sprintf(`{"version":1,"images":[{"name":"debian","ref":"index.docker.io/library/debian:latest","manifest":%q,"config":%q,"layers":[{"digest":%q,"size":3}],"size":9}]}`, d, d, d)))
	f.Add([]byte(`{"version":1,"images":[]}`))
	f.Add([]byte(`{}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		imgs, err := parseIndex(data)
		if err != nil {
			return
		}
		for _, img := range imgs {
			for _, b := range img.blobs() {
				if strings.Contains(string(b), "/") {
					t.Fatalf("digest %q accepted", b)
				}
			}
			if r, err := Normalize(img.Ref); err != nil || r != img.Ref {
				t.Fatalf("ref %q accepted: %v", img.Ref, err)
			}
		}
	})
}

func FuzzNormalize(f *testing.F) {
	for _, s := range []string{"debian:bookworm", "localhost:5000/a@sha256:" + strings.Repeat("0", 64), "[::1]:5000/x", "a/b/c:d"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		n, err := Normalize(s)
		if err != nil {
			return
		}
		// Canonical forms are fixed points.
		n2, err := Normalize(n)
		if err != nil || n2 != n {
			t.Fatalf("Normalize(%q) = %q, then %q, %v", s, n, n2, err)
		}
	})
}

func mustRef(t *testing.T, s string) name.Reference {
	t.Helper()
	r, err := name.ParseReference(s)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }
