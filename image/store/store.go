// Package store is the host-wide content-addressed store: every blob an
// image needs (estargz chunks, TOCs, manifests) is kept once per host, by the
// sha256 digest of its bytes, and shared by every sandbox and every image.
//
// # Layout
//
// Under the store's folder:
//
//	blobs/sha256/<64 hex>   one file per blob, mode 0444, never rewritten
//	tmp/                    blobs being written (same file system as blobs/)
//
// A Put writes to a temporary file in tmp/ while hashing, checks the digest
// (and the size, for PutSized), fsyncs, and renames the file into place, so
// a blob under blobs/ is always complete and was verified when it was
// stored. A mismatch stores nothing and returns a *DigestError.
//
// # Concurrency
//
// Several goroutines and several processes may use one folder at once.
// Rename is atomic: two writers of one digest both verify their bytes, the
// last rename wins, and the bytes are the same either way. A file opened
// before a Delete or a GC keeps its content until it is closed (Unix
// semantics). Has and Put may report a blob that another process's GC
// removes a moment later: callers that need the bytes should Open them and
// fall back to fetching when Open reports fs.ErrNotExist.
//
// # Use and eviction
//
// A blob's modification time is its last use: Put (stored or already
// present) and Open set it to now, at most once a minute per blob. Nothing
// else is kept: there is no index to go stale or to lock. GC removes the
// least recently used blobs that are neither pinned (Pin, in this process)
// nor kept (GC's keep callback, for pins other processes hold) until the
// total is at most Options.MaxBytes, and removes temporary files older than
// an hour (left by a process that died mid-Put).
//
// # Hostile input
//
// Digests come from manifests and TOCs. ParseDigest and every method accept
// only "sha256:" followed by 64 lowercase hex digits before a digest is
// turned into a path. A blob changed on disk after it was stored (a bit
// flip) is caught by Verify and by OpenVerified, which re-hash it.
package store

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"
	"golang.org/x/sys/unix"
)

// Errors that the store's errors wrap, for errors.Is.
var (
	// ErrInvalidDigest: the digest is not "sha256:" and 64 lowercase hex digits.
	ErrInvalidDigest = errors.New("invalid digest")
	// ErrDigestMismatch: the bytes do not hash to the digest, or do not have
	// the expected size. Every *DigestError is one.
	ErrDigestMismatch = errors.New("digest mismatch")
)

// DigestError says that content did not match its digest or its size: in a
// Put (nothing was stored) or on disk (Verify, OpenVerified).
type DigestError struct {
	Want digest.Digest // the digest asked for
	Got  digest.Digest // what the bytes hash to; empty when reading stopped early
	// WantSize is the expected size, or -1 if none was given. GotSize is the
	// bytes read; WantSize+1 means the content was longer than WantSize.
	WantSize, GotSize int64
	Path              string // the blob's path for on-disk corruption, else empty
}

func (e *DigestError) Error() string {
	where := ""
	if e.Path != "" {
		where = " on disk (" + e.Path + ")"
	}
	switch {
	case e.WantSize >= 0 && e.GotSize > e.WantSize:
		return fmt.Sprintf("store: %s%s: content longer than the expected %d bytes", e.Want, where, e.WantSize)
	case e.WantSize >= 0 && e.GotSize != e.WantSize:
		return fmt.Sprintf("store: %s%s: %d bytes, want %d", e.Want, where, e.GotSize, e.WantSize)
	}
	return fmt.Sprintf("store: %s%s: content has digest %s", e.Want, where, e.Got)
}

// Is makes errors.Is(err, ErrDigestMismatch) true.
func (e *DigestError) Is(target error) bool { return target == ErrDigestMismatch }

// ParseDigest parses a digest from untrusted input: only "sha256:" followed by
// exactly 64 lowercase hex digits is accepted.
func ParseDigest(s string) (digest.Digest, error) {
	d := digest.Digest(s)
	if err := validate(d); err != nil {
		return "", err
	}
	return d, nil
}

func validate(d digest.Digest) error {
	s := string(d)
	hexPart, ok := strings.CutPrefix(s, "sha256:")
	if !ok || len(hexPart) != sha256.Size*2 {
		return fmt.Errorf("store: %w: %.80q (want sha256: and %d hex digits)", ErrInvalidDigest, s, sha256.Size*2)
	}
	for i := 0; i < len(hexPart); i++ {
		c := hexPart[i]
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return fmt.Errorf("store: %w: %.80q (not lowercase hex)", ErrInvalidDigest, s)
		}
	}
	return nil
}

