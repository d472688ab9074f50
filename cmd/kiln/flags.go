package main

import (
	"errors"
	"fmt"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/kilnvm/kiln/sandbox"
	"github.com/kilnvm/kiln/vmm"
)

// checkShape refuses --cpus and --mem a sandbox cannot have, by flag
// name, at the command line: 0 is not "the default", as the sandbox
// package would take it.
func checkShape(cpus, memMiB int) error {
	if err := sandbox.CheckCPUs(cpus); err != nil {
		return fmt.Errorf("--cpus: %w", err)
	}
	if err := sandbox.CheckMemory(memMiB); err != nil {
		return fmt.Errorf("--mem: %w", err)
	}
	return nil
}

// refuseZero refuses the named flags when the command line sets them to
// 0: in a request to kilnd, 0 asks for the daemon's default, which is not
// what someone who typed --cpus 0 meant.
func refuseZero(cmd *cobra.Command, names ...string) error {
	for _, n := range names {
		if f := cmd.Flags().Lookup(n); f != nil && f.Changed && f.Value.String() == "0" {
			return usagef("%s: --%s 0: want at least 1 (leave the flag out for the daemon's default)", cmd.CommandPath(), n)
		}
	}
	return nil
}

// bootExitCode is kiln boot's exit code for an error from vmm.New: the
// usage code for a spec that cannot be (a missing or malformed file, a
// bad shape), 1 for the host refusing (KVM, memory, a locked image, a
// tap it may not create), as the other kiln commands fail.
func bootExitCode(err error) int {
	var ce *vmm.ConfigError
	if errors.As(err, &ce) && !hostRefused(err) {
		return exitUsage
	}
	return exitFailed
}

// hostRefused reports whether err carries an errno other than those that
// say a name given is wrong (no such file, not a directory, ...): the host
// refused what the command asked, which is a runtime failure even where
// vmm calls it the spec's.
func hostRefused(err error) bool {
	var errno syscall.Errno
	if !errors.As(err, &errno) {
		return false
	}
	switch errno {
	case syscall.ENOENT, syscall.ENOTDIR, syscall.EISDIR, syscall.ENAMETOOLONG, syscall.ELOOP, syscall.EINVAL, syscall.ENXIO:
		return false
	}
	return true
}
