// Package results is the file a benchmark run writes: the machine, the
// kernel, the commit, how KVM ran (directly or nested inside another VM),
// and every sample of every measure, Kiln's and its peer's side by side.
// `kiln bench report` (package bench/report) turns one or more of them
// into the plots and tables of docs/bench.md. The files are plain JSON,
// versioned, and read as untrusted input: bounded, checked, never a panic.
package results

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"strings"
	"time"
)

// Version is the format's version; Read refuses others.
const Version = 1

// Bounds Read enforces.
const (
	MaxFileBytes = 64 << 20
	MaxMeasures  = 10_000
	MaxSamples   = 1_000_000 // in all
	maxString    = 4096
)

// KVM modes, as bench.KVMMode tells them.
const (
	// KVMDirect: /dev/kvm on the machine's own hardware.
	KVMDirect = "direct"
	// KVMNested: KVM inside a VM with hardware-assisted nesting.
	KVMNested = "nested"
	// KVMEmulated: KVM inside a VM whose CPU QEMU emulates (TCG), as the
	// kvmharness runs it: every figure is emulated.
	KVMEmulated = "emulated"
)

// Run is one benchmark run.
type Run struct {
	Version  int       `json:"version"`
	Started  time.Time `json:"started"`
	Machine  Machine   `json:"machine"`
	Commit   string    `json:"commit,omitempty"`
	KVMMode  string    `json:"kvm_mode"`
	Measures []Measure `json:"measures"`
}

// Machine is where a run ran.
type Machine struct {
	Host   string `json:"host,omitempty"`
	CPU    string `json:"cpu,omitempty"`
	CPUs   int    `json:"cpus,omitempty"`
	Kernel string `json:"kernel,omitempty"` // the host's (uname -r)
	Arch   string `json:"arch,omitempty"`
	// HugePages is the host's transparent huge page modes ("anon always,
	// shmem advise"): whether guest RAM had 2 MiB pages.
	HugePages string `json:"hugepages,omitempty"`
}

// Measure is the samples of one quantity on one VMM, e.g. boot to
// userspace on Kiln with the Debian kernel.
type Measure struct {
	// Name is what is measured ("boot", "cold-start", "exec-rtt", ...).
	Name string `json:"name"`
	// VMM is who ran it: VMMKiln or a peer (VMMQEMU).
	VMM string `json:"vmm"`
	// Unit of the samples: UnitSeconds, UnitBytesPerSecond, UnitBytes,
	// UnitPerSecond or UnitCount.
	Unit string `json:"unit"`
	// Params set the measure apart from others of its name (kernel, vCPUs,
	// memory, concurrency); measures with equal names and params compare.
	Params  map[string]string `json:"params,omitempty"`
	Samples []float64         `json:"samples"`
}

// VMMs and units.
const (
	VMMKiln = "kiln"
	VMMQEMU = "qemu-microvm"

	UnitSeconds        = "s"
	UnitBytesPerSecond = "B/s"
	UnitBytes          = "B"
	// UnitPerSecond is a rate of things other than bytes (sandboxes
	// created per second).
	UnitPerSecond = "/s"
	UnitCount     = "count"
)

var units = map[string]bool{UnitSeconds: true, UnitBytesPerSecond: true, UnitBytes: true, UnitPerSecond: true, UnitCount: true}

// HigherIsBetter says whether a larger sample of unit u is the better one:
// for throughputs and rates (B/s, /s) it is, for times and sizes (s, B)
// and counts it is not.
func HigherIsBetter(u string) bool { return u == UnitBytesPerSecond || u == UnitPerSecond }

// AddDurations appends a measure of durations (in seconds).
func (r *Run) AddDurations(name, vmm string, params map[string]string, ds []time.Duration) {
	s := make([]float64, len(ds))
	for i, d := range ds {
		s[i] = d.Seconds()
	}
	r.Measures = append(r.Measures, Measure{Name: name, VMM: vmm, Unit: UnitSeconds, Params: params, Samples: s})
}

