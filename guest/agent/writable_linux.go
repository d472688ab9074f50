package agent

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/guest/agentpb"
	"github.com/kilnvm/kiln/guest/pid1"
)

// The parts of a writable-layer archive (ExportWritable): the image
// root's overlay upper layer as a layer diff (OCI whiteouts), applied
// over the root; /tmp (a tmpfs of its own) and the container engines'
// storage, kept as they are.
const (
	partRoot    = "root/"
	partTmp     = "tmp/"
	partStorage = "storage/"
)

// OCI's whiteout names: ".wh.NAME" hides NAME of the lower layer,
// ".wh..wh..opq" every entry of the folder it is in.
const (
	whiteoutPrefix = ".wh."
	whiteoutOpaque = ".wh..wh..opq"
)

// writableParts are the trees of an image root's writes: where each is in
// the guest and whether its entries are a layer diff.
func (s *Server) writableParts() ([]writablePart, error) {
	rw := s.cfg.WritableDir
	if rw == "" {
		return nil, status.Error(codes.FailedPrecondition, "the guest's root is no image root: it has no writable layer of its own")
	}
	if _, err := os.Stat(filepath.Join(rw, "upper")); err != nil {
		return nil, status.Errorf(codes.FailedPrecondition, "the image root's writable layer: %v", err)
	}
	return []writablePart{
		{prefix: partRoot, dir: filepath.Join(rw, "upper"), apply: "/", diff: true},
		{prefix: partTmp, dir: "/tmp", apply: "/tmp"},
		{prefix: partStorage, dir: filepath.Join(rw, "storage"), apply: filepath.Join(rw, "storage")},
	}, nil
}

type writablePart struct {
	prefix string
	dir    string // read from on export
	apply  string // written to on import
	diff   bool   // an overlay upper layer: whiteouts are a diff's
}

// ExportWritable streams an image root's writes as a tar (see the part
// constants), for a pause that keeps files and not memory.
func (s *Server) ExportWritable(_ *agentpb.ExportWritableRequest, stream agentpb.Agent_ExportWritableServer) error {
	parts, err := s.writableParts()
	if err != nil {
		return err
	}
	w := chunkWriter(func(b []byte) error { return stream.Send(&agentpb.Chunk{Data: b}) })
	if err := exportWritable(stream.Context(), bufferedTo(w), parts); err != nil {
		return status.Errorf(codes.Internal, "exporting the writable layer: %v", err)
	}
	return nil
}

// bufferedTo batches small tar records into messages of up to
// agentpb.MaxChunkSize.
func bufferedTo(w io.Writer) *chunkBuffer { return &chunkBuffer{w: w} }

type chunkBuffer struct {
	w   io.Writer
	buf []byte
}

func (b *chunkBuffer) Write(p []byte) (int, error) {
	n := len(p)
	for len(p) > 0 {
		room := agentpb.MaxChunkSize - len(b.buf)
		take := min(room, len(p))
		b.buf = append(b.buf, p[:take]...)
		p = p[take:]
		if len(b.buf) == agentpb.MaxChunkSize {
			if err := b.Flush(); err != nil {
				return 0, err
			}
		}
	}
	return n, nil
}

func (b *chunkBuffer) Flush() error {
	if len(b.buf) == 0 {
		return nil
	}
	_, err := b.w.Write(b.buf)
	b.buf = b.buf[:0]
	return err
}

