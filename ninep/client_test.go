package ninep

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"

	"github.com/hugelgupf/p9/linux"
	"github.com/hugelgupf/p9/p9"
	"golang.org/x/sys/unix"
)

// serveConn serves the 9P stream on conn with s, as a transport would: it
// splits the stream into messages by size[4], serves each on its own
// goroutine and writes the replies back as they come.
func serveConn(t *testing.T, s *Server, conn net.Conn) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var wmu sync.Mutex
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			var hdr [4]byte
			if _, err := io.ReadFull(conn, hdr[:]); err != nil {
				return
			}
			size := binary.LittleEndian.Uint32(hdr[:])
			if size < headerSize || size > MaxMsizeLimit {
				conn.Close()
				return
			}
			req := make([]byte, size)
			copy(req, hdr[:])
			if _, err := io.ReadFull(conn, req[4:]); err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				resp := make([]byte, s.MaxMsize())
				s.Serve(ctx, req, resp, func(r []byte) {
					wmu.Lock()
					defer wmu.Unlock()
					conn.Write(r)
				})
			}()
		}
	}()
	t.Cleanup(func() {
		cancel()
		conn.Close()
		wg.Wait()
	})
}

// newClient returns a p9 client talking to a new server over tree.
func newClient(t *testing.T, tree *memFS, msize uint32, opts Options) (*p9.Client, *Server) {
	t.Helper()
	s := NewServer(tree, opts)
	cc, sc := net.Pipe()
	serveConn(t, s, sc)
	c, err := p9.NewClient(cc, p9.WithMessageSize(msize))
	if err != nil {
		t.Fatalf("NewClient: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	return c, s
}

func attach(t *testing.T, c *p9.Client) p9.File {
	t.Helper()
	root, err := c.Attach("/")
	if err != nil {
		t.Fatalf("Attach: %v", err)
	}
	return root
}

func walk(t *testing.T, f p9.File, names ...string) p9.File {
	t.Helper()
	_, nf, err := f.Walk(names)
	if err != nil {
		t.Fatalf("Walk %q: %v", names, err)
	}
	t.Cleanup(func() { nf.Close() })
	return nf
}

// wantErrno fails unless err is the errno want, as the client decodes it.
func wantErrno(t *testing.T, what string, err error, want unix.Errno) {
	t.Helper()
	var got linux.Errno
	if !errors.As(err, &got) || uintptr(got) != uintptr(want) {
		t.Errorf("%s: error %v, want %v", what, err, want)
	}
}

func TestClientVersion(t *testing.T) {
	tests := []struct {
		name    string
		max     uint32
		client  uint32
		want    uint32
		wantIOU uint32
	}{
		{"client smaller", 0, 64 << 10, 64 << 10, 64<<10 - 24},
		{"client larger", 0, 1 << 20, DefaultMsize, DefaultMsize - 24},
		{"server limit", 8192, 1 << 20, 8192, 8192 - 24},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, s := newClient(t, testTree(), tt.client, Options{MaxMsize: tt.max})
			if got := s.Msize(); got != tt.want {
				t.Fatalf("negotiated msize %d, want %d", got, tt.want)
			}
			root := attach(t, c)
			f := walk(t, root, "etc", "hello")
			_, iounit, err := f.Open(p9.ReadOnly)
			if err != nil {
				t.Fatal(err)
			}
			if iounit != tt.wantIOU {
				t.Errorf("iounit %d, want %d", iounit, tt.wantIOU)
			}
		})
	}
}

