package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/spf13/cobra"
	"golang.org/x/term"

	kilnclient "github.com/kilnvm/kiln/daemon/client"
)

// onTerminal makes an exec run on a terminal of the size of kiln's own
// (its stdin): kiln's terminal goes into raw mode, so that keys (Ctrl-C
// too) reach the sandbox's terminal as typed, and each SIGWINCH resizes
// the sandbox's. restore puts kiln's terminal back as it was and stops
// the resizing; it must be called once the exec has returned.
func (a *cli) onTerminal(opts *kilnclient.ExecOptions) (restore func(), _ error) {
	f, ok := a.stdin.(*os.File)
	if !ok || !term.IsTerminal(int(f.Fd())) {
		return nil, usagef("--tty: kiln's stdin is not a terminal")
	}
	fd := int(f.Fd())
	size := func() (kilnclient.PtySize, error) {
		cols, rows, err := term.GetSize(fd)
		if err != nil {
			return kilnclient.PtySize{}, err
		}
		return kilnclient.PtySize{Rows: uint32(max(rows, 1)), Cols: uint32(max(cols, 1))}, nil
	}
	sz, err := size()
	if err != nil {
		return nil, fmt.Errorf("--tty: the terminal's size: %w", err)
	}
	old, err := term.MakeRaw(fd)
	if err != nil {
		return nil, fmt.Errorf("--tty: raw mode: %w", err)
	}
	opts.Pty, opts.Stdin = &sz, f
	// One standing buffer: a size that arrives while the last is in
	// flight replaces it, never blocks the handler.
	resize := make(chan kilnclient.PtySize, 1)
	opts.Resize = resize
	winch := make(chan os.Signal, 1)
	signal.Notify(winch, syscall.SIGWINCH)
	quit := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-winch:
				if sz, err := size(); err == nil {
					select {
					case <-resize: // drop the stale one
					default:
					}
					resize <- sz
				}
			case <-quit:
				return
			}
		}
	}()
	return func() {
		signal.Stop(winch)
		close(quit)
		<-done
		term.Restore(fd, old)
	}, nil
}

// mvCmd renames a file or directory inside a sandbox.
func (a *cli) mvCmd() *cobra.Command {
	var id, src, dst string
	return &cobra.Command{
		Use:   "mv ID:SRC [ID:]DST",
		Short: "rename a file or directory inside a sandbox (rename(2): not across its file systems)",
		Long: `Rename a file or directory inside a sandbox, as rename(2) does: a file at
DST is replaced; across the sandbox's file systems it fails (copy with cp, then
rm instead). Both paths are absolute paths of the one sandbox.`,
		Args:              args(cobra.ExactArgs(2)),
		ValidArgsFunction: a.completeSandboxes,
		PreRunE: func(_ *cobra.Command, argv []string) error {
			var ok bool
			if id, src, ok = remotePath(argv[0]); !ok {
				return usagef("sandbox mv: want ID:SRC, got %q", argv[0])
			}
			dst = argv[1]
			if dstID, p, ok := remotePath(dst); ok {
				if dstID != id {
					return usagef("sandbox mv: %s and %s are in different sandboxes", argv[0], dst)
				}
				dst = p
			}
			if !strings.HasPrefix(src, "/") || !strings.HasPrefix(dst, "/") {
				return usagef("sandbox mv: want absolute paths, got %q and %q", src, dst)
			}
			return nil
		},
		RunE: a.call(func(ctx context.Context, c *kilnclient.Client, _ []string) error {
			_, err := c.Move(ctx, id, src, dst)
			return err
		}),
	}
}
