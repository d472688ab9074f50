package virtio

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// Vsock packet constants (virtio 1.x section 5.10).
const (
	// VsockHostCID is the host's context ID, the only peer the guest has.
	VsockHostCID = 2
	// vsockHdrSize is sizeof(struct virtio_vsock_hdr).
	vsockHdrSize = 44
	// vsockMaxPayload bounds one packet's payload in either direction
	// (Linux's VIRTIO_VSOCK_MAX_PKT_BUF_SIZE).
	vsockMaxPayload = 64 << 10

	vsockTypeStream = 1

	vsockOpRequest       = 1
	vsockOpResponse      = 2
	vsockOpRST           = 3
	vsockOpShutdown      = 4
	vsockOpRW            = 5
	vsockOpCreditUpdate  = 6
	vsockOpCreditRequest = 7

	// SHUTDOWN flags: the sender will receive no more / send no more.
	vsockShutdownRcv  = 1
	vsockShutdownSend = 2

	// vsockEventTransportReset is VIRTIO_VSOCK_EVENT_TRANSPORT_RESET.
	vsockEventTransportReset = 0
)

// errVsockPacket is wrapped by every packet validation error.
var errVsockPacket = errors.New("bad vsock packet")

// vsockHdr is struct virtio_vsock_hdr.
type vsockHdr struct {
	SrcCID, DstCID   uint64
	SrcPort, DstPort uint32
	Len              uint32
	Type, Op         uint16
	Flags            uint32
	BufAlloc, FwdCnt uint32
}

// decode fills h from the first vsockHdrSize bytes of b.
func (h *vsockHdr) decode(b []byte) error {
	if len(b) < vsockHdrSize {
		return fmt.Errorf("%w: %d-byte header, want %d", errVsockPacket, len(b), vsockHdrSize)
	}
	le := binary.LittleEndian
	*h = vsockHdr{
		SrcCID: le.Uint64(b[0:]), DstCID: le.Uint64(b[8:]),
		SrcPort: le.Uint32(b[16:]), DstPort: le.Uint32(b[20:]),
		Len:  le.Uint32(b[24:]),
		Type: le.Uint16(b[28:]), Op: le.Uint16(b[30:]),
		Flags:    le.Uint32(b[32:]),
		BufAlloc: le.Uint32(b[36:]), FwdCnt: le.Uint32(b[40:]),
	}
	return nil
}

// encode writes h into the first vsockHdrSize bytes of b.
func (h *vsockHdr) encode(b []byte) {
	le := binary.LittleEndian
	le.PutUint64(b[0:], h.SrcCID)
	le.PutUint64(b[8:], h.DstCID)
	le.PutUint32(b[16:], h.SrcPort)
	le.PutUint32(b[20:], h.DstPort)
	le.PutUint32(b[24:], h.Len)
	le.PutUint16(b[28:], h.Type)
	le.PutUint16(b[30:], h.Op)
	le.PutUint32(b[32:], h.Flags)
	le.PutUint32(b[36:], h.BufAlloc)
	le.PutUint32(b[40:], h.FwdCnt)
}

// validate checks a header the guest sent on its tx queue, with avail the
// payload bytes that follow it in the chain. Errors wrap errVsockPacket;
// reply says whether the guest should get an RST for it (a stream packet
// from the guest to the host with a bad op or length) rather than have it
// silently dropped (wrong addresses, an RST, an unknown type).
func (h *vsockHdr) validate(guestCID uint64, avail int) (reply bool, err error) {
	switch {
	case h.SrcCID != guestCID:
		return false, fmt.Errorf("%w: source CID %d, the guest is %d", errVsockPacket, h.SrcCID, guestCID)
	case h.DstCID != VsockHostCID:
		return false, fmt.Errorf("%w: destination CID %d, only the host (%d) is reachable", errVsockPacket, h.DstCID, VsockHostCID)
	case h.Type != vsockTypeStream:
		return h.Op != vsockOpRST, fmt.Errorf("%w: socket type %d, only stream (%d) is supported", errVsockPacket, h.Type, vsockTypeStream)
	case h.Op < vsockOpRequest || h.Op > vsockOpCreditRequest:
		return true, fmt.Errorf("%w: unknown op %d", errVsockPacket, h.Op)
	case h.Len > vsockMaxPayload:
		return h.Op != vsockOpRST, fmt.Errorf("%w: payload of %d bytes, at most %d", errVsockPacket, h.Len, vsockMaxPayload)
	case int64(h.Len) > int64(avail):
		return h.Op != vsockOpRST, fmt.Errorf("%w: payload of %d bytes in a chain with %d", errVsockPacket, h.Len, avail)
	case h.Op != vsockOpRW && h.Len != 0:
		return h.Op != vsockOpRST, fmt.Errorf("%w: op %d with a %d-byte payload", errVsockPacket, h.Op, h.Len)
	}
	return false, nil
}

// rstFor returns the RST answering h (addresses swapped).
func (h *vsockHdr) rstFor() vsockHdr {
	return vsockHdr{
		SrcCID: h.DstCID, DstCID: h.SrcCID,
		SrcPort: h.DstPort, DstPort: h.SrcPort,
		Type: vsockTypeStream, Op: vsockOpRST,
	}
}
