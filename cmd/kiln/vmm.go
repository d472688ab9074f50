package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/kilnvm/kiln/jail"
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
	// Image roots open from the images folder their spec names; jailed,
	// the parent fetches their missing chunks (sandbox.ServeVMM).
	return sandbox.ServeVMM(ctx, *sock)
}

// vmmProcess returns the options that run a sandbox's VM in a `kiln vmm`
// process of this very binary, jailed (package jail) when jailIDs is set:
// the folder of the jails' id locks.
func vmmProcess(jailIDs string) (*sandbox.ProcessOptions, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	po := &sandbox.ProcessOptions{Command: []string{self, "vmm"}}
	if jailIDs != "" {
		ids, err := jail.NewIDs(jailIDs, jail.FirstID, jail.IDCount)
		if err != nil {
			return nil, err
		}
		po.Jail = &sandbox.JailOptions{IDs: ids}
	}
	return po, nil
}

// jailFlags are kiln run's and kiln fork's --jail and --jail-ids.
type jailFlags struct {
	on  *bool
	ids *string
}

func addJailFlags(fs *flag.FlagSet) jailFlags {
	return jailFlags{
		on:  fs.Bool("jail", false, "jail each VMM process (implies --vmm-process): namespaces of its own, a root holding only what it needs, a uid of its own, no capabilities; needs root (image chunks are fetched by this process for it)"),
		ids: fs.String("jail-ids", jail.DefaultIDsDir, "with --jail, `DIR` whose jail-ids folder holds the locks of the jails' uids (kilnd's --jail-ids)"),
	}
}

// dir is the id folder vmmProcess takes: "" without --jail.
func (f jailFlags) dir() string {
	if !*f.on {
		return ""
	}
	return *f.ids
}
