package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/kilnvm/kiln/guest/client"
	"github.com/kilnvm/kiln/image"
	"github.com/kilnvm/kiln/image/layoutblobs"
	"github.com/kilnvm/kiln/sandbox"
)

// The image benchmark's defaults: the images tools/testimage makes, the one
// the workloads run in and its file read sequentially.
var DefaultImageNames = []string{"busybox", "busybox-big", "debian-read", "debian-big"}

const (
	DefaultWorkloadImage = "debian-read"
	DefaultReadFile      = "/srv/read.bin"
	DefaultImageRuns     = 3
	DefaultImageMemMiB   = 1024
)

// The modes of a time-to-first-exec run.
const (
	ModeCold = "9p cold" // a fresh images folder: pull, then lazy fetches
	ModeWarm = "9p warm" // the images folder of the first cold run
	ModeExt4 = "ext4"    // the same tree as a read-only ext4 virtio-blk disk
)

// ImageSpec configures RunImage: image roots (OCI estargz layers served
// over virtio-9p from an in-process loopback registry) beside ext4 disks
// of the same trees.
type ImageSpec struct {
	Runtime sandbox.Runtime
	// Layout is the OCI image layout served (make test-rootfs's
	// images-v2); its images are named by their ref.name annotation.
	Layout string
	// Ext4 maps an image name to an ext4 image of its tree
	// (tools/build-test-rootfs.sh's ext4-v2/NAME.ext4); images without
	// one get no ext4 runs.
	Ext4 map[string]string
	// Images are timed to their first exec, Runs times per mode.
	Images []string
	Runs   int
	// Workload is the image whose sandboxes (first cold, first warm,
	// first ext4 run, and one per Variant) also run WorkloadScript;
	// empty: none.
	Workload string
	ReadFile string
	// Variants are kiln.rootflags values (9p mount options appended to
	// the defaults, so later ones win) each tried in one more
	// warm-store sandbox of Workload.
	Variants    []string
	MemoryMiB   int
	BootTimeout time.Duration
	// Scratch holds the images folders (removed after); empty: the
	// temporary directory.
	Scratch string
	// QEMU, when set, is the peer: QEMU microvm with its own virtio-9p
	// device (-fsdev local, security_model=none, read-only) over QEMUTree,
	// the Workload image's tree extracted, booting the same kernel and
	// agent initramfs with kiln.root=9p:kilnroot, so that the guest mounts
	// it with the same options (no overlay config: the image's is not
	// given). It runs the workload once. With QEMUCopy the tree is first
	// copied (cp -a) into Scratch, so that QEMU does not read it through
	// the test harness's own 9p share.
	QEMU, QEMUTree string
	QEMUCopy       bool
}

// Normalize fills in defaults and checks the spec.
func (s ImageSpec) Normalize() (ImageSpec, error) {
	if len(s.Images) == 0 {
		s.Images = DefaultImageNames
	}
	if s.Runs == 0 {
		s.Runs = DefaultImageRuns
	}
	if s.ReadFile == "" {
		s.ReadFile = DefaultReadFile
	}
	if s.MemoryMiB == 0 {
		s.MemoryMiB = DefaultImageMemMiB
	}
	if s.BootTimeout == 0 {
		s.BootTimeout = 5 * time.Minute
	}
	switch {
	case s.Layout == "":
		return s, errors.New("bench: image: no OCI layout (make test-rootfs builds one)")
	case s.Runs < 1 || s.MemoryMiB < 1 || s.BootTimeout < 0:
		return s, fmt.Errorf("bench: image: runs %d, memory %d MiB, boot timeout %v: want positive", s.Runs, s.MemoryMiB, s.BootTimeout)
	case !strings.HasPrefix(s.ReadFile, "/") || strings.ContainsAny(s.ReadFile, " '\"\\$`"):
		return s, fmt.Errorf("bench: image: read file %q: want an absolute path without quotes, spaces or $", s.ReadFile)
	}
	for _, v := range s.Variants {
		if v == "" || strings.ContainsAny(v, " \t\n\"") {
			return s, fmt.Errorf("bench: image: mount option variant %q: want one word of comma-separated options", v)
		}
	}
	return s, nil
}

