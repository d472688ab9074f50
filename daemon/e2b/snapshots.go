package e2b

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// snapshotsFile is the snapshot index's file in the state folder.
const snapshotsFile = "snapshots.json"

// maxSnapshotName bounds a snapshot's name.
const maxSnapshotName = 128

// snapshot is an E2B snapshot: a kept Kiln checkpoint, with the tenant
// that took it (checkpoints have no labels, and outlive their sandbox).
type snapshot struct {
	ID        string `json:"id"` // the checkpoint's
	Tenant    string `json:"tenant"`
	SandboxID string `json:"sandbox_id"`
	Name      string `json:"name,omitempty"`
	CreatedMS int64  `json:"created_unix_ms"`
	// MemoryMiB is its sandbox's guest memory: a sandbox created from
	// it counts this much against its tenant's quota (0 in an index
	// written before it was kept).
	MemoryMiB uint32 `json:"memory_mib,omitempty"`
}

// snapshotIndex is the tenants' snapshots, kept in a file.
type snapshotIndex struct {
	path string

	mu    sync.Mutex
	snaps []snapshot // in the order taken
}

func openSnapshotIndex(dir string) (*snapshotIndex, error) {
	x := &snapshotIndex{path: filepath.Join(dir, snapshotsFile)}
	b, err := os.ReadFile(x.path)
	if errors.Is(err, fs.ErrNotExist) {
		return x, nil
	}
	if err != nil {
		return nil, fmt.Errorf("the snapshot index: %w", err)
	}
	if err := json.Unmarshal(b, &x.snaps); err != nil {
		return nil, fmt.Errorf("the snapshot index %s: %w", x.path, err)
	}
	return x, nil
}

// saveLocked writes the index (a new file renamed over the old).
func (x *snapshotIndex) saveLocked() error {
	b, err := json.Marshal(x.snaps)
	if err != nil {
		return err
	}
	tmp := x.path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return fmt.Errorf("writing the snapshot index: %w", err)
	}
	if err := os.Rename(tmp, x.path); err != nil {
		return fmt.Errorf("writing the snapshot index: %w", err)
	}
	return nil
}

// find is tenant's snapshot with this ID or name.
func (x *snapshotIndex) find(tenant, idOrName string) (snapshot, bool) {
	x.mu.Lock()
	defer x.mu.Unlock()
	for _, s := range x.snaps {
		if s.Tenant == tenant && (s.ID == idOrName || s.Name != "" && s.Name == idOrName) {
			return s, true
		}
	}
	return snapshot{}, false
}

func (x *snapshotIndex) add(s snapshot) error {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.snaps = append(x.snaps, s)
	return x.saveLocked()
}

func (x *snapshotIndex) remove(id string) error {
	x.mu.Lock()
	defer x.mu.Unlock()
	for i, s := range x.snaps {
		if s.ID == id {
			x.snaps = append(x.snaps[:i:i], x.snaps[i+1:]...)
			return x.saveLocked()
		}
	}
	return nil
}

// list is tenant's snapshots, oldest first.
func (x *snapshotIndex) list(tenant string) []snapshot {
	x.mu.Lock()
	defer x.mu.Unlock()
	var out []snapshot
	for _, s := range x.snaps {
		if s.Tenant == tenant {
			out = append(out, s)
		}
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].CreatedMS < out[j].CreatedMS })
	return out
}

type snapshotRequest struct {
	Name *string `json:"name"`
}

type snapshotInfo struct {
	SnapshotID string   `json:"snapshotID"`
	Names      []string `json:"names"`
}

func (s snapshot) info() snapshotInfo {
	names := []string{}
	if s.Name != "" {
		names = append(names, s.Name)
	}
	return snapshotInfo{SnapshotID: s.ID, Names: names}
}

