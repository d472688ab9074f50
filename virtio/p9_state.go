package virtio

import (
	"encoding/json"
	"fmt"
)

// P9StateVersion is the version of P9State's form.
const P9StateVersion = 1

// P9State is a virtio-9p device in a snapshot: its mount tag, what tree it
// served (FSConfig.Key) and the 9P session (msize and fid table, in
// ninep's own form). The tree itself is not part of it: the restoring side
// builds the same tree again, which gives the same inode numbers.
type P9State struct {
	Version int             `json:"version"`
	Tag     string          `json:"tag"`
	Key     string          `json:"key"`
	Server  json.RawMessage `json:"server"`
}

// SaveState implements Device. Call it with the transport paused: no
// request is then in flight.
func (p *P9) SaveState() (json.RawMessage, error) {
	srv, err := p.srv.SaveState()
	if err != nil {
		return nil, fmt.Errorf("virtio-9p %s: %w", p.tag, err)
	}
	return json.Marshal(P9State{Version: P9StateVersion, Tag: p.tag, Key: p.key, Server: srv})
}

// RestoreState implements Device: the device must have the snapshot's tag
// and serve the same tree (the same key), or the guest's fids would name
// other files.
func (p *P9) RestoreState(data json.RawMessage) error {
	var st P9State
	if err := decodeState(data, &st); err != nil {
		return fmt.Errorf("virtio-9p %s: %w", p.tag, err)
	}
	switch {
	case st.Version != P9StateVersion:
		return fmt.Errorf("virtio-9p %s: state is version %d, this device reads version %d", p.tag, st.Version, P9StateVersion)
	case st.Tag != p.tag:
		return fmt.Errorf("virtio-9p %s: mount tag %q, the snapshot's device had %q", p.tag, p.tag, st.Tag)
	case st.Key != p.key:
		return fmt.Errorf("virtio-9p %s: serves tree %q, the snapshot's device served %q", p.tag, p.key, st.Key)
	}
	if err := p.srv.RestoreState(st.Server); err != nil {
		return fmt.Errorf("virtio-9p %s: %w", p.tag, err)
	}
	return nil
}