func TestClientWalkAndGetattr(t *testing.T) {
	tree := testTree()
	c, _ := newClient(t, tree, 64<<10, Options{})
	root := attach(t, c)
	ino := tree.paths

	// Clone, and ".." at the root stays there.
	qids, clone, err := root.Walk(nil)
	if err != nil || len(qids) != 0 {
		t.Fatalf("clone: %v %v", qids, err)
	}
	defer clone.Close()
	qids, up, err := root.Walk([]string{".."})
	if err != nil || len(qids) != 1 || qids[0].Path != tree.root || qids[0].Type != p9.TypeDir {
		t.Fatalf("walk .. at root: %v %v", qids, err)
	}
	up.Close()
	qids, up, err = root.Walk([]string{"deep", "a", "b", "..", "..", "a", "b", "c"})
	if err != nil || len(qids) != 8 || qids[4].Path != ino["/deep"] || qids[7].Path != ino["/deep/a/b/c"] {
		t.Fatalf("walk with ..: %v %v", qids, err)
	}
	up.Close()

	tests := []struct {
		path  []string
		qtype p9.QIDType
		check func(t *testing.T, a p9.Attr)
	}{
		{[]string{"etc"}, p9.TypeDir, func(t *testing.T, a p9.Attr) {
			if a.Mode != p9.FileMode(unix.S_IFDIR|0o755) || a.NLink != 2 {
				t.Errorf("dir attr %v", a)
			}
		}},
		{[]string{"etc", "hello"}, p9.TypeRegular, func(t *testing.T, a p9.Attr) {
			if a.Size != uint64(len(helloText)) || a.NLink != 2 || a.Blocks != 1 || a.BlockSize != 4096 || a.UID != 1000 || a.GID != 1000 {
				t.Errorf("file attr %v", a)
			}
			if a.MTimeSeconds != uint64(memTime.Unix()) || a.MTimeNanoSeconds != uint64(memTime.Nanosecond()) ||
				a.ATimeSeconds != a.MTimeSeconds || a.CTimeSeconds != a.MTimeSeconds || a.CTimeNanoSeconds != a.MTimeNanoSeconds {
				t.Errorf("times %v", a)
			}
		}},
		{[]string{"etc", "link"}, p9.TypeSymlink, func(t *testing.T, a p9.Attr) {
			if a.Mode&p9.FileModeMask != p9.ModeSymlink || a.Size != 5 {
				t.Errorf("symlink attr %v", a)
			}
		}},
		{[]string{"bin", "ping"}, p9.TypeRegular, func(t *testing.T, a p9.Attr) {
			if a.Mode != p9.FileMode(unix.S_IFREG|unix.S_ISUID|0o755) || a.UID != 0 {
				t.Errorf("setuid attr %v", a)
			}
		}},
		{[]string{"dev", "null"}, p9.TypeRegular, func(t *testing.T, a p9.Attr) {
			if a.Mode&p9.FileModeMask != p9.ModeCharacterDevice || uint64(a.RDev) != unix.Mkdev(1, 3) {
				t.Errorf("char dev attr %v", a)
			}
		}},
		{[]string{"dev", "sda"}, p9.TypeRegular, func(t *testing.T, a p9.Attr) {
			if a.Mode&p9.FileModeMask != p9.ModeBlockDevice || uint64(a.RDev) != unix.Mkdev(8, 0) {
				t.Errorf("block dev attr %v", a)
			}
		}},
		{[]string{"big"}, p9.TypeRegular, func(t *testing.T, a p9.Attr) {
			if a.Size != bigSize || a.Blocks != (bigSize+511)/512 {
				t.Errorf("big attr %v", a)
			}
		}},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprint(tt.path), func(t *testing.T) {
			qids, f, err := root.Walk(tt.path)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			last := qids[len(qids)-1]
			if last.Type != tt.qtype || last.Version != 0 {
				t.Errorf("qid %v, want type %d", last, tt.qtype)
			}
			q, valid, a, err := f.GetAttr(p9.AttrMaskAll)
			if err != nil {
				t.Fatal(err)
			}
			if q != last || !valid.Mode || !valid.Size || !valid.Blocks || !valid.RDev || !valid.MTime {
				t.Errorf("getattr qid %v (walk gave %v), valid %v", q, last, valid)
			}
			tt.check(t, a)
		})
	}

	// A hard link is the same file.
	q1, _, _, _ := walk(t, root, "etc", "hello").GetAttr(p9.AttrMaskAll)
	q2, _, _, _ := walk(t, root, "etc", "hard").GetAttr(p9.AttrMaskAll)
	if q1.Path != q2.Path || q1.Path != ino["/etc/hello"] {
		t.Errorf("hard link qids %v and %v", q1, q2)
	}

	_, _, err = root.Walk([]string{"nothere"})
	wantErrno(t, "walk to a missing name", err, unix.ENOENT)
	_, _, err = root.Walk([]string{"etc", "hello", "x"})
	if err != nil {
		// The client reports a partial walk as a success with fewer qids;
		// either way the server must not fail the first step.
		t.Errorf("partial walk: %v", err)
	}
}