func (s *Server) createSnapshot(w http.ResponseWriter, r *http.Request, tenant string) error {
	var req snapshotRequest
	if err := decodeBody(w, r, &req); err != nil {
		return err
	}
	name := ""
	if req.Name != nil {
		name = *req.Name
		if name == "" || len(name) > maxSnapshotName {
			return errorf(http.StatusBadRequest, "name: want 1 to %d bytes", maxSnapshotName)
		}
		if _, taken := s.snaps.find(tenant, name); taken {
			return errorf(http.StatusConflict, "a snapshot named %q exists", name)
		}
	}
	sb, err := s.owned(r.Context(), tenant, r.PathValue("id"))
	if err != nil {
		return err
	}
	admitted, err := s.admit(r.Context(), tenant, usage{Snapshots: 1})
	if err != nil {
		return err
	}
	defer admitted()
	ck, err := s.kiln.Checkpoint(r.Context(), &kilnpb.CheckpointRequest{SandboxId: sb.GetId(), Keep: true})
	if err != nil {
		return err
	}
	snap := snapshot{ID: ck.GetId(), Tenant: tenant, SandboxID: sb.GetId(), Name: name, CreatedMS: ck.GetCreatedUnixMs(), MemoryMiB: sb.GetResources().GetMemoryMib()}
	if err := s.snaps.add(snap); err != nil {
		// Unindexed, nobody could use or delete it through this API.
		s.kiln.DeleteCheckpoint(r.Context(), &kilnpb.DeleteCheckpointRequest{Id: ck.GetId()})
		return err
	}
	s.log.Info("e2b: took a snapshot", "sandbox", sb.GetId(), "tenant", tenant, "snapshot", ck.GetId())
	writeJSON(w, http.StatusCreated, snap.info())
	return nil
}

func (s *Server) listSnapshots(w http.ResponseWriter, r *http.Request, tenant string) error {
	q := r.URL.Query()
	limit := maxList
	if v := q.Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > maxList {
			return errorf(http.StatusBadRequest, "limit %q: want 1 to %d", v, maxList)
		}
		limit = n
	}
	snaps := s.snaps.list(tenant)
	start := 0
	if tok := q.Get("nextToken"); tok != "" {
		start = -1
		for i, sn := range snaps {
			if sn.ID == tok {
				start = i + 1
			}
		}
		if start < 0 {
			return errorf(http.StatusBadRequest, "nextToken %q is not one this API gave out (or its snapshot is gone)", tok)
		}
	}
	out := []snapshotInfo{}
	for i := start; i < len(snaps); i++ {
		sn := snaps[i]
		if v := q.Get("sandboxID"); v != "" && sn.SandboxID != v {
			continue
		}
		// The SDKs' name filter is a snapshot's name or its ID.
		if v := q.Get("name"); v != "" && sn.Name != v && sn.ID != v {
			continue
		}
		if len(out) == limit {
			w.Header().Set("X-Next-Token", snaps[i-1].ID)
			break
		}
		out = append(out, sn.info())
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

// deleteSnapshot is DELETE /templates/{id}: E2B deletes snapshots as
// templates. Only a tenant's own snapshots can be: Kiln's templates are
// the operator's (kiln template).
func (s *Server) deleteSnapshot(w http.ResponseWriter, r *http.Request, tenant string) error {
	id := r.PathValue("id")
	snap, ok := s.snaps.find(tenant, id)
	if !ok {
		return errorf(http.StatusNotFound, "snapshot %q not found", id)
	}
	_, err := s.kiln.DeleteCheckpoint(r.Context(), &kilnpb.DeleteCheckpointRequest{Id: snap.ID})
	if err != nil && status.Code(err) != codes.NotFound {
		return err
	}
	if rerr := s.snaps.remove(snap.ID); rerr != nil {
		return rerr
	}
	if err != nil {
		return errorf(http.StatusNotFound, "snapshot %q not found", id)
	}
	s.log.Info("e2b: deleted a snapshot", "tenant", tenant, "snapshot", snap.ID)
	w.WriteHeader(http.StatusNoContent)
	return nil
}
