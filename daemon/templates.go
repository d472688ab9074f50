package daemon

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// Limits of a template's request.
const (
	maxSetupArgs = 4096
	maxSetupArg  = 1 << 20
	maxPoolSize  = 256
	// setupOutputTail is how much of a failed setup's output its error
	// quotes.
	setupOutputTail = 2048
)

// Name prefixes of the sandbox folders a template makes: its builder and
// its pool's sandboxes (the same length as a sandbox's, for the socket
// paths' sake).
const (
	builderPrefix = "tb-"
	poolPrefix    = "pl-"
)

// templateRecord is what the state folder keeps of a template
// (StateDir/templates/ID.json, its snapshot in StateDir/templates/ID/).
type templateRecord struct {
	ID          string   `json:"id"`
	Name        string   `json:"name,omitempty"`
	ImageRef    string   `json:"image_ref"`
	ImageDigest string   `json:"image_digest,omitempty"`
	Setup       []string `json:"setup,omitempty"`
	CPUs        uint32   `json:"cpus"`
	MemoryMiB   uint32   `json:"memory_mib"`
	DiskMiB     uint32   `json:"disk_mib,omitempty"`
	// Init is its sandbox's process 1: "" (the agent) or "systemd".
	Init     string `json:"init,omitempty"`
	PoolSize uint32 `json:"pool_size,omitempty"`
	// Dir is the template's snapshot.
	Dir           string `json:"dir"`
	CreatedUnixMS int64  `json:"created_unix_ms"`
	RequestID     string `json:"request_id,omitempty"`
	RequestKey    string `json:"request_key,omitempty"`
	// Net says its snapshot has a network card: its sandboxes need a
	// network (Config.Network).
	Net bool `json:"net,omitempty"`
}

// template is a template the server knows: building (only its request
// ID finds it) or ready.
type template struct {
	rec templateRecord
	// ready is closed once the build has finished; err says how.
	ready chan struct{}
	err   error
	// deleting: DeleteTemplate is under way, creates are refused.
	deleting bool
	pool     *pool
	// secrets are the setup's, in memory only, until the build ends.
	secrets []secret
}

func (s *Server) templatePath(id string) string {
	return filepath.Join(s.cfg.StateDir, templatesDir, id+".json")
}

