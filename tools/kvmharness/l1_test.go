package main

import (
	"bytes"
	"context"
	"go/token"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/u-root/u-root/pkg/cpio"

	"github.com/kilnvm/kiln/guestkernel"
)

func TestChooseMode(t *testing.T) {
	ok := func() error { return nil }
	no := func() error { return os.ErrNotExist }
	tests := []struct {
		mode   string
		usable func() error
		want   string
		err    bool
	}{
		{"auto", ok, modeDirect, false},
		{"auto", no, modeTCG, false},
		{"tcg", ok, modeTCG, false},
		{"direct", no, modeDirect, false},
		{"fast", ok, "", true},
	}
	for _, tt := range tests {
		got, err := chooseMode(tt.mode, tt.usable)
		if got != tt.want || (err != nil) != tt.err {
			t.Errorf("chooseMode(%q) = %q, %v; want %q, error %v", tt.mode, got, err, tt.want, tt.err)
		}
	}
}

func TestSourceKVMTests(t *testing.T) {
	tests := []struct {
		src  string
		want string
	}{
		{"package p\nimport \"testing\"\nfunc TestKVMBoot(t *testing.T) {}\nfunc TestKVMWarmSnap(t *testing.T) {}\n", "TestKVMBoot,TestKVMWarmSnap"},
		{"package p\nfunc TestBoot(t *testing.T) {}\nfunc helperKVM() {}\n", ""},
		{"package p\ntype s struct{}\nfunc (s) TestKVMx() {}\n", ""},
		{"package p\n// func TestKVMInComment\n", ""},
	}
	for _, tt := range tests {
		got, err := sourceKVMTests(token.NewFileSet(), "x_test.go", []byte(tt.src))
		if err != nil || strings.Join(got, ",") != tt.want {
			t.Errorf("sourceKVMTests(%q) = %q, %v; want %q", tt.src, got, err, tt.want)
		}
	}
	if _, err := sourceKVMTests(token.NewFileSet(), "bad_test.go", []byte("package")); err == nil {
		t.Error("no error for unparsable source")
	}
}

func TestCopyConsole(t *testing.T) {
	in := "\x1b[2J\x1bcboot\r\n\x16=== RUN   TestKVMX\r\n\x16=== NAME  \r\n--- PASS: TestKVMX (0.1s)\r\nno newline"
	var out writeCounter
	copyConsole(&out, strings.NewReader(in), "L1 TestKVMX| ")
	want := "L1 TestKVMX| boot\nL1 TestKVMX| === RUN   TestKVMX\nL1 TestKVMX| --- PASS: TestKVMX (0.1s)\nL1 TestKVMX| no newline\n"
	if out.String() != want {
		t.Fatalf("console:\n%q\nwant:\n%q", out.String(), want)
	}
	if out.writes != 4 {
		t.Errorf("%d writes for 4 lines: a line must be one write, or parallel consoles mix", out.writes)
	}
}

// writeCounter is a buffer that counts its writes.
type writeCounter struct {
	buf    bytes.Buffer
	writes int
}

func (w *writeCounter) Write(p []byte) (int, error) {
	w.writes++
	return w.buf.Write(p)
}

func (w *writeCounter) String() string { return w.buf.String() }

func TestShQuote(t *testing.T) {
	for _, s := range []string{"", "plain", "it's", "a b\tc", "$(rm -rf /)", `"\`, "new\nline", "'''"} {
		out, err := exec.Command("sh", "-c", "printf %s "+shQuote(s)).Output()
		if err != nil || string(out) != s {
			t.Errorf("sh printed %q, %v for shQuote(%q) = %s", out, err, s, shQuote(s))
		}
	}
}

func TestExportLine(t *testing.T) {
	got := exportLine([]string{"A=1", "B=it's", "BAD-NAME=x", "1X=y", "C="})
	if want := `export A='1' B='it'\''s' C=''`; got != want {
		t.Fatalf("exportLine = %s, want %s", got, want)
	}
}