// exportWritable writes parts as one tar to w.
func exportWritable(ctx context.Context, w *chunkBuffer, parts []writablePart) error {
	tw := tar.NewWriter(w)
	for _, p := range parts {
		if err := exportPart(ctx, tw, p); err != nil {
			return err
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}
	return w.Flush()
}

// exportPart writes the tree of p under its prefix: not crossing into
// other file systems (a container's mounts), hard links kept, overlay
// whiteouts and opaque folders written as OCI's.
func exportPart(ctx context.Context, tw *tar.Writer, p writablePart) error {
	var root unix.Stat_t
	if err := unix.Lstat(p.dir, &root); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil
		}
		return fmt.Errorf("%s: %w", p.dir, err)
	}
	links := map[[2]uint64]string{}
	mounts := mountPoints()
	return filepath.WalkDir(p.dir, func(full string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		rel, err := filepath.Rel(p.dir, full)
		if err != nil || rel == "." {
			return err
		}
		var st unix.Stat_t
		if err := unix.Lstat(full, &st); err != nil {
			return fmt.Errorf("%s: %w", full, err)
		}
		if st.Dev != root.Dev || p.diff && mounts[filepath.Join(p.apply, rel)] {
			// A mount: not the part's. In the root, the folder an
			// upper layer holds for a mount point (the modules disk,
			// the engines' storage) is the mount's, not the writes'.
			if d.IsDir() {
				return fs.SkipDir
			}
			return nil
		}
		name := p.prefix + filepath.ToSlash(rel)
		mode := st.Mode & unix.S_IFMT
		if p.diff && mode == unix.S_IFCHR && st.Rdev == 0 {
			// overlayfs's whiteout: the lower entry is gone.
			return tw.WriteHeader(&tar.Header{Name: path.Join(path.Dir(name), whiteoutPrefix+path.Base(name)), Typeflag: tar.TypeReg, Mode: 0o600, ModTime: time.Unix(0, 0)})
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		target := ""
		if mode == unix.S_IFLNK {
			if target, err = os.Readlink(full); err != nil {
				return err
			}
		}
		hdr, err := tar.FileInfoHeader(info, target)
		if err != nil {
			return fmt.Errorf("%s: %w", full, err)
		}
		hdr.Name, hdr.Uname, hdr.Gname = name, "", ""
		hdr.Uid, hdr.Gid = int(st.Uid), int(st.Gid)
		hdr.Format = tar.FormatPAX
		if mode == unix.S_IFDIR {
			hdr.Name += "/"
		}
		if x := xattrs(full, p.diff); len(x) > 0 {
			hdr.PAXRecords = x
		}
		if mode == unix.S_IFREG && st.Nlink > 1 {
			key := [2]uint64{st.Dev, st.Ino}
			if first, ok := links[key]; ok {
				hdr.Typeflag, hdr.Linkname, hdr.Size = tar.TypeLink, first, 0
				return tw.WriteHeader(hdr)
			}
			links[key] = name
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if p.diff && mode == unix.S_IFDIR && opaque(full) {
			if err := tw.WriteHeader(&tar.Header{Name: name + "/" + whiteoutOpaque, Typeflag: tar.TypeReg, Mode: 0o600, ModTime: time.Unix(0, 0)}); err != nil {
				return err
			}
		}
		if mode != unix.S_IFREG {
			return nil
		}
		f, err := os.Open(full)
		if err != nil {
			return err
		}
		defer f.Close()
		if _, err := io.CopyN(tw, f, hdr.Size); err != nil {
			return fmt.Errorf("%s: %w", full, err)
		}
		return nil
	})
}

// mountPoints are the paths this process's mounts are on
// (/proc/self/mountinfo, as pid1 reads it). A comparison of st_dev would
// not do: overlayfs reports a file's upper layer's device for it, not the
// overlay's.
func mountPoints() map[string]bool {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	out := map[string]bool{}
	for _, p := range pid1.MountPoints(b) {
		out[p] = true
	}
	return out
}

// opaque says folder p of an overlay upper layer hides the lower's.
func opaque(p string) bool {
	var b [8]byte
	for _, name := range []string{"trusted.overlay.opaque", "user.overlay.opaque"} {
		if n, err := unix.Lgetxattr(p, name, b[:]); err == nil && n == 1 && b[0] == 'y' {
			return true
		}
	}
	return false
}

// xattrs are p's extended attributes as PAX records, overlayfs's own left
// out of a diff.
func xattrs(p string, diff bool) map[string]string {
	buf := make([]byte, 4096)
	n, err := unix.Llistxattr(p, buf)
	if err != nil || n <= 0 {
		return nil
	}
	out := map[string]string{}
	for _, name := range strings.Split(strings.TrimRight(string(buf[:n]), "\x00"), "\x00") {
		if name == "" || diff && (strings.HasPrefix(name, "trusted.overlay.") || strings.HasPrefix(name, "user.overlay.")) {
			continue
		}
		v := make([]byte, 64<<10)
		m, err := unix.Lgetxattr(p, name, v)
		if err != nil {
			continue
		}
		out["SCHILY.xattr."+name] = string(v[:m])
	}
	return out
}

// ImportWritable applies an ExportWritable tar to this guest's root: its
// diff over the root (whiteouts remove), the rest as it was.
func (s *Server) ImportWritable(stream agentpb.Agent_ImportWritableServer) error {
	parts, err := s.writableParts()
	if err != nil {
		return err
	}
	r := &chunkReader{recv: func() ([]byte, error) {
		m, err := stream.Recv()
		return m.GetData(), err
	}}
	if err := importWritable(stream.Context(), r, parts); err != nil {
		return status.Errorf(codes.InvalidArgument, "importing the writable layer: %v", err)
	}
	return stream.SendAndClose(&agentpb.ImportWritableResponse{})
}

// chunkReader reads the data of a stream of messages.
type chunkReader struct {
	recv func() ([]byte, error)
	buf  []byte
}

func (r *chunkReader) Read(p []byte) (int, error) {
	for len(r.buf) == 0 {
		b, err := r.recv()
		if err != nil {
			return 0, err
		}
		r.buf = b
	}
	n := copy(p, r.buf)
	r.buf = r.buf[n:]
	return n, nil
}

// importWritable applies the tar r to parts.
func importWritable(ctx context.Context, r io.Reader, parts []writablePart) error {
	tr := tar.NewReader(r)
	type dirTime struct {
		path string
		t    time.Time
	}
	var dirs []dirTime // set once their entries are in
	mounts := mountPoints()
	for {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return err
		}
		var part *writablePart
		var rel string
		for i := range parts {
			if r, ok := strings.CutPrefix(hdr.Name, parts[i].prefix); ok {
				part, rel = &parts[i], strings.TrimSuffix(r, "/")
				break
			}
		}
		if part == nil || rel == "" || !filepath.IsLocal(rel) {
			return fmt.Errorf("entry %q: not in a part of the layer", hdr.Name)
		}
		target := filepath.Join(part.apply, filepath.FromSlash(rel))
		base := path.Base(rel)
		if part.diff && base == whiteoutOpaque {
			if err := clearDir(filepath.Dir(target)); err != nil {
				return err
			}
			continue
		}
		if part.diff && strings.HasPrefix(base, whiteoutPrefix) {
			gone := filepath.Join(filepath.Dir(target), strings.TrimPrefix(base, whiteoutPrefix))
			if err := os.RemoveAll(gone); err != nil {
				return err
			}
			continue
		}
		if mounts[target] {
			continue // a mount of this boot's (an export leaves them out)
		}
		if err := applyEntry(tr, hdr, target, part); err != nil {
			return fmt.Errorf("%s: %w", target, err)
		}
		if hdr.Typeflag == tar.TypeDir {
			dirs = append(dirs, dirTime{target, hdr.ModTime})
		}
	}
	for i := len(dirs) - 1; i >= 0; i-- {
		os.Chtimes(dirs[i].path, dirs[i].t, dirs[i].t)
	}
	return nil
}

