package daemon

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/kilnvm/kiln/daemon/kilnpb"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// record is what the state folder keeps of a sandbox, one JSON file per
// sandbox (StateDir/sandboxes/ID.json), rewritten atomically on every
// change of state: enough for a restarted server to take the sandbox over
// and list it as it was.
type record struct {
	ID    string `json:"id"`
	Dir   string `json:"dir"` // the VMM process's folder
	PID   int    `json:"pid,omitempty"`
	State string `json:"state"` // kilnpb.SandboxState's name
	// Reason says why it is in a final state.
	Reason string `json:"reason,omitempty"`
	// Cgroup is its VMM process's cgroup folder, when kilnd made one.
	Cgroup string `json:"cgroup,omitempty"`
	// Frozen says its memory has been frozen by a fork: it maps a base its
	// VMM process pays for (resizeCgroup).
	Frozen bool `json:"frozen,omitempty"`

	// What it was created from and with.
	Image      string            `json:"image,omitempty"` // manifest digest
	ImageRef   string            `json:"image_ref,omitempty"`
	Checkpoint string            `json:"checkpoint,omitempty"`
	Template   string            `json:"template,omitempty"`
	FromPool   bool              `json:"from_pool,omitempty"`
	Parent     string            `json:"parent,omitempty"` // the sandbox it was forked from
	CPUs       uint32            `json:"cpus"`
	MemoryMiB  uint32            `json:"memory_mib"`
	DiskMiB    uint32            `json:"disk_mib,omitempty"`
	Env        []string          `json:"env,omitempty"`
	Labels     map[string]string `json:"labels,omitempty"`
	// SecretNames are the names of its secrets: never their values,
	// which its VMM process keeps in memory (secrets.go).
	SecretNames []string `json:"secret_names,omitempty"`

	// RequestID and RequestKey: the client's ID of the request that made
	// it, and the request's other fields (a retry must match them).
	RequestID  string `json:"request_id,omitempty"`
	RequestKey string `json:"request_key,omitempty"`

	CreatedUnixMS int64 `json:"created_unix_ms"`
	ExpiresUnixMS int64 `json:"expires_unix_ms,omitempty"` // 0: never
	IdleTimeoutMS int64 `json:"idle_timeout_ms,omitempty"` // 0: never
	EndedUnixMS   int64 `json:"ended_unix_ms,omitempty"`
	ReadyMS       int64 `json:"ready_ms,omitempty"`
	// LastCheckpoint is the parent of the next checkpoint.
	LastCheckpoint string `json:"last_checkpoint,omitempty"`
	// Net is its network (Config.Network), nil without one.
	Net *netRecord `json:"net,omitempty"`

	// LifetimeMS is the lifetime last asked for (at create or by
	// UpdateSandbox; 0: none, or a record older than it), which a
	// sandbox hibernated by its timeout gets again when resumed.
	LifetimeMS int64 `json:"lifetime_ms,omitempty"`
	// TimeoutAction is what its lifetime's end does: destroy (0) or
	// hibernate (kilnpb.TimeoutAction).
	TimeoutAction kilnpb.TimeoutAction `json:"timeout_action,omitempty"`
	// Init is its process 1: "" (the agent) or "systemd".
	Init string `json:"init,omitempty"`
	// Volumes are the volumes it mounts (volumes.go): while it has not
	// ended, they are its.
	Volumes []volumeMount `json:"volumes,omitempty"`
	// Hibernated: paused with its state in HibernateDir (a snapshot
	// Instance.Save wrote) and no VMM process; its lifetime stands
	// still, ResumeLifeMS left of it (0: none) once resumed.
	Hibernated   bool   `json:"hibernated,omitempty"`
	HibernateDir string `json:"hibernate_dir,omitempty"`
	// FilesOnly: its hibernation kept only its image root's files
	// (HibernateDir/writableFile, Instance.ExportWritable): a resume boots
	// Image again and applies them.
	FilesOnly    bool  `json:"files_only,omitempty"`
	ResumeLifeMS int64 `json:"resume_life_ms,omitempty"`
}

func (r *record) state() kilnpb.SandboxState {
	return kilnpb.SandboxState(kilnpb.SandboxState_value[r.State])
}

func (r *record) setState(s kilnpb.SandboxState) { r.State = s.String() }