func TestClientReadlinkStatfs(t *testing.T) {
	tree := testTree()
	c, _ := newClient(t, tree, 64<<10, Options{})
	root := attach(t, c)
	if target, err := walk(t, root, "etc", "link").Readlink(); err != nil || target != "hello" {
		t.Errorf("readlink: %q %v", target, err)
	}
	_, err := walk(t, root, "etc", "hello").Readlink()
	wantErrno(t, "readlink of a file", err, unix.EINVAL)
	st, err := root.StatFS()
	if err != nil {
		t.Fatal(err)
	}
	want := tree.StatFS()
	if st.Type != V9FSMagic || st.BlockSize != 4096 || st.Blocks != want.Blocks || st.BlocksFree != 0 || st.BlocksAvailable != 0 ||
		st.Files != want.Files || st.FilesFree != 0 || st.NameLength != 255 {
		t.Errorf("statfs %+v, tree %+v", st, want)
	}
}

func TestClientRead(t *testing.T) {
	tree := testTree()
	const msize = 64 << 10
	c, s := newClient(t, tree, msize, Options{})
	root := attach(t, c)
	big := walk(t, root, "big")
	if _, _, err := big.Open(p9.ReadOnly); err != nil {
		t.Fatal(err)
	}
	data := tree.nodes[tree.paths["/big"]].data
	payload := msize - rreadHeader
	tests := []struct {
		off, n int
	}{
		{0, 0}, {0, 1}, {0, 4096}, {1, 4095}, {bigSize - 1, 1}, {bigSize - 1, 10}, {bigSize, 1}, {bigSize + 1, 100},
		{0, payload}, {0, payload + 1}, {12345, 3 * msize}, {bigSize - payload, payload}, {1 << 40, 10},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprintf("%d+%d", tt.off, tt.n), func(t *testing.T) {
			buf := make([]byte, tt.n)
			n, err := big.ReadAt(buf, int64(tt.off))
			want := 0
			if tt.off < bigSize {
				want = min(tt.n, bigSize-tt.off)
			}
			if n != want || (err != nil && err != io.EOF) {
				t.Fatalf("read %d bytes, err %v; want %d", n, err, want)
			}
			if n > 0 && !bytes.Equal(buf[:n], data[tt.off:tt.off+n]) {
				t.Fatal("wrong data")
			}
		})
	}
	before := s.Stats().BytesRead

	// A Tread over msize is clamped, not refused.
	r := rawOn(t, s)
	fid := r.walkOpen("big")
	resp := r.do(tmsg(tread, 1, fid, uint64(0), uint32(1<<30)))
	if resp.typ != tread+1 || resp.size != msize || int(binary.LittleEndian.Uint32(resp.body)) != payload {
		t.Errorf("Tread of 1 GiB: %s, %d bytes; want Rread of %d", resp, resp.size, msize)
	}
	if got := s.Stats().BytesRead - before; got != uint64(payload) {
		t.Errorf("BytesRead grew by %d, want %d", got, payload)
	}

	// A directory, a fid not open and the EIO file.
	dir := walk(t, root, "etc")
	if _, _, err := dir.Open(p9.ReadOnly); err != nil {
		t.Fatal(err)
	}
	_, err := dir.ReadAt(make([]byte, 10), 0)
	wantErrno(t, "read of a directory", err, unix.EISDIR)
	_, err = walk(t, root, "etc", "hello").ReadAt(make([]byte, 10), 0)
	wantErrno(t, "read of a fid not open", err, unix.EBADF)
	bad := walk(t, root, "bad")
	if _, _, err := bad.Open(p9.ReadOnly); err != nil {
		t.Fatal(err)
	}
	_, err = bad.ReadAt(make([]byte, 10), 0)
	wantErrno(t, "read of a file whose fetch fails", err, unix.EIO)
}

