// Command kiln-vmm is a VMM process: it serves one VM for its parent
// (kiln run, kiln fork, kilnd, or a library user of package sandbox) over
// a Unix socket, and is nothing else (package vmmproc, whose Main it
// runs). It links the VMM, its devices, the jail and the seccomp filter,
// not the kiln CLI: every sandbox runs one, so what it does not link is
// memory and attack surface every sandbox saves. Parents find it with
// sandbox.FindVMM ($KILN_VMM, else kiln-vmm beside themselves, else on
// PATH).
//
//	kiln-vmm [--socket PATH]   (default: $KILN_VMM_SOCKET)
//
// Build it with CGO_ENABLED=0 (make build does): a jailed VMM process
// changes every thread's ids and capabilities through the Go runtime,
// which it cannot do in a cgo binary.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/kilnvm/kiln/vmmproc"
)

func main() {
	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := vmmproc.Main(ctx, os.Args[1:])
	cancel()
	os.Exit(code)
}