// CreateTemplate boots an image once, runs the setup command in it, and
// keeps a snapshot of the sandbox as it is then: CreateSandbox from the
// template restores that snapshot instead of booting. It returns once
// the template is ready. With pool_size, the server keeps that many
// sandboxes restored from it and ready to hand out.
func (s *Server) CreateTemplate(ctx context.Context, req *kilnpb.CreateTemplateRequest) (_ *kilnpb.Template, err error) {
	defer func() { s.metrics.opDone(opTemplate, time.Time{}, err) }()
	if err := checkRequestID(req.GetRequestId()); err != nil {
		return nil, err
	}
	if n := req.GetName(); n != "" {
		if err := checkID("template name", n); err != nil {
			return nil, err
		}
		if strings.HasPrefix(n, "tp-") {
			return nil, status.Errorf(codes.InvalidArgument, "template name %q: the prefix tp- is kept for template IDs", n)
		}
	}
	img := req.GetImage()
	if img == "" || strings.ContainsRune(img, 0) {
		return nil, status.Errorf(codes.InvalidArgument, "image %q: want an image reference or manifest digest", img)
	}
	if err := checkSetup(req.GetSetup()); err != nil {
		return nil, err
	}
	init, err := checkInit(req.GetInit())
	if err != nil {
		return nil, err
	}
	secrets, err := checkSecrets("secrets", req.GetSecrets())
	if err != nil {
		return nil, err
	}
	cpus, mem, err := s.resources(req.GetResources())
	if err != nil {
		return nil, err
	}
	if n := req.GetPoolSize(); n > maxPoolSize {
		return nil, status.Errorf(codes.InvalidArgument, "pool_size %d: at most %d", n, maxPoolSize)
	}
	egress, err := s.requestEgress("egress", req.GetEgress())
	if err != nil {
		return nil, err
	}
	keyReq := proto.Clone(req).(*kilnpb.CreateTemplateRequest)
	keyReq.RequestId = ""
	keyReq.Secrets = withoutValues(keyReq.Secrets) // no digest of a value on disk
	t := &template{ready: make(chan struct{}), secrets: secrets, rec: templateRecord{
		ID: newID("tp-"), Name: req.GetName(), ImageRef: img, Setup: req.GetSetup(),
		CPUs: cpus, MemoryMiB: mem, DiskMiB: req.GetResources().GetDiskMib(), PoolSize: req.GetPoolSize(), Init: init,
		RequestID: req.GetRequestId(), RequestKey: requestKey("template", keyReq),
		Net: s.cfg.Network != nil,
	}}
	t.rec.Dir = filepath.Join(s.cfg.StateDir, templatesDir, t.rec.ID)

	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, status.Error(codes.Unavailable, "kilnd is shutting down")
	}
	if o := s.templateReqs[t.rec.RequestID]; o != nil {
		s.mu.Unlock()
		select {
		case <-o.ready:
		case <-ctx.Done():
			return nil, status.FromContextError(ctx.Err()).Err()
		}
		if o.rec.RequestKey != t.rec.RequestKey {
			return nil, status.Errorf(codes.AlreadyExists, "request_id %q made template %s with other parameters", t.rec.RequestID, o.rec.ID)
		}
		if o.err != nil {
			return nil, o.err
		}
		return s.templateProto(o), nil
	}
	if n := t.rec.Name; n != "" {
		for _, o := range s.templateReqs {
			if o.rec.Name == n {
				s.mu.Unlock()
				return nil, status.Errorf(codes.AlreadyExists, "a template named %q exists (%s)", n, o.rec.ID)
			}
		}
	}
	// The builder is a sandbox of the host's, for as long as it runs.
	if err := s.admitLocked(1, uint64(mem)); err != nil {
		s.mu.Unlock()
		return nil, err
	}
	s.templateReqs[t.rec.RequestID] = t
	s.building++
	s.buildingMiB += uint64(mem)
	s.mu.Unlock()

	err = s.buildTemplate(t, egress)
	for _, sec := range t.secrets {
		clear(sec.Value)
	}
	t.secrets = nil
	s.mu.Lock()
	s.building--
	s.buildingMiB -= uint64(mem)
	if err != nil {
		delete(s.templateReqs, t.rec.RequestID) // a retry builds afresh
	} else {
		s.templates[t.rec.ID] = t
	}
	t.err = err
	close(t.ready)
	s.mu.Unlock()
	if err != nil {
		return nil, err
	}
	s.startPool(t)
	s.log.Info("template ready", "template", t.rec.ID, "name", t.rec.Name, "image", t.rec.ImageDigest)
	return s.templateProto(t), nil
}

func checkSetup(argv []string) error {
	if len(argv) > maxSetupArgs {
		return status.Errorf(codes.InvalidArgument, "setup has %d arguments: at most %d", len(argv), maxSetupArgs)
	}
	for i, a := range argv {
		if len(a) > maxSetupArg || strings.ContainsRune(a, 0) {
			return status.Errorf(codes.InvalidArgument, "setup[%d]: want at most %d bytes, no NUL", i, maxSetupArg)
		}
	}
	if len(argv) > 0 && argv[0] == "" {
		return status.Error(codes.InvalidArgument, "setup[0] is empty: want a command")
	}
	return nil
}

