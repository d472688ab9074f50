package client

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// WriteFileOptions are WriteFile's choices.
type WriteFileOptions struct {
	// Mode is the file's permission bits; 0: 0644.
	Mode uint32
	// MakeParents creates missing parent directories.
	MakeParents bool
	// User, when set, owns the file (and the parents the call creates):
	// a user of the guest's /etc/passwd, with its group.
	User string
}

// WriteFile writes r's bytes to path (absolute, in the sandbox),
// replacing what was there, and returns the file's new attributes.
func (c *Client) WriteFile(ctx context.Context, sandboxID, path string, r io.Reader, opts WriteFileOptions) (*kilnpb.FileInfo, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := c.api.WriteFile(ctx)
	if err != nil {
		return nil, callErr(fmt.Sprintf("write %s in %s", path, sandboxID), err)
	}
	fail := func(err error) (*kilnpb.FileInfo, error) {
		if errors.Is(err, io.EOF) {
			// The server ended the call early; CloseAndRecv says why.
			if _, rerr := st.CloseAndRecv(); rerr != nil {
				err = rerr
			}
		}
		return nil, callErr(fmt.Sprintf("write %s in %s", path, sandboxID), err)
	}
	hdr := &kilnpb.WriteFileHeader{SandboxId: sandboxID, Path: path, Mode: opts.Mode, MakeParents: opts.MakeParents, User: opts.User}
	if err := st.Send(&kilnpb.WriteFileRequest{Kind: &kilnpb.WriteFileRequest_Header{Header: hdr}}); err != nil {
		return fail(err)
	}
	buf := make([]byte, chunkSize)
	for {
		n, rerr := r.Read(buf)
		if n > 0 {
			// Send marshals before it returns, so buf can be reused.
			if err := st.Send(&kilnpb.WriteFileRequest{Kind: &kilnpb.WriteFileRequest_Data{Data: buf[:n]}}); err != nil {
				return fail(err)
			}
		}
		if errors.Is(rerr, io.EOF) {
			break
		}
		if rerr != nil {
			return nil, callErr(fmt.Sprintf("write %s in %s: reading the source", path, sandboxID), rerr)
		}
	}
	fi, err := st.CloseAndRecv()
	if err != nil {
		return nil, callErr(fmt.Sprintf("write %s in %s", path, sandboxID), err)
	}
	return fi, nil
}

// ReadFile copies the file at path in the sandbox to w and returns how
// many bytes it wrote.
func (c *Client) ReadFile(ctx context.Context, sandboxID, path string, w io.Writer) (int64, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := c.api.ReadFile(ctx, &kilnpb.ReadFileRequest{SandboxId: sandboxID, Path: path})
	if err != nil {
		return 0, callErr(fmt.Sprintf("read %s in %s", path, sandboxID), err)
	}
	var total int64
	for ch, err := range stream(st.Recv) {
		if err != nil {
			return total, callErr(fmt.Sprintf("read %s in %s", path, sandboxID), err)
		}
		n, err := w.Write(ch.GetData())
		total += int64(n)
		if err != nil {
			return total, callErr(fmt.Sprintf("read %s in %s: writing", path, sandboxID), err)
		}
	}
	return total, nil
}

// ListDir lists a directory in the sandbox.
func (c *Client) ListDir(ctx context.Context, sandboxID, path string) ([]*kilnpb.FileInfo, error) {
	return c.ListDirDepth(ctx, sandboxID, path, 1)
}

// ListDirDepth lists a directory in the sandbox and, depth levels down,
// its subdirectories: each directory's entries by name, a subdirectory's
// after it, with full paths (symlinks are not followed).
func (c *Client) ListDirDepth(ctx context.Context, sandboxID, path string, depth uint32) ([]*kilnpb.FileInfo, error) {
	resp, err := c.api.ListDir(ctx, &kilnpb.ListDirRequest{SandboxId: sandboxID, Path: path, Depth: depth})
	if err != nil {
		return nil, callErr(fmt.Sprintf("list %s in %s", path, sandboxID), err)
	}
	return resp.GetEntries(), nil
}

