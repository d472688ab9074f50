package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/internal/kvmtest"
	"github.com/kilnvm/kiln/vmm"
)

func TestBootExitCode(t *testing.T) {
	pathErr := func(errno syscall.Errno) error {
		return &os.PathError{Op: "open", Path: "/x", Err: errno}
	}
	for _, tc := range []struct {
		name string
		err  error
		want int
	}{
		{"bad shape", &vmm.ConfigError{Err: errors.New("0 vCPUs: want 1 to 254")}, exitUsage},
		{"missing file", &vmm.ConfigError{Err: fmt.Errorf("read kernel: %w", pathErr(syscall.ENOENT))}, exitUsage},
		{"a directory", &vmm.ConfigError{Err: pathErr(syscall.EISDIR)}, exitUsage},
		{"locked image", &vmm.ConfigError{Err: fmt.Errorf("virtio-blk: locking image: %w", syscall.EWOULDBLOCK)}, exitFailed},
		{"tap not allowed", &vmm.ConfigError{Err: fmt.Errorf("tap: %w", pathErr(syscall.EPERM))}, exitFailed},
		{"KVM", fmt.Errorf("open /dev/kvm: %w", syscall.ENOENT), exitFailed},
		{"anything else", errors.New("KVM_CREATE_VM failed"), exitFailed},
	} {
		if got := bootExitCode(tc.err); got != tc.want {
			t.Errorf("%s: exit code %d, want %d", tc.name, got, tc.want)
		}
	}
}

// TestBootRuntimeFailures: kiln boot exits 1, not with the usage code,
// when the command line is fine but the host refuses: no cached kernel
// for the default, a disk image another VM holds locked.
func TestBootRuntimeFailures(t *testing.T) {
	kernel := kvmtest.Kernel(t).Image
	img := filepath.Join(t.TempDir(), "disk.img")
	if err := os.WriteFile(img, make([]byte, 1<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(img)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	code, stdout, stderr := runKiln(t, "boot", "--kernel", kernel, "--disk", img)
	if code != exitFailed || !strings.Contains(stderr, "locking image") || stdout != "" {
		t.Errorf("boot with a locked disk: exit code %d (want %d), stderr %q", code, exitFailed, stderr)
	}
	t.Setenv("KILN_CACHE", t.TempDir())
	code, _, stderr = runKiln(t, "boot")
	if code != exitFailed || !strings.Contains(stderr, "no --kernel given") {
		t.Errorf("boot without a cached kernel: exit code %d (want %d), stderr %q", code, exitFailed, stderr)
	}
}

// TestZeroShapeRefused: --cpus 0 and --mem 0 are refused by name with the
// usage code, not taken as the defaults.
func TestZeroShapeRefused(t *testing.T) {
	t.Setenv("KILN_HOST", "unix://"+filepath.Join(t.TempDir(), "no-daemon.sock"))
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"run", "--cpus", "0", "--", "true"}, "--cpus: 0 vCPUs: want 1 to"},
		{[]string{"run", "--mem", "0", "--", "true"}, "--mem: 0 MiB of memory: want 128 to"},
		{[]string{"run", "--cpus", "-1", "--", "true"}, "--cpus: -1 vCPUs"},
		{[]string{"run", "--cpus", "1000", "--", "true"}, "--cpus: 1000 vCPUs"},
		{[]string{"boot", "--cpus", "0"}, "0 vCPUs"},
		{[]string{"boot", "--mem", "0"}, "0 MiB of memory"},
		{[]string{"sandbox", "create", "--image", "x", "--cpus", "0"}, "--cpus 0: want at least 1"},
		{[]string{"sandbox", "create", "--image", "x", "--mem", "0"}, "--mem 0: want at least 1"},
		{[]string{"template", "create", "t", "--image", "x", "--cpus", "0"}, "--cpus 0: want at least 1"},
		{[]string{"template", "create", "t", "--image", "x", "--mem", "0"}, "--mem 0: want at least 1"},
	} {
		if tc.args[0] == "boot" {
			tc.args = append(tc.args, "--kernel", kvmtest.Kernel(t).Image)
		}
		code, _, stderr := runKiln(t, tc.args...)
		if code != exitUsage || !strings.Contains(stderr, tc.want) {
			t.Errorf("%q: exit code %d (want %d), stderr %q (want %q)", tc.args, code, exitUsage, stderr, tc.want)
		}
	}
}