// live says the sandbox has not ended.
func (r *record) live() bool { return isLive(r.state()) }

func isLive(s kilnpb.SandboxState) bool {
	switch s {
	case kilnpb.SandboxState_SANDBOX_STATE_STARTING, kilnpb.SandboxState_SANDBOX_STATE_RUNNING, kilnpb.SandboxState_SANDBOX_STATE_PAUSED:
		return true
	}
	return false
}

// checkpointRecord is what the state folder keeps of a checkpoint
// (StateDir/checkpoints/ID.json, its snapshot in StateDir/checkpoints/ID/).
type checkpointRecord struct {
	ID            string `json:"id"`
	SandboxID     string `json:"sandbox_id"`
	ParentID      string `json:"parent_id,omitempty"`
	Dir           string `json:"dir"`
	CreatedUnixMS int64  `json:"created_unix_ms"`
	Persisted     bool   `json:"persisted"`
	Keep          bool   `json:"keep"`
	// The sandbox's machine and environment, which its restores keep.
	CPUs      uint32   `json:"cpus"`
	MemoryMiB uint32   `json:"memory_mib"`
	Image     string   `json:"image,omitempty"`
	Env       []string `json:"env,omitempty"`
	// Net says the sandbox had a network card (its restores need one),
	// and Egress its policy then (a fork's children get it).
	Net    bool          `json:"net,omitempty"`
	Egress *EgressPolicy `json:"egress,omitempty"`
	// FilesOnly, DiskMiB and Init: a fork's source that is a sandbox
	// hibernated keeping only files (savedSource), never persisted: Dir
	// has its writableFile, and each child boots Image with a writable
	// layer of DiskMiB under process 1 Init and applies it.
	FilesOnly bool   `json:"-"`
	DiskMiB   uint32 `json:"-"`
	Init      string `json:"-"`
}

// writeJSON writes v to path atomically: a temporary file beside it,
// synced, renamed over path, and the folder synced.
func writeJSON(path string, v any) error { return writeRecord(path, v, true) }

// writeRecord writes v to path atomically, synced when sync says so (a
// record whose loss in a crash of the host loses nothing else).
func writeRecord(path string, v any, sync bool) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return fmt.Errorf("daemon: encode %s: %w", filepath.Base(path), err)
	}
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".*")
	if err != nil {
		return fmt.Errorf("daemon: write %s: %w", path, err)
	}
	tmp := f.Name()
	defer os.Remove(tmp) // fails harmlessly after the rename
	if _, err := f.Write(append(b, '\n')); err != nil {
		f.Close()
		return fmt.Errorf("daemon: write %s: %w", path, err)
	}
	if sync {
		if err := f.Sync(); err != nil {
			f.Close()
			return fmt.Errorf("daemon: write %s: %w", path, err)
		}
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("daemon: write %s: %w", path, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("daemon: write %s: %w", path, err)
	}
	if !sync {
		return nil
	}
	if d, err := os.Open(dir); err == nil {
		d.Sync()
		d.Close()
	}
	return nil
}

// readRecords reads every *.json file of dir into a new T each, skipping
// the temporary files of interrupted writes.
func readRecords[T any](dir string) ([]*T, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("daemon: state: %w", err)
	}
	var out []*T
	var errs []error
	for _, e := range ents {
		name := e.Name()
		if e.IsDir() || strings.HasPrefix(name, ".") || !strings.HasSuffix(name, ".json") {
			continue
		}
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			errs = append(errs, err)
			continue
		}
		v := new(T)
		if err := json.Unmarshal(b, v); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", name, err))
			continue
		}
		out = append(out, v)
	}
	if err := errors.Join(errs...); err != nil {
		return out, fmt.Errorf("daemon: state %s: %w", dir, err)
	}
	return out, nil
}

// checkInit checks a request's init: "" or "agent" (the agent as process
// 1, recorded as "") or "systemd".
func checkInit(v string) (string, error) {
	switch v {
	case "", "agent":
		return "", nil
	case "systemd":
		return v, nil
	}
	return "", status.Errorf(codes.InvalidArgument, "init %q: want \"agent\" (the default) or \"systemd\" (the image's /sbin/init boots, the agent runs as a service)", v)
}

// initName is what a record's init is called in replies: "agent" for the
// default.
func initName(v string) string {
	if v == "" {
		return "agent"
	}
	return v
}