func TestClientOpen(t *testing.T) {
	tree := testTree()
	c, _ := newClient(t, tree, 64<<10, Options{})
	root := attach(t, c)
	tests := []struct {
		path  []string
		flags p9.OpenFlags
		want  unix.Errno // 0: success
	}{
		{[]string{"etc", "hello"}, p9.ReadOnly, 0},
		{[]string{"etc"}, p9.ReadOnly, 0},
		{[]string{"etc"}, p9.OpenFlags(unix.O_DIRECTORY), 0},
		{[]string{"etc", "hello"}, p9.OpenFlags(unix.O_DIRECTORY), unix.ENOTDIR},
		{[]string{"etc", "hello"}, p9.WriteOnly, unix.EROFS},
		{[]string{"etc", "hello"}, p9.ReadWrite, unix.EROFS},
		{[]string{"etc", "hello"}, p9.OpenFlags(unix.O_TRUNC), unix.EROFS},
		{[]string{"etc", "hello"}, p9.OpenFlags(unix.O_CREAT), unix.EROFS},
		{[]string{"etc"}, p9.ReadWrite, unix.EROFS},
		{[]string{"etc", "link"}, p9.ReadOnly, unix.ELOOP},
		{[]string{"dev", "null"}, p9.ReadOnly, unix.EINVAL},
		{[]string{"etc", "hello"}, p9.OpenFlags(unix.O_NOATIME | unix.O_LARGEFILE | unix.O_CLOEXEC | unix.O_NONBLOCK), 0},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprintf("%v %#o", tt.path, tt.flags), func(t *testing.T) {
			f := walk(t, root, tt.path...)
			q, _, err := f.Open(tt.flags)
			if tt.want != 0 {
				wantErrno(t, "open", err, tt.want)
				return
			}
			if err != nil || q.Path != tree.paths["/"+joinPath(tt.path)] {
				t.Fatalf("open: %v %v", q, err)
			}
			if _, _, err := f.Open(tt.flags); err == nil {
				t.Error("second open of a fid succeeded")
			}
		})
	}
}

func joinPath(p []string) string {
	var b bytes.Buffer
	for i, s := range p {
		if i > 0 {
			b.WriteByte('/')
		}
		b.WriteString(s)
	}
	return b.String()
}

