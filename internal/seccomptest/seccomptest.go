// Package seccomptest makes a test binary serving as a VMM process call a
// system call its seccomp filter forbids, on the test's signal: the test's
// TestMain starts Watch when TriggerEnv is set, and the test writes the
// file named for the process's PID in the folder TriggerEnv names (File)
// once it wants that process killed. Only _test.go
// files import it, so no production binary (kiln, kilnd) holds the
// trigger; a guest cannot reach it, and a parent only through a test
// binary's environment.
package seccomptest

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/seccomp"
)

// TriggerEnv names the trigger folder of a VMM process that is a test
// binary.
const TriggerEnv = "KILN_TEST_SECCOMP_TRIGGER"

// Install is the trigger file's content that has Watch install the VMM's
// filter itself first (a VMM process with no VM, in tests without KVM).
const Install = "install"

// File is the trigger file of the process pid in the folder dir.
func File(dir string, pid int) string { return filepath.Join(dir, strconv.Itoa(pid)) }

// Watch polls for this process's trigger file in dir until ctx ends; once
// it exists it calls mount(2), which no VMM filter allows: the process
// dies of SIGSYS. With content Install it installs seccomp.VMM() first.
func Watch(ctx context.Context, dir string) {
	path := File(dir, os.Getpid())
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
