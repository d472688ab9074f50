package hostcheck

import (
	"context"
	"fmt"
	"os"
	"strings"
)

// CheckHugePages: the host gives guest RAM transparent huge pages. A
// cold-booted VM's RAM is a memfd, whose pages are shmem: the kernel backs
// it with 2 MiB pages only when shmem_enabled allows (Kiln advises the
// mapping, so advise suffices). In 4 KiB pages every page a guest first
// touches is a nested page fault: its disk reads into fresh page cache, its
// boot, its first run of a program. Never fatal.
func CheckHugePages(_ context.Context, h *Host) Result {
	b, err := os.ReadFile(h.ShmemTHP)
	if err != nil {
		return Result{Status: Warn, Detail: "no transparent huge pages: " + err.Error(),
			Hint: "a kernel with CONFIG_TRANSPARENT_HUGEPAGE gives guest RAM 2 MiB pages"}
	}
	mode, ok := thpMode(string(b))
	if !ok {
		return Result{Status: Warn, Detail: fmt.Sprintf("%s holds %q", h.ShmemTHP, strings.TrimSpace(string(b)))}
	}
	switch mode {
	case "advise", "always", "within_size", "force":
		return Result{Detail: "shmem " + mode + ": guest RAM in 2 MiB pages"}
	}
	return Result{Status: Warn, Detail: "shmem " + mode + ": guest RAM in 4 KiB pages (a nested page fault per page a guest first touches)",
		Hint: "echo advise > " + h.ShmemTHP + " (at boot: w " + h.ShmemTHP + " - - - - advise in /etc/tmpfiles.d/kiln.conf)"}
}

// thpMode returns the bracketed choice of a transparent_hugepage sysfs
// file ("always within_size advise [never] deny force").
func thpMode(s string) (string, bool) {
	for _, f := range strings.Fields(s) {
		if len(f) > 2 && f[0] == '[' && f[len(f)-1] == ']' {
			return f[1 : len(f)-1], true
		}
	}
	return "", false
}
