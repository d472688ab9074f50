package bench

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"

	"github.com/kilnvm/kiln/image"
	"github.com/kilnvm/kiln/image/imagetest"
)

// workloadOut is what WorkloadScript prints in a healthy guest.
const workloadOut = `KILN-IMG find1 2500000000 11873
KILN-IMG find2 400000000 11873
KILN-IMG py1 900000000 0
KILN-IMG py2 300000000 0
KILN-IMG read1 1280000000 268435456
KILN-IMG read2 128000000 268435456
`

func TestParseWorkload(t *testing.T) {
	for _, tc := range []struct {
		name, in string
		err      string // substring; "" for success
	}{
		{name: "all steps", in: workloadOut},
		{name: "noise around", in: "booting\n" + workloadOut + "trailing\n"},
		{name: "step missing", in: strings.Replace(workloadOut, "KILN-IMG read2 128000000 268435456\n", "", 1), err: "step read2"},
		{name: "find printed an error", in: strings.Replace(workloadOut, "find1 2500000000 11873", "find1 2500000000 find: /x: Input/output error", 1), err: "not a file count"},
		{name: "python failed", in: strings.Replace(workloadOut, "py1 900000000 0", "py1 900000000 ModuleNotFoundError: No module named 'email'", 1), err: "python3 printed"},
		{name: "dd read nothing", in: strings.Replace(workloadOut, "read1 1280000000 268435456", "read1 1280000000 stat: cannot statx", 1), err: "not the file's size"},
		{name: "time overflows", in: strings.Replace(workloadOut, "find1 2500000000", "find1 99999999999999999999999", 1), err: "step find1: time"},
		{name: "empty", in: "", err: "step find1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w, err := ParseWorkload(tc.in)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("ParseWorkload: %v, want an error containing %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if w.Files != 11873 || w.ReadBytes != 256<<20 || w.Steps["find1"] != 2500*time.Millisecond || w.Steps["py2"] != 300*time.Millisecond {
				t.Errorf("parsed %+v", w)
			}
			// 268435456 bytes in 1.28 s and 0.128 s.
			if got := w.MBps("read1"); got < 209.7 || got > 209.8 {
				t.Errorf("read1: %.2f MB/s, want 209.7", got)
			}
			if got := w.MBps("read2"); got < 2097 || got > 2098 {
				t.Errorf("read2: %.2f MB/s, want 2097.2", got)
			}
		})
	}
}

func FuzzParseWorkload(f *testing.F) {
	f.Add(workloadOut)
	f.Add("KILN-IMG find1 -1 x\n")
	f.Add("KILN-IMG read1 0 0\nKILN-IMG read2 0 0\n")
	f.Fuzz(func(t *testing.T, s string) {
		w, err := ParseWorkload(s)
		if err != nil {
			return
		}
		if w.Files < 1 || w.ReadBytes < 1 {
			t.Fatalf("accepted %q as %+v", s, w)
		}
		for _, step := range WorkloadSteps {
			if _, ok := w.Steps[step]; !ok {
				t.Fatalf("accepted %q without step %s", s, step)
			}
		}
		_ = w.MBps("read1")
	})
}

func TestWorkloadScriptNamesEveryStep(t *testing.T) {
	s := WorkloadScript("/srv/read.bin")
	for _, step := range WorkloadSteps {
		if !strings.Contains(s, "step "+step+" '") {
			t.Errorf("the script runs no step %s", step)
		}
	}
	if strings.Count(s, "/srv/read.bin") != 4 {
		t.Errorf("the script reads the file other than twice (dd and stat each): %s", s)
	}
}

func TestSummarize(t *testing.T) {
	s := time.Second
	for _, tc := range []struct {
		in   []time.Duration
		want Summary
		str  string
	}{
		{in: nil, want: Summary{}, str: "-"},
		{in: []time.Duration{2 * s}, want: Summary{N: 1, Median: 2 * s, Min: 2 * s, Max: 2 * s}, str: "2.00 s"},
		{in: []time.Duration{3 * s, 1 * s, 2 * s}, want: Summary{N: 3, Median: 2 * s, Min: s, Max: 3 * s}, str: "2.00 s [1.00–3.00]"},
	} {
		got := Summarize(tc.in)
		if got != tc.want || got.String() != tc.str {
			t.Errorf("Summarize(%v) = %+v %q, want %+v %q", tc.in, got, got.String(), tc.want, tc.str)
		}
	}
}

