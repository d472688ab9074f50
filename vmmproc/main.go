package vmmproc

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/opencontainers/go-digest"

	"github.com/kilnvm/kiln/erofs"
	"github.com/kilnvm/kiln/hostfs"
	"github.com/kilnvm/kiln/image"
	"github.com/kilnvm/kiln/image/chunkrpc"
	"github.com/kilnvm/kiln/image/tree"
	"github.com/kilnvm/kiln/rofs"
	"github.com/kilnvm/kiln/virtio"
)

// Main is the main of a VMM process: cmd/kiln-vmm, the hidden `kiln vmm`,
// and test binaries run as one (their TestMain calls it when SocketEnv is
// set). args are the flags after the program's name: --socket PATH (the
// default is $KILN_VMM_SOCKET, as Start passes it). It serves ServeMain
// with image roots that open from the images folder their spec names.
// Unjailed, the process fetches lazy chunks from the registry itself, as
// its parent would; jailed, where it has neither the registry's network
// nor write access to the store, its parent fetches them (ChunkSocket,
// beside the API socket). It returns the process's exit code: 2 for bad
// arguments.
func Main(ctx context.Context, args []string) int {
	return mainWith(ctx, args, os.Stderr)
}

func mainWith(ctx context.Context, args []string, stderr io.Writer) int {
	fs := flag.NewFlagSet("kiln-vmm", flag.ContinueOnError)
	fs.SetOutput(stderr)
	sock := fs.String("socket", "", "the API's Unix socket `PATH` (default: $"+SocketEnv+")")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "kiln-vmm: unexpected argument %q\n", fs.Arg(0))
		return 2
	}
	path := *sock
	if path == "" {
		path = os.Getenv(SocketEnv)
	}
	var opts image.Options
	if os.Getenv(JailEnv) != "" && path != "" {
		opts.Fetcher = chunkrpc.Client{Path: ChunkSocket(path)}
	}
	return ServeMain(ctx, *sock, OpenImageFS(image.NewRoots(opts)))
}

// OpenImageFS returns the opener of the trees a VM needs for its fs
// devices (vmm.Config.OpenFS): image roots through roots (the devices of
// one image in one folder share one tree; nil: no image store here), and
// host directories (package hostfs: never following a symbolic link,
// never leaving the directory), each a *hostfs.Trees, to which further
// named trees can be added while it is served. A VMM process opens its
// trees with it, and so does package sandbox for a VM in its own process.
func OpenImageFS(roots *image.Roots) virtio.FSOpener {
	return func(spec virtio.FSSpec) (rofs.FS, io.Closer, error) {
		if spec.Dir != "" {
			t, err := hostfs.NewTrees(spec.Dir)
			if err != nil {
				return nil, nil, err
			}
			return t, t, nil
		}
		if roots == nil {
			return nil, nil, errors.New("no image store here")
		}
		r, release, err := roots.Open(context.Background(), spec.Images, digest.Digest(spec.Image))
		if err != nil {
			return nil, nil, err
		}
		return rootTree{r.Tree, r}, closerFunc(release), nil
	}
}

// rootTree is an image root's tree that keeps its EROFS layout in the
// root (virtio.EROFSLayout): one layout per image, however many disks
// serve it in this process.
type rootTree struct {
	*tree.Tree
	root *image.Root
}

func (t rootTree) EROFS(ctx context.Context) (*erofs.Image, error) { return t.root.EROFS(ctx) }

type closerFunc func() error

func (f closerFunc) Close() error { return f() }
