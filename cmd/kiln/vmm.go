package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/kilnvm/kiln/image"
	"github.com/kilnvm/kiln/sandbox"
	"github.com/kilnvm/kiln/vmmproc"
)

// cmdVMM is `kiln vmm`: a VMM process, serving one VM on a Unix socket
// for its parent (package vmmproc). The socket is --socket, or the one
// $KILN_VMM_SOCKET names (as vmmproc.Start passes it).
func cmdVMM(ctx context.Context, args []string, stderr io.Writer) int {
	fs := flag.NewFlagSet("kiln vmm", flag.ContinueOnError)
	fs.SetOutput(stderr)
	sock := fs.String("socket", "", "the API's Unix socket `PATH` (default: $"+vmmproc.SocketEnv+")")
	if err := fs.Parse(args); err != nil {
		return exitUsage
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "kiln vmm: unexpected argument %q\n", fs.Arg(0))
		return exitUsage
	}
	// Image roots open from the images folder their spec names, lazily
	// fetching chunks from the image's registry as the parent would.
	return vmmproc.ServeMain(ctx, *sock, sandbox.OpenImageFS(image.NewRoots(image.Options{})))
}

// vmmProcess returns the options that run a sandbox's VM in a `kiln vmm`
// process of this very binary.
func vmmProcess() (*sandbox.ProcessOptions, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	return &sandbox.ProcessOptions{Command: []string{self, "vmm"}}, nil
}
