package virtio

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/kilnvm/kiln/erofs"
	"github.com/kilnvm/kiln/rofs"
)

// EROFSLayout is what a tree offers when it keeps its EROFS layout itself
// (an image's root lays its tree out once for every device that serves
// it); a tree without it is laid out for each device.
type EROFSLayout interface {
	EROFS(ctx context.Context) (*erofs.Image, error)
}

// erofsLayoutTimeout bounds laying a tree out: it reads only metadata the
// tree holds in memory.
const erofsLayoutTimeout = 2 * time.Minute

// newEROFSDisk makes the read-only virtio-blk disk of spec's image: tree
// laid out as EROFS, its serial spec.Tag. The disk's snapshot state is
// keyed by the image and the layout's digest, so a restore serves the
// very blocks the guest cached. closer is released when the disk closes.
func newEROFSDisk(spec FSSpec, tree rofs.FS, closer io.Closer, log *slog.Logger) (*Block, error) {
	ctx, cancel := context.WithTimeout(context.Background(), erofsLayoutTimeout)
	defer cancel()
	var img *erofs.Image
	var err error
	if l, ok := tree.(EROFSLayout); ok {
		img, err = l.EROFS(ctx)
	} else {
		img, err = erofs.Build(ctx, tree, erofs.Options{VolumeName: spec.Tag, Logger: log})
	}
	if err != nil {
		return nil, fmt.Errorf("laying %s out as erofs: %w", spec.Key(), err)
	}
	key := spec.Key() + " erofs " + img.Digest()
	return NewBlockFromSource(img, key, closer, BlockConfig{Path: "erofs:" + spec.Key(), ID: spec.Tag, Logger: log})
}
