package daemon

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/daemon/kilnpb"
	"github.com/kilnvm/kiln/volume"
)

// Volumes are ext4 images in StateDir/volumes (ID.ext4, described by
// ID.json), made by package volume. A sandbox mounts one through a
// volume slot of its backend (CreateSpec.Volumes, Instance.AttachVolume).
// Who holds a volume is not kept apart: it is read from the records of
// the sandboxes that have not ended (record.Volumes), under s.mu, so that
// it survives a restart of kilnd with them and cannot disagree with them.

// volumeIDPrefix starts every volume's ID; names may not.
const volumeIDPrefix = "vol-"

// maxVolumePath bounds a mount path; volumeFreezeTimeout, the wait for a
// guest to freeze its volumes at its end.
const (
	maxVolumePath       = 256
	volumeFreezeTimeout = 10 * time.Second
)

// volumeRecord is what the state folder keeps of a volume.
type volumeRecord struct {
	ID            string            `json:"id"`
	Name          string            `json:"name,omitempty"`
	SizeMiB       uint32            `json:"size_mib"`
	Labels        map[string]string `json:"labels,omitempty"`
	CreatedUnixMS int64             `json:"created_unix_ms"`
}

// volumeMount is a volume in a sandbox's record: its slot and where the
// guest mounts it.
type volumeMount struct {
	ID       string `json:"id"`
	Slot     int    `json:"slot"`
	Path     string `json:"path"`
	ReadOnly bool   `json:"read_only,omitempty"`
}

// vol is a volume the server knows; deleting: DeleteVolume is under
// way, and no sandbox may take it.
type vol struct {
	rec      volumeRecord
	deleting bool
}

func (s *Server) volumeRecordPath(id string) string {
	return filepath.Join(s.cfg.StateDir, volumesDir, id+".json")
}

// volumeImage is the image of volume id.
func (s *Server) volumeImage(id string) string {
	return filepath.Join(s.cfg.StateDir, volumesDir, id+".ext4")
}