func TestImageSpecNormalize(t *testing.T) {
	for _, tc := range []struct {
		name string
		spec ImageSpec
		err  string
	}{
		{name: "defaults", spec: ImageSpec{Layout: "/l"}},
		{name: "no layout", spec: ImageSpec{}, err: "no OCI layout"},
		{name: "negative runs", spec: ImageSpec{Layout: "/l", Runs: -1}, err: "want positive"},
		{name: "relative read file", spec: ImageSpec{Layout: "/l", ReadFile: "srv/x"}, err: "read file"},
		{name: "read file that breaks the script", spec: ImageSpec{Layout: "/l", ReadFile: "/x'; reboot; '"}, err: "read file"},
		{name: "variant with a space", spec: ImageSpec{Layout: "/l", Variants: []string{"cache=mmap msize=8192"}}, err: "variant"},
		{name: "variants", spec: ImageSpec{Layout: "/l", Variants: []string{"cache=mmap", "msize=131072"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := tc.spec.Normalize()
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("Normalize: %v, want an error containing %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got.Runs != DefaultImageRuns || got.ReadFile != DefaultReadFile || got.MemoryMiB != DefaultImageMemMiB || len(got.Images) != len(DefaultImageNames) {
				t.Errorf("defaults not filled in: %+v", got)
			}
		})
	}
}

// TestServeLayoutPull pulls an image from a LoopbackRegistry serving an
// OCI layout, and counts what the pull cost: the manifest, config and
// TOCs, a small part of the 8 MiB image.
func TestServeLayoutPull(t *testing.T) {
	img, _, err := imagetest.RandomImage(7, 8)
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "layout")
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.AppendImage(img, layout.WithAnnotations(map[string]string{"org.opencontainers.image.ref.name": "small"})); err != nil {
		t.Fatal(err)
	}
	reg, err := ServeLayout(dir, "kiln/bench")
	if err != nil {
		t.Fatal(err)
	}
	defer reg.Close()
	ref, ok := reg.Refs["small"]
	if !ok || !strings.HasPrefix(ref, reg.Host+"/kiln/bench/small:") {
		t.Fatalf("refs %v", reg.Refs)
	}
	if st := reg.Stats(); st != (RegistryStats{}) {
		t.Errorf("counters after ServeLayout: %+v, want zero", st)
	}
	size := reg.ImageSize("small")
	if size < 8<<20 {
		t.Errorf("ImageSize = %d, want at least the 8 MiB of random data", size)
	}
	ims, err := image.NewRoots(image.Options{FetchTimeout: 10 * time.Second}).Images(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	pi, err := ims.Pull(context.Background(), ref, image.PullOptions{})
	if err != nil {
		t.Fatal(err)
	}
	st := reg.Stats()
	if st.Requests == 0 || st.Bytes == 0 {
		t.Fatalf("the pull went unseen: %+v", st)
	}
	if st.Bytes*20 > size {
		t.Errorf("the pull of an estargz image fetched %d bytes of %d: not lazy", st.Bytes, size)
	}
	var layers int64
	for _, l := range pi.Layers {
		layers += l.Size
	}
	if layers != size {
		t.Errorf("pulled layers total %d, the registry's manifest %d", layers, size)
	}
	reg.Reset()
	if st := reg.Stats(); st != (RegistryStats{}) {
		t.Errorf("after Reset: %+v", st)
	}
}

func TestServeLayoutErrors(t *testing.T) {
	if _, err := ServeLayout(filepath.Join(t.TempDir(), "none"), "x"); err == nil {
		t.Error("ServeLayout of a missing folder succeeded")
	}
	dir := t.TempDir()
	if _, err := layout.Write(dir, empty.Index); err != nil {
		t.Fatal(err)
	}
	if _, err := ServeLayout(dir, "x"); err == nil || !strings.Contains(err.Error(), "names no images") {
		t.Errorf("ServeLayout of an empty layout: %v", err)
	}
}

func TestExt4Images(t *testing.T) {
	dir := t.TempDir()
	for _, n := range []string{"busybox.ext4", "debian-read.ext4", "notes.txt"} {
		if err := os.WriteFile(filepath.Join(dir, n), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Mkdir(filepath.Join(dir, "dir.ext4"), 0o755); err != nil {
		t.Fatal(err)
	}
	m, err := Ext4Images(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(m) != 2 || m["busybox"] != filepath.Join(dir, "busybox.ext4") || m["debian-read"] == "" {
		t.Errorf("Ext4Images = %v", m)
	}
	if _, err := Ext4Images(filepath.Join(dir, "missing")); err == nil {
		t.Error("Ext4Images of a missing folder succeeded")
	}
}

func TestImageReportPrint(t *testing.T) {
	w, err := ParseWorkload(workloadOut)
	if err != nil {
		t.Fatal(err)
	}
	w.Root = ModeWarm
	rep := ImageReport{
		Spec: ImageSpec{Images: []string{"busybox"}, Workload: "debian-read"},
		Runs: []FirstExecRun{
			{Image: "busybox", Mode: ModeCold, Run: 1, Pull: time.Second, Start: 10 * time.Second, Exec: time.Second, Total: 12 * time.Second, Fetched: 1 << 20, ImageSize: 10 << 20},
			{Image: "busybox", Mode: ModeCold, Run: 2, Pull: time.Second, Start: 12 * time.Second, Exec: time.Second, Total: 14 * time.Second, Fetched: 1 << 20, ImageSize: 10 << 20},
			{Image: "busybox", Mode: ModeExt4, Run: 1, Start: 9 * time.Second, Exec: time.Second, Total: 10 * time.Second},
			{Image: "debian-read", Mode: ModeWarm, Run: 1, Start: 20 * time.Second, Exec: time.Second, Total: 21 * time.Second, ImageSize: 378 << 20},
		},
		Workloads: []WorkloadResult{w, {Root: ModeWarm + " cache=fscache", Err: "mount refused"}},
		Memory:    []MemResult{{Image: "go-repo", Mode: ModeEROFSWarm, Guest: []MemUsage{{Pss: 380 << 20}}, GuestCached: []int64{200 << 20}, VMM: []uint64{30 << 20}}},
	}
	var out bytes.Buffer
	rep.Print(&out)
	s := out.String()
	for _, want := range []string{"13.00 s [12.00–14.00]", "1.0 MiB (10.000%)", "9p cold", "ext4", "209.7", "2097.2", "cache=fscache", "failed: mount refused", "debian-read  378.0 MiB 9p warm",
		"go-repo      erofs warm PSS 380.0; page cache 200.0; VMM 30.0 MiB"} {
		if !strings.Contains(s, want) {
			t.Errorf("the report lacks %q:\n%s", want, s)
		}
	}
	var js bytes.Buffer
	if err := rep.WriteJSON(&js); err != nil || !strings.Contains(js.String(), `"Mode": "9p cold"`) {
		t.Errorf("WriteJSON: %v\n%s", err, js.String())
	}
}

// The repository table gives each root's median over its runs, and the
// ratio of medians to ext4's.
func TestImageReportRepoMedians(t *testing.T) {
	repo := func(root string, secs ...float64) WorkloadResult {
		w := WorkloadResult{Kind: WorkloadRepo, Root: root, Files: 11505, Steps: map[string]time.Duration{}}
		for i, s := range RepoSteps {
			w.Steps[s] = time.Duration(secs[i%len(secs)] * float64(time.Second))
		}
		return w
	}
	rep := ImageReport{
		Spec: ImageSpec{Repo: "go-repo", RepoDir: "/src/go"},
		Workloads: []WorkloadResult{
			repo(ModeEROFSWarm, 3), repo(ModeExt4, 2), repo(ModeEROFSWarm, 30), repo(ModeExt4, 2.5),
			repo(ModeEROFSWarm, 4), repo(ModeExt4, 1), {Kind: WorkloadRepo, Root: ModeExt4, Err: "boot failed"},
		},
	}
	var out bytes.Buffer
	rep.Print(&out)
	s := strings.Join(strings.Fields(out.String()), " ")
	// erofs warm: 3, 30, 4 -> 4; ext4: 2, 2.5, 1 -> 2; the failed run is
	// listed, not counted.
	for _, want := range []string{"erofs warm 4.00 (2.00) 4.00 (2.00)", "ext4 2.00 (1.00) 2.00 (1.00)", "ext4 failed: boot failed", "(2.00) 3 11505 0 B"} {
		if !strings.Contains(s, want) {
			t.Errorf("the report lacks %q:\n%s", want, s)
		}
	}
}

func TestQEMU9pArgs(t *testing.T) {
	got := strings.Join(QEMU9pArgs("/srv/tree", "kilnroot"), " ")
	want := "-fsdev local,id=kilnroot,path=/srv/tree,security_model=none,readonly=on -device virtio-9p-device,fsdev=kilnroot,mount_tag=kilnroot"
	if got != want {
		t.Errorf("QEMU9pArgs = %q, want %q", got, want)
	}
}

// TestRepoScriptRuns runs RepoScript on this host in a small git
// repository (as root in a guest, it runs the same commands) and parses
// its output: every step, a clean tree, the file count, the modules.
func TestRepoScriptRuns(t *testing.T) {
	dir := t.TempDir()
	repo := filepath.Join(dir, "repo")
	for _, f := range []string{"a.go", "sub/b.go", "sub/deep/c.txt"} {
		p := filepath.Join(repo, f)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte("package x\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	env := append(os.Environ(), "HOME="+dir, "GIT_CONFIG_NOSYSTEM=1", "GIT_AUTHOR_NAME=k", "GIT_AUTHOR_EMAIL=k@x",
		"GIT_COMMITTER_NAME=k", "GIT_COMMITTER_EMAIL=k@x")
	for _, args := range [][]string{{"init", "-q"}, {"add", "-A"}, {"commit", "-q", "-m", "x"}} {
		cmd := exec.Command("git", args...)
		cmd.Dir, cmd.Env = repo, env
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("git %v: %v: %s", args, err, out)
		}
	}
	cmd := exec.Command("sh", "-c", RepoScript(repo))
	cmd.Env = env
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("RepoScript: %v: %s", err, out)
	}
	w, err := ParseRepoWorkload(string(out))
	if err != nil {
		t.Fatal(err)
	}
	// find . -type f counts the repository's own files under .git too.
	if w.Files < 3 || w.Modules < len(PyModules) || w.Kind != WorkloadRepo {
		t.Errorf("files %d, modules %d, kind %q: want ≥ 3 files, ≥ %d modules, %q", w.Files, w.Modules, w.Kind, len(PyModules), WorkloadRepo)
	}
	for _, s := range RepoSteps {
		if w.Steps[s] <= 0 {
			t.Errorf("step %s took %v", s, w.Steps[s])
		}
	}
	// MemScript's last line is the page cache's size.
	cmd = exec.Command("sh", "-c", MemScript(repo))
	cmd.Env = env
	if out, err := cmd.CombinedOutput(); err != nil || !strings.Contains(string(out), "Cached:") {
		t.Fatalf("MemScript: %v: %s", err, out)
	}
}

func TestParseRepoWorkload(t *testing.T) {
	good := "KILN-IMG git1 5 0\nKILN-IMG git2 4 0\nKILN-IMG find1 3 120\nKILN-IMG find2 2 120\nKILN-IMG grep1 9 0\nKILN-IMG py1 7 400\nKILN-IMG py2 6 400\n"
	for _, tc := range []struct {
		name, out, err string
	}{
		{"good", good, ""},
		{"dirty tree", strings.Replace(good, "git1 5 0", "git1 5 3", 1), "git1"},
		{"grep found", strings.Replace(good, "grep1 9 0", "grep1 9 2", 1), "grep1"},
		{"step missing", strings.Replace(good, "KILN-IMG py2 6 400\n", "", 1), "py2"},
		{"find differs", strings.Replace(good, "find2 2 120", "find2 2 119", 1), "find"},
		{"few modules", strings.Replace(good, "py1 7 400", "py1 7 12", 1), "py1"},
		{"bad time", strings.Replace(good, "git2 4", "git2 99999999999999999999", 1), "git2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w, err := ParseRepoWorkload(tc.out)
			if tc.err == "" {
				if err != nil || w.Files != 120 || w.Modules != 400 || w.Steps["grep1"] != 9 {
					t.Fatalf("ParseRepoWorkload = %+v, %v", w, err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Fatalf("error %v, want one naming %s", err, tc.err)
			}
		})
	}
}

func TestImageModes(t *testing.T) {
	for _, tc := range []struct {
		mode, transport string
		cold, chroot    bool
	}{
		{ModeEROFSCold, "erofs", true, false}, {ModeEROFSWarm, "erofs", false, false}, {ModeCold, "9p", true, false},
		{ModeWarm, "9p", false, false}, {ModeExt4, "", false, false},
		{ModeEROFSLower, "erofs", false, true}, {ModeExt4Overlay, "", false, true},
	} {
		script := `step x 'echo "a b" $HOME'`
		argv := inRoot(tc.mode, script)
		if !tc.chroot && !slices.Equal(argv, []string{"sh", "-c", script}) {
			t.Errorf("inRoot(%q) = %q, want the script as it is", tc.mode, argv)
		}
		// The script travels as the chroot's $1, unquoted by nothing.
		if tc.chroot && (len(argv) != 5 || argv[4] != script || !strings.HasSuffix(argv[2], `exec chroot $ROOT sh -c "$1"`)) {
			t.Errorf("inRoot(%q) = %q, want a setup that chroots into $ROOT and runs $1", tc.mode, argv)
		}
		if got := modeTransport(tc.mode); got != tc.transport {
			t.Errorf("modeTransport(%q) = %q, want %q", tc.mode, got, tc.transport)
		}
		if got := modeCold(tc.mode); got != tc.cold {
			t.Errorf("modeCold(%q) = %v", tc.mode, got)
		}
	}
	if _, err := (ImageSpec{Layout: "x", Modes: []string{"erofs lukewarm"}}).Normalize(); err == nil || !strings.Contains(err.Error(), "lukewarm") {
		t.Errorf("an unknown mode: %v", err)
	}
	if _, err := (ImageSpec{Layout: "x", Repo: "r", RepoDir: "/a b"}).Normalize(); err == nil {
		t.Error("a repository folder with a space was taken")
	}
	s, err := (ImageSpec{Layout: "x", Repo: "r"}).Normalize()
	if err != nil || s.RepoDir != DefaultRepoDir || !slices.Equal(s.Modes, DefaultImageModes) {
		t.Errorf("Normalize = %+v, %v", s, err)
	}
}