// FirstExecRun is one sandbox timed from Start to its first exec of true.
type FirstExecRun struct {
	Image string
	Mode  string
	Run   int
	// Pull is the pull of the image (manifest, config, TOCs) in a fresh
	// images folder: cold runs only.
	Pull time.Duration
	// Start is sandbox.Start to the agent answering; Exec the first exec
	// of true after it; Total is Pull+Start+Exec.
	Start, Exec, Total time.Duration
	// Fetched and Requests are what the registry served during the run
	// (pull, boot, exec); ImageSize is the image's compressed layers.
	Fetched, Requests, ImageSize int64
}

// Workload steps, in the order WorkloadScript runs them.
var WorkloadSteps = []string{"find1", "find2", "py1", "py2", "read1", "read2"}

// WorkloadResult is WorkloadScript's timings in one sandbox.
type WorkloadResult struct {
	Root  string // ModeCold, ModeWarm, ModeExt4, or ModeWarm + " " + flags
	Flags string // kiln.rootflags, "" for the defaults
	// Steps are the guest's own timings (date +%s%N around each).
	Steps map[string]time.Duration
	// Files is what find / -xdev | wc -l counted.
	Files int
	// ReadBytes is the read file's size.
	ReadBytes int64
	// Fetched is what the registry served during the script.
	Fetched int64
	// Err is why the sandbox failed (a variant whose mount the guest
	// refused, say); the steps are then missing.
	Err string `json:",omitempty"`
}

// MBps is the read throughput of step (read1 or read2) in MB/s (10^6).
func (w WorkloadResult) MBps(step string) float64 {
	d := w.Steps[step]
	if d <= 0 || w.ReadBytes <= 0 {
		return 0
	}
	return float64(w.ReadBytes) / 1e6 / d.Seconds()
}

// ImageReport is RunImage's result.
type ImageReport struct {
	Spec      ImageSpec
	Runs      []FirstExecRun
	Workloads []WorkloadResult
	Took      time.Duration
}

// Summary is the median, minimum and maximum of some durations.
type Summary struct {
	N                int
	Median, Min, Max time.Duration
}

// Summarize is ds's Summary; the zero Summary for none.
func Summarize(ds []time.Duration) Summary {
	if len(ds) == 0 {
		return Summary{}
	}
	return Summary{N: len(ds), Median: Median(ds), Min: slices.Min(ds), Max: slices.Max(ds)}
}

func (s Summary) String() string {
	if s.N == 0 {
		return "-"
	}
	r := func(d time.Duration) string { return strconv.FormatFloat(d.Seconds(), 'f', 2, 64) }
	if s.N == 1 {
		return r(s.Median) + " s"
	}
	return fmt.Sprintf("%s s [%s–%s]", r(s.Median), r(s.Min), r(s.Max))
}

// Select returns the runs of img in mode.
func (rep ImageReport) Select(img, mode string) []FirstExecRun {
	var out []FirstExecRun
	for _, r := range rep.Runs {
		if r.Image == img && r.Mode == mode {
			out = append(out, r)
		}
	}
	return out
}

// durations maps runs to one of their durations.
func durations(runs []FirstExecRun, f func(FirstExecRun) time.Duration) []time.Duration {
	ds := make([]time.Duration, len(runs))
	for i, r := range runs {
		ds[i] = f(r)
	}
	return ds
}

