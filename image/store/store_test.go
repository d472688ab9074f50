package store

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
)

// childEnv makes the test binary a second process putting one blob: its value
// is the store folder. startEnv is when to start (Unix nanoseconds), so that
// the processes overlap.
const (
	childEnv = "KILN_STORE_TEST_CHILD"
	startEnv = "KILN_STORE_TEST_START"
)

func TestMain(m *testing.M) {
	if dir := os.Getenv(childEnv); dir != "" {
		os.Exit(childPut(dir))
	}
	os.Exit(m.Run())
}

// bigBlob is what the processes of TestConcurrentProcesses put.
func bigBlob() []byte { return bytes.Repeat([]byte("kiln-chunk-"), 300_000) } // 3.3 MB

func childPut(dir string) int {
	s, err := Open(dir, Options{})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if ns, err := strconv.ParseInt(os.Getenv(startEnv), 10, 64); err == nil {
		time.Sleep(time.Until(time.Unix(0, ns)))
	}
	b := bigBlob()
	if _, err := s.PutSized(context.Background(), digest.FromBytes(b), int64(len(b)), slowReader(b)); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

// slowReader hands out b in 64 KiB pieces with a pause before each, so that
// concurrent writers overlap.
func slowReader(b []byte) io.Reader {
	return &slow{r: bytes.NewReader(b)}
}

type slow struct{ r *bytes.Reader }

func (s *slow) Read(p []byte) (int, error) {
	time.Sleep(time.Millisecond)
	if len(p) > 64<<10 {
		p = p[:64<<10]
	}
	return s.r.Read(p)
}

// failReader fails the test if it is read.
type failReader struct{ t *testing.T }

func (f failReader) Read([]byte) (int, error) {
	f.t.Error("reader consumed for a blob already present")
	return 0, io.ErrUnexpectedEOF
}

func newStore(t *testing.T, opts Options) *Store {
	t.Helper()
	s, err := Open(t.TempDir(), opts)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// tmpEmpty checks that no temporary file was left behind.
func tmpEmpty(t *testing.T, s *Store) {
	t.Helper()
	ents, err := os.ReadDir(filepath.Join(s.Dir(), "tmp"))
	if err != nil || len(ents) != 0 {
		t.Errorf("tmp/ holds %v (%v)", ents, err)
	}
}

func countBlobs(t *testing.T, s *Store) int {
	t.Helper()
	ents, err := os.ReadDir(filepath.Join(s.Dir(), "blobs", "sha256"))
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

func TestParseDigest(t *testing.T) {
	hex := strings.Repeat("ab", 32)
	for _, tc := range []struct {
		in string
		ok bool
	}{
		{"sha256:" + hex, true},
		{string(digest.FromString("x")), true},
		{"sha256:" + strings.ToUpper(hex), false},
		{"sha256:" + hex[:63], false},
		{"sha256:" + hex + "0", false},
		{"sha512:" + hex + hex, false},
		{"SHA256:" + hex, false},
		{hex, false},
		{"", false},
		{"sha256:", false},
		{"sha256:../../../../etc/passwd" + strings.Repeat("0", 37), false},
		{"sha256:" + hex[:62] + "/x", false},
		{"sha256:" + hex[:63] + "\x00", false},
		{"sha256:" + hex + "\n", false},
	} {
		d, err := ParseDigest(tc.in)
		if (err == nil) != tc.ok {
			t.Errorf("ParseDigest(%q) = %v, want ok=%v", tc.in, err, tc.ok)
		}
		if err != nil && !errors.Is(err, ErrInvalidDigest) {
			t.Errorf("ParseDigest(%q): %v is not ErrInvalidDigest", tc.in, err)
		}
		if err == nil && string(d) != tc.in {
			t.Errorf("ParseDigest(%q) = %q", tc.in, d)
		}
	}
}

// FuzzParseDigest: whatever is accepted names a file directly in blobs/sha256.
func FuzzParseDigest(f *testing.F) {
	f.Add(string(digest.FromString("x")))
	f.Add("sha256:../../etc/passwd")
	f.Add("sha512:00")
	s, err := Open(f.TempDir(), Options{})
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, in string) {
		d, err := ParseDigest(in)
		p, perr := s.Path(digest.Digest(in))
		if (err == nil) != (perr == nil) {
			t.Fatalf("ParseDigest and Path disagree on %q: %v, %v", in, err, perr)
		}
		if err != nil {
			return
		}
		if filepath.Dir(p) != filepath.Join(s.Dir(), "blobs", "sha256") || filepath.Base(p) != d.Encoded() || len(d.Encoded()) != 64 {
			t.Fatalf("%q maps to %q", in, p)
		}
	})
}

func TestPut(t *testing.T) {
	content := []byte("hello, chunk")
	good := digest.FromBytes(content)
	other := digest.FromString("something else")
	for _, tc := range []struct {
		name    string
		d       digest.Digest
		size    int64
		r       io.Reader
		wantErr error // nil: stored
		wantN   int64
	}{
		{"ok", good, -1, bytes.NewReader(content), nil, int64(len(content))},
		{"ok sized", good, int64(len(content)), bytes.NewReader(content), nil, int64(len(content))},
		{"empty", digest.FromBytes(nil), 0, bytes.NewReader(nil), nil, 0},
		{"wrong digest", other, -1, bytes.NewReader(content), ErrDigestMismatch, 0},
		{"short", good, int64(len(content)) + 1, bytes.NewReader(content), ErrDigestMismatch, 0},
		{"long", good, int64(len(content)) - 1, bytes.NewReader(content), ErrDigestMismatch, 0},
		{"endless reader refused", good, 4, io.MultiReader(strings.NewReader("hell"), zeros{}), ErrDigestMismatch, 0},
		{"invalid digest", "sha256:../x", -1, bytes.NewReader(content), ErrInvalidDigest, 0},
		{"read error", good, -1, io.MultiReader(strings.NewReader("x"), errReader{}), errBoom, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newStore(t, Options{})
			n, err := s.PutSized(context.Background(), tc.d, tc.size, tc.r)
			if !errors.Is(err, tc.wantErr) || (tc.wantErr == nil) != (err == nil) {
				t.Fatalf("PutSized = %d, %v; want %v", n, err, tc.wantErr)
			}
			tmpEmpty(t, s)
			if tc.wantErr != nil {
				if countBlobs(t, s) != 0 {
					t.Error("a failed Put stored a blob")
				}
				return
			}
			if n != tc.wantN {
				t.Errorf("n = %d, want %d", n, tc.wantN)
			}
			if err := s.Verify(tc.d); err != nil {
				t.Error(err)
			}
			// Present: not rewritten, reader not consumed.
			if n2, err := s.Put(context.Background(), tc.d, failReader{t}); err != nil || n2 != n {
				t.Errorf("second Put = %d, %v", n2, err)
			}
		})
	}
}

