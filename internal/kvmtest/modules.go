package kvmtest

import (
	"path/filepath"
	"testing"

	"github.com/kilnvm/kiln/guestkernel"
	"github.com/kilnvm/kiln/initramfs"
)

// ModulesDir is where ModulesInitrd puts the modules in the initramfs.
const ModulesDir = guestkernel.InitrdModulesDir

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
	init, err := guestkernel.InsmodScript(order, script, "kvmtest")
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