// Print writes the report as tables.
func (rep ImageReport) Print(w io.Writer) {
	fmt.Fprintf(w, "time to first exec (sandbox.Start to the first exec of true answered), seconds, median [min–max]:\n")
	fmt.Fprintf(w, "%-12s %-8s %-8s %-22s %-22s %-22s %-22s %s\n", "image", "size", "root", "pull", "start (agent up)", "first exec", "total", "registry bytes (median, % of image)")
	images := rep.Spec.Images
	if w := rep.Spec.Workload; w != "" && !slices.Contains(images, w) {
		images = append(slices.Clone(images), w)
	}
	for _, img := range images {
		for _, mode := range []string{ModeCold, ModeWarm, ModeExt4} {
			runs := rep.Select(img, mode)
			if len(runs) == 0 {
				continue
			}
			pull := "-"
			if mode == ModeCold {
				pull = Summarize(durations(runs, func(r FirstExecRun) time.Duration { return r.Pull })).String()
			}
			fetched := make([]int64, len(runs))
			for i, r := range runs {
				fetched[i] = r.Fetched
			}
			slices.Sort(fetched)
			f := fetched[len(fetched)/2]
			bytesCol := "-"
			if mode != ModeExt4 {
				bytesCol = fmt.Sprintf("%s (%.3f%%)", humanBytes(f), 100*float64(f)/float64(max(runs[0].ImageSize, 1)))
			}
			fmt.Fprintf(w, "%-12s %-8s %-8s %-22s %-22s %-22s %-22s %s\n", img, humanBytes(runs[0].ImageSize), mode, pull,
				Summarize(durations(runs, func(r FirstExecRun) time.Duration { return r.Start })),
				Summarize(durations(runs, func(r FirstExecRun) time.Duration { return r.Exec })),
				Summarize(durations(runs, func(r FirstExecRun) time.Duration { return r.Total })), bytesCol)
		}
	}
	if len(rep.Workloads) == 0 {
		return
	}
	fmt.Fprintf(w, "\nworkloads in %s (guest-timed, seconds; #1 first run after boot, #2 again with the guest's caches warm):\n", rep.Spec.Workload)
	fmt.Fprintf(w, "%-36s %8s %8s %8s %8s %14s %14s %8s %s\n", "root", "find#1", "find#2", "py#1", "py#2", "read#1 MB/s", "read#2 MB/s", "files", "registry bytes")
	sec := func(d time.Duration) string { return strconv.FormatFloat(d.Seconds(), 'f', 2, 64) }
	for _, wl := range rep.Workloads {
		if wl.Err != "" {
			fmt.Fprintf(w, "%-36s failed: %s\n", wl.Root, wl.Err)
			continue
		}
		fmt.Fprintf(w, "%-36s %8s %8s %8s %8s %14.1f %14.1f %8d %s\n", wl.Root, sec(wl.Steps["find1"]), sec(wl.Steps["find2"]),
			sec(wl.Steps["py1"]), sec(wl.Steps["py2"]), wl.MBps("read1"), wl.MBps("read2"), wl.Files, humanBytes(wl.Fetched))
	}
}

// WriteJSON writes the report as indented JSON.
func (rep ImageReport) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(rep)
}