// AddThroughput appends a measure of throughputs (in B/s): bytes moved in
// each of ds. A duration that is not positive has no throughput: it is
// refused, and nothing is added.
func (r *Run) AddThroughput(name, vmm string, params map[string]string, bytes int64, ds []time.Duration) error {
	if bytes < 0 {
		return fmt.Errorf("results: %s on %s: %d bytes", name, vmm, bytes)
	}
	s := make([]float64, len(ds))
	for i, d := range ds {
		if d <= 0 {
			return fmt.Errorf("results: %s on %s: sample %d took %v: no throughput", name, vmm, i, d)
		}
		s[i] = float64(bytes) / d.Seconds()
	}
	r.Measures = append(r.Measures, Measure{Name: name, VMM: vmm, Unit: UnitBytesPerSecond, Params: params, Samples: s})
	return nil
}

// Check reports what is wrong with r, naming it.
func (r *Run) Check() error {
	if r.Version != Version {
		return fmt.Errorf("results: version %d, this kiln reads %d", r.Version, Version)
	}
	switch r.KVMMode {
	case KVMDirect, KVMNested, KVMEmulated:
	default:
		return fmt.Errorf("results: kvm_mode %q: want %s, %s or %s", r.KVMMode, KVMDirect, KVMNested, KVMEmulated)
	}
	if len(r.Measures) > MaxMeasures {
		return fmt.Errorf("results: %d measures, at most %d", len(r.Measures), MaxMeasures)
	}
	for _, s := range []string{r.Commit, r.Machine.Host, r.Machine.CPU, r.Machine.Kernel, r.Machine.Arch} {
		if len(s) > maxString {
			return fmt.Errorf("results: a machine or commit field of %d bytes, at most %d", len(s), maxString)
		}
	}
	total := 0
	for i, m := range r.Measures {
		what := fmt.Sprintf("results: measure %d (%q on %q)", i, m.Name, m.VMM)
		if m.Name == "" || len(m.Name) > 128 || m.VMM == "" || len(m.VMM) > 128 {
			return fmt.Errorf("%s: want a name and a VMM of 1 to 128 bytes", what)
		}
		if !units[m.Unit] {
			return fmt.Errorf("%s: unit %q: want s, B/s, B, /s or count", what, m.Unit)
		}
		if len(m.Params) > 32 {
			return fmt.Errorf("%s: %d params, at most 32", what, len(m.Params))
		}
		for k, v := range m.Params {
			if k == "" || len(k) > 128 || len(v) > 1024 {
				return fmt.Errorf("%s: param %q: want a key of 1 to 128 bytes and a value of at most 1024", what, k)
			}
		}
		if len(m.Samples) == 0 {
			return fmt.Errorf("%s: no samples", what)
		}
		total += len(m.Samples)
		if total > MaxSamples {
			return fmt.Errorf("results: more than %d samples", MaxSamples)
		}
		for j, v := range m.Samples {
			if math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
				return fmt.Errorf("%s: sample %d is %v: want a finite number, not negative", what, j, v)
			}
		}
	}
	return nil
}

// Write writes r as indented JSON, after checking it.
func (r *Run) Write(w io.Writer) error {
	if err := r.Check(); err != nil {
		return err
	}
	e := json.NewEncoder(w)
	e.SetIndent("", "  ")
	return e.Encode(r)
}

// WriteFile writes r to path.
func (r *Run) WriteFile(path string) error {
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("results: %w", err)
	}
	if err := r.Write(f); err != nil {
		f.Close()
		return fmt.Errorf("results: writing %s: %w", path, err)
	}
	return f.Close()
}

// Read reads and checks one run (at most MaxFileBytes; unknown fields are
// refused, so a typo does not pass as an empty measure).
func Read(rd io.Reader) (*Run, error) {
	b, err := io.ReadAll(io.LimitReader(rd, MaxFileBytes+1))
	if err != nil {
		return nil, fmt.Errorf("results: %w", err)
	}
	if len(b) > MaxFileBytes {
		return nil, fmt.Errorf("results: more than %d bytes", MaxFileBytes)
	}
	d := json.NewDecoder(strings.NewReader(string(b)))
	d.DisallowUnknownFields()
	var r Run
	if err := d.Decode(&r); err != nil {
		return nil, fmt.Errorf("results: %w", err)
	}
	if d.More() {
		return nil, errors.New("results: more than one JSON value")
	}
	if err := r.Check(); err != nil {
		return nil, err
	}
	return &r, nil
}

// ReadFile reads the run in path.
func ReadFile(path string) (*Run, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("results: %w", err)
	}
	defer f.Close()
	r, err := Read(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return r, nil
}