// CreateVolume makes a volume: an empty ext4 file system of size_mib
// whose root any guest user may write into.
func (s *Server) CreateVolume(ctx context.Context, req *kilnpb.CreateVolumeRequest) (*kilnpb.Volume, error) {
	name := req.GetName()
	if name != "" {
		if err := checkID("volume name", name); err != nil {
			return nil, err
		}
		if strings.HasPrefix(name, volumeIDPrefix) {
			return nil, status.Errorf(codes.InvalidArgument, "volume name %q: the prefix %s is kept for volume IDs", name, volumeIDPrefix)
		}
	}
	size := req.GetSizeMib()
	if size == 0 {
		size = s.cfg.DefaultVolumeMiB
	}
	if size < volume.MinMiB || size > s.cfg.MaxVolumeMiB {
		return nil, status.Errorf(codes.InvalidArgument, "volume size_mib %d: want %d to %d", size, volume.MinMiB, s.cfg.MaxVolumeMiB)
	}
	if err := checkLabels("labels", req.GetLabels()); err != nil {
		return nil, err
	}
	v := &vol{rec: volumeRecord{ID: newID(volumeIDPrefix), Name: name, SizeMiB: size, Labels: req.GetLabels(), CreatedUnixMS: s.clock.Now().UnixMilli()}}
	// The name and the count are reserved before the image is made; a
	// volume being made is "deleting" to every other call until it is.
	s.mu.Lock()
	err := s.volumeNameFreeLocked(name)
	if err == nil && len(s.volumes) >= s.cfg.MaxVolumeCount {
		err = status.Errorf(codes.ResourceExhausted, "the host has %d volumes, its limit", len(s.volumes))
	}
	if err == nil {
		v.deleting = true
		s.volumes[v.rec.ID] = v
	}
	s.mu.Unlock()
	if err != nil {
		return nil, err
	}
	err = volume.Make(ctx, s.volumeImage(v.rec.ID), size)
	if err == nil {
		err = writeJSON(s.volumeRecordPath(v.rec.ID), &v.rec)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err != nil {
		delete(s.volumes, v.rec.ID)
		os.Remove(s.volumeImage(v.rec.ID))
		return nil, status.Errorf(codes.Internal, "create volume: %v", err)
	}
	v.deleting = false
	s.log.Info("volume created", "volume", v.rec.ID, "name", name, "size_mib", size)
	return s.volumeProtoLocked(v), nil
}

// volumeNameFreeLocked refuses a name another volume has; s.mu is held.
func (s *Server) volumeNameFreeLocked(name string) error {
	if name == "" {
		return nil
	}
	for _, o := range s.volumes {
		if o.rec.Name == name {
			return status.Errorf(codes.AlreadyExists, "a volume is named %q (%s)", name, o.rec.ID)
		}
	}
	return nil
}

// volumeLocked is the volume idOrName names; s.mu is held.
func (s *Server) volumeLocked(idOrName string) (*vol, error) {
	if err := checkID("volume", idOrName); err != nil {
		return nil, err
	}
	v := s.volumes[idOrName]
	if v == nil {
		for _, o := range s.volumes {
			if o.rec.Name == idOrName {
				v = o
			}
		}
	}
	if v == nil || v.deleting {
		return nil, status.Errorf(codes.NotFound, "no volume %q", idOrName)
	}
	return v, nil
}

// volumeUsersLocked returns the mounts of volume id in sandboxes that
// have not ended, with their sandboxes' IDs; s.mu is held.
func (s *Server) volumeUsersLocked(id string) []*kilnpb.VolumeUser {
	var out []*kilnpb.VolumeUser
	for _, b := range s.boxes {
		b.mu.Lock()
		if b.life.get().live() {
			for _, m := range b.rec.Volumes {
				if m.ID == id {
					out = append(out, &kilnpb.VolumeUser{Sandbox: b.id, Path: m.Path, ReadOnly: m.ReadOnly})
				}
			}
		}
		b.mu.Unlock()
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Sandbox < out[j].Sandbox })
	return out
}

func (s *Server) volumeProtoLocked(v *vol) *kilnpb.Volume {
	r := &v.rec
	return &kilnpb.Volume{Id: r.ID, Name: r.Name, SizeMib: r.SizeMiB, Labels: r.Labels, CreatedUnixMs: r.CreatedUnixMS, Users: s.volumeUsersLocked(r.ID)}
}

// GetVolume describes a volume, by ID or name.
func (s *Server) GetVolume(ctx context.Context, req *kilnpb.GetVolumeRequest) (*kilnpb.Volume, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	v, err := s.volumeLocked(req.GetId())
	if err != nil {
		return nil, err
	}
	return s.volumeProtoLocked(v), nil
}

// ListVolumes lists the volumes with all of the request's labels, oldest
// first.
func (s *Server) ListVolumes(ctx context.Context, req *kilnpb.ListVolumesRequest) (*kilnpb.ListVolumesResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var vs []*vol
	for _, v := range s.volumes {
		if !v.deleting && hasLabels(v.rec.Labels, req.GetLabels()) {
			vs = append(vs, v)
		}
	}
	sort.Slice(vs, func(i, j int) bool {
		if vs[i].rec.CreatedUnixMS != vs[j].rec.CreatedUnixMS {
			return vs[i].rec.CreatedUnixMS < vs[j].rec.CreatedUnixMS
		}
		return vs[i].rec.ID < vs[j].rec.ID
	})
	out := &kilnpb.ListVolumesResponse{}
	for _, v := range vs {
		out.Volumes = append(out.Volumes, s.volumeProtoLocked(v))
	}
	return out, nil
}

