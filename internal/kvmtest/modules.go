package kvmtest

import (
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kilnvm/kiln/guestkernel"
	"github.com/kilnvm/kiln/initramfs"
)

// ModulesDir is where ModulesInitrd puts the modules in the initramfs.
const ModulesDir = "lib/modules"

// ModulesInitrd writes an uncompressed initramfs like BusyboxInitrd's, that
// also holds the named modules of the cached kernel (Kernel(t)) and all
// their dependencies, as uncompressed .ko files in /lib/modules. Its /init
// mounts proc, sysfs and devtmpfs, loads the modules in dependency order
// (insmod), then runs script. It returns the initramfs's path in
// t.TempDir. Modules built into the kernel are skipped.
func ModulesInitrd(t testing.TB, modules []string, script string) string {
	t.Helper()
	k := Kernel(t)
	order, err := k.ModuleLoadOrder(modules...)
	if err != nil {
		t.Fatalf("modules for the initramfs: %v", err)
	}
	init, err := modulesInit(order, script)
	if err != nil {
		t.Fatal(err)
	}
	b, err := initramfs.BusyboxInit(init)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.AddDir("lib", 0o755); err != nil {
		t.Fatal(err)
	}
	if err := b.AddDir(ModulesDir, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, m := range order {
		ko, err := guestkernel.ReadModule(m.Path)
		if err != nil {
			t.Fatal(err)
		}
		if err := b.AddFile(ModulesDir+"/"+m.Name+".ko", ko, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	p := filepath.Join(t.TempDir(), "initrd.cpio")
	if err := b.WriteFile(p, false); err != nil {
		t.Fatal(err)
	}
	return p
}

// modulesInit returns the /init script body: mounts, one insmod per module
// (stopping with a message naming the module that failed), then script.
func modulesInit(order []guestkernel.Module, script string) (string, error) {
	var s strings.Builder
	s.WriteString("mount -t proc proc /proc\n")
	s.WriteString("mount -t sysfs sysfs /sys\n")
	s.WriteString("mount -t devtmpfs devtmpfs /dev\n")
	for _, m := range order {
		if strings.ContainsAny(m.Name, " \t\n'\"$`\\;&|<>()*?[]{}~#") {
			return "", fmt.Errorf("module name %q is not a plain word", m.Name)
		}
		fmt.Fprintf(&s, "insmod /%s/%s.ko || { echo 'kvmtest: insmod %s failed'; poweroff -f; }\n", ModulesDir, m.Name, m.Name)
	}
	s.WriteString(script)
	return s.String(), nil
}