// Options configures a Store.
type Options struct {
	// MaxBytes caps the total size of the blobs once GC has run; 0 means no
	// cap (GC then only removes stale temporary files). Put does not enforce
	// it: a pull is never refused for space, GC makes room afterwards.
	MaxBytes int64
	Logger   *slog.Logger // slog.Default() when nil
}

// Store is a content-addressed store in one folder. Its methods are safe for
// concurrent use, and other processes may use the same folder at once.
type Store struct {
	dir, blobs, tmp string
	opts            Options
	log             *slog.Logger

	mu   sync.Mutex
	pins map[digest.Digest]map[string]struct{}
}

const (
	touchEvery = time.Minute // how stale a last-use time may get
	staleTemp  = time.Hour   // temporary files older than this are garbage
	bufSize    = 256 << 10
)

// Open opens the store in dir, creating its folders if needed.
func Open(dir string, opts Options) (*Store, error) {
	if opts.MaxBytes < 0 {
		return nil, fmt.Errorf("store: MaxBytes %d is negative", opts.MaxBytes)
	}
	s := &Store{
		dir:   dir,
		blobs: filepath.Join(dir, "blobs", "sha256"),
		tmp:   filepath.Join(dir, "tmp"),
		opts:  opts,
		log:   opts.Logger,
		pins:  map[digest.Digest]map[string]struct{}{},
	}
	if s.log == nil {
		s.log = slog.Default()
	}
	for _, d := range []string{s.blobs, s.tmp} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, fmt.Errorf("store: %w", err)
		}
	}
	return s, nil
}

// Dir is the store's folder.
func (s *Store) Dir() string { return s.dir }

// Path is where the blob d is (or would be) kept.
func (s *Store) Path(d digest.Digest) (string, error) {
	if err := validate(d); err != nil {
		return "", err
	}
	return filepath.Join(s.blobs, d.Encoded()), nil
}

// Put stores the content of r under d and returns its size. See PutSized.
func (s *Store) Put(ctx context.Context, d digest.Digest, r io.Reader) (int64, error) {
	return s.PutSized(ctx, d, -1, r)
}

// PutSized stores the content of r under d, checking that it hashes to d and,
// if size >= 0, that it is exactly size bytes long: it reads at most size+1
// bytes. A blob already present is not rewritten and r is not read; its size
// is returned. On a mismatch nothing is stored and the error is a
// *DigestError.
func (s *Store) PutSized(ctx context.Context, d digest.Digest, size int64, r io.Reader) (int64, error) {
	path, err := s.Path(d)
	if err != nil {
		return 0, err
	}
	if fi, err := os.Stat(path); err == nil {
		s.touch(path, fi)
		return fi.Size(), nil
	}
	f, err := os.CreateTemp(s.tmp, d.Encoded()[:16]+"-*")
	if err != nil {
		return 0, fmt.Errorf("store: put %s: %w", d, err)
	}
	tmp := f.Name()
	defer func() {
		if f != nil {
			f.Close()
			os.Remove(tmp)
		}
	}()
	h := sha256.New()
	src := r
	if size >= 0 {
		src = io.LimitReader(r, size+1)
	}
	n, err := copyCtx(ctx, io.MultiWriter(f, h), src)
	if err != nil {
		return 0, fmt.Errorf("store: put %s: %w", d, err)
	}
	if err := check(d, size, n, h); err != nil {
		return 0, err
	}
	if err := f.Chmod(0o444); err != nil {
		return 0, fmt.Errorf("store: put %s: %w", d, err)
	}
	if err := f.Sync(); err != nil {
		return 0, fmt.Errorf("store: put %s: %w", d, err)
	}
	if err := f.Close(); err != nil {
		return 0, fmt.Errorf("store: put %s: %w", d, err)
	}
	f = nil
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return 0, fmt.Errorf("store: put %s: %w", d, err)
	}
	syncDir(s.blobs)
	return n, nil
}

// Blob is one blob of a PutMany: its digest and its bytes, in memory.
type Blob struct {
	Digest digest.Digest
	Data   []byte
}