// buildTemplate boots t's image in a builder sandbox (on a network of
// its own with policy egress, when t has one), runs the setup, saves the
// snapshot and records the template. Not the caller's context: a client
// that gives up leaves a template a retry finds.
func (s *Server) buildTemplate(t *template, egress EgressPolicy) (err error) {
	r := &t.rec
	ctx, cancel := context.WithTimeout(s.ctx, s.cfg.TemplateTimeout)
	defer cancel()
	dir := filepath.Join(s.cfg.StateDir, sandboxesDir, builderPrefix+strings.TrimPrefix(r.ID, "tp-"))
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return status.Errorf(codes.Internal, "template %s: builder folder: %v", r.ID, err)
	}
	defer os.RemoveAll(dir)
	var n *netRecord
	if r.Net {
		if n, err = s.attachNet(ctx, filepath.Base(dir), egress); err != nil {
			return status.Errorf(status.Code(err), "template %s: %s", r.ID, status.Convert(err).Message())
		}
		defer s.detachNet(n) // after the builder's close, below
	}
	release, err := s.takeStartSlot(ctx)
	if err != nil {
		return callErr("template "+r.ID, err)
	}
	inst, err := s.createNet(ctx, CreateSpec{Dir: dir, Image: r.ImageRef, CPUs: int(r.CPUs),
		MemoryMiB: int(r.MemoryMiB), WritableMiB: int(r.DiskMiB), Hostname: "template", Init: r.Init}, n)
	release()
	if err != nil {
		return callErr("template "+r.ID+": boot "+r.ImageRef, err)
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if cerr := inst.Close(cctx); cerr != nil {
			s.log.Warn("template builder not closed", "template", r.ID, "err", cerr)
		}
	}()
	r.ImageDigest = inst.Image()
	// The setup's secrets: its env, and files written for it and removed
	// before the snapshot (the template's sandboxes do not get them).
	if err := writeSecretFiles(ctx, inst, t.secrets); err != nil {
		return status.Errorf(status.Code(err), "template %s: %s", r.ID, status.Convert(err).Message())
	}
	if len(r.Setup) > 0 {
		var out tailBuffer
		// The output is masked before the tail is cut: the error quotes
		// no secret.
		masked := newMasker(&out, secretValues(t.secrets))
		opts := ExecOptions{Argv: r.Setup, Stdout: masked, Stderr: masked, Env: secretEnv(plainEnv(nil, t.secrets), t.secrets)}
		p, err := inst.Start(ctx, opts)
		if err != nil {
			return callErr("template "+r.ID+": start the setup", err)
		}
		st, err := p.Wait()
		flushMasked(masked)
		if err != nil {
			return callErr("template "+r.ID+": setup", err)
		}
		if !st.Success() {
			return status.Errorf(codes.FailedPrecondition, "template %s: the setup %q %s; its output ends: %s",
				r.ID, strings.Join(r.Setup, " "), st, strings.TrimSpace(out.String()))
		}
	}
	for _, sec := range t.secrets {
		if sec.File == "" {
			continue
		}
		if err := inst.Remove(ctx, sec.File, false); err != nil && status.Code(err) != codes.NotFound {
			return callErr("template "+r.ID+": remove secret "+sec.Name+"'s file "+sec.File+" before the snapshot", err)
		}
	}
	s.roomForSave(filepath.Base(dir), uint64(r.MemoryMiB))
	if err := inst.Save(ctx, r.Dir); err != nil {
		os.RemoveAll(r.Dir)
		return callErr("template "+r.ID+": save its snapshot", err)
	}
	r.CreatedUnixMS = s.clock.Now().UnixMilli()
	if err := writeJSON(s.templatePath(r.ID), r); err != nil {
		os.RemoveAll(r.Dir)
		return status.Errorf(codes.Internal, "template %s: %v", r.ID, err)
	}
	if s.cfg.Cgroups != nil {
		// The snapshot's pages, written by the builder (charged to its
		// cgroup, gone with it), charged to kilnd before a sandbox maps
		// them.
		for _, f := range s.checkpointFiles(r.Dir) {
			if _, err := chargePageCache(ctx, f, true); err != nil {
				s.log.Warn("template's memory not read into kilnd's page cache: the sandbox that maps a page first is charged for it", "template", r.ID, "err", err)
			}
		}
	}
	return nil
}

// tailBuffer keeps the last setupOutputTail bytes written to it.
type tailBuffer struct {
	mu  sync.Mutex
	buf []byte
}

