// Package seccomptest makes a test binary serving as a VMM process call a
// system call its seccomp filter forbids, on the test's signal: the test's
// TestMain starts Watch when TriggerEnv is set, and the test writes the
// file TriggerEnv names once it wants the process killed. Only _test.go
// files import it, so no production binary (kiln, kilnd) holds the
// trigger; a guest cannot reach it, and a parent only through a test
// binary's environment.
package seccomptest

import (
	"context"
	"fmt"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/seccomp"
)

// TriggerEnv names the trigger file of a VMM process that is a test
// binary.
const TriggerEnv = "KILN_TEST_SECCOMP_TRIGGER"

// Install is the trigger file's content that has Watch install the VMM's
// filter itself first (a VMM process with no VM, in tests without KVM).
const Install = "install"

// Watch polls for the trigger file at path until ctx ends; once it exists
// it calls mount(2), which no VMM filter allows: the process dies of
// SIGSYS. With content Install it installs seccomp.VMM() first.
func Watch(ctx context.Context, path string) {
	t := time.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		b, err := os.ReadFile(path)
		if err != nil {
			continue
		}
		if string(b) == Install {
			if err := seccomp.VMM().Install(); err != nil {
				fmt.Fprintln(os.Stderr, "seccomptest: install:", err)
				os.Exit(3)
			}
		}
		fmt.Fprintln(os.Stderr, "seccomptest: calling mount(2), outside the VMM's allowlist")
		err = unix.Mount("none", os.TempDir(), "tmpfs", 0, "")
		fmt.Fprintln(os.Stderr, "seccomptest: mount(2) returned, the filter did not stop it:", err)
		os.Exit(4)
	}
}
