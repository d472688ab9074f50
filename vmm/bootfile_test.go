package vmm

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestBootFileLimits: the kernel and initrd are read only when they are
// regular files under their limit; a huge (sparse) kernel or /dev/zero is
// refused with an error naming the file, before it is read.
func TestBootFileLimits(t *testing.T) {
	dir := t.TempDir()
	huge := filepath.Join(dir, "huge-vmlinux")
	f, err := os.Create(huge)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(MaxKernelSize + 1); err != nil { // sparse: no disk used
		t.Fatal(err)
	}
	f.Close()
	elf := elfKernel(t, []byte{0xf4})  // hlt
	fifo := filepath.Join(dir, "fifo") // no writer: an open that blocks would hang the test
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	small := filepath.Join(dir, "small")
	if err := os.WriteFile(small, []byte("abc"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		cfg  Config
		want []string
	}{
		{"kernel over the cap", Config{Spec: Spec{Kernel: huge}}, []string{"read kernel", huge, "over the limit of 512 MiB"}},
		{"kernel from /dev/zero", Config{Spec: Spec{Kernel: "/dev/zero"}}, []string{"read kernel", "/dev/zero", "not a regular file"}},
		{"kernel a directory", Config{Spec: Spec{Kernel: dir}}, []string{"read kernel", dir, "not a regular file"}},
		{"initrd over the VM's low memory", Config{Spec: Spec{Kernel: elf, Initrd: huge}}, []string{"read initrd", huge, "over the limit of 64 MiB"}},
		{"kernel a FIFO", Config{Spec: Spec{Kernel: fifo}}, []string{"read kernel", fifo, "not a regular file"}},
		{"initrd a FIFO", Config{Spec: Spec{Kernel: elf, Initrd: fifo}}, []string{"read initrd", fifo, "not a regular file"}},
		{"initrd from /dev/zero", Config{Spec: Spec{Kernel: elf, Initrd: "/dev/zero"}}, []string{"read initrd", "not a regular file"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.cfg.CPUs, tc.cfg.MemoryMiB = 1, 64
			_, err := New(tc.cfg)
			var ce *ConfigError
			if !errors.As(err, &ce) {
				t.Fatalf("New: %v, want a ConfigError", err)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %q", err, w)
				}
			}
		})
	}
	if f, size, err := openBootFile(small, 3); err != nil || size != 3 {
		t.Fatalf("a file at the limit: %d, %v", size, err)
	} else {
		f.Close()
	}
	if _, _, err := openBootFile(small, 2); err == nil || !strings.Contains(err.Error(), small) {
		t.Fatalf("a file over the limit: %v", err)
	}
}