func (b *tailBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf = append(b.buf, p...)
	if over := len(b.buf) - setupOutputTail; over > 0 {
		b.buf = append(b.buf[:0], b.buf[over:]...)
	}
	return len(p), nil
}

func (b *tailBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return string(bytes.ToValidUTF8(b.buf, []byte("?")))
}

// template returns the ready template idOrName names (an ID or a name).
func (s *Server) template(idOrName string) (*template, error) {
	if err := checkID("template", idOrName); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if t := s.templates[idOrName]; t != nil {
		return t, nil
	}
	for _, t := range s.templates {
		if t.rec.Name == idOrName {
			return t, nil
		}
	}
	return nil, status.Errorf(codes.NotFound, "no template %q", idOrName)
}

// templateUsersLocked counts the live sandboxes created from template
// id; s.mu is held.
func (s *Server) templateUsersLocked(id string) int {
	n := 0
	for _, b := range s.boxes {
		b.mu.Lock()
		if b.rec.Template == id && b.life.get().live() {
			n++
		}
		b.mu.Unlock()
	}
	return n
}

func (s *Server) templateProto(t *template) *kilnpb.Template {
	s.mu.Lock()
	users := s.templateUsersLocked(t.rec.ID)
	s.mu.Unlock()
	r := &t.rec
	pb := &kilnpb.Template{
		Id: r.ID, Name: r.Name, Image: r.ImageRef, ImageDigest: r.ImageDigest, Setup: r.Setup,
		Resources: &kilnpb.Resources{Cpus: r.CPUs, MemoryMib: r.MemoryMiB, DiskMib: r.DiskMiB},
		PoolSize:  r.PoolSize, CreatedUnixMs: r.CreatedUnixMS, Sandboxes: uint32(users),
		Init: initName(r.Init),
	}
	if t.pool != nil {
		pb.PoolReady = uint32(t.pool.readyCount())
	}
	return pb
}

// GetTemplate describes a template, by ID or name.
func (s *Server) GetTemplate(ctx context.Context, req *kilnpb.GetTemplateRequest) (*kilnpb.Template, error) {
	t, err := s.template(req.GetId())
	if err != nil {
		return nil, err
	}
	return s.templateProto(t), nil
}

// ListTemplates lists the ready templates, oldest first.
func (s *Server) ListTemplates(ctx context.Context, req *kilnpb.ListTemplatesRequest) (*kilnpb.ListTemplatesResponse, error) {
	s.mu.Lock()
	ts := make([]*template, 0, len(s.templates))
	for _, t := range s.templates {
		ts = append(ts, t)
	}
	s.mu.Unlock()
	sort.Slice(ts, func(i, j int) bool {
		if ts[i].rec.CreatedUnixMS != ts[j].rec.CreatedUnixMS {
			return ts[i].rec.CreatedUnixMS < ts[j].rec.CreatedUnixMS
		}
		return ts[i].rec.ID < ts[j].rec.ID
	})
	out := &kilnpb.ListTemplatesResponse{}
	for _, t := range ts {
		out.Templates = append(out.Templates, s.templateProto(t))
	}
	return out, nil
}