// PutMany stores the blobs that match their digests, with one flush,
// and nothing for the ones that do not; present blobs are left alone; no
// temporary file stays behind.
func TestPutMany(t *testing.T) {
	s := newStore(t, Options{})
	ctx := context.Background()
	a, b, c := []byte("chunk a"), []byte("chunk b"), []byte("chunk c")
	if _, err := s.Put(ctx, digest.FromBytes(c), bytes.NewReader(c)); err != nil {
		t.Fatal(err)
	}
	blobs := []Blob{
		{digest.FromBytes(a), a},
		{digest.FromBytes(b), []byte("chunk B")}, // flipped
		{digest.FromBytes(c), c},                 // present
		{digest.FromBytes(a), a},                 // twice in one batch
		{"sha256:../x", a},                       // invalid
		{digest.FromBytes(nil), nil},             // empty
	}
	errs, err := s.PutMany(ctx, blobs)
	if err != nil {
		t.Fatal(err)
	}
	for i, want := range []error{nil, ErrDigestMismatch, nil, nil, ErrInvalidDigest, nil} {
		if !errors.Is(errs[i], want) || (want == nil) != (errs[i] == nil) {
			t.Errorf("blob %d: %v, want %v", i, errs[i], want)
		}
	}
	for _, d := range []digest.Digest{digest.FromBytes(a), digest.FromBytes(c), digest.FromBytes(nil)} {
		if err := s.Verify(d); err != nil {
			t.Error(err)
		}
		p, _ := s.Path(d)
		if fi, err := os.Stat(p); err != nil || fi.Mode().Perm() != 0o444 {
			t.Errorf("%s: %v, %v", d, fi.Mode(), err)
		}
	}
	if s.Has(digest.FromBytes(b)) {
		t.Error("a blob that failed its check was stored")
	}
	if n := countBlobs(t, s); n != 3 {
		t.Errorf("%d blobs stored, want 3", n)
	}
	tmpEmpty(t, s)
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := s.PutMany(cctx, []Blob{{digest.FromBytes(b), b}}); !errors.Is(err, context.Canceled) || s.Has(digest.FromBytes(b)) {
		t.Errorf("a cancelled PutMany: %v (stored: %v)", err, s.Has(digest.FromBytes(b)))
	}
	tmpEmpty(t, s)
}

