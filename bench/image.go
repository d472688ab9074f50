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
	DefaultRepoImage     = "go-repo" // tools/testimage's repository image
	DefaultRepoDir       = "/src/go" // its repository
	DefaultReadFile      = "/srv/read.bin"
	DefaultImageRuns     = 3
	DefaultImageMemMiB   = 1024
)

// The modes of a time-to-first-exec run: how the root reaches the guest
// (an image root as EROFS over virtio-blk, the default, or over virtio-9p;
// or an ext4 disk of the same tree) and, for an image root, from which
// store.
const (
	ModeEROFSCold = "erofs cold" // a fresh images folder: pull, then lazy fetches
	ModeEROFSWarm = "erofs warm" // the images folder of the image's first cold run
	ModeCold      = "9p cold"
	ModeWarm      = "9p warm"
	ModeExt4      = "ext4" // the same tree as a read-only ext4 virtio-blk disk

	// The modes that split an image root's cost between its file system
	// and its overlay: an EROFS root whose workloads run chrooted into
	// the overlay's lower layer (the EROFS mount itself, no overlay), and
	// an ext4 disk whose workloads run chrooted into a tmpfs overlay over
	// it (as an image root's overlay is over EROFS).
	ModeEROFSLower  = "erofs lower"
	ModeExt4Overlay = "ext4 overlay"
)

// DefaultImageModes are the modes RunImage times by default, in the order
// each run goes through them.
var DefaultImageModes = []string{ModeEROFSCold, ModeEROFSWarm, ModeWarm, ModeExt4}

// AllImageModes are the modes there are.
var AllImageModes = []string{ModeEROFSCold, ModeEROFSWarm, ModeCold, ModeWarm, ModeExt4, ModeEROFSLower, ModeExt4Overlay}

// modeTransport is the image transport of an image-root mode
// (virtio.TransportEROFS or Transport9P), "" for ext4.
func modeTransport(mode string) string {
	t, _, _ := strings.Cut(mode, " ")
	if modeExt4(mode) {
		return ""
	}
	return t
}

// modeExt4 reports whether mode boots the ext4 disk of the tree.
func modeExt4(mode string) bool { return mode == ModeExt4 || mode == ModeExt4Overlay }

// chrootSetup is, for the modes that run their workloads in another root
// than the guest's own, the guest's commands that make that root (ROOT);
// the workload then runs chrooted there.
var chrootSetup = map[string]string{
	// The image root's lower layer, bound read-only at /run/kiln/image.
	ModeEROFSLower: `ROOT=/run/kiln/image; mount -t proc proc $ROOT/proc && mount --bind /dev $ROOT/dev && mount -t tmpfs tmpfs $ROOT/tmp`,
	// A tmpfs overlay over the read-only ext4 root, as pid1 makes over EROFS.
	ModeExt4Overlay: `ROOT=/mnt/root; mount -t tmpfs -o mode=0755 tmpfs /mnt && mkdir /mnt/upper /mnt/work /mnt/root && ` +
		`mount -t overlay overlay -o lowerdir=/,upperdir=/mnt/upper,workdir=/mnt/work $ROOT && ` +
		`mount -t proc proc $ROOT/proc && mount --bind /dev $ROOT/dev && mount -t tmpfs tmpfs $ROOT/tmp`,
}

// inRoot wraps script so that it runs in mode's root (chrootSetup), or
// returns it as it is for a mode that runs in the guest's own.
func inRoot(mode, script string) []string {
	setup, ok := chrootSetup[mode]
	if !ok {
		return []string{"sh", "-c", script}
	}
	return []string{"sh", "-c", setup + ` && exec chroot $ROOT sh -c "$1"`, "sh", script}
}

// modeCold reports whether mode starts from a fresh images folder.
func modeCold(mode string) bool { return strings.HasSuffix(mode, " cold") }

