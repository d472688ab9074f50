package hostcheck

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// CheckKVM: /dev/kvm opens read-write, speaks KVM API version 12 and
// makes a VM, and the CPU has hardware virtualization (vmx or svm).
// Without it /dev/kvm is paravirtual (kvm_pvm, say), which boots only
// guest kernels built for it, not the stock kernel Kiln boots.
func CheckKVM(_ context.Context, h *Host) Result {
	r := Result{Required: true}
	probe := h.ProbeKVM
	if probe == nil {
		probe = probeKVM
	}
	if err := probe(h.KVM); err != nil {
		r.Status, r.Detail = Fail, err.Error()
		switch {
		case errors.Is(err, fs.ErrNotExist):
			r.Hint = "load kvm_intel or kvm_amd (modprobe), and enable virtualization (VT-x/AMD-V) in the firmware; in a VM, enable nested virtualization"
		case errors.Is(err, fs.ErrPermission):
			r.Hint = "run kilnd as root, or give its user the kvm group (" + h.KVM + " is rw for it)"
		default:
			r.Hint = h.KVM + " is not a working KVM device"
		}
		return r
	}
	cpuinfo, err := os.ReadFile(h.CPUInfo)
	if err != nil {
		r.Status, r.Detail = Fail, fmt.Sprintf("%s opens and makes VMs, but reading %s: %v", h.KVM, h.CPUInfo, err)
		return r
	}
	if !hasVirtFlag(string(cpuinfo)) {
		r.Status = Fail
		r.Detail = h.KVM + " opens and makes VMs (API 12), but the CPU has no vmx or svm flag: it is a paravirtual KVM"
		if _, err := os.Stat(filepath.Join(h.SysModule, "kvm_pvm")); err == nil {
			r.Detail += " (kvm_pvm)"
		}
		r.Detail += ", which cannot boot stock guest kernels"
		r.Hint = "run on bare metal or in a VM with nested hardware virtualization; kiln's tests fall back to QEMU TCG here (tools/kvmharness)"
		return r
	}
	r.Detail = h.KVM + ": API 12, makes VMs, hardware virtualization"
	return r
}

// hasVirtFlag reports whether a /proc/cpuinfo "flags" line lists vmx or
// svm.
func hasVirtFlag(cpuinfo string) bool {
	for _, line := range strings.Split(cpuinfo, "\n") {
		key, value, ok := strings.Cut(line, ":")
		if !ok || strings.TrimSpace(key) != "flags" {
			continue
		}
		for _, f := range strings.Fields(value) {
			if f == "vmx" || f == "svm" {
				return true
			}
		}
	}
	return false
}