// PutMany stores blobs as PutSized would store each (size len(Data)),
// with one flush of the file system for them all instead of two per blob:
// what a registry fetch of many small chunks puts at once. Each blob is
// checked against its digest first; errs[i] is blob i's outcome (a
// *DigestError when it does not match, and nothing stored for it), err a
// failure of the batch, after which none of the blobs not stored before
// may be there. Blobs present already are not rewritten.
func (s *Store) PutMany(ctx context.Context, blobs []Blob) (errs []error, err error) {
	errs = make([]error, len(blobs))
	type pending struct {
		i         int
		tmp, path string
	}
	var todo []pending
	defer func() {
		for _, p := range todo {
			if p.tmp != "" {
				os.Remove(p.tmp)
			}
		}
	}()
	for i, b := range blobs {
		if err := ctx.Err(); err != nil {
			return errs, fmt.Errorf("store: put %d blobs: %w", len(blobs), err)
		}
		path, err := s.Path(b.Digest)
		if err != nil {
			errs[i] = err
			continue
		}
		if fi, err := os.Stat(path); err == nil {
			s.touch(path, fi)
			continue
		}
		h := sha256.New()
		h.Write(b.Data)
		if err := check(b.Digest, int64(len(b.Data)), int64(len(b.Data)), h); err != nil {
			errs[i] = err
			continue
		}
		tmp, err := s.writeTemp(b)
		if err != nil {
			return errs, err
		}
		todo = append(todo, pending{i, tmp, path})
	}
	if len(todo) == 0 {
		return errs, nil
	}
	// One flush for every file written above: syncfs(2) of the store's
	// file system, then the renames, then the folder's flush.
	if err := syncFS(s.tmp); err != nil {
		return errs, fmt.Errorf("store: put %d blobs: %w", len(todo), err)
	}
	for k, p := range todo {
		if err := os.Rename(p.tmp, p.path); err != nil {
			errs[p.i] = fmt.Errorf("store: put %s: %w", blobs[p.i].Digest, err)
			continue
		}
		todo[k].tmp = ""
	}
	syncDir(s.blobs)
	return errs, nil
}

// writeTemp writes b to a new read-only file in the store's temporary
// folder, not flushed, and returns its path.
func (s *Store) writeTemp(b Blob) (string, error) {
	f, err := os.CreateTemp(s.tmp, b.Digest.Encoded()[:16]+"-*")
	if err != nil {
		return "", fmt.Errorf("store: put %s: %w", b.Digest, err)
	}
	_, err = f.Write(b.Data)
	if err == nil {
		err = f.Chmod(0o444)
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(f.Name())
		return "", fmt.Errorf("store: put %s: %w", b.Digest, err)
	}
	return f.Name(), nil
}

// syncFS flushes the file system that holds dir.
func syncFS(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer f.Close()
	return unix.Syncfs(int(f.Fd()))
}

// check compares what was read (n bytes hashed into h) with d and size. A
// read cut at size+1 bytes reports the overrun without a digest.
func check(d digest.Digest, size, n int64, h hash.Hash) error {
	e := &DigestError{Want: d, WantSize: size, GotSize: n}
	if size >= 0 && n != size {
		if n < size {
			e.Got = digest.NewDigestFromEncoded(digest.SHA256, hex.EncodeToString(h.Sum(nil)))
		}
		return e
	}
	got := digest.NewDigestFromEncoded(digest.SHA256, hex.EncodeToString(h.Sum(nil)))
	if got != d {
		e.Got = got
		return e
	}
	return nil
}

// copyCtx copies src to dst, checking ctx between reads.
func copyCtx(ctx context.Context, dst io.Writer, src io.Reader) (int64, error) {
	buf := make([]byte, bufSize)
	var n int64
	for {
		if err := ctx.Err(); err != nil {
			return n, err
		}
		k, rerr := src.Read(buf)
		if k > 0 {
			if _, err := dst.Write(buf[:k]); err != nil {
				return n, err
			}
			n += int64(k)
		}
		if rerr == io.EOF {
			return n, nil
		}
		if rerr != nil {
			return n, rerr
		}
	}
}

// Info describes a stored blob.
type Info struct {
	Digest   digest.Digest
	Size     int64
	LastUsed time.Time // the file's modification time; see the package comment
}