// ImageSpec configures RunImage: image roots (OCI estargz layers served
// over virtio-9p from an in-process loopback registry) beside ext4 disks
// of the same trees.
type ImageSpec struct {
	Runtime sandbox.Runtime
	// Layout is the OCI image layout served (make test-rootfs's
	// images-v3); its images are named by their ref.name annotation.
	Layout string
	// Ext4 maps an image name to an ext4 image of its tree
	// (tools/build-test-rootfs.sh's ext4-v3/NAME.ext4); images without
	// one get no ext4 runs.
	Ext4 map[string]string
	// Images are timed to their first exec, Runs times per mode.
	Images []string
	Runs   int
	// Modes are the roots tried, in order (DefaultImageModes if empty).
	Modes []string
	// Workload is the image whose sandboxes (first cold, first warm,
	// first ext4 run, and one per Variant) also run WorkloadScript;
	// empty: none.
	Workload string
	ReadFile string
	// Repo is the image whose first RepoRuns sandboxes of each mode (1 if
	// 0; at most Runs) also run RepoScript in its repository RepoDir (git
	// status twice, find twice, grep -r, python imports twice); empty:
	// none. The report gives each step's median over the runs.
	Repo, RepoDir string
	RepoRuns      int
	// MemSandboxes, when above 1, is how many sandboxes of Repo (or
	// Workload) each of the warm modes and ext4 holds at once, each having
	// run the same reads (MemScript), to measure the memory each extra
	// sandbox of one image costs. With VMM (a kiln-vmm binary) they run in
	// VMM processes of their own, whose own PSS is measured too; without,
	// in this process, and only their guests' memory is.
	MemSandboxes int
	VMM          string
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
	if len(s.Modes) == 0 {
		s.Modes = DefaultImageModes
	}
	for _, m := range s.Modes {
		if !slices.Contains(AllImageModes, m) {
			return s, fmt.Errorf("bench: image: mode %q: want one of %q", m, AllImageModes)
		}
	}
	if s.Repo != "" && s.RepoDir == "" {
		s.RepoDir = DefaultRepoDir
	}
	if s.RepoDir != "" && (!strings.HasPrefix(s.RepoDir, "/") || strings.ContainsAny(s.RepoDir, " '\"\\$`")) {
		return s, fmt.Errorf("bench: image: repository folder %q: want an absolute path without quotes, spaces or $", s.RepoDir)
	}
	if s.MemSandboxes < 0 || s.MemSandboxes > 64 {
		return s, fmt.Errorf("bench: image: %d sandboxes for the memory figure: want 0 to 64", s.MemSandboxes)
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
	if s.RepoRuns == 0 {
		s.RepoRuns = 1
	}
	if s.RepoRuns < 0 || s.RepoRuns > s.Runs {
		return s, fmt.Errorf("bench: image: the repository workload in %d runs: want 1 to the %d runs", s.RepoRuns, s.Runs)
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

// RepoSteps are RepoScript's steps, in order: git status, find and python
// twice each (the second with the guest's caches warm), and grep -r once.
var RepoSteps = []string{"git1", "git2", "find1", "find2", "grep1", "py1", "py2"}

// The kinds of workload.
const (
	WorkloadRead = "read" // WorkloadScript: find /, a few imports, dd of ReadFile
	WorkloadRepo = "repo" // RepoScript: a repository's git status, find, grep, many imports
)

// WorkloadResult is WorkloadScript's or RepoScript's timings in one
// sandbox.
type WorkloadResult struct {
	Image string
	Kind  string // WorkloadRead or WorkloadRepo ("" in older reports: read)
	Root  string // a mode, or ModeWarm + " " + flags
	Flags string // kiln.rootflags, "" for the defaults
	// Steps are the guest's own timings (date +%s%N around each).
	Steps map[string]time.Duration
	// Files is what find / -xdev | wc -l counted (the repository's find
	// . -type f for RepoScript).
	Files int
	// Modules is how many modules python3 had loaded (RepoScript).
	Modules int `json:",omitempty"`
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
	Layouts   []LayoutResult `json:",omitempty"`
	Memory    []MemResult    `json:",omitempty"`
	Took      time.Duration
}

// LayoutResult is an image's EROFS layout, built by a fresh image.Roots
// from a warm store, as a new kiln process builds it once per image.
type LayoutResult struct {
	Image string
	// Open is the image opened as a root (TOCs read, layers merged);
	// Build the EROFS metadata laid out from that tree.
	Open, Build  time.Duration
	Inodes       int
	MetadataSize int64 // bytes held in memory per image and process
	Size         int64 // the whole image's size as the guest sees it
}

// MemResult is N sandboxes of one image in one mode held at once, each
// having run MemScript: what each costs the host.
type MemResult struct {
	Image, Mode string
	// Guest is each sandbox's guest RAM (PSS of the mapping: pages the
	// guest touched, its page cache included), in start order.
	Guest []MemUsage
	// GuestCached is each guest's own page cache (Cached in its
	// /proc/meminfo, bytes) after MemScript.
	GuestCached []int64
	// VMM is each sandbox's VMM process's own PSS (its PSS less its
	// guest RAM's): the image root's tree, layout and device in an image
	// root's. Empty when the sandboxes ran in this process (no
	// ImageSpec.VMM).
	VMM []uint64
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

// repoMedians groups the repository workloads that ran by root, in the
// order the roots first ran: each root's median of each step and of the
// bytes fetched, and how many runs it had.
func repoMedians(repo []WorkloadResult) ([]string, map[string]*WorkloadResult, map[string]int) {
	var roots []string
	by := map[string][]WorkloadResult{}
	for _, wl := range repo {
		if wl.Err != "" {
			continue
		}
		if by[wl.Root] == nil {
			roots = append(roots, wl.Root)
		}
		by[wl.Root] = append(by[wl.Root], wl)
	}
	med, runs := map[string]*WorkloadResult{}, map[string]int{}
	for _, root := range roots {
		wls := by[root]
		m := wls[0]
		m.Steps = map[string]time.Duration{}
		for _, s := range RepoSteps {
			m.Steps[s] = Summarize(durations(wls, func(wl WorkloadResult) time.Duration { return wl.Steps[s] })).Median
		}
		fetched := durations(wls, func(wl WorkloadResult) time.Duration { return time.Duration(wl.Fetched) })
		m.Fetched = int64(Summarize(fetched).Median)
		med[root], runs[root] = &m, len(wls)
	}
	return roots, med, runs
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

// durations maps runs (or workloads) to one of their durations.
func durations[T any](xs []T, f func(T) time.Duration) []time.Duration {
	ds := make([]time.Duration, len(xs))
	for i, x := range xs {
		ds[i] = f(x)
	}
	return ds
}

// Print writes the report as tables.
func (rep ImageReport) Print(w io.Writer) {
	modes := rep.Spec.Modes
	if len(modes) == 0 {
		modes = AllImageModes
	}
	fmt.Fprintf(w, "time to first exec (sandbox.Start to the first exec of true answered), seconds, median [min–max]:\n")
	fmt.Fprintf(w, "%-12s %-8s %-10s %-22s %-22s %-22s %-22s %s\n", "image", "size", "root", "pull", "start (agent up)", "first exec", "total", "registry bytes (median, % of image)")
	images := slices.Clone(rep.Spec.Images)
	for _, img := range []string{rep.Spec.Workload, rep.Spec.Repo} {
		if img != "" && !slices.Contains(images, img) {
			images = append(images, img)
		}
	}
	for _, img := range images {
		for _, mode := range modes {
			runs := rep.Select(img, mode)
			if len(runs) == 0 {
				continue
			}
			pull := "-"
			if modeCold(mode) {
				pull = Summarize(durations(runs, func(r FirstExecRun) time.Duration { return r.Pull })).String()
			}
			fetched := make([]int64, len(runs))
			for i, r := range runs {
				fetched[i] = r.Fetched
			}
			slices.Sort(fetched)
			f := fetched[len(fetched)/2]
			bytesCol := "-"
			if !modeExt4(mode) {
				bytesCol = fmt.Sprintf("%s (%.3f%%)", humanBytes(f), 100*float64(f)/float64(max(runs[0].ImageSize, 1)))
			}
			fmt.Fprintf(w, "%-12s %-8s %-10s %-22s %-22s %-22s %-22s %s\n", img, humanBytes(runs[0].ImageSize), mode, pull,
				Summarize(durations(runs, func(r FirstExecRun) time.Duration { return r.Start })),
				Summarize(durations(runs, func(r FirstExecRun) time.Duration { return r.Exec })),
				Summarize(durations(runs, func(r FirstExecRun) time.Duration { return r.Total })), bytesCol)
		}
	}
	sec := func(d time.Duration) string { return strconv.FormatFloat(d.Seconds(), 'f', 2, 64) }
	var read, repo []WorkloadResult
	for _, wl := range rep.Workloads {
		if wl.Kind == WorkloadRepo {
			repo = append(repo, wl)
		} else {
			read = append(read, wl)
		}
	}
	if len(read) > 0 {
		fmt.Fprintf(w, "\nworkloads in %s (guest-timed, seconds; #1 first run after boot, #2 again with the guest's caches warm):\n", rep.Spec.Workload)
		fmt.Fprintf(w, "%-36s %8s %8s %8s %8s %14s %14s %8s %s\n", "root", "find#1", "find#2", "py#1", "py#2", "read#1 MB/s", "read#2 MB/s", "files", "registry bytes")
		for _, wl := range read {
			if wl.Err != "" {
				fmt.Fprintf(w, "%-36s failed: %s\n", wl.Root, wl.Err)
				continue
			}
			fmt.Fprintf(w, "%-36s %8s %8s %8s %8s %14.1f %14.1f %8d %s\n", wl.Root, sec(wl.Steps["find1"]), sec(wl.Steps["find2"]),
				sec(wl.Steps["py1"]), sec(wl.Steps["py2"]), wl.MBps("read1"), wl.MBps("read2"), wl.Files, humanBytes(wl.Fetched))
		}
	}
	if len(repo) > 0 {
		roots, med, runs := repoMedians(repo)
		ext4 := med[ModeExt4]
		fmt.Fprintf(w, "\nrepository workload in %s:%s (guest-timed, seconds, the median of each root's runs; in parentheses: / ext4's):\n", rep.Spec.Repo, rep.Spec.RepoDir)
		fmt.Fprintf(w, "%-12s", "root")
		for _, s := range RepoSteps {
			fmt.Fprintf(w, " %16s", s)
		}
		fmt.Fprintf(w, " %5s %7s %s\n", "runs", "files", "registry bytes")
		for _, wl := range repo {
			if wl.Err != "" {
				fmt.Fprintf(w, "%-12s failed: %s\n", wl.Root, wl.Err)
			}
		}
		for _, root := range roots {
			wl := med[root]
			fmt.Fprintf(w, "%-12s", root)
			for _, s := range RepoSteps {
				col := sec(wl.Steps[s])
				if ext4 != nil && ext4.Steps[s] > 0 {
					col += fmt.Sprintf(" (%.2f)", float64(wl.Steps[s])/float64(ext4.Steps[s]))
				}
				fmt.Fprintf(w, " %16s", col)
			}
			fmt.Fprintf(w, " %5d %7d %s\n", runs[root], wl.Files, humanBytes(wl.Fetched))
		}
	}
	if len(rep.Layouts) > 0 {
		fmt.Fprintf(w, "\nEROFS layouts (a fresh image.Roots on the warm store):\n%-12s %10s %10s %8s %12s %12s\n", "image", "open", "lay out", "inodes", "metadata", "image size")
		for _, l := range rep.Layouts {
			fmt.Fprintf(w, "%-12s %10v %10v %8d %12s %12s\n", l.Image, l.Open.Round(time.Millisecond), l.Build.Round(time.Millisecond),
				l.Inodes, humanBytes(l.MetadataSize), humanBytes(l.Size))
		}
	}
	if len(rep.Memory) > 0 {
		fmt.Fprintf(w, "\nmemory of sandboxes of one image held at once (guest RAM PSS, MiB; guest page cache, MiB; VMM process's own PSS, MiB):\n")
		for _, m := range rep.Memory {
			fmt.Fprintf(w, "%-12s %-10s PSS %s; page cache %s; VMM %s\n", m.Image, m.Mode,
				strings.Join(mapStrings(m.Guest, func(u MemUsage) string { return fmt.Sprintf("%.1f", MiB(u.Pss)) }), " / "),
				strings.Join(mapStrings(m.GuestCached, func(c int64) string { return fmt.Sprintf("%.1f", float64(c)/(1<<20)) }), " / "),
				vmmPSS(m.VMM))
		}
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

// stepFunc is the workload scripts' shell preamble: step NAME COMMAND runs
// COMMAND, timed by the guest's clock, and prints "KILN-IMG NAME
// nanoseconds last-line-of-output".
const stepFunc = `set -u
step() {
	name=$1; shift
	s=$(date +%s%N)
	out=$(sh -c "$1" 2>&1 | tail -n 1)
	e=$(date +%s%N)
	echo "KILN-IMG $name $((e - s)) $out"
}
`

// WorkloadScript is the guest side of the workloads: each step timed by
// the guest's clock (date +%s%N, GNU date), printed as
// "KILN-IMG step nanoseconds last-line-of-output". readFile is read with
// dd twice: the first read goes to the 9p server (or the disk), the second
// hits the guest's page cache.
func WorkloadScript(readFile string) string {
	return stepFunc + `step find1 'find / -xdev | wc -l'
step find2 'find / -xdev | wc -l'
step py1 'python3 -c "import email, json, http.client; print(0)"'
step py2 'python3 -c "import email, json, http.client; print(0)"'
step read1 'dd if=` + readFile + ` of=/dev/null bs=1M 2>&1 >/dev/null; stat -c %s ` + readFile + `'
step read2 'dd if=` + readFile + ` of=/dev/null bs=1M 2>&1 >/dev/null; stat -c %s ` + readFile + `'
`
}

// PyModules are the standard library modules RepoScript and MemScript
// import: a test suite's worth of imports (hundreds of files stat'ed,
// opened and read, most of them .pyc).
var PyModules = []string{"argparse", "ast", "asyncio", "base64", "bz2", "calendar", "collections", "concurrent.futures",
	"configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "dis", "email.mime.text",
	"email.parser", "enum", "fnmatch", "fractions", "ftplib", "functools", "glob", "gzip", "hashlib", "heapq", "hmac",
	"html.parser", "http.client", "http.server", "imaplib", "importlib.metadata", "inspect", "ipaddress", "itertools",
	"json", "logging.handlers", "lzma", "mimetypes", "multiprocessing", "netrc", "operator", "optparse", "pathlib",
	"pickle", "pkgutil", "platform", "plistlib", "pprint", "queue", "quopri", "random", "re", "secrets", "selectors",
	"shelve", "shlex", "shutil", "smtplib", "socketserver", "sqlite3", "ssl", "statistics", "string", "struct",
	"subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "trace", "traceback", "typing",
	"unittest", "unittest.mock", "urllib.parse", "urllib.request", "uuid", "wave", "xml.dom.minidom",
	"xml.etree.ElementTree", "xml.sax", "zipfile", "zoneinfo"}

// pyImports is a python3 command line importing PyModules and printing
// how many modules it then had loaded.
func pyImports() string {
	return `python3 -c "import sys, ` + strings.Join(PyModules, ", ") + `; print(len(sys.modules))"`
}

// RepoScript is the guest side of the repository workload, in the
// repository dir, timed as WorkloadScript's steps are: git status
// (porcelain, lines counted: a clean tree prints 0; its index a copy on
// the guest's tmpfs, so every root can write it), find of the files,
// grep -r of a string no file holds (so that every byte is read), and
// PyModules imported.
func RepoScript(dir string) string {
	return stepFunc + `cd ` + dir + ` || exit 1
# git status refreshes the index and writes it back: onto tmpfs, so that a
# read-only root (the ext4 disk has no overlay) keeps what it learnt as the
# image roots' overlays do.
cp .git/index /tmp/kiln-bench-index && export GIT_INDEX_FILE=/tmp/kiln-bench-index || exit 1
step git1 'git status --porcelain | wc -l'
step git2 'git status --porcelain | wc -l'
step find1 'find . -type f | wc -l'
step find2 'find . -type f | wc -l'
step grep1 'grep -r -l -F kiln-bench-no-file-holds-this . | wc -l'
step py1 '` + pyImports() + `'
step py2 '` + pyImports() + `'
`
}

// MemScript is what each sandbox of the memory figure reads before it is
// measured: the repository's git status (every file's metadata and the
// index) and PyModules, a typical agent's first step; then the guest's
// page cache size (Cached, kB).
func MemScript(dir string) string {
	return `cd ` + dir + ` && git status --porcelain | wc -l && ` + pyImports() +
		` && grep '^Cached:' /proc/meminfo`
}

// ParseRepoWorkload reads RepoScript's output as ParseWorkload reads
// WorkloadScript's: every step there, git status clean, the counts
// numbers.
func ParseRepoWorkload(out string) (WorkloadResult, error) {
	r := WorkloadResult{Kind: WorkloadRepo}
	steps, outs, err := parseSteps(out, RepoSteps)
	r.Steps = steps
	if err != nil {
		return r, err
	}
	for _, s := range []string{"git1", "git2", "grep1"} {
		if outs[s] != "0" {
			return r, fmt.Errorf("workload step %s: printed %q, want 0 (a clean tree, no file holding the string)", s, outs[s])
		}
	}
	if r.Files, err = strconv.Atoi(outs["find1"]); err != nil || r.Files < 1 || outs["find2"] != outs["find1"] {
		return r, fmt.Errorf("workload step find: printed %q and %q, not one file count", outs["find1"], outs["find2"])
	}
	if r.Modules, err = strconv.Atoi(outs["py1"]); err != nil || r.Modules < len(PyModules) {
		return r, fmt.Errorf("workload step py1: printed %q, not a module count of at least %d", outs["py1"], len(PyModules))
	}
	return r, nil
}

// showRootMounts prints the guest's root and 9p mounts to stderr: the
// options the guest's 9p client took.
const showRootMounts = "grep -E ' / | /kiln/lower ' /proc/mounts >&2; "

var workloadRE = regexp.MustCompile(`(?m)^KILN-IMG ([a-z0-9]+) ([0-9]+) ?(.*)$`)

// parseSteps reads the KILN-IMG lines of a workload's output: each step's
// time and last line of output; a step of want missing is an error.
func parseSteps(out string, want []string) (map[string]time.Duration, map[string]string, error) {
	steps, outs := map[string]time.Duration{}, map[string]string{}
	for _, m := range workloadRE.FindAllStringSubmatch(out, -1) {
		ns, err := strconv.ParseInt(m[2], 10, 64)
		if err != nil {
			return steps, outs, fmt.Errorf("workload step %s: time %q: %w", m[1], m[2], err)
		}
		steps[m[1]] = time.Duration(ns)
		outs[m[1]] = strings.TrimSpace(m[3])
	}
	for _, s := range want {
		if _, ok := steps[s]; !ok {
			return steps, outs, fmt.Errorf("workload step %s: no KILN-IMG line in %q", s, lastBytes(out, 400))
		}
	}
	return steps, outs, nil
}

// ParseWorkload reads WorkloadScript's output: every step's time, the
// file count (find's output) and the read file's size (stat's). A step
// missing, or an output that is not the number it must be, is an error
// naming it.
func ParseWorkload(out string) (WorkloadResult, error) {
	r := WorkloadResult{}
	steps, outs, err := parseSteps(out, WorkloadSteps)
	r.Steps = steps
	if err != nil {
		return r, err
	}
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

// RunImage runs the image benchmark: for each image and run, one sandbox
// per mode (by default: EROFS from a fresh images folder, EROFS and 9p
// from the first cold run's folder, and the ext4 disk of the tree where
// there is one); the workloads in the first sandbox of each mode of their
// images; one warm 9p sandbox of Workload per mount option variant; each
// image's EROFS layout built again from its warm store; and, with
// MemSandboxes, the memory figure. Progress lines go to progress as they
// happen.
func RunImage(ctx context.Context, spec ImageSpec, progress io.Writer) (rep ImageReport, err error) {
	rep.Spec = spec
	start := time.Now()
	defer func() { rep.Took = time.Since(start) }()
	if progress == nil {
		progress = io.Discard
	}
	if len(spec.Modes) == 0 {
		spec.Modes = DefaultImageModes
	}
	reg, err := ServeLayout(spec.Layout, "kiln/bench")
	if err != nil {
		return rep, err
	}
	defer reg.Close()
	all := slices.Clone(spec.Images)
	for _, img := range []string{spec.Workload, spec.Repo} {
		if img != "" && !slices.Contains(all, img) {
			all = append(all, img)
		}
	}
	for _, img := range all {
		if _, ok := reg.Refs[img]; !ok {
			return rep, fmt.Errorf("bench: image: %s is not in the layout %s (make test-rootfs makes %s)", img, spec.Layout, DefaultImageLayout)
		}
	}
	scratch, err := os.MkdirTemp(spec.Scratch, "kiln-bench-image-")
	if err != nil {
		return rep, fmt.Errorf("bench: image: %w", err)
	}
	defer os.RemoveAll(scratch)
	b := &imageBench{spec: spec, reg: reg, scratch: scratch, progress: progress, warm: map[string]string{}}
	for _, img := range all {
		runs := spec.Runs
		if !slices.Contains(spec.Images, img) {
			runs = 1 // a workload image only
		}
		for i := 1; i <= runs; i++ {
			for _, mode := range spec.Modes {
				if modeExt4(mode) && spec.Ext4[img] == "" {
					continue
				}
				var kinds []string
				if i == 1 && img == spec.Workload {
					kinds = append(kinds, WorkloadRead)
				}
				if i <= max(spec.RepoRuns, 1) && img == spec.Repo {
					kinds = append(kinds, WorkloadRepo)
				}
				r, ws, err := b.firstExec(ctx, img, mode, i, kinds, "")
				if err != nil {
					return rep, err
				}
				rep.Runs = append(rep.Runs, r)
				rep.Workloads = append(rep.Workloads, ws...)
			}
		}
	}
	if spec.QEMU != "" && spec.Workload != "" {
		w, err := b.qemuWorkload(ctx)
		if err != nil {
			fmt.Fprintf(progress, "qemu microvm: %v\n", err)
			w = WorkloadResult{Root: RootQEMU, Err: err.Error()}
		}
		w.Image, w.Kind = spec.Workload, WorkloadRead
		rep.Workloads = append(rep.Workloads, w)
	}
	for _, v := range spec.Variants {
		if spec.Workload == "" {
			break
		}
		_, ws, err := b.firstExec(ctx, spec.Workload, ModeWarm, 0, []string{WorkloadRead}, v)
		if err != nil {
			// A variant the guest refuses is a finding, not the end.
			fmt.Fprintf(progress, "variant %s: %v\n", v, err)
			rep.Workloads = append(rep.Workloads, WorkloadResult{Image: spec.Workload, Kind: WorkloadRead, Root: ModeWarm + " " + v, Flags: v, Err: err.Error()})
			continue
		}
		rep.Workloads = append(rep.Workloads, ws...)
	}
	for _, img := range all {
		if b.warm[img] == "" {
			continue
		}
		l, err := b.layout(ctx, img)
		if err != nil {
			return rep, err
		}
		rep.Layouts = append(rep.Layouts, l)
	}
	if spec.MemSandboxes > 1 {
		img, dir := spec.Repo, spec.RepoDir
		if img == "" {
			return rep, errors.New("bench: image: the memory figure needs a repository image (Repo)")
		}
		for _, mode := range []string{ModeEROFSWarm, ModeWarm, ModeExt4} {
			if !slices.Contains(spec.Modes, mode) || (mode == ModeExt4 && spec.Ext4[img] == "") {
				continue
			}
			m, err := b.memory(ctx, img, dir, mode, spec.MemSandboxes)
			if err != nil {
				return rep, err
			}
			rep.Memory = append(rep.Memory, m)
		}
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

// start boots one sandbox of img in mode (flags: kiln.rootflags for a 9p
// root) and times it to its first exec of true, in a VMM process of its
// own (proc) or in this one (nil). The caller closes the sandbox.
func (b *imageBench) start(ctx context.Context, img, mode, flags string, r *FirstExecRun, proc *sandbox.ProcessOptions) (*sandbox.Sandbox, error) {
	opts := sandbox.Options{Runtime: b.spec.Runtime, MemoryMiB: b.spec.MemoryMiB, BootTimeout: b.spec.BootTimeout,
		Hostname: "bench", Console: io.Discard, Process: proc}
	if flags != "" {
		opts.Cmdline = "kiln.rootflags=" + flags
	}
	ref := b.reg.Refs[img]
	b.reg.Reset()
	begin := time.Now()
	if modeExt4(mode) {
		opts.Disk, opts.DiskReadOnly = b.spec.Ext4[img], true
	} else {
		dir := b.warm[img]
		fresh := modeCold(mode) || dir == ""
		if fresh {
			b.n++
			dir = filepath.Join(b.scratch, fmt.Sprintf("images-%d", b.n))
		}
		// A Roots of its own, as a fresh kiln process would have: a warm
		// store, but the tree and its layout built again from the stored
		// TOCs.
		roots := image.NewRoots(image.Options{FetchTimeout: time.Minute})
		ims, err := roots.Images(dir)
		if err != nil {
			return nil, err
		}
		if fresh {
			pi, err := ims.Pull(ctx, ref, image.PullOptions{})
			if err != nil {
				return nil, fmt.Errorf("pull: %w", err)
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
				return nil, err
			}
			for _, l := range pi.Layers {
				r.ImageSize += l.Size
			}
		}
		opts.Image, opts.Images, opts.ImageRoots, opts.ImageTransport = ref, dir, roots, modeTransport(mode)
	}
	if r.ImageSize == 0 {
		r.ImageSize = b.reg.ImageSize(img)
	}
	t0 := time.Now()
	sb, err := sandbox.Start(ctx, opts)
	if err != nil {
		return nil, err
	}
	r.Start = time.Since(t0)
	t1 := time.Now()
	if err := execTrue(ctx, sb.Client()); err != nil {
		sb.Close(context.Background())
		return nil, fmt.Errorf("first exec: %w", err)
	}
	r.Exec = time.Since(t1)
	r.Total = time.Since(begin)
	st := b.reg.Stats()
	r.Fetched, r.Requests = st.Bytes, st.Requests
	return sb, nil
}

// firstExec boots one sandbox of img in mode, times it to its first exec
// of true, runs the workloads of kinds in it, and closes it. flags are
// kiln.rootflags for a 9p root.
func (b *imageBench) firstExec(ctx context.Context, img, mode string, run int, kinds []string, flags string) (FirstExecRun, []WorkloadResult, error) {
	r := FirstExecRun{Image: img, Mode: mode, Run: run}
	fail := func(err error) (FirstExecRun, []WorkloadResult, error) {
		return r, nil, fmt.Errorf("bench: image %s, %s, run %d: %w", img, mode, run, err)
	}
	sb, err := b.start(ctx, img, mode, flags, &r, nil)
	if err != nil {
		return fail(err)
	}
	defer sb.Close(context.Background())
	label := mode
	if flags != "" {
		label += " " + flags
	}
	fmt.Fprintf(b.progress, "%s %s run %d: pull %v, start %v, first exec %v, total %v; registry %d requests, %s of %s\n",
		img, label, run, r.Pull.Round(time.Millisecond), r.Start.Round(time.Millisecond), r.Exec.Round(time.Millisecond),
		r.Total.Round(time.Millisecond), r.Requests, humanBytes(r.Fetched), humanBytes(r.ImageSize))
	var ws []WorkloadResult
	for _, kind := range kinds {
		w, err := b.workload(ctx, sb, kind, mode, label)
		if err != nil {
			return fail(err)
		}
		w.Image, w.Flags = img, flags
		ws = append(ws, w)
	}
	return r, ws, nil
}

// workload runs one workload in sb and parses its timings.
func (b *imageBench) workload(ctx context.Context, sb *sandbox.Sandbox, kind, mode, label string) (WorkloadResult, error) {
	b.reg.Reset()
	script := showRootMounts + WorkloadScript(b.spec.ReadFile)
	if kind == WorkloadRepo {
		script = showRootMounts + RepoScript(b.spec.RepoDir)
	}
	var out, errOut bytes.Buffer
	ectx, cancel := context.WithTimeout(ctx, 40*time.Minute)
	defer cancel()
	es, err := sb.Client().Exec(ectx, client.ExecOptions{Argv: inRoot(mode, script),
		Stdout: &out, Stderr: &errOut, Timeout: 40 * time.Minute})
	if err != nil || !es.Success() {
		return WorkloadResult{}, fmt.Errorf("%s workload: %v %v: %s %s", kind, es, err, lastBytes(out.String(), 400), lastBytes(errOut.String(), 400))
	}
	var w WorkloadResult
	if kind == WorkloadRepo {
		w, err = ParseRepoWorkload(out.String())
	} else {
		w, err = ParseWorkload(out.String())
		w.Kind = WorkloadRead
	}
	if err != nil {
		return w, err
	}
	fmt.Fprintf(b.progress, "  guest mounts: %s\n", strings.Join(strings.Fields(errOut.String()), " "))
	w.Root, w.Fetched = label, b.reg.Stats().Bytes
	sec := func(s string) time.Duration { return w.Steps[s].Round(time.Millisecond) }
	if kind == WorkloadRepo {
		fmt.Fprintf(b.progress, "  repository: git status %v / %v, find %v / %v (%d files), grep -r %v, python %v / %v (%d modules); registry %s\n",
			sec("git1"), sec("git2"), sec("find1"), sec("find2"), w.Files, sec("grep1"), sec("py1"), sec("py2"), w.Modules, humanBytes(w.Fetched))
	} else {
		fmt.Fprintf(b.progress, "  workload: find %v / %v (%d files), python %v / %v, read %.1f / %.1f MB/s; registry %s\n",
			sec("find1"), sec("find2"), w.Files, sec("py1"), sec("py2"), w.MBps("read1"), w.MBps("read2"), humanBytes(w.Fetched))
	}
	return w, nil
}

// layout opens img from its warm store in a fresh image.Roots and lays it
// out as EROFS, as a new kiln process does once per image.
func (b *imageBench) layout(ctx context.Context, img string) (LayoutResult, error) {
	l := LayoutResult{Image: img}
	roots := image.NewRoots(image.Options{FetchTimeout: time.Minute})
	ims, err := roots.Images(b.warm[img])
	if err != nil {
		return l, err
	}
	t0 := time.Now()
	root, err := ims.OpenRoot(ctx, b.reg.Refs[img])
	if err != nil {
		return l, fmt.Errorf("bench: image %s: %w", img, err)
	}
	defer root.Close()
	l.Open = time.Since(t0)
	t1 := time.Now()
	e, err := root.EROFS(ctx)
	if err != nil {
		return l, fmt.Errorf("bench: image %s: %w", img, err)
	}
	l.Build = time.Since(t1)
	l.Inodes, l.MetadataSize, l.Size = e.Inodes(), e.MetadataSize(), e.Size()
	fmt.Fprintf(b.progress, "%s: opened in %v, laid out as EROFS in %v: %d inodes, %s of metadata, %s in all\n", img,
		l.Open.Round(time.Millisecond), l.Build.Round(time.Millisecond), l.Inodes, humanBytes(l.MetadataSize), humanBytes(l.Size))
	return l, nil
}

// memory holds n sandboxes of img in mode at once, each having run
// MemScript in dir, and measures each one's guest RAM and page cache.
func (b *imageBench) memory(ctx context.Context, img, dir, mode string, n int) (MemResult, error) {
	m := MemResult{Image: img, Mode: mode}
	var sbs []*sandbox.Sandbox
	defer func() {
		for _, sb := range sbs {
			sb.Close(context.Background())
		}
	}()
	for i := range n {
		var r FirstExecRun
		var proc *sandbox.ProcessOptions
		if b.spec.VMM != "" {
			proc = &sandbox.ProcessOptions{Command: []string{b.spec.VMM}}
		}
		sb, err := b.start(ctx, img, mode, "", &r, proc)
		if err != nil {
			return m, fmt.Errorf("bench: image %s, %s, memory sandbox %d: %w", img, mode, i+1, err)
		}
		sbs = append(sbs, sb)
		var out, errOut bytes.Buffer
		es, err := sb.Client().Exec(ctx, client.ExecOptions{Argv: []string{"sh", "-c", MemScript(dir)},
			Stdout: &out, Stderr: &errOut, Timeout: 20 * time.Minute})
		if err != nil || !es.Success() {
			return m, fmt.Errorf("bench: image %s, %s, memory sandbox %d: %v %v: %s", img, mode, i+1, es, err, lastBytes(out.String()+errOut.String(), 400))
		}
		f := strings.Fields(out.String())
		var kb int64
		if len(f) < 3 || f[len(f)-3] != "Cached:" {
			return m, fmt.Errorf("bench: image %s, %s, memory sandbox %d: no Cached line in %q", img, mode, i+1, lastBytes(out.String(), 200))
		}
		if kb, err = strconv.ParseInt(f[len(f)-2], 10, 64); err != nil {
			return m, fmt.Errorf("bench: image %s, %s, memory sandbox %d: Cached %q: %w", img, mode, i+1, f[len(f)-2], err)
		}
		m.GuestCached = append(m.GuestCached, kb<<10)
	}
	for i, sb := range sbs {
		sm, err := sandboxMem(sb)
		if err != nil {
			return m, fmt.Errorf("bench: image %s, %s, memory sandbox %d: %w", img, mode, i+1, err)
		}
		m.Guest = append(m.Guest, sm.Guest)
		if sb.PID() != os.Getpid() { // a VMM process of its own
			m.VMM = append(m.VMM, sm.VMMPSS())
		}
	}
	fmt.Fprintf(b.progress, "%s %s: %d sandboxes held; guest RAM PSS %s; guest page cache %s; VMM PSS %s\n", img, mode, n,
		strings.Join(mapStrings(m.Guest, func(u MemUsage) string { return fmt.Sprintf("%.1f", MiB(u.Pss)) }), " / ")+" MiB",
		strings.Join(mapStrings(m.GuestCached, func(c int64) string { return fmt.Sprintf("%.1f", float64(c)/(1<<20)) }), " / ")+" MiB",
		vmmPSS(m.VMM))
	return m, nil
}

// vmmPSS formats VMM processes' own PSS in MiB, "-" for none (the
// sandboxes ran in this process).
func vmmPSS(vs []uint64) string {
	if len(vs) == 0 {
		return "- (in this process)"
	}
	return strings.Join(mapStrings(vs, func(v uint64) string { return fmt.Sprintf("%.1f", MiB(v)) }), " / ") + " MiB"
}

// mapStrings is f of each of xs.
func mapStrings[T any](xs []T, f func(T) string) []string {
	out := make([]string, len(xs))
	for i, x := range xs {
		out[i] = f(x)
	}
	return out
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
	DefaultImageLayout = "images-v3"
	DefaultExt4Dir     = "ext4-v3"
	DefaultTreeDir     = "tree-v3"
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
