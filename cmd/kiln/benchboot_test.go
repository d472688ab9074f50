package main

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/bench"
	"github.com/kilnvm/kiln/bench/results"
	"github.com/kilnvm/kiln/vmm"
)

// TestBootPhaseResults: a boot comparison's phases become measures of both
// VMMs (the kernel's time and the time before its clock), Kiln's setup and
// its setup per phase; a boot without a kernel time adds none of those.
func TestBootPhaseResults(t *testing.T) {
	s := time.Second
	c := bench.BootComparison{
		KilnPhases: []bench.BootPhases{
			{Total: 4 * s, Setup: 2 * s, Kernel: 2 * s, VMM: vmm.SetupTimes{Kernel: time.Millisecond, Load: s}},
			{Total: 5 * s, Setup: 2 * s, VMM: vmm.SetupTimes{Load: s}},
		},
		PeerPhases: []bench.BootPhases{{Total: 6 * s, Kernel: 4 * s}},
	}
	r := &results.Run{Version: results.Version, KVMMode: results.KVMEmulated}
	params := map[string]string{"kernel": "vmlinux"}
	addBootPhases(r, params, c)
	count := map[string]int{}
	for _, m := range r.Measures {
		count[m.Name+"/"+m.VMM] += len(m.Samples)
		if m.Name == "boot-vmm-setup-phase" && m.Params["phase"] == "" {
			t.Errorf("a setup phase measure without its phase: %+v", m)
		}
	}
	want := map[string]int{
		"boot-kernel-to-init/kiln": 1, "boot-before-kernel-clock/kiln": 1,
		"boot-kernel-to-init/qemu-microvm": 1, "boot-before-kernel-clock/qemu-microvm": 1,
		"boot-vmm-setup/kiln": 2, "boot-vmm-setup-phase/kiln": 2 * 7,
	}
	for k, n := range want {
		if count[k] != n {
			t.Errorf("%s: %d samples, want %d (all: %v)", k, count[k], n, count)
		}
	}
	if params["phase"] != "" {
		t.Error("addBootPhases changed the caller's params")
	}
	if err := r.Check(); err != nil {
		t.Errorf("the results do not check: %v", err)
	}
	var out bytes.Buffer
	printBootPhases(&out, c)
	if !strings.Contains(out.String(), "load 1s") || !strings.Contains(out.String(), "kernel clock to /init") {
		t.Errorf("phase table:\n%s", out.String())
	}
}
