package client

import (
	"context"
	"fmt"
	"io"

	"github.com/kilnvm/kiln/guest/agentpb"
)

// ExportWritable copies the guest's ExportWritable tar (what the writes to
// its image root made) to w and returns how many bytes it copied.
func (c *Client) ExportWritable(ctx context.Context, w io.Writer) (int64, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := c.api.ExportWritable(ctx, &agentpb.ExportWritableRequest{})
	if err != nil {
		return 0, fmt.Errorf("client: export the writable layer: %w", err)
	}
	return copyChunks(w, stream.Recv, "export the writable layer")
}

// copyChunks writes the data of the messages recv returns to w until the
// stream ends, and returns how many bytes it wrote; what names the call
// in errors.
func copyChunks(w io.Writer, recv func() (*agentpb.Chunk, error), what string) (int64, error) {
	var n int64
	for {
		chunk, err := recv()
		if err == io.EOF {
			return n, nil
		}
		if err != nil {
			return n, fmt.Errorf("client: %s: %w", what, err)
		}
		m, err := w.Write(chunk.GetData())
		n += int64(m)
		if err != nil {
			return n, fmt.Errorf("client: %s: writing: %w", what, err)
		}
	}
}

// ImportWritable sends the tar r (an ExportWritable's) for the guest to
// apply to its root.
func (c *Client) ImportWritable(ctx context.Context, r io.Reader) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := c.api.ImportWritable(ctx)
	if err != nil {
		return fmt.Errorf("client: import the writable layer: %w", err)
	}
	buf := make([]byte, writeChunk)
	for {
		n, rerr := io.ReadFull(r, buf)
		if n > 0 {
			if err := stream.Send(&agentpb.ImportWritableRequest{Data: buf[:n]}); err != nil {
				break // CloseAndRecv has the reason
			}
		}
		if rerr == io.EOF || rerr == io.ErrUnexpectedEOF {
			break
		}
		if rerr != nil {
			return fmt.Errorf("client: import the writable layer: reading it: %w", rerr)
		}
	}
	if _, err := stream.CloseAndRecv(); err != nil {
		return fmt.Errorf("client: import the writable layer: %w", err)
	}
	return nil
}