// DeleteTemplate deletes a template and its pool. While sandboxes created
// from it live it is refused, or with wait it waits until they are gone
// (new creates from it are refused meanwhile).
func (s *Server) DeleteTemplate(ctx context.Context, req *kilnpb.DeleteTemplateRequest) (*kilnpb.DeleteTemplateResponse, error) {
	t, err := s.template(req.GetId())
	if err != nil {
		return nil, err
	}
	id := t.rec.ID
	s.mu.Lock()
	if t.deleting && !req.GetWait() {
		s.mu.Unlock()
		return nil, status.Errorf(codes.FailedPrecondition, "template %s is being deleted", id)
	}
	if n := s.templateUsersLocked(id); n > 0 && !req.GetWait() {
		s.mu.Unlock()
		return nil, status.Errorf(codes.FailedPrecondition, "template %s has %d live sandboxes: destroy them first, or delete with wait", id, n)
	}
	t.deleting = true
	s.mu.Unlock()
	for {
		s.mu.Lock()
		n := s.templateUsersLocked(id)
		_, still := s.templates[id]
		s.mu.Unlock()
		if !still {
			return &kilnpb.DeleteTemplateResponse{}, nil // another delete finished it
		}
		if n == 0 {
			break
		}
		select {
		case <-ctx.Done():
			s.mu.Lock()
			t.deleting = false
			s.mu.Unlock()
			return nil, status.Errorf(status.FromContextError(ctx.Err()).Code(), "template %s: still %d live sandboxes when the wait ended", id, n)
		case <-s.ctx.Done():
			return nil, status.Error(codes.Unavailable, "kilnd is shutting down")
		case <-time.After(100 * time.Millisecond):
		}
	}
	s.mu.Lock()
	if s.templates[id] != t {
		s.mu.Unlock()
		return &kilnpb.DeleteTemplateResponse{}, nil
	}
	delete(s.templates, id)
	delete(s.templateReqs, t.rec.RequestID)
	p := t.pool
	s.mu.Unlock()
	if p != nil {
		p.close()
	}
	if err := errors.Join(os.Remove(s.templatePath(id)), os.RemoveAll(t.rec.Dir)); err != nil {
		return nil, status.Errorf(codes.Internal, "delete template %s: %v", id, err)
	}
	s.log.Info("template deleted", "template", id)
	return &kilnpb.DeleteTemplateResponse{}, nil
}

// fromTemplate fills r and spec for a create from template t and checks
// the request's resources: a restore keeps the template's.
func fromTemplate(t *template, res *kilnpb.Resources, r *record, spec *CreateSpec) error {
	tr := &t.rec
	for _, f := range []struct {
		name     string
		got, has uint32
	}{{"cpus", res.GetCpus(), tr.CPUs}, {"memory_mib", res.GetMemoryMib(), tr.MemoryMiB}, {"disk_mib", res.GetDiskMib(), tr.DiskMiB}} {
		if f.got != 0 && f.got != f.has {
			return status.Errorf(codes.InvalidArgument, "resources.%s %d: a sandbox from template %s has the template's (%d); leave it 0", f.name, f.got, tr.ID, f.has)
		}
	}
	spec.Checkpoint = tr.Dir
	r.Template, r.Image, r.ImageRef = tr.ID, tr.ImageDigest, tr.ImageRef
	return nil
}

// loadTemplates reads the templates' records and drops the snapshots of
// builds that did not finish.
func (s *Server) loadTemplates() {
	dir := filepath.Join(s.cfg.StateDir, templatesDir)
	recs, err := readRecords[templateRecord](dir)
	if err != nil {
		s.log.Warn("some template records could not be read", "err", err)
	}
	for _, r := range recs {
		if checkID("template record", r.ID) != nil || r.Dir != filepath.Join(dir, r.ID) {
			s.log.Warn("skipping a template record", "id", r.ID)
			continue
		}
		t := &template{rec: *r, ready: make(chan struct{})}
		close(t.ready)
		s.templates[r.ID] = t
		s.chargeFiles(false, s.checkpointFiles(r.Dir)...)
		if r.RequestID != "" {
			s.templateReqs[r.RequestID] = t
		}
	}
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if e.IsDir() && s.templates[e.Name()] == nil {
			os.RemoveAll(filepath.Join(dir, e.Name())) // an unfinished build's
		}
	}
}

