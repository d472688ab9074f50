package sandbox

import (
	"strings"
	"testing"

	"github.com/kilnvm/kiln/guest/pid1"
)

// kernelSpace is the kernel's isspace (lib/ctype.c): what separates
// parameters on its command line.
func kernelSpace(r rune) bool {
	switch r {
	case ' ', '\t', '\n', '\v', '\f', '\r', 0xa0:
		return true
	}
	return false
}

// FuzzKernelCmdline builds a VM's kernel command line from the values a
// caller (an API request, a flag) gives: the host name and the root
// filesystem type. Either the value is refused, or the command line, split
// as the kernel splits it and parsed as the guest's pid1 parses it, holds
// exactly the parameters Kiln meant, with the caller's values intact: no
// value can add, end or change a parameter.
func FuzzKernelCmdline(f *testing.F) {
	f.Add("box", "ext4", false, false)
	f.Add("a b", "", true, false)
	f.Add("h\u00a0kiln.init=systemd", "xfs", false, true)
	f.Add("h\rinit=/bin/sh", "ext4\vquiet", true, true)
	f.Add("h\x00", "btrfs", false, false)
	f.Add("--", "-", false, false)
	f.Add("h\u00a0kiln.ro", "ext4", false, false)
	f.Add("h", "ext4\fkiln.debug", false, false)
	f.Fuzz(func(t *testing.T, hostname, fstype string, modules, ro bool) {
		o := Options{
			Hostname: hostname, Disk: "/nonexistent/disk.img", RootFSType: fstype, DiskReadOnly: ro,
			Runtime: Runtime{Kernel: "/nonexistent/vmlinux", Initrd: "/nonexistent/initrd"},
		}
		if modules {
			o.Runtime.Modules = "/nonexistent/modules.img"
		}
		cfg, err := o.vmConfig()
		if err != nil {
			if !strings.HasPrefix(err.Error(), "sandbox: ") {
				t.Fatalf("error %q does not say where it is from", err)
			}
			return
		}
		if hostname == "" {
			hostname = "kiln"
		}
		want := pid1.Options{Root: "/dev/vda", RootFSType: fstype, ReadOnly: ro, Hostname: hostname}
		words := 9 // console= reboot= panic= quiet nowatchdog sysctl.vm.compaction_proactiveness= kiln.hostname= kiln.root= kiln.rootfstype=
		if fstype == "" {
			want.RootFSType = pid1.DefaultRootFSType
			words--
		}
		if modules {
			want.Modules = ModulesDevice
			words++
		}
		if ro {
			words++
		}
		if got := pid1.ParseCmdline(cfg.Cmdline); got != want {
			t.Fatalf("command line %q parses as %+v, want %+v", cfg.Cmdline, got, want)
		}
		if strings.IndexByte(cfg.Cmdline, 0) >= 0 || strings.Contains(cfg.Cmdline, `"`) {
			t.Fatalf("command line %q holds a NUL or a quote", cfg.Cmdline)
		}
		if got := strings.FieldsFunc(cfg.Cmdline, kernelSpace); len(got) != words {
			t.Fatalf("command line %q has %d parameters, want %d: %q", cfg.Cmdline, len(got), words, got)
		}
		if err := CheckHostname(hostname); err != nil {
			t.Fatalf("host name %q made a command line but CheckHostname refuses it: %v", hostname, err)
		}
	})
}