// Has reports whether d is stored (an invalid digest is not).
func (s *Store) Has(d digest.Digest) bool {
	_, err := s.Stat(d)
	return err == nil
}

// Stat describes the blob d; the error wraps fs.ErrNotExist if it is absent.
// It does not count as a use.
func (s *Store) Stat(d digest.Digest) (Info, error) {
	path, err := s.Path(d)
	if err != nil {
		return Info{}, err
	}
	fi, err := os.Stat(path)
	if err != nil {
		return Info{}, fmt.Errorf("store: %w", err)
	}
	return Info{Digest: d, Size: fi.Size(), LastUsed: fi.ModTime()}, nil
}

// Open opens the blob d for reading and marks it used. The error wraps
// fs.ErrNotExist if it is absent. The content is not re-hashed: see
// OpenVerified.
func (s *Store) Open(d digest.Digest) (*os.File, int64, error) {
	path, err := s.Path(d)
	if err != nil {
		return nil, 0, err
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, 0, fmt.Errorf("store: %w", err)
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, 0, fmt.Errorf("store: %w", err)
	}
	s.touch(path, fi)
	return f, fi.Size(), nil
}

// OpenVerified is Open, but it first re-hashes the whole blob through the
// returned file and fails with a *DigestError if the content on disk no
// longer matches d. The file is positioned at offset 0.
func (s *Store) OpenVerified(d digest.Digest) (*os.File, int64, error) {
	f, size, err := s.Open(d)
	if err != nil {
		return nil, 0, err
	}
	if err := verifyFile(d, f, size); err != nil {
		f.Close()
		return nil, 0, err
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		f.Close()
		return nil, 0, fmt.Errorf("store: %w", err)
	}
	return f, size, nil
}

// Verify re-hashes the stored blob d. A blob whose content no longer matches
// gives a *DigestError; Verify leaves it in place (Delete removes it).
func (s *Store) Verify(d digest.Digest) error {
	path, err := s.Path(d)
	if err != nil {
		return err
	}
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("store: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return fmt.Errorf("store: %w", err)
	}
	return verifyFile(d, f, fi.Size())
}

func verifyFile(d digest.Digest, f *os.File, size int64) error {
	h := sha256.New()
	n, err := copyCtx(context.Background(), h, f)
	if err != nil {
		return fmt.Errorf("store: verify %s: %w", d, err)
	}
	if err := check(d, size, n, h); err != nil {
		err.(*DigestError).Path = f.Name()
		return err
	}
	return nil
}

// Delete removes the blob d; removing an absent blob is not an error. Files
// already open keep their content.
func (s *Store) Delete(d digest.Digest) error {
	path, err := s.Path(d)
	if err != nil {
		return err
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("store: %w", err)
	}
	return nil
}

// Pin keeps d from GC in this Store until holder unpins it. One digest may
// have many holders (a sandbox ID, an image ref). Pins are not stored: other
// processes protect their blobs through GC's keep callback.
func (s *Store) Pin(d digest.Digest, holder string) error {
	if err := validate(d); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.pins[d] == nil {
		s.pins[d] = map[string]struct{}{}
	}
	s.pins[d][holder] = struct{}{}
	return nil
}

// Unpin drops holder's pin on d.
func (s *Store) Unpin(d digest.Digest, holder string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.pins[d], holder)
	if len(s.pins[d]) == 0 {
		delete(s.pins, d)
	}
}

func (s *Store) pinned(d digest.Digest) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.pins[d]) > 0
}

// GCResult is what a GC removed and what is left.
type GCResult struct {
	Removed     []digest.Digest // evicted blobs, least recently used first
	FreedBytes  int64           // their total size
	TempRemoved int             // stale temporary files removed
	TempBytes   int64           // their total size
	Blobs       int             // blobs left
	TotalBytes  int64           // their total size
}

// GC removes temporary files older than an hour and then, if Options.MaxBytes
// is set, the least recently used blobs that are neither pinned nor kept
// (keep may be nil) until the blobs total at most MaxBytes. If pinned and
// kept blobs alone exceed the cap, GC removes what it may and returns no
// error: TotalBytes says what is left. Files in blobs/ that are not named by
// a valid digest are left alone.
func (s *Store) GC(ctx context.Context, keep func(digest.Digest) bool) (GCResult, error) {
	if s.opts.MaxBytes == 0 {
		return s.gc(ctx, -1, keep)
	}
	return s.gc(ctx, s.opts.MaxBytes, keep)
}