// BenchmarkPutChunks stores 256 chunks of 4 KiB (a readahead run of small
// files) one PutSized each, or in one PutMany.
func BenchmarkPutChunks(b *testing.B) {
	chunks := make([]Blob, 256)
	for i := range chunks {
		data := bytes.Repeat([]byte{byte(i), byte(i >> 8)}, 2048)
		chunks[i] = Blob{digest.FromBytes(data), data}
	}
	dir := os.Getenv("KILN_STORE_BENCH_DIR") // a real disk; default: the test's temp folder
	for _, mode := range []string{"PutSized", "PutMany"} {
		b.Run(mode, func(b *testing.B) {
			for b.Loop() {
				b.StopTimer()
				root, err := os.MkdirTemp(dir, "kiln-store-bench-")
				if err != nil {
					b.Fatal(err)
				}
				s, err := Open(root, Options{})
				if err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
				if mode == "PutSized" {
					for _, c := range chunks {
						if _, err := s.PutSized(context.Background(), c.Digest, int64(len(c.Data)), bytes.NewReader(c.Data)); err != nil {
							b.Fatal(err)
						}
					}
				} else if errs, err := s.PutMany(context.Background(), chunks); err != nil || errors.Join(errs...) != nil {
					b.Fatal(err, errs)
				}
				b.StopTimer()
				os.RemoveAll(root)
				b.StartTimer()
			}
		})
	}
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) { clear(p); return len(p), nil }

var errBoom = errors.New("boom")

type errReader struct{}

func (errReader) Read([]byte) (int, error) { return 0, errBoom }

// A chunk with one flipped byte is refused with both digests named, and
// nothing is stored.
func TestFlippedChunkByte(t *testing.T) {
	s := newStore(t, Options{})
	chunk := bytes.Repeat([]byte{0x5a}, 1<<20)
	want := digest.FromBytes(chunk)
	chunk[12345] ^= 0x01
	_, err := s.PutSized(context.Background(), want, int64(len(chunk)), bytes.NewReader(chunk))
	var de *DigestError
	if !errors.As(err, &de) || !errors.Is(err, ErrDigestMismatch) {
		t.Fatalf("Put = %v, want a *DigestError", err)
	}
	got := digest.FromBytes(chunk)
	if de.Want != want || de.Got != got || !strings.Contains(err.Error(), want.String()) || !strings.Contains(err.Error(), got.String()) {
		t.Errorf("error %q (%+v) does not name want %s and got %s", err, de, want, got)
	}
	if s.Has(want) || countBlobs(t, s) != 0 {
		t.Error("corrupt chunk stored")
	}
	tmpEmpty(t, s)
}

// Two images sharing a base layer store its chunks once, and the second
// image's shared chunks are not read at all.
func TestSharedBaseLayer(t *testing.T) {
	s := newStore(t, Options{})
	chunk := func(i int) []byte { return []byte(fmt.Sprintf("chunk %d", i)) }
	base := []int{0, 1, 2, 3}
	imageA := append(append([]int{}, base...), 10, 11)
	imageB := append(append([]int{}, base...), 20, 2) // repeats a chunk within itself too
	reads := 0
	pull := func(img []int) {
		for _, i := range img {
			b := chunk(i)
			r := readCounter{bytes.NewReader(b), &reads}
			if _, err := s.Put(context.Background(), digest.FromBytes(b), r); err != nil {
				t.Fatal(err)
			}
		}
	}
	pull(imageA)
	afterA := reads
	pull(imageB)
	if n := countBlobs(t, s); n != 7 {
		t.Errorf("%d blobs stored, want 7", n)
	}
	if reads-afterA != 2 { // chunk 20's data and EOF
		t.Errorf("image B read %d times, want only its own chunk", reads-afterA)
	}
}

type readCounter struct {
	r *bytes.Reader
	n *int
}

func (c readCounter) Read(p []byte) (int, error) { *c.n++; return c.r.Read(p) }

