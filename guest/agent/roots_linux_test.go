package agent_test

import (
	"bytes"
	"debug/elf"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

	"github.com/kilnvm/kiln/guest/agent"
	"github.com/kilnvm/kiln/guest/client"
)

func TestRootNames(t *testing.T) {
	for _, tc := range []struct {
		name string
		ok   bool
	}{
		{"web", true},
		{"0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef", true},
		{"a.b_c-d", true},
		{"", false},
		{".", false},
		{"..", false},
		{"a/b", false},
		{"a b", false},
		{"a,aname=x", false},
		{strings.Repeat("a", 129), false},
	} {
		if err := agent.CheckRootName(tc.name); (err == nil) != tc.ok {
			t.Errorf("CheckRootName(%q) = %v, want ok %v", tc.name, err, tc.ok)
		}
	}
}

func TestIsZombieStat(t *testing.T) {
	for _, tc := range []struct {
		stat string
		want bool
	}{
		{"12 (sleep) S 1 12 12 0", false},
		{"12 (a) Z) Z 1 12", true}, // the command may hold ") "
		{"12 (x) X 1", true},
		{"12 (x)", false},
		{"", false},
	} {
		if got := agent.IsZombieStat([]byte(tc.stat)); got != tc.want {
			t.Errorf("IsZombieStat(%q) = %v, want %v", tc.stat, got, tc.want)
		}
	}
}

// TestExecInRoot: a process Exec starts in a container root runs chrooted
// in a mount namespace of its own, with its executable, working
// directory and user resolved in the root (an absolute symbolic link
// included), and the rest of the guest out of its sight.
func TestExecInRoot(t *testing.T) {
	busybox, err := os.ReadFile("/usr/bin/busybox")
	if err != nil {
		t.Skip("no /usr/bin/busybox to make a root of")
	}
	base := t.TempDir()
	root := filepath.Join(base, "root")
	for _, d := range []string{"", "bin", "proc", "etc", "work"} {
		if err := os.Mkdir(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(root, "bin", "busybox"), busybox, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/bin/busybox", filepath.Join(root, "bin", "sh")); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(root, "etc", "passwd"), []byte("root:x:0:0::/root:/bin/sh\napp:x:1234:1234::/work:/bin/sh\n"), 0o644)
	os.WriteFile(filepath.Join(root, "etc", "group"), []byte("root:x:0:\n"), 0o644)
	os.WriteFile(filepath.Join(root, "work", "marker"), []byte("in the root\n"), 0o644)
	// The trampoline is /proc/self/exe, found through the root's /proc: a
	// test binary built with cgo needs its loader and libraries there
	// (the guest's agent is static).
	copyLibraries(t, root)
	if err := unix.Mount("proc", filepath.Join(root, "proc"), "proc", 0, ""); err != nil {
		t.Skipf("cannot mount proc in a test root: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(filepath.Join(root, "proc"), unix.MNT_DETACH) })

	a := startAgent(t, agent.Config{})
	a.srv.AddTestRoot("c1", base)
	ctx := testContext(t, 30*time.Second)
	var out, errb bytes.Buffer
	st, err := a.Exec(ctx, client.ExecOptions{
		Argv: []string{"sh", "-c", "cat marker; id -u; pwd; test -e /var && echo host-visible; exit 0"},
		Env:  []string{"PATH=/bin"}, Dir: "/work", User: "app", Root: "c1",
		Stdout: &out, Stderr: &errb,
	})
	if err != nil || st.Code != 0 {
		t.Fatalf("Run in root = %+v, %v (stderr %q)", st, err, errb.String())
	}
	want := "in the root\n1234\n/work\n"
	if out.String() != want {
		t.Errorf("output %q, want %q", out.String(), want)
	}

	// What is not in the root is not found, even if the guest has it.
	_, err = a.Exec(ctx, client.ExecOptions{Argv: []string{"busybox-not-here"}, Env: []string{"PATH=/bin:/usr/bin"}, Root: "c1"})
	wantCode(t, err, codes.NotFound, "busybox-not-here")
	_, err = a.Exec(ctx, client.ExecOptions{Argv: []string{"sh"}, Env: []string{"PATH=/bin"}, Dir: "/nowhere", Root: "c1"})
	wantCode(t, err, codes.InvalidArgument, "/nowhere")
	_, err = a.Exec(ctx, client.ExecOptions{Argv: []string{"sh"}, Root: "c2"})
	wantCode(t, err, codes.NotFound, "c2")
	_, err = a.Exec(ctx, client.ExecOptions{Argv: []string{"sh"}, Root: "../c1"})
	wantCode(t, err, codes.InvalidArgument)

	// UnmountRoot kills what runs in it, a process that left its group too.
	p, err := a.Start(ctx, client.ExecOptions{Argv: []string{"sh", "-c", "setsid sleep 600 & sleep 600"}, Env: []string{"PATH=/bin"}, Root: "c1"})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	// (Before UnmountRoot removes the folder: a real root's proc goes
	// with its overlay.)
	if err := unix.Unmount(filepath.Join(root, "proc"), unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	if err := a.UnmountRoot(ctx, "c1"); err != nil {
		t.Fatalf("UnmountRoot: %v", err)
	}
	if _, err := os.Stat(base); !os.IsNotExist(err) {
		t.Errorf("the root's folder after UnmountRoot: %v", err)
	}
	if st, err := p.Wait(); err != nil || st.Signal != 9 {
		t.Errorf("the root's process after UnmountRoot: %+v, %v; want killed", st, err)
	}
	if err := a.UnmountRoot(ctx, "c1"); err == nil {
		t.Error("a second UnmountRoot succeeded")
	}
}

// copyLibraries copies the dynamic loader and libraries of this test
// binary, if it has any, into root at their paths.
func copyLibraries(t *testing.T, root string) {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	f, err := elf.Open(exe)
	if err != nil {
		t.Fatal(err)
	}
	dynamic := false
	for _, p := range f.Progs {
		dynamic = dynamic || p.Type == elf.PT_INTERP
	}
	f.Close()
	if !dynamic {
		return
	}
	out, err := exec.Command("ldd", exe).Output()
	if err != nil {
		t.Fatalf("ldd %s: %v", exe, err)
	}
	for _, line := range strings.Split(string(out), "\n") {
		for _, field := range strings.Fields(line) {
			if !strings.HasPrefix(field, "/") {
				continue
			}
			b, err := os.ReadFile(field)
			if err != nil {
				t.Fatal(err)
			}
			dst := filepath.Join(root, field)
			if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(dst, b, 0o755); err != nil {
				t.Fatal(err)
			}
		}
	}
}
