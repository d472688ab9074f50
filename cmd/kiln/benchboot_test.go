package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

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

// TestCopyFileSparse: the bench's copy of a kernel is byte-for-byte the
// source, whatever its length, and a whole zero page becomes a hole.
func TestCopyFileSparse(t *testing.T) {
	const page = 4096
	for _, tc := range []struct {
		name string
		size int
		data [][2]int // non-zero extents
	}{
		{"empty", 0, nil},
		{"dense, odd length", 3*page + 17, [][2]int{{0, 3*page + 17}}},
		{"hole in the middle and a zero tail", 300 * page, [][2]int{{0, 10}, {200*page + 5, 201 * page}}},
		{"zeros only", 5*page + 1, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			want := make([]byte, tc.size)
			for _, e := range tc.data {
				for i := e[0]; i < e[1]; i++ {
					want[i] = byte(i%251 + 1)
				}
			}
			src, dst := filepath.Join(dir, "src"), filepath.Join(dir, "dst")
			if err := os.WriteFile(src, want, 0o644); err != nil {
				t.Fatal(err)
			}
			if err := copyFile(src, dst); err != nil {
				t.Fatal(err)
			}
			got, err := os.ReadFile(dst)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				t.Fatalf("copy differs: %d bytes, want %d", len(got), len(want))
			}
			if tc.size < 100*page {
				return
			}
			f, err := os.Open(dst)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			if d, err := unix.Seek(int(f.Fd()), page, unix.SEEK_DATA); err == nil && d != 200*page {
				t.Errorf("next data after the first page at %d, want %d (the zeros were written)", d, 200*page)
			}
		})
	}
	if err := copyFile(filepath.Join(t.TempDir(), "none"), filepath.Join(t.TempDir(), "x")); err == nil {
		t.Error("copying a missing file succeeded")
	}
}