// A blob changed on disk after it was stored is caught by Verify and
// OpenVerified, not by Open.
func TestCorruptOnDisk(t *testing.T) {
	content := bytes.Repeat([]byte("0123456789"), 1000)
	d := digest.FromBytes(content)
	for _, tc := range []struct {
		name   string
		damage func(path string) error
	}{
		{"bit flip", func(p string) error {
			b, _ := os.ReadFile(p)
			b[777] ^= 0x80
			return os.WriteFile(p, b, 0o444)
		}},
		{"truncated", func(p string) error { return os.Truncate(p, 10) }},
		{"extended", func(p string) error {
			f, err := os.OpenFile(p, os.O_APPEND|os.O_WRONLY, 0)
			if err != nil {
				return err
			}
			f.Write([]byte("x"))
			return f.Close()
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newStore(t, Options{})
			if _, err := s.Put(context.Background(), d, bytes.NewReader(content)); err != nil {
				t.Fatal(err)
			}
			f, _, err := s.OpenVerified(d)
			if err != nil {
				t.Fatal(err)
			}
			if b, _ := io.ReadAll(f); !bytes.Equal(b, content) {
				t.Error("OpenVerified did not start at offset 0")
			}
			f.Close()
			p, _ := s.Path(d)
			os.Chmod(p, 0o644)
			if err := tc.damage(p); err != nil {
				t.Fatal(err)
			}
			var de *DigestError
			if err := s.Verify(d); !errors.As(err, &de) || de.Path != p || de.Want != d {
				t.Errorf("Verify = %v", err)
			}
			if f, _, err := s.OpenVerified(d); !errors.Is(err, ErrDigestMismatch) {
				t.Errorf("OpenVerified = %v, want a mismatch", err)
				if f != nil {
					f.Close()
				}
			}
			f, _, err = s.Open(d)
			if err != nil {
				t.Fatalf("Open without verifying: %v", err)
			}
			f.Close()
			if err := s.Delete(d); err != nil || s.Has(d) {
				t.Errorf("Delete = %v", err)
			}
		})
	}
}

func TestMissingAndInvalid(t *testing.T) {
	s := newStore(t, Options{})
	absent := digest.FromString("absent")
	if _, _, err := s.Open(absent); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Open absent = %v", err)
	}
	if _, err := s.Stat(absent); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Stat absent = %v", err)
	}
	if err := s.Verify(absent); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Verify absent = %v", err)
	}
	if err := s.Delete(absent); err != nil {
		t.Errorf("Delete absent = %v", err)
	}
	bad := digest.Digest("sha256:../../../etc/passwd")
	for name, err := range map[string]error{
		"Open":   func() error { _, _, err := s.Open(bad); return err }(),
		"Stat":   func() error { _, err := s.Stat(bad); return err }(),
		"Verify": s.Verify(bad),
		"Delete": s.Delete(bad),
		"Pin":    s.Pin(bad, "x"),
	} {
		if !errors.Is(err, ErrInvalidDigest) {
			t.Errorf("%s(invalid) = %v", name, err)
		}
	}
	if s.Has(bad) {
		t.Error("Has(invalid)")
	}
	if _, err := Open(t.TempDir(), Options{MaxBytes: -1}); err == nil {
		t.Error("negative MaxBytes accepted")
	}
}

func TestPutCancelled(t *testing.T) {
	s := newStore(t, Options{})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	b := []byte("data")
	if _, err := s.Put(ctx, digest.FromBytes(b), bytes.NewReader(b)); !errors.Is(err, context.Canceled) {
		t.Errorf("Put = %v", err)
	}
	if countBlobs(t, s) != 0 {
		t.Error("stored after cancel")
	}
	tmpEmpty(t, s)
}

func TestConcurrentGoroutines(t *testing.T) {
	s := newStore(t, Options{})
	b := bytes.Repeat([]byte("ab"), 200_000)
	d := digest.FromBytes(b)
	var wg sync.WaitGroup
	errs := make([]error, 8)
	for i := range errs {
		wg.Go(func() { _, errs[i] = s.Put(context.Background(), d, slowReader(b)) })
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("writer %d: %v", i, err)
		}
	}
	if countBlobs(t, s) != 1 {
		t.Error("not exactly one blob")
	}
	if err := s.Verify(d); err != nil {
		t.Error(err)
	}
	tmpEmpty(t, s)
}