// DeleteVolume deletes a volume and its files, refused while a sandbox
// that has not ended mounts it.
func (s *Server) DeleteVolume(ctx context.Context, req *kilnpb.DeleteVolumeRequest) (*kilnpb.DeleteVolumeResponse, error) {
	s.mu.Lock()
	v, err := s.volumeLocked(req.GetId())
	if err == nil {
		if users := s.volumeUsersLocked(v.rec.ID); len(users) > 0 {
			err = status.Errorf(codes.FailedPrecondition, "volume %s is mounted in sandbox %s (and %d more): destroy them first", v.rec.ID, users[0].Sandbox, len(users)-1)
		}
	}
	if err != nil {
		s.mu.Unlock()
		return nil, err
	}
	v.deleting = true
	s.mu.Unlock()
	err = errors.Join(os.Remove(s.volumeRecordPath(v.rec.ID)), os.Remove(s.volumeImage(v.rec.ID)))
	s.mu.Lock()
	delete(s.volumes, v.rec.ID)
	s.mu.Unlock()
	if err != nil {
		return nil, status.Errorf(codes.Internal, "delete volume %s: %v", v.rec.ID, err)
	}
	s.log.Info("volume deleted", "volume", v.rec.ID)
	return &kilnpb.DeleteVolumeResponse{}, nil
}

// loadVolumes reads the volumes' records; an image without a record (a
// create that did not finish) is removed.
func (s *Server) loadVolumes() {
	dir := filepath.Join(s.cfg.StateDir, volumesDir)
	recs, err := readRecords[volumeRecord](dir)
	if err != nil {
		s.log.Warn("some volume records could not be read", "err", err)
	}
	for _, r := range recs {
		if checkID("volume record", r.ID) != nil || !strings.HasPrefix(r.ID, volumeIDPrefix) {
			s.log.Warn("skipping a volume record", "id", r.ID)
			continue
		}
		if _, err := os.Stat(s.volumeImage(r.ID)); err != nil {
			s.log.Warn("skipping a volume without its image", "volume", r.ID, "err", err)
			continue
		}
		s.volumes[r.ID] = &vol{rec: *r}
	}
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if id, ok := strings.CutSuffix(e.Name(), ".ext4"); ok && s.volumes[id] == nil {
			os.Remove(filepath.Join(dir, e.Name()))
		}
	}
}

// checkVolumeMounts checks a create's volumes (field names them) and
// resolves them to mounts in slots 0, 1, ... in the order given; the
// volumes are looked up but not taken (admitVolumesLocked takes them).
func (s *Server) checkVolumeMounts(field string, vms []*kilnpb.VolumeMount) ([]volumeMount, error) {
	if len(vms) > MaxVolumes {
		return nil, status.Errorf(codes.InvalidArgument, "%s: %d volumes, at most %d", field, len(vms), MaxVolumes)
	}
	var out []volumeMount
	for i, vm := range vms {
		p := vm.GetPath()
		switch {
		case p == "" || len(p) > maxVolumePath || !path.IsAbs(p) || strings.ContainsRune(p, 0) || path.Clean(p) != p:
			return nil, status.Errorf(codes.InvalidArgument, "%s[%d].path %q: want a clean absolute path of at most %d bytes", field, i, p, maxVolumePath)
		case p == "/":
			return nil, status.Errorf(codes.InvalidArgument, "%s[%d].path /: a volume cannot replace the root", field, i)
		}
		s.mu.Lock()
		v, err := s.volumeLocked(vm.GetVolume())
		s.mu.Unlock()
		if err != nil {
			return nil, status.Errorf(status.Code(err), "%s[%d]: %s", field, i, status.Convert(err).Message())
		}
		for j, o := range out {
			switch {
			case o.ID == v.rec.ID:
				return nil, status.Errorf(codes.InvalidArgument, "%s[%d]: volume %s is %s[%d] already", field, i, v.rec.ID, field, j)
			case o.Path == p || strings.HasPrefix(p, o.Path+"/") || strings.HasPrefix(o.Path, p+"/"):
				return nil, status.Errorf(codes.InvalidArgument, "%s[%d].path %s: in or over %s[%d].path %s", field, i, p, field, j, o.Path)
			}
		}
		out = append(out, volumeMount{ID: v.rec.ID, Slot: i, Path: p, ReadOnly: vm.GetReadOnly()})
	}
	return out, nil
}