// humanBytes is n in B, KiB, MiB or GiB.
func humanBytes(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.2f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

// WorkloadScript is the guest side of the workloads: each step timed by
// the guest's clock (date +%s%N, GNU date), printed as
// "KILN-IMG step nanoseconds last-line-of-output". readFile is read with
// dd twice: the first read goes to the 9p server (or the disk), the second
// hits the guest's page cache.
func WorkloadScript(readFile string) string {
	return `set -u
step() {
	name=$1; shift
	s=$(date +%s%N)
	out=$(sh -c "$1" 2>&1 | tail -n 1)
	e=$(date +%s%N)
	echo "KILN-IMG $name $((e - s)) $out"
}
step find1 'find / -xdev | wc -l'
step find2 'find / -xdev | wc -l'
step py1 'python3 -c "import email, json, http.client; print(0)"'
step py2 'python3 -c "import email, json, http.client; print(0)"'
step read1 'dd if=` + readFile + ` of=/dev/null bs=1M 2>&1 >/dev/null; stat -c %s ` + readFile + `'
step read2 'dd if=` + readFile + ` of=/dev/null bs=1M 2>&1 >/dev/null; stat -c %s ` + readFile + `'
`
}

// showRootMounts prints the guest's root and 9p mounts to stderr: the
// options the guest's 9p client took.
const showRootMounts = "grep -E ' / | /kiln/lower ' /proc/mounts >&2; "

var workloadRE = regexp.MustCompile(`(?m)^KILN-IMG ([a-z0-9]+) ([0-9]+) ?(.*)$`)

// ParseWorkload reads WorkloadScript's output: every step's time, the
// file count (find's output) and the read file's size (stat's). A step
// missing, or an output that is not the number it must be, is an error
// naming it.
func ParseWorkload(out string) (WorkloadResult, error) {
	r := WorkloadResult{Steps: map[string]time.Duration{}}
	outs := map[string]string{}
	for _, m := range workloadRE.FindAllStringSubmatch(out, -1) {
		ns, err := strconv.ParseInt(m[2], 10, 64)
		if err != nil {
			return r, fmt.Errorf("workload step %s: time %q: %w", m[1], m[2], err)
		}
		r.Steps[m[1]] = time.Duration(ns)
		outs[m[1]] = strings.TrimSpace(m[3])
	}
	for _, s := range WorkloadSteps {
		if _, ok := r.Steps[s]; !ok {
			return r, fmt.Errorf("workload step %s: no KILN-IMG line in %q", s, lastBytes(out, 400))
		}
	}
	var err error
	if r.Files, err = strconv.Atoi(outs["find1"]); err != nil || r.Files < 1 {
		return r, fmt.Errorf("workload step find1: printed %q, not a file count", outs["find1"])
	}
	if outs["py1"] != "0" || outs["py2"] != "0" {
		return r, fmt.Errorf("workload step py: python3 printed %q and %q, not 0", outs["py1"], outs["py2"])
	}
	if r.ReadBytes, err = strconv.ParseInt(outs["read1"], 10, 64); err != nil || r.ReadBytes < 1 {
		return r, fmt.Errorf("workload step read1: printed %q, not the file's size", outs["read1"])
	}
	return r, nil
}

// RunImage runs the image benchmark: for each image and run, a cold
// start (fresh images folder), a warm start (the first cold run's folder)
// and, where there is an ext4 image of the tree, a start from it; the
// workload in the first sandbox of each mode of the workload image; then
// one warm sandbox of it per mount option variant. Progress lines go to
// progress as they happen.
func RunImage(ctx context.Context, spec ImageSpec, progress io.Writer) (rep ImageReport, err error) {
	rep.Spec = spec
	start := time.Now()
	defer func() { rep.Took = time.Since(start) }()
	if progress == nil {
		progress = io.Discard
	}
	reg, err := ServeLayout(spec.Layout, "kiln/bench")
	if err != nil {
		return rep, err
	}
	defer reg.Close()
	for _, img := range append(slices.Clone(spec.Images), spec.Workload) {
		if _, ok := reg.Refs[img]; !ok && img != "" {
			return rep, fmt.Errorf("bench: image: %s is not in the layout %s (make test-rootfs makes images-v2)", img, spec.Layout)
		}
	}
	scratch, err := os.MkdirTemp(spec.Scratch, "kiln-bench-image-")
	if err != nil {
		return rep, fmt.Errorf("bench: image: %w", err)
	}
	defer os.RemoveAll(scratch)
	b := &imageBench{spec: spec, reg: reg, scratch: scratch, progress: progress, warm: map[string]string{}}
	for _, img := range spec.Images {
		for i := 1; i <= spec.Runs; i++ {
			for _, mode := range []string{ModeCold, ModeWarm, ModeExt4} {
				if mode == ModeExt4 && spec.Ext4[img] == "" {
					continue
				}
				wl := img == spec.Workload && i == 1
				r, w, err := b.firstExec(ctx, img, mode, i, wl, "")
				if err != nil {
					return rep, err
				}
				rep.Runs = append(rep.Runs, r)
				if w != nil {
					rep.Workloads = append(rep.Workloads, *w)
				}
			}
		}
	}
	if spec.Workload != "" && !slices.Contains(spec.Images, spec.Workload) {
		for _, mode := range []string{ModeCold, ModeWarm, ModeExt4} {
			if mode == ModeExt4 && spec.Ext4[spec.Workload] == "" {
				continue
			}
			r, w, err := b.firstExec(ctx, spec.Workload, mode, 1, true, "")
			if err != nil {
				return rep, err
			}
			rep.Runs = append(rep.Runs, r)
			rep.Workloads = append(rep.Workloads, *w)
		}
	}
	if spec.QEMU != "" && spec.Workload != "" {
		w, err := b.qemuWorkload(ctx)
		if err != nil {
			fmt.Fprintf(progress, "qemu microvm: %v\n", err)
			w = WorkloadResult{Root: RootQEMU, Err: err.Error()}
		}
		rep.Workloads = append(rep.Workloads, w)
	}
	for _, v := range spec.Variants {
		if spec.Workload == "" {
			break
		}
		_, w, err := b.firstExec(ctx, spec.Workload, ModeWarm, 0, true, v)
		if err != nil {
			// A variant the guest refuses is a finding, not the end.
			fmt.Fprintf(progress, "variant %s: %v\n", v, err)
			rep.Workloads = append(rep.Workloads, WorkloadResult{Root: ModeWarm + " " + v, Flags: v, Err: err.Error()})
			continue
		}
		rep.Workloads = append(rep.Workloads, *w)
	}
	return rep, nil
}

// imageBench is RunImage's state.
type imageBench struct {
	spec     ImageSpec
	reg      *LoopbackRegistry
	scratch  string
	progress io.Writer
	warm     map[string]string // image -> its first cold run's images folder
	n        int
}

// firstExec boots one sandbox of img in mode, times it to its first exec
// of true, runs the workload in it when wl, and closes it. flags are
// kiln.rootflags for a 9p root.
func (b *imageBench) firstExec(ctx context.Context, img, mode string, run int, wl bool, flags string) (FirstExecRun, *WorkloadResult, error) {
	r := FirstExecRun{Image: img, Mode: mode, Run: run}
	opts := sandbox.Options{Runtime: b.spec.Runtime, MemoryMiB: b.spec.MemoryMiB, BootTimeout: b.spec.BootTimeout,
		Hostname: "bench", Console: io.Discard}
	if flags != "" {
		opts.Cmdline = "kiln.rootflags=" + flags
	}
	fail := func(err error) (FirstExecRun, *WorkloadResult, error) {
		return r, nil, fmt.Errorf("bench: image %s, %s, run %d: %w", img, mode, run, err)
	}
	ref := b.reg.Refs[img]
	b.reg.Reset()
	begin := time.Now()
	switch mode {
	case ModeExt4:
		opts.Disk, opts.DiskReadOnly = b.spec.Ext4[img], true
	case ModeCold, ModeWarm:
		dir := b.warm[img]
		if mode == ModeCold || dir == "" {
			b.n++
			dir = filepath.Join(b.scratch, fmt.Sprintf("images-%d", b.n))
		}
		// A Roots of its own, as a fresh kiln process would have: a warm
		// store, but the tree built again from the stored TOCs.
		roots := image.NewRoots(image.Options{FetchTimeout: time.Minute})
		ims, err := roots.Images(dir)
		if err != nil {
			return fail(err)
		}
		if mode == ModeCold || b.warm[img] == "" {
			pi, err := ims.Pull(ctx, ref, image.PullOptions{})
			if err != nil {
				return fail(fmt.Errorf("pull: %w", err))
			}
			r.Pull = time.Since(begin)
			for _, l := range pi.Layers {
				r.ImageSize += l.Size
			}
			if b.warm[img] == "" {
				b.warm[img] = dir
			}
		} else {
			pi, err := ims.Get(ref)
			if err != nil {
				return fail(err)
			}
			for _, l := range pi.Layers {
				r.ImageSize += l.Size
			}
		}
		opts.Image, opts.Images, opts.ImageRoots = ref, dir, roots
	default:
		return fail(fmt.Errorf("unknown mode %q", mode))
	}
	if r.ImageSize == 0 {
		r.ImageSize = b.reg.ImageSize(img)
	}
	t0 := time.Now()
	sb, err := sandbox.Start(ctx, opts)
	if err != nil {
		return fail(err)
	}
	defer sb.Close(context.Background())
	r.Start = time.Since(t0)
	t1 := time.Now()
	if err := execTrue(ctx, sb.Client()); err != nil {
		return fail(fmt.Errorf("first exec: %w", err))
	}
	r.Exec = time.Since(t1)
	r.Total = time.Since(begin)
	st := b.reg.Stats()
	r.Fetched, r.Requests = st.Bytes, st.Requests
	label := mode
	if flags != "" {
		label += " " + flags
	}
	fmt.Fprintf(b.progress, "%s %s run %d: pull %v, start %v, first exec %v, total %v; registry %d requests, %s of %s\n",
		img, label, run, r.Pull.Round(time.Millisecond), r.Start.Round(time.Millisecond), r.Exec.Round(time.Millisecond),
		r.Total.Round(time.Millisecond), r.Requests, humanBytes(r.Fetched), humanBytes(r.ImageSize))
	if !wl {
		return r, nil, nil
	}
	b.reg.Reset()
	var out, errOut bytes.Buffer
	ectx, cancel := context.WithTimeout(ctx, 20*time.Minute)
	defer cancel()
	es, err := sb.Client().Exec(ectx, client.ExecOptions{Argv: []string{"sh", "-c", showRootMounts + WorkloadScript(b.spec.ReadFile)},
		Stdout: &out, Stderr: &errOut, Timeout: 20 * time.Minute})
	if err != nil || !es.Success() {
		return fail(fmt.Errorf("workload: %v %v: %s %s", es, err, lastBytes(out.String(), 400), lastBytes(errOut.String(), 400)))
	}
	w, err := ParseWorkload(out.String())
	if err != nil {
		return fail(err)
	}
	fmt.Fprintf(b.progress, "  guest mounts: %s\n", strings.Join(strings.Fields(errOut.String()), " "))
	w.Root, w.Flags, w.Fetched = label, flags, b.reg.Stats().Bytes
	fmt.Fprintf(b.progress, "  workload: find %v / %v (%d files), python %v / %v, read %.1f / %.1f MB/s; registry %s\n",
		w.Steps["find1"].Round(time.Millisecond), w.Steps["find2"].Round(time.Millisecond), w.Files,
		w.Steps["py1"].Round(time.Millisecond), w.Steps["py2"].Round(time.Millisecond), w.MBps("read1"), w.MBps("read2"), humanBytes(w.Fetched))
	return r, &w, nil
}

// RootQEMU labels the peer's workload.
const RootQEMU = "qemu microvm virtio-9p (local)"

// QEMU9pArgs are the peer's arguments for a read-only virtio-9p device
// over tree under mount tag tag.
func QEMU9pArgs(tree, tag string) []string {
	return []string{"-fsdev", "local,id=kilnroot,path=" + tree + ",security_model=none,readonly=on",
		"-device", "virtio-9p-device,fsdev=kilnroot,mount_tag=" + tag}
}

// qemuWorkload boots the QEMU peer over the tree and runs the workload.
func (b *imageBench) qemuWorkload(ctx context.Context) (WorkloadResult, error) {
	w := WorkloadResult{Root: RootQEMU}
	tree := b.spec.QEMUTree
	if tree == "" {
		return w, errors.New("no tree for QEMU's 9p device")
	}
	if b.spec.QEMUCopy {
		dst := filepath.Join(b.scratch, "tree")
		t0 := time.Now()
		if out, err := exec.CommandContext(ctx, "cp", "-a", tree, dst).CombinedOutput(); err != nil {
			return w, fmt.Errorf("copying the tree: %w: %s", err, lastBytes(string(out), 400))
		}
		fmt.Fprintf(b.progress, "qemu: copied %s to %s in %v\n", tree, dst, time.Since(t0).Round(time.Second))
		tree = dst
	}
	if err := EnsureVhostVsock(); err != nil {
		return w, err
	}
	s := StartSpec{Kernel: b.spec.Runtime.Kernel, Initrd: b.spec.Runtime.Initrd, Cmdline: "kiln.root=9p:" + sandbox.ImageTag,
		CPUs: 1, MemoryMiB: b.spec.MemoryMiB, BootTimeout: b.spec.BootTimeout}
	cid := randomCID()
	con := newMarkerWriter()
	cmd := exec.Command(b.spec.QEMU, append(QEMUStartArgs(s, cid), QEMU9pArgs(tree, sandbox.ImageTag)...)...)
	cmd.Stdout, cmd.Stderr = con, con
	begin := time.Now()
	if err := cmd.Start(); err != nil {
		return w, fmt.Errorf("qemu: %w", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	defer func() {
		cmd.Process.Kill()
		<-exited
	}()
	wctx, cancel := context.WithTimeout(ctx, b.spec.BootTimeout)
	defer cancel()
	c, err := client.WaitReadyFunc(wctx, AFVsockDialer(cid))
	if err != nil {
		return w, fmt.Errorf("qemu: agent did not answer: %w; console: %s", err, con.tail())
	}
	defer c.Close()
	ready := time.Since(begin)
	t1 := time.Now()
	if err := execTrue(ctx, c); err != nil {
		return w, fmt.Errorf("qemu: first exec: %w", err)
	}
	fmt.Fprintf(b.progress, "qemu microvm 9p: agent up after %v, first exec %v\n", ready.Round(time.Millisecond), time.Since(t1).Round(time.Millisecond))
	var out, errOut bytes.Buffer
	es, err := c.Exec(ctx, client.ExecOptions{Argv: []string{"sh", "-c", showRootMounts + WorkloadScript(b.spec.ReadFile)},
		Stdout: &out, Stderr: &errOut, Timeout: 20 * time.Minute})
	if err != nil || !es.Success() {
		return w, fmt.Errorf("qemu: workload: %v %v: %s %s", es, err, lastBytes(out.String(), 400), lastBytes(errOut.String(), 400))
	}
	fmt.Fprintf(b.progress, "  guest mounts: %s\n", strings.Join(strings.Fields(errOut.String()), " "))
	pw, err := ParseWorkload(out.String())
	if err != nil {
		return w, fmt.Errorf("qemu: %w", err)
	}
	pw.Root = RootQEMU
	fmt.Fprintf(b.progress, "  workload: find %v / %v (%d files), python %v / %v, read %.1f / %.1f MB/s\n",
		pw.Steps["find1"].Round(time.Millisecond), pw.Steps["find2"].Round(time.Millisecond), pw.Files,
		pw.Steps["py1"].Round(time.Millisecond), pw.Steps["py2"].Round(time.Millisecond), pw.MBps("read1"), pw.MBps("read2"))
	return pw, nil
}

// LoopbackRegistry is a registry on 127.0.0.1 serving an OCI layout's
// images from its files (go-containerregistry's pkg/registry), counting
// what it serves: the registry a cold start pulls from.
type LoopbackRegistry struct {
	Host string
	// Refs maps each image's name in the layout to its reference here.
	Refs map[string]string

	srv      *http.Server
	sizes    map[string]int64
	requests atomic.Int64
	bytes    atomic.Int64
}

// ServeLayout starts a LoopbackRegistry with every named image of the OCI
// layout at dir pushed, as it is, to prefix/NAME:latest.
func ServeLayout(dir, prefix string) (*LoopbackRegistry, error) {
	p, err := layout.FromPath(dir)
	if err != nil {
		return nil, fmt.Errorf("bench: layout %s: %w", dir, err)
	}
	idx, err := p.ImageIndex()
	if err != nil {
		return nil, fmt.Errorf("bench: layout %s: %w", dir, err)
	}
	m, err := idx.IndexManifest()
	if err != nil {
		return nil, fmt.Errorf("bench: layout %s: %w", dir, err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("bench: registry: %w", err)
	}
	r := &LoopbackRegistry{Host: ln.Addr().String(), Refs: map[string]string{}, sizes: map[string]int64{}}
	h := registry.New(registry.Logger(log.New(io.Discard, "", 0)), registry.WithBlobHandler(layoutblobs.Handler{Dir: filepath.Join(dir, "blobs")}))
	r.srv = &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		r.requests.Add(1)
		h.ServeHTTP(&countingWriter{ResponseWriter: w, n: &r.bytes}, req)
	}), ReadHeaderTimeout: time.Minute}
	go r.srv.Serve(ln)
	for _, d := range m.Manifests {
		n := d.Annotations["org.opencontainers.image.ref.name"]
		if n == "" || !d.MediaType.IsImage() {
			continue
		}
		img, err := idx.Image(d.Digest)
		if err != nil {
			r.Close()
			return nil, fmt.Errorf("bench: layout %s: %s: %w", dir, n, err)
		}
		ref := r.Host + "/" + strings.TrimSuffix(prefix, "/") + "/" + n + ":latest"
		nr, err := name.ParseReference(ref)
		if err == nil {
			err = remote.Write(nr, img)
		}
		if err != nil {
			r.Close()
			return nil, fmt.Errorf("bench: push %s: %w", ref, err)
		}
		if mf, err := img.Manifest(); err == nil {
			for _, l := range mf.Layers {
				r.sizes[n] += l.Size
			}
		}
		r.Refs[n] = ref
	}
	if len(r.Refs) == 0 {
		r.Close()
		return nil, fmt.Errorf("bench: layout %s names no images", dir)
	}
	r.Reset()
	return r, nil
}

// Stats is what the registry served since the last Reset.
func (r *LoopbackRegistry) Stats() RegistryStats {
	return RegistryStats{Requests: r.requests.Load(), Bytes: r.bytes.Load()}
}

// RegistryStats counts requests and response body bytes.
type RegistryStats struct{ Requests, Bytes int64 }

// Reset zeroes the counters.
func (r *LoopbackRegistry) Reset() { r.requests.Store(0); r.bytes.Store(0) }

// ImageSize is the compressed size of image name's layers.
func (r *LoopbackRegistry) ImageSize(name string) int64 { return r.sizes[name] }

// Close stops the registry.
func (r *LoopbackRegistry) Close() error { return r.srv.Close() }

type countingWriter struct {
	http.ResponseWriter
	n *atomic.Int64
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.ResponseWriter.Write(p)
	c.n.Add(int64(n))
	return n, err
}

// DefaultImageLayout is make test-rootfs's layout under the kernel cache's
// test-rootfs folder, DefaultExt4Dir its ext4 images, DefaultTreeDir the
// extracted trees (the QEMU peer's 9p roots).
const (
	DefaultImageLayout = "images-v2"
	DefaultExt4Dir     = "ext4-v2"
	DefaultTreeDir     = "tree-v2"
)

// Ext4Images maps each image name with an ext4 image NAME.ext4 in dir to
// its path.
func Ext4Images(dir string) (map[string]string, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("bench: ext4 images: %w", err)
	}
	m := map[string]string{}
	for _, e := range ents {
		if n, ok := strings.CutSuffix(e.Name(), ".ext4"); ok && e.Type().IsRegular() {
			m[n] = filepath.Join(dir, e.Name())
		}
	}
	return m, nil
}
