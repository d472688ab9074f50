package shim

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/kilnvm/kiln/guest/agentpb"
)

// A checkpoint the shim takes (Service.Checkpoint) is a folder: the VM's
// snapshot in checkpointDir, and beside it checkpointMetaFile, what a
// task restored from it takes over. A checkpoint comes back from
// containerd's content store and is not trusted: parseCheckpointMeta
// refuses what this shim would not have written.

// checkpointDir is the snapshot's folder in a checkpoint's path.
const checkpointDir = "kiln-snapshot"

// checkpointMetaFile, beside checkpointDir, says what a task restored
// from the checkpoint takes over. A checkpoint without one was taken
// while its task ran nothing.
const checkpointMetaFile = "kiln-shim.json"

// maxCheckpointMeta is the most bytes of checkpointMetaFile read.
const maxCheckpointMeta = 4096

// checkpointMeta is checkpointMetaFile's content: one JSON object.
type checkpointMeta struct {
	// Init is the detached ID (agentpb.ValidDetachedID) of the init
	// process that ran when the checkpoint was taken ("": none ran; the
	// restored task runs its spec's process anew).
	Init string `json:"init,omitempty"`
}

// initDetachID is the agent's detached ID of container id's init.
func initDetachID(id string) string { return "init:" + id }

// validate says what, if anything, is wrong with m.
func (m checkpointMeta) validate() error {
	if m.Init != "" && !agentpb.ValidDetachedID(m.Init) {
		return fmt.Errorf("init %q is not a detached process ID (1 to %d of A-Z a-z 0-9 . _ - :)", m.Init, agentpb.MaxDetachedIDLen)
	}
	return nil
}

// marshal encodes m as checkpointMetaFile holds it; it refuses an m that
// parseCheckpointMeta would refuse, so that a checkpoint fails when it is
// taken rather than when it is restored.
func (m checkpointMeta) marshal() ([]byte, error) {
	if err := m.validate(); err != nil {
		return nil, fmt.Errorf("%s: %w", checkpointMetaFile, err)
	}
	b, err := json.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", checkpointMetaFile, err)
	}
	return b, nil
}

// parseCheckpointMeta decodes checkpointMetaFile's bytes: at most
// maxCheckpointMeta of them, one JSON object with no field this shim does
// not know and nothing after it, naming a valid detached ID.
func parseCheckpointMeta(b []byte) (checkpointMeta, error) {
	var m checkpointMeta
	if len(b) > maxCheckpointMeta {
		return m, fmt.Errorf("%s: more than the %d bytes it may have", checkpointMetaFile, maxCheckpointMeta)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&m); err != nil {
		return checkpointMeta{}, fmt.Errorf("%s: not a JSON object of its fields: %w", checkpointMetaFile, err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return checkpointMeta{}, fmt.Errorf("%s: more after its JSON object", checkpointMetaFile)
	}
	if err := m.validate(); err != nil {
		return checkpointMeta{}, fmt.Errorf("%s: %w", checkpointMetaFile, err)
	}
	return m, nil
}

// writeCheckpointMeta writes m into checkpoint folder dir.
func writeCheckpointMeta(dir string, m checkpointMeta) error {
	b, err := m.marshal()
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, checkpointMetaFile), b, 0o600); err != nil {
		return fmt.Errorf("writing %s: %w", checkpointMetaFile, err)
	}
	return nil
}

// readCheckpointMeta reads and parses checkpoint folder dir's
// checkpointMetaFile; a folder without one gives the zero checkpointMeta.
func readCheckpointMeta(dir string) (checkpointMeta, error) {
	f, err := os.Open(filepath.Join(dir, checkpointMetaFile))
	if errors.Is(err, os.ErrNotExist) {
		return checkpointMeta{}, nil
	}
	if err != nil {
		return checkpointMeta{}, fmt.Errorf("checkpoint: %w", err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxCheckpointMeta+1))
	if err != nil {
		return checkpointMeta{}, fmt.Errorf("checkpoint %s: %w", checkpointMetaFile, err)
	}
	m, err := parseCheckpointMeta(b)
	if err != nil {
		return checkpointMeta{}, fmt.Errorf("checkpoint %w", err)
	}
	return m, nil
}