func TestClientReaddir(t *testing.T) {
	tree := testTree()
	c, _ := newClient(t, tree, 64<<10, Options{})
	root := attach(t, c)
	dir := walk(t, root, "many")
	if _, _, err := dir.Open(p9.ReadOnly); err != nil {
		t.Fatal(err)
	}
	want := []string{".", ".."}
	for i := range manyFiles {
		want = append(want, fmt.Sprintf("f%03d", i))
	}
	// Every count from the smallest that holds one entry, resuming from
	// the last entry's offset each time: every name once, in order.
	for _, count := range []uint32{direntSizeFor("f000"), direntSizeFor("f000") + 1, 100, 1000, 64 << 10} {
		var got []string
		off := uint64(0)
		for calls := 0; ; calls++ {
			if calls > 2*len(want) {
				t.Fatalf("count %d: no end after %d calls", count, calls)
			}
			ents, err := dir.Readdir(off, count)
			if err != nil {
				t.Fatalf("count %d offset %d: %v", count, off, err)
			}
			if len(ents) == 0 {
				break
			}
			for _, e := range ents {
				got = append(got, e.Name)
				off = e.Offset
			}
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("count %d: names\n%v\nwant\n%v", count, got, want)
		}
	}
	// Resumable at every offset; the entries carry qids and DT_ types.
	all, err := dir.Readdir(0, 64<<10)
	if err != nil || len(all) != len(want) {
		t.Fatalf("whole listing: %d entries, %v", len(all), err)
	}
	for i := range all {
		ents, err := dir.Readdir(uint64(i), 64)
		if err != nil || len(ents) == 0 || ents[0].Name != want[i] || ents[0].Offset != uint64(i+1) {
			t.Fatalf("at offset %d: %v %v", i, ents, err)
		}
	}
	if all[0].QID.Path != tree.paths["/many"] || all[1].QID.Path != tree.root || all[2].QID.Path != tree.paths["/many/f000"] {
		t.Errorf("qids of ., .., f000: %v %v %v", all[0].QID, all[1].QID, all[2].QID)
	}
	if all[0].Type != unix.DT_DIR || all[2].Type != unix.DT_REG {
		t.Errorf("types %d %d", all[0].Type, all[2].Type)
	}
	if ents, err := dir.Readdir(uint64(len(want)), 1000); err != nil || len(ents) != 0 {
		t.Errorf("past the end: %v %v", ents, err)
	}
	if ents, err := dir.Readdir(1<<62, 1000); err != nil || len(ents) != 0 {
		t.Errorf("far past the end: %v %v", ents, err)
	}

	// Types of other entries.
	devs := walk(t, root, "etc")
	if _, _, err := devs.Open(p9.ReadOnly); err != nil {
		t.Fatal(err)
	}
	ents, err := devs.Readdir(2, 1000)
	if err != nil {
		t.Fatal(err)
	}
	types := map[string]uint8{}
	for _, e := range ents {
		types[e.Name] = uint8(e.Type)
	}
	if types["link"] != unix.DT_LNK || types["hello"] != unix.DT_REG || types["hard"] != unix.DT_REG {
		t.Errorf("entry types %v", types)
	}
	_, err = walk(t, root, "etc", "hello").Readdir(0, 1000)
	wantErrno(t, "readdir of a fid not open", err, unix.EBADF)
	f := walk(t, root, "etc", "hello")
	f.Open(p9.ReadOnly)
	_, err = f.Readdir(0, 1000)
	wantErrno(t, "readdir of a file", err, unix.ENOTDIR)
}

func direntSizeFor(name string) uint32 { return uint32(direntSize(name)) }

func TestClientChangesRefused(t *testing.T) {
	tree := testTree()
	c, s := newClient(t, tree, 64<<10, Options{})
	root := attach(t, c)
	etc := walk(t, root, "etc")
	hello := walk(t, root, "etc", "hello")
	tests := []struct {
		name string
		do   func() error
	}{
		{"create", func() error { _, _, _, err := etc.Create("new", p9.ReadWrite, 0o644, 0, 0); return err }},
		{"mkdir", func() error { _, err := etc.Mkdir("d", 0o755, 0, 0); return err }},
		{"symlink", func() error { _, err := etc.Symlink("x", "s", 0, 0); return err }},
		{"link", func() error { return etc.Link(hello, "l") }},
		{"mknod", func() error { _, err := etc.Mknod("n", p9.ModeNamedPipe|0o644, 0, 0, 0, 0); return err }},
		{"renameat", func() error { return etc.RenameAt("hello", etc, "bye") }},
		{"rename", func() error { return hello.Rename(root, "bye") }},
		{"unlinkat", func() error { return etc.UnlinkAt("hello", 0) }},
		{"setattr", func() error {
			return hello.SetAttr(p9.SetAttrMask{Size: true}, p9.SetAttr{Size: 0})
		}},
		{"write", func() error { _, err := hello.WriteAt([]byte("x"), 0); return err }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			wantErrno(t, tt.name, tt.do(), unix.EROFS)
		})
	}
	if err := hello.FSync(); err != nil {
		t.Errorf("fsync: %v", err)
	}
	// Remove fails but clunks the fid.
	n := s.Fids()
	_, f, err := root.Walk([]string{"etc", "hello"})
	if err != nil {
		t.Fatal(err)
	}
	if s.Fids() != n+1 {
		t.Fatalf("fids %d after walk, want %d", s.Fids(), n+1)
	}
	wantErrno(t, "remove", f.(interface{ Remove() error }).Remove(), unix.EROFS)
	if s.Fids() != n {
		t.Errorf("fids %d after remove, want %d", s.Fids(), n)
	}
	if _, ok := tree.paths["/etc/new"]; ok || len(tree.nodes[tree.paths["/etc"]].entries) != 3 {
		t.Error("the tree changed")
	}
}