// Stat returns a file's attributes, following a final symlink.
func (c *Client) Stat(ctx context.Context, sandboxID, path string) (*kilnpb.FileInfo, error) {
	return c.stat(ctx, sandboxID, path, false)
}

// Lstat returns a file's attributes; a symlink is described itself.
func (c *Client) Lstat(ctx context.Context, sandboxID, path string) (*kilnpb.FileInfo, error) {
	return c.stat(ctx, sandboxID, path, true)
}

func (c *Client) stat(ctx context.Context, sandboxID, path string, noFollow bool) (*kilnpb.FileInfo, error) {
	fi, err := c.api.Stat(ctx, &kilnpb.StatRequest{SandboxId: sandboxID, Path: path, NoFollow: noFollow})
	if err != nil {
		return nil, callErr(fmt.Sprintf("stat %s in %s", path, sandboxID), err)
	}
	return fi, nil
}

// Remove removes a file or an empty directory in the sandbox.
func (c *Client) Remove(ctx context.Context, sandboxID, path string) error {
	return c.remove(ctx, sandboxID, path, false)
}

// RemoveAll removes path and everything under it.
func (c *Client) RemoveAll(ctx context.Context, sandboxID, path string) error {
	return c.remove(ctx, sandboxID, path, true)
}

func (c *Client) remove(ctx context.Context, sandboxID, path string, recursive bool) error {
	if _, err := c.api.Remove(ctx, &kilnpb.RemoveRequest{SandboxId: sandboxID, Path: path, Recursive: recursive}); err != nil {
		return callErr(fmt.Sprintf("remove %s in %s", path, sandboxID), err)
	}
	return nil
}

// MakeDirOptions are MakeDir's choices.
type MakeDirOptions struct {
	// Mode is the permission bits; 0: 0755.
	Mode uint32
	// Parents creates missing parents and accepts an existing directory.
	Parents bool
	// User, when set, owns the directories the call creates: a user of
	// the guest's /etc/passwd, with its group.
	User string
}

// MakeDir creates a directory in the sandbox.
func (c *Client) MakeDir(ctx context.Context, sandboxID, path string, opts MakeDirOptions) (*kilnpb.FileInfo, error) {
	fi, err := c.api.MakeDir(ctx, &kilnpb.MakeDirRequest{SandboxId: sandboxID, Path: path, Mode: opts.Mode, Parents: opts.Parents, User: opts.User})
	if err != nil {
		return nil, callErr(fmt.Sprintf("make directory %s in %s", path, sandboxID), err)
	}
	return fi, nil
}

// Move renames a file or directory in the sandbox (rename(2): a file at
// the destination is replaced; across file systems it is
// FailedPrecondition) and returns it at its destination.
func (c *Client) Move(ctx context.Context, sandboxID, source, destination string) (*kilnpb.FileInfo, error) {
	fi, err := c.api.Move(ctx, &kilnpb.MoveRequest{SandboxId: sandboxID, Source: source, Destination: destination})
	if err != nil {
		return nil, callErr(fmt.Sprintf("move %s to %s in %s", source, destination, sandboxID), err)
	}
	return fi, nil
}

// WatchDir calls fn with the changes below a directory of the sandbox
// (recursive: in its subdirectories too), a started event first (the
// watch is in place), until ctx ends or the directory goes (nil), fn
// returns an error (that error) or the watch fails (ResourceExhausted
// when the guest lost events).
func (c *Client) WatchDir(ctx context.Context, sandboxID, path string, recursive bool, fn func(*kilnpb.WatchEvent) error) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	what := fmt.Sprintf("watch %s in %s", path, sandboxID)
	st, err := c.api.WatchDir(ctx, &kilnpb.WatchDirRequest{SandboxId: sandboxID, Path: path, Recursive: recursive})
	if err != nil {
		return callErr(what, err)
	}
	for ev, err := range stream(st.Recv) {
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return callErr(what, err)
		}
		if err := fn(ev); err != nil {
			return err
		}
	}
	return nil
}