// admitVolumesLocked refuses mounts that a sandbox which has not ended
// holds against them: a volume read-write in one is in no other, and
// read-only in any number; s.mu is held. The caller makes them the new
// sandbox's (its record's Volumes) before s.mu is let go.
func (s *Server) admitVolumesLocked(ms []volumeMount) error {
	for _, m := range ms {
		v := s.volumes[m.ID]
		if v == nil || v.deleting {
			return status.Errorf(codes.NotFound, "no volume %q", m.ID)
		}
		users := s.volumeUsersLocked(m.ID)
		for _, u := range users {
			if !m.ReadOnly || !u.ReadOnly {
				return status.Errorf(codes.FailedPrecondition, "volume %s is mounted in sandbox %s (%s); read-write it may be in one sandbox only, read-only in any number", m.ID, u.Sandbox, rwName(u.ReadOnly))
			}
		}
		if m.ReadOnly && len(users) == 0 {
			// A journal to replay needs writes, which a read-only slot
			// refuses: the guest's mount would fail.
			dirty, err := volume.NeedsRecovery(s.volumeImage(m.ID))
			if err != nil {
				return status.Errorf(codes.Internal, "volume %s: %v", m.ID, err)
			}
			if dirty {
				return status.Errorf(codes.FailedPrecondition, "volume %s was left with its journal to replay (its last read-write sandbox was stopped without unmounting it): mount it read-write once, which replays it, before mounting it read-only", m.ID)
			}
		}
	}
	return nil
}

func rwName(ro bool) string {
	if ro {
		return "read-only"
	}
	return "read-write"
}

// volumeAttaches are a record's volumes as a backend mounts them.
func (s *Server) volumeAttaches(ms []volumeMount) []VolumeAttach {
	var out []VolumeAttach
	for _, m := range ms {
		out = append(out, VolumeAttach{Slot: m.Slot, Path: s.volumeImage(m.ID), ReadOnly: m.ReadOnly, MountPath: m.Path})
	}
	return out
}

// volumesProto are a record's volumes as the API shows them.
func volumesProto(ms []volumeMount) []*kilnpb.VolumeMount {
	var out []*kilnpb.VolumeMount
	for _, m := range ms {
		out = append(out, &kilnpb.VolumeMount{Volume: m.ID, Path: m.Path, ReadOnly: m.ReadOnly})
	}
	return out
}

// attachVolumes mounts ms in inst, a pool's sandbox being handed out
// (it has none yet).
func attachVolumes(ctx context.Context, inst Instance, ms []VolumeAttach) error {
	for _, v := range ms {
		if err := inst.AttachVolume(ctx, v); err != nil {
			return fmt.Errorf("attach volume in slot %d at %s: %w", v.Slot, v.MountPath, err)
		}
	}
	return nil
}

// writableVolume returns the first of ms that is read-write, or nil: a
// sandbox with one forks no children (they cannot share it) and takes
// no checkpoint.
func writableVolume(ms []volumeMount) *volumeMount {
	for i := range ms {
		if !ms[i].ReadOnly {
			return &ms[i]
		}
	}
	return nil
}

// forkVolumes gives a fork's children (tmpl) the volumes of b, its
// parent, all read-only: a read-write one refuses the fork, since the
// children cannot share it; b.mu is held.
func forkVolumes(b *box, tmpl *record) error {
	if m := writableVolume(b.rec.Volumes); m != nil {
		return status.Errorf(codes.FailedPrecondition, "fork sandbox %s: it mounts volume %s read-write at %s, which its children cannot share (mount it read-only to fork)", b.id, m.ID, m.Path)
	}
	tmpl.Volumes = slices.Clone(b.rec.Volumes)
	return nil
}