// TestClientConcurrent reads many files at once through one connection.
func TestClientConcurrent(t *testing.T) {
	tree := testTree()
	c, s := newClient(t, tree, 64<<10, Options{})
	root := attach(t, c)
	data := tree.nodes[tree.paths["/big"]].data
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for g := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, f, err := root.Walk([]string{"big"})
			if err != nil {
				errs <- err
				return
			}
			defer f.Close()
			if _, _, err := f.Open(p9.ReadOnly); err != nil {
				errs <- err
				return
			}
			buf := make([]byte, 100000)
			off := int64(g * 7919)
			n, err := f.ReadAt(buf, off)
			if err != nil || n != len(buf) || !bytes.Equal(buf, data[off:off+int64(n)]) {
				errs <- fmt.Errorf("goroutine %d: read %d, %v", g, n, err)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if st := s.Stats(); st.Panics != 0 || st.Requests == 0 {
		t.Errorf("stats %+v", st)
	}
}

// BenchmarkRead measures Tread of msize-sized chunks of a file held in
// memory, through HandleTo into a reused buffer: the server's own cost.
func BenchmarkRead(b *testing.B) {
	tree := testTree()
	s := NewServer(tree, Options{})
	ctx := context.Background()
	resp := make([]byte, DefaultMsize)
	for _, m := range [][]byte{
		tmsg(tversion, NoTag, uint32(DefaultMsize), "9P2000.L"),
		tmsg(tattach, 1, uint32(1), uint32(NoFid), "", "", uint32(0)),
		tmsg(twalk, 1, uint32(1), uint32(2), uint16(1), "big"),
		tmsg(tlopen, 1, uint32(2), uint32(0)),
	} {
		if n := s.HandleTo(ctx, m, resp); resp[4] == rlerror {
			b.Fatalf("setup: % x", resp[:n])
		}
	}
	count := uint32(DefaultMsize - rreadHeader)
	b.SetBytes(int64(count))
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		off := uint64(i%2) * uint64(count)
		if n := s.HandleTo(ctx, tmsg(tread, 1, uint32(2), off, count), resp); n != DefaultMsize {
			b.Fatalf("Rread of %d bytes", n)
		}
	}
}

// BenchmarkGetattr measures a small request's round trip.
func BenchmarkGetattr(b *testing.B) {
	tree := testTree()
	s := NewServer(tree, Options{})
	ctx := context.Background()
	resp := make([]byte, 8192)
	s.HandleTo(ctx, tmsg(tversion, NoTag, uint32(8192), "9P2000.L"), resp)
	s.HandleTo(ctx, tmsg(tattach, 1, uint32(1), uint32(NoFid), "", "", uint32(0)), resp)
	req := tmsg(tgetattr, 1, uint32(1), uint64(getattrBasic))
	b.ReportAllocs()
	for b.Loop() {
		if n := s.HandleTo(ctx, req, resp); n != 160 {
			b.Fatalf("Rgetattr of %d bytes", n)
		}
	}
}
