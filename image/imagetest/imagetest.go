// Package imagetest is test support for code that pulls images: an
// in-process registry on 127.0.0.1 that counts what it serves and can be
// made to misbehave, and builders of small images with estargz or plain
// gzip layers. Other packages' tests (KVM tests and benchmarks among them)
// use it; nothing in it is for production.
package imagetest

import (
	"bytes"
	"compress/gzip"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/kilnvm/kiln/image/layoutblobs"
)

// Stats is what the registry served.
type Stats struct {
	Requests int64 // requests of any kind
	Bytes    int64 // response body bytes
}

// Registry is an in-memory registry (go-containerregistry's pkg/registry
// with its in-memory blob handler) behind a handler that counts requests
// and bytes, in total and per blob, and injects faults into blob GETs.
type Registry struct {
	// Host is "127.0.0.1:port": references are Host + "/repo:tag".
	Host string
	URL  string // "http://" + Host

	srv *httptest.Server

	mu     sync.Mutex
	total  Stats
	blobs  map[string]*Stats // by digest, GETs of /v2/<repo>/blobs/<digest>
	faults map[string]*fault
}

// fault is what GETs of one blob suffer.
type fault struct {
	flip    int64 // blob offset of a byte to invert; -1: none
	stallAt int64 // body offset (in the blob) to stop at; -1: none
	release chan struct{}
	status  int // answer with this status instead; 0: none
}

// NewRegistry starts a registry; it stops when the test ends.
func NewRegistry(t testing.TB) *Registry {
	t.Helper()
	return newRegistry(t, registry.NewInMemoryBlobHandler())
}

// newRegistry starts a registry whose blobs bh holds.
func newRegistry(t testing.TB, bh registry.BlobHandler) *Registry {
	t.Helper()
	r := &Registry{blobs: map[string]*Stats{}, faults: map[string]*fault{}}
	h := registry.New(
		registry.Logger(log.New(io.Discard, "", 0)), // nil panics
		registry.WithBlobHandler(bh),
	)
	r.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		r.serve(h, w, req)
	}))
	t.Cleanup(r.Close)
	r.URL = r.srv.URL
	r.Host = strings.TrimPrefix(r.srv.URL, "http://")
	return r
}

// blobDigest is the digest a request names, for a blob GET.
func blobDigest(req *http.Request) (string, bool) {
	if req.Method != http.MethodGet {
		return "", false
	}
	i := strings.LastIndex(req.URL.Path, "/blobs/")
	if i < 0 {
		return "", false
	}
	d := req.URL.Path[i+len("/blobs/"):]
	return d, strings.HasPrefix(d, "sha256:")
}

func (r *Registry) serve(h http.Handler, w http.ResponseWriter, req *http.Request) {
	d, isBlob := blobDigest(req)
	r.mu.Lock()
	r.total.Requests++
	var st *Stats
	f := fault{flip: -1, stallAt: -1}
	if isBlob {
		st = r.blobs[d]
		if st == nil {
			st = &Stats{}
			r.blobs[d] = st
		}
		st.Requests++
		if ff := r.faults[d]; ff != nil {
			f = *ff
		}
	}
	r.mu.Unlock()
	if isBlob && f.status != 0 {
		http.Error(w, "injected failure", f.status)
		return
	}
	cw := &countWriter{ResponseWriter: w, r: r, blob: st, pos: rangeStart(req), flip: -1, stallAt: -1}
	if isBlob {
		cw.flip, cw.stallAt, cw.release, cw.done = f.flip, f.stallAt, f.release, req.Context().Done()
	}
	h.ServeHTTP(cw, req)
}

// rangeStart is the first blob byte a request asks for.
func rangeStart(req *http.Request) int64 {
	s, ok := strings.CutPrefix(req.Header.Get("Range"), "bytes=")
	if !ok {
		return 0
	}
	a, _, _ := strings.Cut(s, "-")
	n, err := strconv.ParseInt(a, 10, 64)
	if err != nil {
		return 0
	}
	return n
}

// countWriter counts a response's body bytes and applies a blob's faults;
// pos is the blob offset of the next byte written.
type countWriter struct {
	http.ResponseWriter
	r       *Registry
	blob    *Stats
	pos     int64
	flip    int64
	stallAt int64
	release chan struct{}
	done    <-chan struct{}
	stalled bool
}

func (c *countWriter) Write(p []byte) (int, error) {
	if c.flip >= c.pos && c.flip < c.pos+int64(len(p)) {
		p = bytes.Clone(p)
		p[c.flip-c.pos] ^= 0xff
	}
	if !c.stalled && c.stallAt >= 0 && c.stallAt < c.pos+int64(len(p)) {
		k := max(c.stallAt-c.pos, 0)
		n, err := c.write(p[:k])
		if err != nil {
			return n, err
		}
		if f, ok := c.ResponseWriter.(http.Flusher); ok {
			f.Flush()
		}
		c.stalled = true
		select {
		case <-c.release:
		case <-c.done:
			return n, fmt.Errorf("imagetest: client gone while stalled")
		}
		m, err := c.write(p[k:])
		return n + m, err
	}
	return c.write(p)
}

func (c *countWriter) write(p []byte) (int, error) {
	n, err := c.ResponseWriter.Write(p)
	c.pos += int64(n)
	c.r.mu.Lock()
	c.r.total.Bytes += int64(n)
	if c.blob != nil {
		c.blob.Bytes += int64(n)
	}
	c.r.mu.Unlock()
	return n, err
}

