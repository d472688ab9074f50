package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/kilnvm/kiln/bench"
	"github.com/kilnvm/kiln/guestkernel"
	"github.com/kilnvm/kiln/sandbox"
)

// cmdBenchImage is `kiln bench image`: image roots (estargz pulled from a
// loopback registry, served as EROFS over virtio-blk or over virtio-9p)
// beside ext4 virtio-blk disks of the same trees: time to first exec cold
// and warm, registry bytes, a repository workload (git status, find, grep
// -r, imports), metadata, import and sequential-read workloads, 9p mount
// option variants, EROFS layout times and memory per extra sandbox.
func cmdBenchImage(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("kiln bench image", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: kiln bench image [-n RUNS] [--images A,B,...] [--modes M,...] [--workload IMAGE] [--repo IMAGE] [--repo-runs N] [--mem-sandboxes N] [--rootflags OPTS]... [--mem MiB] [--json FILE]")
		fs.PrintDefaults()
	}
	n := fs.Int("n", bench.DefaultImageRuns, "runs per image and mode")
	modes := fs.String("modes", strings.Join(bench.DefaultImageModes, ","), "roots tried, comma-separated, of: "+strings.Join(bench.AllImageModes, ", "))
	repo := fs.String("repo", bench.DefaultRepoImage, "image whose first sandbox of each mode runs the repository workload (git status, find, grep -r, python imports); empty: none")
	repoDir := fs.String("repo-dir", bench.DefaultRepoDir, "the repository's folder in --repo")
	repoRuns := fs.Int("repo-runs", 1, "runs (of -n) whose sandbox of each mode runs the repository workload; the report gives medians")
	memSandboxes := fs.Int("mem-sandboxes", 0, "sandboxes of --repo held at once per warm mode for the memory figure, each in a VMM process (kiln-vmm) of its own (0: none)")
	images := fs.String("images", strings.Join(bench.DefaultImageNames, ","), "images of the layout timed to their first exec, comma-separated")
	workload := fs.String("workload", bench.DefaultWorkloadImage, "image whose first sandbox of each mode runs the workloads (find, python3, dd); empty: none")
	readFile := fs.String("read-file", bench.DefaultReadFile, "the workload image's file read sequentially")
	var variants repeated
	fs.Var(&variants, "rootflags", "9p mount `OPTIONS` (kiln.rootflags, after the defaults) for one more warm sandbox of the workload image; repeatable")
	mem := fs.Int("mem", bench.DefaultImageMemMiB, "guest memory in MiB")
	layoutDir := fs.String("layout", "", "OCI image layout; default: <cache>/test-rootfs/"+bench.DefaultImageLayout+" (make test-rootfs)")
	ext4Dir := fs.String("ext4", "", "folder of NAME.ext4 images of the trees; default: <cache>/test-rootfs/"+bench.DefaultExt4Dir+"; \"none\": no ext4 runs")
	kernel := fs.String("kernel", "", "kernel image; default: the cached Debian kernel")
	agent := fs.String("agent", "", "static kiln-agent binary; default: $KILN_AGENT, or kiln-agent beside kiln")
	qemu := fs.String("qemu", "", "the peer: QEMU microvm `BINARY` with virtio-9p over --qemu-tree, running the workload once; empty: none")
	qemuTree := fs.String("qemu-tree", "", "the workload image's tree for the peer; default: <cache>/test-rootfs/"+bench.DefaultTreeDir+"/WORKLOAD")
	qemuCopy := fs.Bool("qemu-copy", false, "copy the peer's tree into --scratch first (in the TCG L1, whose view of the host is itself 9p)")
	jsonOut := fs.String("json", "", "also write the report as JSON to `FILE` (\"-\": to stdout, after the tables)")
	scratch := fs.String("scratch", "", "where the images folders go (removed after); default: the temporary directory")
	bootTimeout := fs.Duration("boot-timeout", 5*time.Minute, "how long to wait for each guest's agent")
	timeout := fs.Duration("timeout", 0, "stop after this long (0: no limit)")
	if err := fs.Parse(args); err != nil {
		return exitUsage
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "kiln bench image: unexpected arguments %q\n", fs.Args())
		return exitUsage
	}
	var names []string
	for _, s := range strings.Split(*images, ",") {
		if s = strings.TrimSpace(s); s != "" {
			names = append(names, s)
		}
	}
	if len(names) == 0 {
		fmt.Fprintln(stderr, "kiln bench image: --images names no image")
		return exitUsage
	}
	if *layoutDir == "" || *ext4Dir == "" || (*qemu != "" && *qemuTree == "") {
		cache, err := guestkernel.CacheDir()
		if err != nil {
			fmt.Fprintf(stderr, "kiln bench image: %v\n", err)
			return exitUsage
		}
		if *layoutDir == "" {
			*layoutDir = filepath.Join(cache, "test-rootfs", bench.DefaultImageLayout)
		}
		if *ext4Dir == "" {
			*ext4Dir = filepath.Join(cache, "test-rootfs", bench.DefaultExt4Dir)
		}
		if *qemu != "" && *qemuTree == "" {
			*qemuTree = filepath.Join(cache, "test-rootfs", bench.DefaultTreeDir, *workload)
		}
	}
	qpath := ""
	if *qemu != "" {
		p, err := exec.LookPath(*qemu)
		if err != nil {
			fmt.Fprintf(stderr, "kiln bench image: peer VMM: %v (make deps installs qemu-system-x86)\n", err)
			return exitUsage
		}
		qpath = p
	}
	ext4 := map[string]string{}
	if *ext4Dir != "none" {
		m, err := bench.Ext4Images(*ext4Dir)
		if err != nil {
			fmt.Fprintf(stderr, "kiln bench image: %v (make test-rootfs makes them; --ext4 none runs without)\n", err)
			return exitUsage
		}
		ext4 = m
	}
	var modeList []string
	for _, m := range strings.Split(*modes, ",") {
		if m = strings.TrimSpace(m); m != "" {
			modeList = append(modeList, m)
		}
	}
	rt, err := sandbox.FindRuntime(*kernel, *agent)
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench image: %v\n", err)
		return exitUsage
	}
	// The memory figure's sandboxes run in VMM processes, as kilnd's and
	// kiln run's do, so that each process's own memory is measured.
	var vmm string
	if *memSandboxes > 0 {
		if vmm, err = sandbox.FindVMM(); err != nil {
			fmt.Fprintf(stderr, "kiln bench image: the memory figure: %v\n", err)
			return exitUsage
		}
	}
	spec, err := bench.ImageSpec{
		Runtime: rt, Layout: *layoutDir, Ext4: ext4, Images: names, Runs: *n, Modes: modeList, Workload: *workload, ReadFile: *readFile,
		Repo: *repo, RepoDir: *repoDir, RepoRuns: *repoRuns, MemSandboxes: *memSandboxes, VMM: vmm,
		Variants: variants, MemoryMiB: *mem, BootTimeout: *bootTimeout, Scratch: *scratch,
		QEMU: qpath, QEMUTree: *qemuTree, QEMUCopy: *qemuCopy,
	}.Normalize()
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench image: %v\n", err)
		return exitUsage
	}
	if *timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, *timeout)
		defer cancel()
	}
	fmt.Fprintf(stdout, "image roots: %s; ext4 images %v; modes %q, %d runs each; workload %q (read %s); repository %q (%s); variants %q; %d MiB; %d sandboxes for memory\n",
		spec.Layout, ext4, spec.Modes, spec.Runs, spec.Workload, spec.ReadFile, spec.Repo, spec.RepoDir, spec.Variants, spec.MemoryMiB, spec.MemSandboxes)
	fmt.Fprintf(stdout, "kernel %s; load average %s\n", rt.Kernel, bench.LoadAverage())
	rep, err := bench.RunImage(ctx, spec, stdout)
	fmt.Fprintf(stdout, "\nload average %s; took %v\n", bench.LoadAverage(), rep.Took.Round(time.Second))
	rep.Print(stdout)
	if *jsonOut == "-" {
		fmt.Fprintln(stdout, "\nJSON:")
		if jerr := rep.WriteJSON(stdout); jerr != nil {
			fmt.Fprintf(stderr, "kiln bench image: %v\n", jerr)
			return exitInternal
		}
	} else if *jsonOut != "" {
		f, ferr := os.Create(*jsonOut)
		if ferr == nil {
			ferr = rep.WriteJSON(f)
			if cerr := f.Close(); ferr == nil {
				ferr = cerr
			}
		}
		if ferr != nil {
			fmt.Fprintf(stderr, "kiln bench image: %v\n", ferr)
			return exitInternal
		}
	}
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench image: %v\n", err)
		return exitInternal
	}
	return exitOK
}
