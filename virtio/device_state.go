package virtio

import (
	"encoding/json"
	"fmt"
	"net"
	"strings"
)

// Each device's own state in a snapshot, beside the transport's MMIOState.
// What a device keeps is what the guest saw of it and must see again; its
// host side (an image file, a tap, a Unix socket) is configured anew on
// restore and checked against it.

// decodeState decodes a device's state strictly: an unknown field is an
// error, so a state from another device or version is not taken silently.
func decodeState(data json.RawMessage, v any) error {
	if len(data) == 0 {
		return fmt.Errorf("no device state")
	}
	dec := json.NewDecoder(strings.NewReader(string(data)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("decoding device state: %w", err)
	}
	return nil
}

// BlockState is a virtio-blk device in a snapshot: what the guest read from
// its config space. The image itself is not part of it (the caller keeps
// the disk as it was, or a copy).
type BlockState struct {
	Capacity uint64 `json:"capacity_sectors"`
	ReadOnly bool   `json:"read_only"`
	ID       string `json:"id"`
	// Key is what a source-backed disk served (NewBlockFromSource), ""
	// for a file: its guest cached the source's blocks, so a restore
	// must serve the very same bytes.
	Key string `json:"key,omitempty"`
	// Slot says the disk is a volume slot: empty when Capacity is 0, its
	// image named to the restore (as any disk's) when not.
	Slot bool `json:"slot,omitempty"`
}

// SaveState implements Device.
func (b *Block) SaveState() (json.RawMessage, error) {
	if b.slot {
		b.media.RLock()
		defer b.media.RUnlock()
	}
	return json.Marshal(BlockState{Capacity: b.capacity, ReadOnly: b.readOnly, ID: strings.TrimRight(string(b.id[:]), "\x00"), Key: b.key, Slot: b.slot})
}

// RestoreState implements Device: the disk must have the snapshot's size,
// writability and ID, and be a volume slot where the snapshot's was, or
// the guest's view of it would be wrong.
func (b *Block) RestoreState(data json.RawMessage) error {
	var st BlockState
	if err := decodeState(data, &st); err != nil {
		return fmt.Errorf("virtio-blk %s: %w", b.path, err)
	}
	if b.slot {
		b.media.RLock()
		defer b.media.RUnlock()
	}
	switch id := strings.TrimRight(string(b.id[:]), "\x00"); {
	case st.Slot != b.slot:
		return fmt.Errorf("virtio-blk %s: volume slot is %v, the snapshot's disk's was %v", b.path, b.slot, st.Slot)
	case st.Capacity != b.capacity:
		return fmt.Errorf("virtio-blk %s: image has %d sectors, the snapshot's disk had %d", b.path, b.capacity, st.Capacity)
	case st.ReadOnly != b.readOnly:
		return fmt.Errorf("virtio-blk %s: read-only is %v, the snapshot's disk had %v", b.path, b.readOnly, st.ReadOnly)
	case st.ID != id:
		return fmt.Errorf("virtio-blk %s: ID %q, the snapshot's disk had %q", b.path, id, st.ID)
	case st.Key != b.key:
		return fmt.Errorf("virtio-blk %s: serves %q, the snapshot's disk served %q", b.path, b.key, st.Key)
	}
	return nil
}

// NetState is a virtio-net device in a snapshot.
type NetState struct {
	MAC string `json:"mac"`
}

// SaveState implements Device.
func (n *Net) SaveState() (json.RawMessage, error) {
	return json.Marshal(NetState{MAC: n.mac.String()})
}

// RestoreState implements Device. A restored VM may sit on another tap with
// another MAC (a clone needs its own): the device keeps its configured
// MAC, which the guest sees in config space; its driver keeps the address
// it read at boot until told otherwise, so the difference is logged.
func (n *Net) RestoreState(data json.RawMessage) error {
	var st NetState
	if err := decodeState(data, &st); err != nil {
		return fmt.Errorf("virtio-net %s: %w", n.tapName, err)
	}
	mac, err := net.ParseMAC(st.MAC)
	if err != nil {
		return fmt.Errorf("virtio-net %s: snapshot MAC: %w", n.tapName, err)
	}
	if mac.String() != n.mac.String() {
		n.log.Info("restored with a new MAC address", "snapshot_mac", mac.String(), "mac", n.mac.String())
	}
	return nil
}

// VsockState is a virtio-vsock device in a snapshot. Connections are not
// part of it: the host ends of them do not survive, so a restored device
// drops them and sends the guest TRANSPORT_RESET.
type VsockState struct {
	CID uint64 `json:"guest_cid"`
}

// SaveState implements Device.
func (v *Vsock) SaveState() (json.RawMessage, error) {
	return json.Marshal(VsockState{CID: v.cid})
}

// RestoreState implements Device. The device may have another CID than the
// snapshot's (each clone has its own): the guest rereads it on the
// TRANSPORT_RESET event that the device sends once it is active again.
func (v *Vsock) RestoreState(data json.RawMessage) error {
	var st VsockState
	if err := decodeState(data, &st); err != nil {
		return fmt.Errorf("vsock %s: %w", v.path, err)
	}
	if st.CID < 3 || st.CID > 0xffffffff {
		return fmt.Errorf("vsock %s: snapshot's guest CID %d is not a valid guest CID", v.path, st.CID)
	}
	v.mu.Lock()
	v.resetOnActivate = true
	v.mu.Unlock()
	return nil
}

// RNGState is a virtio-rng device in a snapshot: it has no state of its own.
type RNGState struct{}

// SaveState implements Device.
func (r *RNG) SaveState() (json.RawMessage, error) { return json.Marshal(RNGState{}) }

// RestoreState implements Device.
func (r *RNG) RestoreState(data json.RawMessage) error {
	var st RNGState
	if err := decodeState(data, &st); err != nil {
		return fmt.Errorf("virtio-rng: %w", err)
	}
	return nil
}