// runScript runs a generated job script here with sh.
func runScript(t *testing.T, script string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "run.sh")
	if err := os.WriteFile(p, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("sh", p).CombinedOutput()
	if err != nil {
		t.Fatalf("sh %s: %v\n%s", p, err, out)
	}
	return string(out)
}

func TestTestJobScript(t *testing.T) {
	job := filepath.Join(t.TempDir(), "job dir with 'quotes'")
	pkgDir := t.TempDir()
	for _, d := range []string{"bin", "out"} {
		if err := os.MkdirAll(filepath.Join(job, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// Fake test binaries: print their arguments, working folder and env.
	fake := func(name, body string) string {
		p := filepath.Join(job, "bin", name)
		if err := os.WriteFile(p, []byte("#!/bin/sh\n"+body), 0o755); err != nil {
			t.Fatal(err)
		}
		return p
	}
	bins := []testBinary{
		{pkg: testPackage{ImportPath: "a", Dir: pkgDir}, path: fake("0.test", `echo "$@" "$PWD" "$KILN_KVM_TESTS"; exit 0`),
			out: filepath.Join(job, "out", "0.out"), rc: filepath.Join(job, "out", "0.rc")},
		{pkg: testPackage{ImportPath: "b", Dir: pkgDir}, path: fake("1.test", "echo failing >&2; exit 3"),
			out: filepath.Join(job, "out", "1.out"), rc: filepath.Join(job, "out", "1.rc")},
		{pkg: testPackage{ImportPath: "c", Dir: filepath.Join(pkgDir, "missing")}, path: fake("2.test", "exit 0"),
			out: filepath.Join(job, "out", "2.out"), rc: filepath.Join(job, "out", "2.rc")},
		// Fails TestKVMFlaky (and times out in TestKVMHung) the first time,
		// then passes: only those two run again.
		{pkg: testPackage{ImportPath: "d", Dir: pkgDir}, path: fake("3.test", `
if [ -f ran ]; then echo "again $@"; exit 0; fi
touch ran
echo "--- FAIL: TestKVMFlaky (1.00s)"
echo "    --- FAIL: TestKVMFlaky/sub (1.00s)"
echo "--- PASS: TestKVMSteady (1.00s)"
echo "panic: test timed out after 1s"
echo "running tests:"
printf '\tTestKVMHung (1s)\n'
exit 1`),
			out: filepath.Join(job, "out", "3.out"), rc: filepath.Join(job, "out", "3.rc")},
	}
	console := runScript(t, testJobScript(job, []string{"KILN_KVM_TESTS=require", "PATH=" + os.Getenv("PATH")}, bins, 90*time.Second))
	read := func(p string) string {
		data, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		return string(data)
	}
	if got, want := read(bins[0].out), "-test.run ^TestKVM -test.v=test2json -test.timeout=1m30s "+pkgDir+" require\n"; got != want {
		t.Errorf("first binary printed %q, want %q", got, want)
	}
	if read(bins[0].rc) != "0\n" || read(bins[1].rc) != "3\n" || read(bins[1].out) != "failing\n" {
		t.Errorf("rc files %q %q, second output %q", read(bins[0].rc), read(bins[1].rc), read(bins[1].out))
	}
	if got, want := read(bins[3].retryOut()), "again -test.run ^(TestKVMFlaky|TestKVMHung)$ -test.v=test2json -test.timeout=1m30s\n"; got != want {
		t.Errorf("retry printed %q, want %q", got, want)
	}
	if read(bins[3].retryRC()) != "0\n" {
		t.Errorf("retry rc %q", read(bins[3].retryRC()))
	}
	if _, err := os.Stat(bins[0].retryOut()); err == nil {
		t.Error("a passing binary ran again")
	}
	if _, err := os.Stat(bins[1].retryOut()); err == nil {
		t.Error("a binary with no failed KVM test named ran again")
	}
	if _, err := os.Stat(bins[2].out); err == nil {
		t.Error("a binary whose package folder is missing ran")
	}
	if read(filepath.Join(job, "done")) != "ok\n" {
		t.Error("no done marker")
	}
	if !strings.Contains(console, "failing") || !strings.Contains(console, "kvmharness-l1: a") {
		t.Errorf("console lacks the tests' output: %q", console)
	}
}

func TestExecJobScript(t *testing.T) {
	if _, err := os.Stat("/proc/uptime"); err != nil {
		t.Skip("no /proc/uptime")
	}
	job, dir := t.TempDir(), t.TempDir()
	console := runScript(t, execJobScript(job, dir, []string{"GREETING=hello there"}, []string{"sh", "-c", `sleep 0.3; echo "$GREETING from $PWD"; exit 7`}))
	if want := "hello there from " + dir + "\n"; console != want {
		t.Errorf("console %q, want %q", console, want)
	}
	rc, err := readExitStatus(filepath.Join(job, "rc"))
	if err != nil || rc != 7 {
		t.Errorf("exit status %d, %v; want 7", rc, err)
	}
	if d, err := l1Duration(filepath.Join(job, "time")); err != nil || d < 0 || d > time.Minute {
		t.Errorf("duration %v, %v", d, err)
	}
	// The heartbeat beat while the command ran (its first beat is at
	// once), so a frozen L1 is kicked and killed as a test job's is.
	if b, err := os.ReadFile(filepath.Join(job, heartbeatFile)); err != nil || len(strings.TrimSpace(string(b))) == 0 {
		t.Errorf("heartbeat %q, %v; want an uptime", b, err)
	}

	job2 := t.TempDir()
	runScript(t, execJobScript(job2, filepath.Join(dir, "nonesuch"), nil, []string{"true"}))
	if rc, err := readExitStatus(filepath.Join(job2, "rc")); err != nil || rc != 97 {
		t.Errorf("missing folder: exit status %d, %v; want 97", rc, err)
	}
}

func TestL1InitScriptParses(t *testing.T) {
	c := l1Config{job: "/tmp/kiln job's", unit: "/tmp/kiln job's/units/0-1", workdir: "/tmp/clone", shared: "/tmp/kiln-test-shared-1"}
	script := l1InitScript(c, []string{"irqbypass", "kvm", "kvm_amd"})
	if out, err := exec.Command("sh", "-n", "-c", script).CombinedOutput(); err != nil {
		t.Fatalf("sh -n: %v\n%s\n%s", err, out, script)
	}
	for _, want := range []string{"for m in irqbypass kvm kvm_amd;", "[ $m = kvm ] && args=tsc_tolerance_ppm=10000", `'/host/tmp/kiln job'\''s'`, "chroot /host /bin/sh '/tmp/kiln job'\\''s/units/0-1/run.sh'",
		"cache=mmap shared '/host/tmp/kiln-test-shared-1'", "poweroff -f"} {
		if !strings.Contains(script, want) {
			t.Errorf("init script lacks %q:\n%s", want, script)
		}
	}
}

func TestQEMUArgs(t *testing.T) {
	c := l1Config{kernel: &guestkernel.Kernel{Image: "/k/vmlinuz"}, memMiB: 4096, cpus: 3, job: "/tmp/a,b"}
	args := strings.Join(qemuArgs(c, "/tmp/a,b/initrd"), " ")
	for _, want := range []string{"-accel tcg,thread=multi -cpu max", "-m 4096 -smp 3", "-kernel /k/vmlinuz", "path=/tmp/a,,b,mount_tag=job", "readonly=on"} {
		if !strings.Contains(args, want) {
			t.Errorf("qemu args lack %q: %s", want, args)
		}
	}
	c.kernel.Vmlinux = "/k/vmlinux"
	if args := strings.Join(qemuArgs(c, "i"), " "); !strings.Contains(args, "-kernel /k/vmlinux") {
		t.Errorf("qemu args do not boot the vmlinux: %s", args)
	}
}

func TestBuildL1Initramfs(t *testing.T) {
	if _, err := os.Stat("/bin/busybox"); err != nil {
		t.Skip("busybox-static not installed")
	}
	dir := t.TempDir()
	dep := "kernel/kvm-amd.ko: kernel/kvm.ko kernel/irqbypass.ko kernel/ccp.ko\nkernel/kvm.ko: kernel/irqbypass.ko\n" +
		"kernel/irqbypass.ko:\nkernel/ccp.ko:\nkernel/virtio_pci.ko: kernel/virtio.ko\nkernel/virtio.ko:\n" +
		"kernel/9pnet_virtio.ko: kernel/9pnet.ko kernel/virtio.ko\nkernel/9pnet.ko:\nkernel/9p.ko: kernel/9pnet.ko\n" +
		"kernel/tun.ko:\n"
	if err := os.MkdirAll(filepath.Join(dir, "kernel"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "modules.dep"), []byte(dep), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, m := range []string{"kvm-amd", "kvm", "irqbypass", "ccp", "virtio_pci", "virtio", "9pnet_virtio", "9pnet", "9p", "tun"} {
		if err := os.WriteFile(filepath.Join(dir, "kernel", m+".ko"), []byte("module "+m), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	k := &guestkernel.Kernel{Version: "test", ModulesDir: dir}
	out := filepath.Join(t.TempDir(), "initrd")
	if err := buildL1Initramfs(l1Config{kernel: k, job: "/tmp/job"}, out); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	recs, err := cpio.ReadAllRecords(cpio.Newc.Reader(bytes.NewReader(data)))
	if err != nil {
		t.Fatal(err)
	}
	files := map[string]string{}
	for _, r := range recs {
		if r.ReaderAt != nil {
			b, _ := io.ReadAll(io.NewSectionReader(r.ReaderAt, 0, int64(r.FileSize)))
			files[r.Name] = string(b)
		}
	}
	if files["mod/kvm_amd.ko"] != "module kvm-amd" || files["mod/tun.ko"] != "module tun" {
		t.Errorf("modules missing or wrong: kvm_amd %q tun %q", files["mod/kvm_amd.ko"], files["mod/tun.ko"])
	}
	if want := "for m in irqbypass kvm ccp kvm_amd virtio virtio_pci 9pnet 9pnet_virtio 9p tun;"; !strings.Contains(files["init"], want) {
		t.Errorf("init lacks %q:\n%s", want, files["init"])
	}
	if !strings.HasPrefix(files["init"], "#!/bin/busybox sh\n") {
		t.Error("init is not a busybox script")
	}
}

func TestRunL1MissingQEMU(t *testing.T) {
	if _, err := os.Stat("/bin/busybox"); err != nil {
		t.Skip("busybox-static not installed")
	}
	dir := t.TempDir()
	for _, m := range []string{"kvm_amd", "virtio_pci", "9pnet_virtio", "9p"} {
		if err := os.WriteFile(filepath.Join(dir, m+".ko"), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "modules.dep"), []byte("kvm_amd.ko:\nvirtio_pci.ko:\n9pnet_virtio.ko:\n9p.ko:\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	err := runL1(context.Background(), l1Config{
		qemu: "/nonexistent/qemu", kernel: &guestkernel.Kernel{ModulesDir: dir, Image: "/k"},
		memMiB: 256, cpus: 1, timeout: time.Minute, job: t.TempDir(), console: io.Discard, log: discardLogger(),
	})
	if err == nil || !strings.Contains(err.Error(), "/nonexistent/qemu") {
		t.Fatalf("runL1 error = %v, want one naming the QEMU binary", err)
	}
}

func discardLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func TestWorkdirShare(t *testing.T) {
	for _, tt := range []struct {
		dir  string
		want bool
	}{
		{"/tmp/ci/main", true}, {"/tmp", true}, {"/var/tmp/x", true}, {"/run/user/0/w", true},
		{"/work/main", false}, {"/tmpfoo/x", false}, {"/", false},
	} {
		if got := coveredByTmpfs(tt.dir); got != tt.want {
			t.Errorf("coveredByTmpfs(%q) = %v, want %v", tt.dir, got, tt.want)
		}
	}
	script := l1InitScript(l1Config{job: "/tmp/job", workdir: "/tmp/clone", shared: "/tmp/shared"}, []string{"kvm"})
	tmpfs := strings.Index(script, "mount -t tmpfs")
	work := strings.Index(script, "ro work '/host/tmp/clone'")
	shared := strings.Index(script, " shared '/host/tmp/shared'")
	if tmpfs < 0 || work < tmpfs || shared < tmpfs {
		t.Errorf("the work or shared folder is not mounted after the tmpfs mounts:\n%s", script)
	}
	if !strings.Contains(script, "chroot /host /bin/sh '/tmp/job/run.sh'") {
		t.Errorf("without a unit folder, L1 does not run the job folder's run.sh:\n%s", script)
	}
	if s := l1InitScript(l1Config{job: "/tmp/job"}, []string{"kvm"}); strings.Contains(s, " work ") || strings.Contains(s, " shared ") {
		t.Errorf("a work or shared mount without a folder:\n%s", s)
	}
	args := strings.Join(qemuArgs(l1Config{kernel: &guestkernel.Kernel{Image: "/k"}, memMiB: 1, cpus: 1, job: "/tmp/j", workdir: "/tmp/clone", shared: "/tmp/s,1"}, "/i"), " ")
	if !strings.Contains(args, "path=/tmp/clone,mount_tag=work,security_model=none,readonly=on") {
		t.Errorf("no read-only work share in %s", args)
	}
	if !strings.Contains(args, "path=/tmp/s,,1,mount_tag=shared,security_model=none,multidevs=remap") {
		t.Errorf("no read-write shared folder in %s", args)
	}
}

func TestCollectL1ResultsRetry(t *testing.T) {
	goBin, err := goTool()
	if err != nil {
		t.Skip(err)
	}
	dir := t.TempDir()
	write := func(name, data string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	first := "=== RUN   TestKVMA\n--- FAIL: TestKVMA (1.00s)\n=== RUN   TestKVMB\n--- PASS: TestKVMB (1.00s)\n=== RUN   TestKVMC\n--- FAIL: TestKVMC (1.00s)\nFAIL\n"
	for _, tc := range []struct {
		name               string
		retry, retryRC     string
		passed, failed     int
		flaky, wantFailing bool
	}{
		{"passes again", "=== RUN   TestKVMA\n--- PASS: TestKVMA (1.00s)\n=== RUN   TestKVMC\n--- PASS: TestKVMC (1.00s)\nPASS\n", "0\n", 3, 0, true, false},
		{"fails again", "=== RUN   TestKVMA\n--- PASS: TestKVMA (1.00s)\n=== RUN   TestKVMC\n--- FAIL: TestKVMC (1.00s)\nFAIL\n", "1\n", 2, 1, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := testBinary{pkg: testPackage{ImportPath: "p"}, out: write("0.out", first), rc: write("0.rc", "1\n")}
			write("0.retry.out", tc.retry)
			write("0.retry.rc", tc.retryRC)
			tl := newTally()
			collectL1Results(context.Background(), goBin, b, tl)
			if tl.kvmPassed != tc.passed || tl.kvmFailed != tc.failed {
				t.Errorf("KVM passed %d failed %d, want %d and %d", tl.kvmPassed, tl.kvmFailed, tc.passed, tc.failed)
			}
			if got := len(tl.flaky) > 0; got != tc.flaky {
				t.Errorf("flaky %v", tl.flaky)
			}
			if got := len(tl.reasons()) > 0; got != tc.wantFailing {
				t.Errorf("reasons %q", tl.reasons())
			}
		})
	}
}

func TestWatchHeartbeat(t *testing.T) {
	p := filepath.Join(t.TempDir(), heartbeatFile)
	stop := make(chan struct{})
	hung := make(chan struct{})
	go watchHeartbeat(p, heartbeatWatch{after: 150 * time.Millisecond, poll: 10 * time.Millisecond, hung: func() { close(hung) }}, stop)
	// A beating heart for a while: no alarm.
	for i := range 20 {
		if err := os.WriteFile(p, []byte(strconv.Itoa(i)), 0o644); err != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond)
		select {
		case <-hung:
			t.Fatal("hung while the heartbeat changed")
		default:
		}
	}
	// Then silence: the alarm goes off.
	select {
	case <-hung:
	case <-time.After(5 * time.Second):
		t.Fatal("no alarm after the heartbeat stopped")
	}
	close(stop)
}

func TestListKVMTests(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "fake.test")
	script := "#!/bin/sh\n[ \"$1 $2\" = \"-test.list ^TestKVM\" ] || exit 3\nprintf 'TestKVMBoot\\nTestKVMSave\\nok  \\n'\n"
	if err := os.WriteFile(bin, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	names, err := listKVMTests(context.Background(), bin, dir)
	if err != nil || strings.Join(names, ",") != "TestKVMBoot,TestKVMSave" {
		t.Fatalf("listKVMTests: %q, %v", names, err)
	}
	if err := os.WriteFile(bin, []byte("#!/bin/sh\necho ok\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := listKVMTests(context.Background(), bin, dir); err == nil {
		t.Fatal("a binary with no KVM test listed passed")
	}
	u := testBinary{pkg: testPackage{ImportPath: "example.com/p"}, test: "TestKVMBoot"}
	if u.runPattern() != "^TestKVMBoot$" || u.name() != "example.com/p TestKVMBoot" {
		t.Fatalf("unit %q %q", u.runPattern(), u.name())
	}
	if script := testJobScript("/j", nil, []testBinary{u}, time.Minute); !strings.Contains(script, "-test.run '^TestKVMBoot$'") {
		t.Fatalf("job script runs no single test:\n%s", script)
	}
}

// A silent heartbeat is kicked halfway to the alarm; one that beats again
// after the kick is reported resumed and raises no alarm.
func TestWatchHeartbeatKick(t *testing.T) {
	p := filepath.Join(t.TempDir(), heartbeatFile)
	if err := os.WriteFile(p, []byte("0"), 0o644); err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	defer close(stop)
	kicked, resumed, hung := make(chan time.Duration, 1), make(chan time.Duration, 1), make(chan struct{})
	go watchHeartbeat(p, heartbeatWatch{after: 400 * time.Millisecond, poll: 10 * time.Millisecond, kickEvery: 200 * time.Millisecond,
		kick: func(d time.Duration) {
			kicked <- d
			os.WriteFile(p, []byte("1"), 0o644) // the kick revives it
		},
		resumed: func(d time.Duration) { resumed <- d },
		hung:    func() { close(hung) }}, stop)
	select {
	case d := <-kicked:
		if d < 200*time.Millisecond {
			t.Errorf("kicked after %v of silence, want at least kickEvery (200ms)", d)
		}
	case <-hung:
		t.Fatal("hung before any kick")
	case <-time.After(5 * time.Second):
		t.Fatal("no kick")
	}
	select {
	case <-resumed:
	case <-hung:
		t.Fatal("hung although the heartbeat resumed after the kick")
	case <-time.After(5 * time.Second):
		t.Fatal("resumed was not reported")
	}
	// Keep beating: still no alarm.
	for i := range 10 {
		os.WriteFile(p, []byte(strconv.Itoa(i+2)), 0o644)
		time.Sleep(20 * time.Millisecond)
	}
	select {
	case <-hung:
		t.Fatal("hung while beating")
	default:
	}
}

func TestKickAndPostMortemKeys(t *testing.T) {
	var b strings.Builder
	kickL1(&b)
	if got, want := b.String(), "\x01b"; got != want {
		t.Errorf("kick wrote %q, want %q", got, want)
	}
	b.Reset()
	postMortem(context.Background(), &b, 0)
	if got := b.String(); !strings.HasPrefix(got, "\x01cinfo registers\n") || !strings.Contains(got, "\x01c\x01bl\x01bw") {
		t.Errorf("post-mortem wrote %q", got)
	}
}