func (c *countWriter) Flush() {
	if f, ok := c.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

// Stats is what the registry served so far, every request counted.
func (r *Registry) Stats() Stats {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.total
}

// BlobStats is what GETs of blob d (a "sha256:..." digest) were served.
func (r *Registry) BlobStats(d fmt.Stringer) Stats {
	r.mu.Lock()
	defer r.mu.Unlock()
	if st := r.blobs[d.String()]; st != nil {
		return *st
	}
	return Stats{}
}

// Reset zeroes every counter.
func (r *Registry) Reset() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.total = Stats{}
	r.blobs = map[string]*Stats{}
}

func (r *Registry) faultOf(d string) *fault {
	f := r.faults[d]
	if f == nil {
		f = &fault{flip: -1, stallAt: -1}
		r.faults[d] = f
	}
	return f
}

// FlipByte makes GETs of blob d serve the byte at blob offset off
// inverted, until undo is called.
func (r *Registry) FlipByte(d fmt.Stringer, off int64) (undo func()) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.faultOf(d.String()).flip = off
	return func() {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.faultOf(d.String()).flip = -1
	}
}

// Stall makes GETs of blob d stop answering once they reach blob offset
// at (mid-body, headers sent), until release is called or the client goes
// away. Requests that do not reach at are served whole.
func (r *Registry) Stall(d fmt.Stringer, at int64) (release func()) {
	r.mu.Lock()
	defer r.mu.Unlock()
	f := r.faultOf(d.String())
	f.stallAt, f.release = at, make(chan struct{})
	ch := f.release
	var once sync.Once
	return func() {
		once.Do(func() {
			r.mu.Lock()
			defer r.mu.Unlock()
			close(ch)
			if f := r.faults[d.String()]; f != nil && f.release == ch {
				f.stallAt, f.release = -1, nil
			}
		})
	}
}

// Fail makes GETs of blob d answer status (a 500, say), until undo.
func (r *Registry) Fail(d fmt.Stringer, status int) (undo func()) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.faultOf(d.String()).status = status
	return func() {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.faultOf(d.String()).status = 0
	}
}

// Close stops the registry (a registry gone): requests fail to connect.
// It releases every stall first. Idempotent; the test's end calls it.
func (r *Registry) Close() {
	r.releaseAll()
	r.srv.Close()
}

func (r *Registry) releaseAll() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, f := range r.faults {
		if f.release != nil {
			close(f.release)
			f.release, f.stallAt = nil, -1
		}
	}
}

// Push writes img to the registry as repoTag ("app:v1") and returns the
// full reference (Host + "/" + repoTag).
func (r *Registry) Push(t testing.TB, repoTag string, img v1.Image) string {
	t.Helper()
	ref := r.Host + "/" + repoTag
	nr, err := name.ParseReference(ref)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(nr, img); err != nil {
		t.Fatalf("imagetest: push %s: %v", ref, err)
	}
	return ref
}

// PushIndex writes idx as repoTag and returns the full reference.
func (r *Registry) PushIndex(t testing.TB, repoTag string, idx v1.ImageIndex) string {
	t.Helper()
	ref := r.Host + "/" + repoTag
	nr, err := name.ParseReference(ref)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.WriteIndex(nr, idx); err != nil {
		t.Fatalf("imagetest: push %s: %v", ref, err)
	}
	return ref
}

// gzipBytes compresses b at a fixed level.
func gzipBytes(b []byte) []byte {
	var buf bytes.Buffer
	zw, _ := gzip.NewWriterLevel(&buf, gzip.BestSpeed)
	zw.Write(b)
	zw.Close()
	return buf.Bytes()
}

// ServeLayout starts a registry (NewRegistry) holding every image of the
// OCI image layout at dir that names itself (the index's
// org.opencontainers.image.ref.name annotation), pushed as they are (the
// same manifests and layers, so estargz annotations survive) to
// prefix/<name> (":latest" unless the name has a tag). It returns the
// registry and each name's full reference.
func ServeLayout(t testing.TB, dir, prefix string) (*Registry, map[string]string) {
	t.Helper()
	p, err := layout.FromPath(dir)
	if err != nil {
		t.Fatalf("imagetest: layout %s: %v", dir, err)
	}
	idx, err := p.ImageIndex()
	if err != nil {
		t.Fatalf("imagetest: layout %s: %v", dir, err)
	}
	m, err := idx.IndexManifest()
	if err != nil {
		t.Fatalf("imagetest: layout %s: %v", dir, err)
	}
	// The layout's blobs are served from its files, not copied: a
	// layout of a GiB pushes in a moment and takes no memory.
	r := newRegistry(t, layoutblobs.Handler{Dir: filepath.Join(dir, "blobs")})
	refs := map[string]string{}
	for _, d := range m.Manifests {
		n := d.Annotations["org.opencontainers.image.ref.name"]
		if n == "" || !d.MediaType.IsImage() {
			continue
		}
		img, err := idx.Image(d.Digest)
		if err != nil {
			t.Fatalf("imagetest: layout %s: image %s: %v", dir, n, err)
		}
		repoTag := n
		if !strings.Contains(n, ":") {
			repoTag += ":latest"
		}
		if prefix != "" {
			repoTag = strings.TrimSuffix(prefix, "/") + "/" + repoTag
		}
		refs[n] = r.Push(t, repoTag, img)
	}
	if len(refs) == 0 {
		t.Fatalf("imagetest: layout %s names no images", dir)
	}
	return r, refs
}