// Three processes put one blob at once: all succeed and one verified blob is
// left.
func TestConcurrentProcesses(t *testing.T) {
	dir := t.TempDir()
	var cmds []*exec.Cmd
	var outs []*bytes.Buffer
	start := strconv.FormatInt(time.Now().Add(500*time.Millisecond).UnixNano(), 10)
	for range 3 {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), childEnv+"="+dir, startEnv+"="+start)
		out := new(bytes.Buffer)
		cmd.Stdout, cmd.Stderr = out, out
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		cmds, outs = append(cmds, cmd), append(outs, out)
	}
	for i, cmd := range cmds {
		if err := cmd.Wait(); err != nil {
			t.Errorf("process %d: %v: %s", i, err, outs[i])
		}
	}
	s, err := Open(dir, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if countBlobs(t, s) != 1 {
		t.Error("not exactly one blob")
	}
	if err := s.Verify(digest.FromBytes(bigBlob())); err != nil {
		t.Error(err)
	}
	tmpEmpty(t, s)
}

// A file opened before a Delete or GC keeps reading.
func TestReaderSurvivesDelete(t *testing.T) {
	s := newStore(t, Options{MaxBytes: 1})
	b := bytes.Repeat([]byte("z"), 100_000)
	d := digest.FromBytes(b)
	if _, err := s.Put(context.Background(), d, bytes.NewReader(b)); err != nil {
		t.Fatal(err)
	}
	f, size, err := s.Open(d)
	if err != nil || size != int64(len(b)) {
		t.Fatalf("Open = %d, %v", size, err)
	}
	defer f.Close()
	head := make([]byte, 10)
	io.ReadFull(f, head)
	res, err := s.GC(context.Background(), nil)
	if err != nil || len(res.Removed) != 1 || s.Has(d) {
		t.Fatalf("GC = %+v, %v", res, err)
	}
	rest, err := io.ReadAll(f)
	if err != nil || !bytes.Equal(append(head, rest...), b) {
		t.Errorf("read after delete: %d bytes, %v", len(rest), err)
	}
}

func TestGC(t *testing.T) {
	s := newStore(t, Options{MaxBytes: 300})
	old := time.Now().Add(-24 * time.Hour)
	var ds []digest.Digest
	for i := range 6 { // 100 bytes each; blob i last used at old+i minutes
		b := bytes.Repeat([]byte{byte(i)}, 100)
		d := digest.FromBytes(b)
		if _, err := s.Put(context.Background(), d, bytes.NewReader(b)); err != nil {
			t.Fatal(err)
		}
		p, _ := s.Path(d)
		when := old.Add(time.Duration(i) * time.Minute)
		os.Chtimes(p, when, when)
		ds = append(ds, d)
	}
	// Reading blob 2 makes it the most recently used.
	f, _, err := s.Open(ds[2])
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	if err := s.Pin(ds[0], "sandbox-1"); err != nil {
		t.Fatal(err)
	}
	s.Pin(ds[0], "sandbox-2")
	s.Unpin(ds[0], "sandbox-2") // still pinned by sandbox-1
	keep := func(d digest.Digest) bool { return d == ds[1] }

	// Stale and fresh temporary files.
	staleTmp := filepath.Join(s.Dir(), "tmp", "stale")
	os.WriteFile(staleTmp, make([]byte, 50), 0o644)
	os.Chtimes(staleTmp, old, old)
	freshTmp := filepath.Join(s.Dir(), "tmp", "fresh")
	os.WriteFile(freshTmp, nil, 0o644)
	// A stray file in blobs/ is not a blob and is left alone.
	stray := filepath.Join(s.Dir(), "blobs", "sha256", "stray")
	os.WriteFile(stray, make([]byte, 1000), 0o644)

	res, err := s.GC(context.Background(), keep)
	if err != nil {
		t.Fatal(err)
	}
	// Order by last use: 0 (pinned), 1 (kept), 3, 4, 5, 2. Evict 3, 4, 5 to
	// get from 600 to 300.
	want := []digest.Digest{ds[3], ds[4], ds[5]}
	if fmt.Sprint(res.Removed) != fmt.Sprint(want) || res.FreedBytes != 300 || res.TotalBytes != 300 || res.Blobs != 3 {
		t.Errorf("GC = %+v, want removed %v", res, want)
	}
	if res.TempRemoved != 1 || res.TempBytes != 50 {
		t.Errorf("temp: %+v", res)
	}
	for i, d := range ds {
		if s.Has(d) != (i <= 2) {
			t.Errorf("blob %d present = %v", i, s.Has(d))
		}
	}
	for p, want := range map[string]bool{staleTmp: false, freshTmp: true, stray: true} {
		if _, err := os.Stat(p); (err == nil) != want {
			t.Errorf("%s exists = %v, want %v", p, err == nil, want)
		}
	}

	// Under the cap: nothing to do. Unpinned, over a smaller cap: 0 goes.
	if res, err := s.GC(context.Background(), keep); err != nil || len(res.Removed) != 0 {
		t.Errorf("second GC = %+v, %v", res, err)
	}
	s.Unpin(ds[0], "sandbox-1")
	s.opts.MaxBytes = 200
	if res, err := s.GC(context.Background(), keep); err != nil || fmt.Sprint(res.Removed) != fmt.Sprint([]digest.Digest{ds[0]}) {
		t.Errorf("GC after unpin = %+v, %v", res, err)
	}
	// Everything kept, cap below it: no error, TotalBytes says what is left.
	s.opts.MaxBytes = 1
	if res, err := s.GC(context.Background(), func(digest.Digest) bool { return true }); err != nil || res.TotalBytes != 200 || len(res.Removed) != 0 {
		t.Errorf("GC all kept = %+v, %v", res, err)
	}
}