// cleanLeftovers stops the sandboxes of the previous server's pools and
// builders (a pool refills with sandboxes of its own), but those handed
// out, which records name.
func (s *Server) cleanLeftovers() {
	s.mu.Lock()
	owned := map[string]bool{}
	for _, b := range s.boxes {
		owned[b.rec.Dir] = true
	}
	s.mu.Unlock()
	var leftovers []string
	for _, d := range append(globDirs(filepath.Join(s.cfg.StateDir, sandboxesDir, poolPrefix+"*")),
		globDirs(filepath.Join(s.cfg.StateDir, sandboxesDir, builderPrefix+"*"))...) {
		if !owned[d] {
			leftovers = append(leftovers, d)
		}
	}
	var wg sync.WaitGroup
	for _, d := range leftovers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(s.ctx, time.Minute)
			defer cancel()
			if inst, err := s.backend.Attach(ctx, d, false); err == nil {
				inst.Close(ctx)
			}
			os.RemoveAll(d)
		}()
	}
	wg.Wait()
}

func globDirs(pattern string) []string {
	m, _ := filepath.Glob(pattern)
	var out []string
	for _, p := range m {
		if fi, err := os.Stat(p); err == nil && fi.IsDir() {
			out = append(out, p)
		}
	}
	return out
}

// startPools starts the pools of the templates loaded.
func (s *Server) startPools() {
	s.mu.Lock()
	ts := make([]*template, 0, len(s.templates))
	for _, t := range s.templates {
		ts = append(ts, t)
	}
	s.mu.Unlock()
	for _, t := range ts {
		s.startPool(t)
	}
}

// chargeBuf is the read size of chargePageCache.
const chargeBuf = 1 << 20

// chargePageCache reads the data of the file at path (its holes skipped)
// through the page cache from kilnd's own process, so that the pages a
// sandbox's VMM process maps from it (a template's memory file, the
// kernel and initrd every boot reads) are charged once, to kilnd's
// cgroup: memcg charges a page to the cgroup of the process that first
// brings it in, and a page stays charged there for as long as it is
// cached, shared by every sandbox that maps it. With drop, the file's
// cached pages are dropped first (POSIX_FADV_DONTNEED: clean ones no one
// maps), so that those charged to the cgroup of the process that wrote
// them (a template's builder, gone now) come back charged to kilnd. On
// tmpfs the pages are the file itself and stay where they are charged.
// It returns the bytes read.
func chargePageCache(ctx context.Context, path string, drop bool) (int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return 0, err
	}
	fd, size := int(f.Fd()), fi.Size()
	if drop {
		if err := unix.Fadvise(fd, 0, 0, unix.FADV_DONTNEED); err != nil {
			return 0, fmt.Errorf("drop %s's cached pages: %w", path, err)
		}
	}
	buf := make([]byte, chargeBuf)
	var read int64
	for off := int64(0); off < size; {
		start, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break
		}
		if err != nil { // a file system that cannot tell holes: all data
			start = off
		}
		end, err := unix.Seek(fd, start, unix.SEEK_HOLE)
		if err != nil || end <= start {
			end = size
		}
		for off = start; off < end; {
			if err := ctx.Err(); err != nil {
				return read, err
			}
			n, err := f.ReadAt(buf[:min(int64(len(buf)), end-off)], off)
			read += int64(n)
			off += int64(n)
			if err != nil {
				if errors.Is(err, io.EOF) {
					return read, nil
				}
				return read, fmt.Errorf("read %s at %d: %w", path, off, err)
			}
		}
	}
	return read, nil
}

// checkpointFiles are the files of the checkpoint in folder dir that its
// restores map (SharedFiles), none when the backend does not say.
func (s *Server) checkpointFiles(dir string) []string {
	if sf, ok := s.backend.(SharedFiles); ok {
		return sf.CheckpointFiles(dir)
	}
	return nil
}

// chargeFiles runs chargePageCache over paths in the background (with
// cgroups on), logging what it read.
func (s *Server) chargeFiles(drop bool, paths ...string) {
	if s.cfg.Cgroups == nil {
		return
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for _, p := range paths {
			if p == "" {
				continue
			}
			n, err := chargePageCache(s.ctx, p, drop)
			if err != nil && s.ctx.Err() == nil {
				s.log.Warn("file not read into the page cache: sandboxes that map it first are charged for it", "file", p, "err", err)
				continue
			}
			s.log.Debug("file read into kilnd's page cache", "file", p, "bytes", n)
		}
	}()
}