// clearDir removes what folder dir holds (a lower layer's entries under
// an opaque folder).
func clearDir(dir string) error {
	ents, err := os.ReadDir(dir)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		return err
	}
	for _, e := range ents {
		if err := os.RemoveAll(filepath.Join(dir, e.Name())); err != nil {
			return err
		}
	}
	return nil
}

// applyEntry makes target what hdr says, replacing what is there unless
// both are folders.
func applyEntry(tr *tar.Reader, hdr *tar.Header, target string, part *writablePart) error {
	if fi, err := os.Lstat(target); err == nil && !(fi.IsDir() && hdr.Typeflag == tar.TypeDir) {
		if err := os.RemoveAll(target); err != nil {
			return err
		}
	}
	if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
		return err
	}
	mode := uint32(hdr.Mode & 0o7777)
	switch hdr.Typeflag {
	case tar.TypeDir:
		if err := os.Mkdir(target, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
			return err
		}
	case tar.TypeReg:
		f, err := os.OpenFile(target, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
		if err != nil {
			return err
		}
		_, err = io.Copy(f, tr)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
	case tar.TypeSymlink:
		if err := os.Symlink(hdr.Linkname, target); err != nil {
			return err
		}
		return unix.Lchown(target, hdr.Uid, hdr.Gid)
	case tar.TypeLink:
		rel, ok := strings.CutPrefix(hdr.Linkname, part.prefix)
		if !ok || !filepath.IsLocal(rel) {
			return fmt.Errorf("hard link to %q: not in its part", hdr.Linkname)
		}
		return os.Link(filepath.Join(part.apply, filepath.FromSlash(rel)), target)
	case tar.TypeChar, tar.TypeBlock, tar.TypeFifo:
		kind := map[byte]uint32{tar.TypeChar: unix.S_IFCHR, tar.TypeBlock: unix.S_IFBLK, tar.TypeFifo: unix.S_IFIFO}[hdr.Typeflag]
		if err := unix.Mknod(target, kind|mode, int(unix.Mkdev(uint32(hdr.Devmajor), uint32(hdr.Devminor)))); err != nil {
			return err
		}
	default:
		return fmt.Errorf("entry type %q: not a file, folder, link or device", hdr.Typeflag)
	}
	for k, v := range hdr.PAXRecords {
		if name, ok := strings.CutPrefix(k, "SCHILY.xattr."); ok {
			unix.Lsetxattr(target, name, []byte(v), 0) // best effort: a file system without them
		}
	}
	if err := os.Lchown(target, hdr.Uid, hdr.Gid); err != nil {
		return err
	}
	if err := os.Chmod(target, fs.FileMode(mode&0o777)|modeBits(mode)); err != nil {
		return err
	}
	return os.Chtimes(target, hdr.ModTime, hdr.ModTime)
}

// modeBits are setuid, setgid and sticky of a tar mode as fs.FileMode's.
func modeBits(m uint32) fs.FileMode {
	var out fs.FileMode
	if m&unix.S_ISUID != 0 {
		out |= fs.ModeSetuid
	}
	if m&unix.S_ISGID != 0 {
		out |= fs.ModeSetgid
	}
	if m&unix.S_ISVTX != 0 {
		out |= fs.ModeSticky
	}
	return out
}