// With no cap, GC evicts nothing.
func TestGCNoCap(t *testing.T) {
	s := newStore(t, Options{})
	b := []byte("x")
	s.Put(context.Background(), digest.FromBytes(b), bytes.NewReader(b))
	if res, err := s.GC(context.Background(), nil); err != nil || len(res.Removed) != 0 || res.Blobs != 1 || res.TotalBytes != 1 {
		t.Errorf("GC = %+v, %v", res, err)
	}
}

// GCTo uses its own cap, ignoring Options.MaxBytes, and honours pins and
// keep; 0 evicts everything else.
func TestGCTo(t *testing.T) {
	s := newStore(t, Options{}) // no cap of its own
	var ds []digest.Digest
	for i := range 4 {
		b := bytes.Repeat([]byte{byte(i)}, 100)
		d := digest.FromBytes(b)
		if _, err := s.Put(context.Background(), d, bytes.NewReader(b)); err != nil {
			t.Fatal(err)
		}
		ds = append(ds, d)
	}
	s.Pin(ds[0], "sandbox")
	keep := func(d digest.Digest) bool { return d == ds[1] }
	for _, tc := range []struct {
		max       int64
		wantLeft  int
		wantError bool
	}{
		{-1, 4, true},
		{300, 3, false}, // one of 2, 3 goes
		{0, 2, false},   // only the pinned and the kept stay
	} {
		res, err := s.GCTo(context.Background(), tc.max, keep)
		if (err != nil) != tc.wantError {
			t.Fatalf("GCTo(%d): %v", tc.max, err)
		}
		if err == nil && res.Blobs != tc.wantLeft {
			t.Errorf("GCTo(%d) left %d blobs, want %d: %+v", tc.max, res.Blobs, tc.wantLeft, res)
		}
	}
	if !s.Has(ds[0]) || !s.Has(ds[1]) || s.Has(ds[2]) || s.Has(ds[3]) {
		t.Error("GCTo(0) removed a pinned or kept blob, or kept another")
	}
}

// Put of a present blob and Open mark it used; Stat does not.
func TestMarkUsed(t *testing.T) {
	s := newStore(t, Options{})
	b := []byte("used")
	d := digest.FromBytes(b)
	s.Put(context.Background(), d, bytes.NewReader(b))
	p, _ := s.Path(d)
	old := time.Now().Add(-time.Hour).Truncate(time.Second)
	for name, use := range map[string]func(){
		"Open": func() { f, _, _ := s.Open(d); f.Close() },
		"Put":  func() { s.Put(context.Background(), d, failReader{t}) },
	} {
		os.Chtimes(p, old, old)
		if info, _ := s.Stat(d); !info.LastUsed.Equal(old) || info.Size != 4 {
			t.Fatalf("Stat = %+v", info)
		}
		use()
		if info, _ := s.Stat(d); time.Since(info.LastUsed) > time.Minute {
			t.Errorf("%s did not mark the blob used: %v", name, info.LastUsed)
		}
	}
}
