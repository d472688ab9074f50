package kvmtest

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// SharedEnvVar names the folder that every test of one harness run shares,
// in every L1 VM and package: tools/kvmharness creates it and sets this
// variable. Shared builds into it.
const SharedEnvVar = "KILN_TEST_SHARED"

// Shared returns the folder <shared>/<name> of the folder SharedEnvVar
// names, building it with build first when it is not there yet, so that a
// test can make an expensive thing (a warm snapshot of a booted sandbox)
// once per harness run and the others reuse it. The harness starts the
// tests named TestKVMWarm... before the other KVM tests (the longest of
// which run beside them), so a warm test that calls Shared has usually
// built it by the time the short tests that use it ask; one that asks
// first builds it too (below).
//
// build fills dir, a fresh temporary sibling of the final folder, which
// is then renamed into place: a folder that is there is complete. When two
// tests (in two L1 VMs, say) build the same name at once, both build; the
// first rename wins, the other's folder is removed and the winner's
// returned. So what build writes must not depend on dir's path (it is
// renamed), and two builds of one name must be equally good. A build that
// fails fails the test, and leaves nothing behind.
//
// Without SharedEnvVar (plain go test), it builds into t.TempDir: nothing
// is shared, and the folder goes away with the test.
//
// Under the harness's TCG mode the shared folder reaches L1 over 9p
// (cache=mmap): a file in it can be read and mapped MAP_PRIVATE, as a
// snapshot's memory file is, from any L1, with no copy (see the README;
// TestSharedMappable checks it).
func Shared(t testing.TB, name string, build func(dir string) error) string {
	t.Helper()
	root := os.Getenv(SharedEnvVar)
	if root == "" {
		root = t.TempDir()
	}
	dir, err := sharedDir(root, name, build)
	if err != nil {
		t.Fatalf("kvmtest.Shared: %v", err)
	}
	return dir
}

// sharedDir is Shared in the folder root.
func sharedDir(root, name string, build func(dir string) error) (string, error) {
	if err := checkSharedName(name); err != nil {
		return "", err
	}
	final := filepath.Join(root, name)
	if done, err := isDir(final); err != nil || done {
		return final, err
	}
	tmp, err := os.MkdirTemp(root, "."+name+".building-")
	if err != nil {
		return "", fmt.Errorf("building %s: %w", name, err)
	}
	if err := build(tmp); err != nil {
		os.RemoveAll(tmp)
		return "", fmt.Errorf("building %s: %w", name, err)
	}
	if err := os.Rename(tmp, final); err != nil {
		os.RemoveAll(tmp)
		// Another builder renamed its folder into place first.
		if done, _ := isDir(final); done {
			return final, nil
		}
		return "", fmt.Errorf("moving %s into place: %w", name, err)
	}
	return final, nil
}

// isDir reports whether path is a folder; an error other than its absence
// is returned.
func isDir(path string) (bool, error) {
	fi, err := os.Stat(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("looking for %s: %w", path, err)
	case !fi.IsDir():
		return false, fmt.Errorf("%s is there but not a folder", path)
	}
	return true, nil
}

// checkSharedName accepts one plain path element that does not start with
// a dot (the temporary folders do).
func checkSharedName(name string) error {
	if name == "" || strings.HasPrefix(name, ".") || strings.ContainsAny(name, `/\`) || name != filepath.Clean(name) {
		return fmt.Errorf("shared folder name %q: want one path element, not starting with a dot", name)
	}
	return nil
}