// GCTo is GC with a cap of its own instead of Options.MaxBytes: it evicts
// the least recently used blobs that are neither pinned nor kept until the
// blobs total at most maxBytes; 0 evicts every blob that is neither pinned
// nor kept. Images uses it to drop unreferenced blobs outright and then to
// hold a cache of refetchable chunks under the store's cap.
func (s *Store) GCTo(ctx context.Context, maxBytes int64, keep func(digest.Digest) bool) (GCResult, error) {
	if maxBytes < 0 {
		return GCResult{}, fmt.Errorf("store: gc: cap %d is negative", maxBytes)
	}
	return s.gc(ctx, maxBytes, keep)
}

// gc is GC down to maxBytes; a negative maxBytes evicts nothing.
func (s *Store) gc(ctx context.Context, maxBytes int64, keep func(digest.Digest) bool) (GCResult, error) {
	var res GCResult
	now := time.Now()
	tmps, err := os.ReadDir(s.tmp)
	if err != nil {
		return res, fmt.Errorf("store: gc: %w", err)
	}
	for _, e := range tmps {
		fi, err := e.Info()
		if err != nil || now.Sub(fi.ModTime()) < staleTemp {
			continue
		}
		if os.Remove(filepath.Join(s.tmp, e.Name())) == nil {
			res.TempRemoved++
			res.TempBytes += fi.Size()
		}
	}

	ents, err := os.ReadDir(s.blobs)
	if err != nil {
		return res, fmt.Errorf("store: gc: %w", err)
	}
	var blobs []Info
	for _, e := range ents {
		d := digest.NewDigestFromEncoded(digest.SHA256, e.Name())
		if validate(d) != nil || !e.Type().IsRegular() {
			continue
		}
		fi, err := e.Info()
		if err != nil {
			continue // removed meanwhile
		}
		blobs = append(blobs, Info{Digest: d, Size: fi.Size(), LastUsed: fi.ModTime()})
		res.TotalBytes += fi.Size()
	}
	res.Blobs = len(blobs)
	if maxBytes < 0 || res.TotalBytes <= maxBytes {
		return res, nil
	}
	sort.Slice(blobs, func(i, j int) bool {
		if !blobs[i].LastUsed.Equal(blobs[j].LastUsed) {
			return blobs[i].LastUsed.Before(blobs[j].LastUsed)
		}
		return blobs[i].Digest < blobs[j].Digest
	})
	for _, b := range blobs {
		if res.TotalBytes <= maxBytes {
			break
		}
		if err := ctx.Err(); err != nil {
			return res, err
		}
		if s.pinned(b.Digest) || (keep != nil && keep(b.Digest)) {
			continue
		}
		path := filepath.Join(s.blobs, b.Digest.Encoded())
		// Re-check the last use: another process may have used it since.
		if fi, err := os.Stat(path); err != nil || fi.ModTime().After(b.LastUsed) {
			continue
		}
		if err := os.Remove(path); err != nil {
			if !errors.Is(err, fs.ErrNotExist) {
				s.log.Warn("store: gc", "digest", b.Digest, "err", err)
			}
			continue
		}
		res.Removed = append(res.Removed, b.Digest)
		res.FreedBytes += b.Size
		res.TotalBytes -= b.Size
		res.Blobs--
	}
	if len(res.Removed) > 0 || res.TempRemoved > 0 {
		s.log.Info("store: gc", "removed", len(res.Removed), "freed", res.FreedBytes,
			"temp_removed", res.TempRemoved, "left_bytes", res.TotalBytes)
	}
	return res, nil
}

// touch marks a blob used now, if its last use is older than touchEvery. A
// blob owned by another user cannot be touched; that only weakens LRU.
func (s *Store) touch(path string, fi fs.FileInfo) {
	now := time.Now()
	if now.Sub(fi.ModTime()) < touchEvery {
		return
	}
	if err := os.Chtimes(path, now, now); err != nil && !errors.Is(err, fs.ErrNotExist) {
		s.log.Debug("store: mark used", "path", path, "err", err)
	}
}

func syncDir(dir string) {
	if f, err := os.Open(dir); err == nil {
		f.Sync()
		f.Close()
	}
}
