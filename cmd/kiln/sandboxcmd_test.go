package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/kilnvm/kiln/daemon"
	kilnclient "github.com/kilnvm/kiln/daemon/client"
	"github.com/kilnvm/kiln/daemon/daemontest"
)

// startKilnd serves package daemon, over the test backend (host folders
// and host processes), on a Unix socket, and points $KILN_HOST at it.
func startKilnd(t *testing.T) string {
	t.Helper()
	srv, err := daemon.New(daemon.Config{StateDir: t.TempDir(), Backend: &daemontest.Backend{},
		HostMemoryMiB: 16384, HostCPUs: 8, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(t.TempDir(), "kilnd.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	srv.Register(gs)
	go gs.Serve(ln)
	host := "unix:" + sock
	t.Setenv("KILN_HOST", host)
	t.Cleanup(func() {
		// Destroy what the test left, so that no stand-in VMM outlives it.
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if c, err := kilnclient.Dial(ctx, host); err == nil {
			sbs, _ := c.ListSandboxes(ctx, kilnclient.ListOptions{})
			for _, sb := range sbs {
				c.DestroySandbox(ctx, sb.GetId())
			}
			c.Close()
		}
		gs.Stop()
		srv.Close(ctx)
	})
	return host
}

// kilnIn runs the CLI in-process with stdin and returns its exit code and
// output.
func kilnIn(t *testing.T, stdin string, args ...string) (int, string, string) {
	t.Helper()
	var stdout, stderr bytes.Buffer
	code := run(args, strings.NewReader(stdin), &stdout, &stderr)
	return code, stdout.String(), stderr.String()
}

// oneID checks that out is exactly one ID on a line of its own.
func oneID(t *testing.T, what, out string) string {
	t.Helper()
	ids := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	if !strings.HasSuffix(out, "\n") || len(ids) != 1 || ids[0] == "" || strings.ContainsAny(ids[0], " \t") {
		t.Fatalf("%s printed %q; want one ID on a line", what, out)
	}
	return ids[0]
}

func TestSandboxCLI(t *testing.T) {
	startKilnd(t)
	code, out, errOut := kilnIn(t, "", "sandbox", "create", "--image", "busybox", "--label", "team=a", "-e", "KILN_FOO=bar", "--cpus", "2", "--mem", "256")
	if code != 0 {
		t.Fatalf("create: exit %d: %s", code, errOut)
	}
	id := oneID(t, "create", out)

	// ls --json: the API's fields, our sandbox among them.
	code, out, errOut = kilnIn(t, "", "sandbox", "ls", "--json")
	if code != 0 {
		t.Fatalf("ls --json: exit %d: %s", code, errOut)
	}
	var list []struct {
		ID        string            `json:"id"`
		State     string            `json:"state"`
		Labels    map[string]string `json:"labels"`
		Resources struct {
			CPUs int `json:"cpus"`
			Mem  int `json:"memory_mib"`
		} `json:"resources"`
	}
	if err := json.Unmarshal([]byte(out), &list); err != nil {
		t.Fatalf("ls --json printed %q: %v", out, err)
	}
	if len(list) != 1 || list[0].ID != id || list[0].Labels["team"] != "a" || list[0].State != "SANDBOX_STATE_RUNNING" ||
		list[0].Resources.CPUs != 2 || list[0].Resources.Mem != 256 {
		t.Fatalf("ls --json: %+v; want %s, running, team=a, 2 CPUs, 256 MiB", list, id)
	}
	if code, out, _ = kilnIn(t, "", "sandbox", "ls"); code != 0 || !strings.Contains(out, id) || !strings.HasPrefix(out, "ID") {
		t.Errorf("ls: exit %d, %q", code, out)
	}
	if code, out, _ = kilnIn(t, "", "sandbox", "ls", "--json", "--label", "team=b"); code != 0 || out != "[]\n" {
		t.Errorf("ls --label team=b: exit %d, %q; want []", code, out)
	}
	code, out, _ = kilnIn(t, "", "sandbox", "inspect", id)
	var one struct {
		ID string `json:"id"`
	}
	if code != 0 || json.Unmarshal([]byte(out), &one) != nil || one.ID != id || !strings.Contains(out, "\n  \"id\": \"") {
		t.Errorf("inspect: exit %d, %q; want indented JSON of %s", code, out, id)
	}

	// exec and run: the command's output and exit code.
	execs := []struct {
		name     string
		stdin    string
		args     []string
		code     int
		out, err string
	}{
		{name: "exit code and env", args: []string{"exec", id, "--", "sh", "-c", "echo $KILN_FOO; exit 3"}, code: 3, out: "bar\n"},
		{name: "flags after the ID", args: []string{"exec", id, "-e", "X=1", "--", "sh", "-c", "echo $X"}, out: "1\n"},
		{name: "no dash", args: []string{"exec", id, "echo", "hi"}, out: "hi\n"},
		{name: "run", args: []string{"run", id, "echo oops >&2; exit 7"}, code: 7, err: "oops\n"},
		{name: "stdin", stdin: "line one\nline two\n", args: []string{"exec", "-i", id, "--", "cat"}, out: "line one\nline two\n"},
		{name: "no stdin without -i", stdin: "ignored", args: []string{"exec", id, "--", "cat"}},
		{name: "signal", args: []string{"run", id, "kill -TERM $$"}, code: 128 + 15},
		{name: "timeout", args: []string{"exec", id, "--timeout", "300ms", "--", "sleep", "30"}, code: 128 + 9, err: "killed after --timeout 300ms\n"},
		{name: "not found", args: []string{"exec", id, "--", "no-such-command-kiln"}, code: 127},
		{name: "bad cwd", args: []string{"exec", id, "-w", "/nonexistent", "--", "true"}, code: 126},
		{name: "unknown sandbox", args: []string{"exec", "sb-nope", "--", "true"}, code: 125},
	}
	for _, tt := range execs {
		t.Run(tt.name, func(t *testing.T) {
			code, out, errOut := kilnIn(t, tt.stdin, append([]string{"sandbox"}, tt.args...)...)
			if code != tt.code {
				t.Errorf("exit %d; want %d (stderr %q)", code, tt.code, errOut)
			}
			if out != tt.out {
				t.Errorf("stdout %q; want %q", out, tt.out)
			}
			if tt.err != "" && !strings.HasSuffix(errOut, tt.err) {
				t.Errorf("stderr %q; want it to end with %q", errOut, tt.err)
			}
		})
	}

	// cp in and out.
	dir := t.TempDir()
	local := filepath.Join(dir, "in.txt")
	data := strings.Repeat("kiln sandbox cp\n", 10000)
	if err := os.WriteFile(local, []byte(data), 0o640); err != nil {
		t.Fatal(err)
	}
	if code, out, errOut := kilnIn(t, "", "sandbox", "cp", "-p", local, id+":/work/in.txt"); code != 0 || out != "" {
		t.Fatalf("cp in: exit %d, %q, %s", code, out, errOut)
	}
	if code, out, errOut := kilnIn(t, "", "sandbox", "cp", id+":/work/in.txt", filepath.Join(dir, "out.txt")); code != 0 || out != "" {
		t.Fatalf("cp out: exit %d, %q, %s", code, out, errOut)
	}
	if b, err := os.ReadFile(filepath.Join(dir, "out.txt")); err != nil || string(b) != data {
		t.Fatalf("copied back %d bytes, %v; want the %d sent", len(b), err, len(data))
	}
	if fi, err := os.Stat(filepath.Join(dir, "out.txt")); err != nil || fi.Mode().Perm() != 0o640 {
		t.Errorf("copied back with mode %v, %v; want 0640", fi.Mode(), err)
	}
	if code, _, _ := kilnIn(t, "", "sandbox", "cp", id+":/work/in.txt", dir); code != 0 {
		t.Errorf("cp into a directory: exit %d", code)
	} else if b, _ := os.ReadFile(filepath.Join(dir, "in.txt")); string(b) != data {
		t.Errorf("cp into a directory wrote %d bytes", len(b))
	}
	if code, out, _ := kilnIn(t, "from stdin", "sandbox", "cp", "-", id+":/work/s.txt"); code != 0 || out != "" {
		t.Errorf("cp - in: exit %d, %q", code, out)
	}
	if code, out, _ := kilnIn(t, "", "sandbox", "cp", id+":/work/s.txt", "-"); code != 0 || out != "from stdin" {
		t.Errorf("cp out to -: exit %d, %q", code, out)
	}
	if code, _, errOut := kilnIn(t, "", "sandbox", "cp", id+":/work/missing", filepath.Join(dir, "m")); code != exitFailed || !strings.Contains(errOut, "NotFound") {
		t.Errorf("cp of a missing file: exit %d, %q", code, errOut)
	}
	if _, err := os.Stat(filepath.Join(dir, "m")); !os.IsNotExist(err) {
		t.Errorf("a failed cp left %s: %v", filepath.Join(dir, "m"), err)
	}

	// Background execs: listed by ps, killed by kill.
	code, out, errOut = kilnIn(t, "", "sandbox", "exec", "-d", id, "--", "sleep", "30")
	if code != 0 {
		t.Fatalf("exec -d: exit %d: %s", code, errOut)
	}
	ex := oneID(t, "exec -d", out)
	code, out, _ = kilnIn(t, "", "sandbox", "ps", "--json", id)
	var ps []struct {
		ID         string `json:"exec_id"`
		Background bool   `json:"background"`
	}
	if code != 0 || json.Unmarshal([]byte(out), &ps) != nil || !slices.ContainsFunc(ps, func(e struct {
		ID         string `json:"exec_id"`
		Background bool   `json:"background"`
	}) bool {
		return e.ID == ex && e.Background
	}) {
		t.Fatalf("ps --json: exit %d, %q; want %s in the background", code, out, ex)
	}
	if code, out, errOut := kilnIn(t, "", "sandbox", "kill", id, ex); code != 0 || out != "" {
		t.Fatalf("kill: exit %d, %q, %s", code, out, errOut)
	}
	for deadline := time.Now().Add(10 * time.Second); ; {
		_, out, _ = kilnIn(t, "", "sandbox", "ps", id)
		if strings.Contains(out, "killed by signal 9") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("ps after kill: %q", out)
		}
		time.Sleep(20 * time.Millisecond)
	}

	// pause and resume.
	if code, _, errOut := kilnIn(t, "", "sandbox", "pause", id); code != 0 {
		t.Fatalf("pause: exit %d: %s", code, errOut)
	}
	if _, out, _ := kilnIn(t, "", "sandbox", "ls", "--state", "paused", "--json"); !strings.Contains(out, id) {
		t.Errorf("ls --state paused: %q; want %s", out, id)
	}
	if code, _, errOut := kilnIn(t, "", "sandbox", "resume", id); code != 0 {
		t.Fatalf("resume: exit %d: %s", code, errOut)
	}

	// checkpoint, rollback, fork: IDs only on stdout.
	code, out, errOut = kilnIn(t, "", "sandbox", "checkpoint", id)
	if code != 0 {
		t.Fatalf("checkpoint: exit %d: %s", code, errOut)
	}
	ck := oneID(t, "checkpoint", out)
	code, out, errOut = kilnIn(t, "", "sandbox", "checkpoints", "--json", id)
	var cks []struct {
		ID        string `json:"id"`
		SandboxID string `json:"sandbox_id"`
	}
	if code != 0 || json.Unmarshal([]byte(out), &cks) != nil || len(cks) != 1 || cks[0].ID != ck || cks[0].SandboxID != id {
		t.Fatalf("checkpoints --json: exit %d, %q, %s", code, out, errOut)
	}
	if code, out, errOut := kilnIn(t, "", "sandbox", "rollback", id, ck); code != 0 || out != "" {
		t.Fatalf("rollback: exit %d, %q, %s", code, out, errOut)
	}
	code, out, errOut = kilnIn(t, "", "sandbox", "fork", id, "-n", "3")
	kids := strings.Fields(out)
	if code != 0 || len(kids) != 3 || strings.Count(out, "\n") != 3 {
		t.Fatalf("fork -n 3: exit %d, %q, %s", code, out, errOut)
	}
	code, out, errOut = kilnIn(t, "", "sandbox", "fork", ck, "-n", "1")
	if code != 0 {
		t.Fatalf("fork of a checkpoint: exit %d, %s", code, errOut)
	}
	kids = append(kids, oneID(t, "fork of a checkpoint", out))
	for _, k := range kids {
		if code, out, _ := kilnIn(t, "", "sandbox", "exec", k, "--", "echo", "child"); code != 0 || out != "child\n" {
			t.Errorf("exec in child %s: exit %d, %q", k, code, out)
		}
	}

	// rm: all of them, then an unknown one.
	if code, out, errOut := kilnIn(t, "", append([]string{"sandbox", "rm", id}, kids...)...); code != 0 || out != "" {
		t.Fatalf("rm: exit %d, %q, %s", code, out, errOut)
	}
	if code, out, _ := kilnIn(t, "", "sandbox", "ls", "--json"); code != 0 || out != "[]\n" {
		t.Errorf("ls after rm: exit %d, %q; want []", code, out)
	}
	if code, _, errOut := kilnIn(t, "", "sandbox", "rm", "sb-nope"); code != exitFailed || !strings.Contains(errOut, "sb-nope") {
		t.Errorf("rm of an unknown sandbox: exit %d, %q", code, errOut)
	}
	if code, out, _ := kilnIn(t, "", "sandbox", "ls", "--all", "--json"); code != 0 || !strings.Contains(out, "SANDBOX_STATE_DESTROYED") {
		t.Errorf("ls --all after rm: exit %d, %q", code, out)
	}
}

// TestSandboxCLIUsage: bad command lines exit 2 with a message, before any
// call to kilnd (none runs here).
func TestSandboxCLIUsage(t *testing.T) {
	t.Setenv("KILN_HOST", "unix:"+filepath.Join(t.TempDir(), "none.sock"))
	tests := []struct {
		args []string
		want string
	}{
		{[]string{"sandbox", "create"}, "exactly one of --image, --template and --checkpoint"},
		{[]string{"sandbox", "create", "--image", "a", "--template", "b"}, "exactly one of"},
		{[]string{"sandbox", "create", "--image", "a", "--idle-timeout", "-1s"}, "negative"},
		{[]string{"sandbox", "create", "--image", "a", "-e", "NOVALUE"}, "KEY=VALUE"},
		{[]string{"sandbox", "create", "--image", "a", "--label", "=x"}, "KEY=VALUE"},
		{[]string{"sandbox", "create", "--image", "a", "--cpus", "-1"}, "invalid argument"},
		{[]string{"sandbox", "create", "--bogus"}, "unknown flag"},
		{[]string{"sandbox", "create", "extra"}, "unknown command"},
		{[]string{"sandbox", "exec", "id"}, "requires at least 2 arg"},
		{[]string{"sandbox", "exec", "id", "x", "--", "true"}, "before --"},
		{[]string{"sandbox", "exec", "id", "--timeout", "-1s", "--", "true"}, "negative"},
		{[]string{"sandbox", "run", "id"}, "accepts 2 arg"},
		{[]string{"sandbox", "cp", "a", "b"}, "exactly one side"},
		{[]string{"sandbox", "cp", "x:/a", "y:/b"}, "exactly one side"},
		{[]string{"sandbox", "fork", "id", "-n", "0"}, "at least one child"},
		{[]string{"sandbox", "ls", "--state", "bogus"}, "--state"},
		{[]string{"sandbox", "rollback", "id"}, "accepts 2 arg"},
		{[]string{"sandbox", "rm"}, "requires at least 1 arg"},
		{[]string{"sandbox", "kill", "id", "ex", "-s", "99"}, "1 to 64"},
		{[]string{"sandbox", "pause"}, "requires at least 1 arg"},
		{[]string{"sandbox", "create", "--image", "a", "--egress", "open"}, "want allow-all, deny-all"},
		{[]string{"sandbox", "create", "--image", "a", "--allow", "10.0.0.0/8", "--deny", "x.test"}, "do not mix"},
		{[]string{"sandbox", "create", "--image", "a", "--egress", "deny-all", "--allow", "x.test"}, "takes no --allow"},
		{[]string{"sandbox", "create", "--image", "a", "--egress", "deny-list", "--allow", "x.test"}, "takes --deny"},
		{[]string{"sandbox", "create", "--image", "a", "--allow", "10.0.0.0/33"}, "not a CIDR"},
		{[]string{"sandbox", "create", "--image", "a", "--secret", "TOKEN=hunter2"}, "shows in ps"},
		{[]string{"sandbox", "create", "--image", "a", "--secret", "KILN_CLI_TEST_UNSET"}, "is not set in this shell"},
		{[]string{"sandbox", "create", "--image", "a", "--secret", "T=@/nonexistent/file"}, "no such file"},
		{[]string{"sandbox", "create", "--image", "a", "--secret-file", "T=/etc/t"}, "NAME=GUESTPATH:HOSTFILE"},
		{[]string{"sandbox", "policy", "id"}, "give --egress, --allow or --deny"},
		{[]string{"template", "create", "name"}, "--image is required"},
		{[]string{"template", "create", "name", "--image", "i", "--setup", "x", "--", "y"}, "not both"},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			code, out, errOut := kilnIn(t, "", tt.args...)
			if code != exitUsage || out != "" || !strings.Contains(errOut, tt.want) {
				t.Errorf("exit %d, stdout %q, stderr %q; want exit %d and %q", code, out, errOut, exitUsage, tt.want)
			}
		})
	}
}

// TestSandboxCLINoDaemon: without kilnd, a listing fails with 1 and exec
// with 125, each naming where it looked.
func TestSandboxCLINoDaemon(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "none.sock")
	t.Setenv("KILN_HOST", "unix:"+sock)
	if code, out, errOut := kilnIn(t, "", "sandbox", "ls"); code != exitFailed || out != "" || !strings.Contains(errOut, sock) {
		t.Errorf("ls: exit %d, %q, %q", code, out, errOut)
	}
	if code, _, errOut := kilnIn(t, "", "sandbox", "exec", "x", "--", "true"); code != exitRunFailed || !strings.Contains(errOut, sock) {
		t.Errorf("exec: exit %d, %q", code, errOut)
	}
	// --host wins over $KILN_HOST.
	other := filepath.Join(t.TempDir(), "other.sock")
	if _, _, errOut := kilnIn(t, "", "sandbox", "ls", "--host", "unix:"+other); !strings.Contains(errOut, other) {
		t.Errorf("ls --host: %q; want it to name %s", errOut, other)
	}
	if code, _, errOut := kilnIn(t, "", "sandbox", "ls", "--host", "nonsense"); code != exitFailed || !strings.Contains(errOut, "nonsense") {
		t.Errorf("ls --host nonsense: exit %d, %q", code, errOut)
	}
}

func TestCompletion(t *testing.T) {
	for _, shell := range []string{"bash", "zsh", "fish"} {
		code, out, errOut := kilnIn(t, "", "completion", shell)
		if code != 0 || !strings.Contains(out, "kiln") || len(out) < 1000 {
			t.Errorf("completion %s: exit %d, %d bytes, %s", shell, code, len(out), errOut)
		}
	}
	// What the scripts call: commands, then live sandbox IDs.
	code, out, _ := kilnIn(t, "", "__complete", "")
	for _, c := range []string{"sandbox", "template", "run", "image", "completion"} {
		if code != 0 || !strings.Contains(out, "\n"+c+"\t") && !strings.HasPrefix(out, c+"\t") {
			t.Errorf("__complete '': exit %d, %q lacks %s", code, out, c)
		}
	}
	startKilnd(t)
	_, out, _ = kilnIn(t, "", "sandbox", "create", "--image", "busybox")
	id := strings.TrimSpace(out)
	code, out, _ = kilnIn(t, "", "__complete", "sandbox", "exec", "")
	if code != 0 || !strings.HasPrefix(out, id+"\t") {
		t.Errorf("__complete sandbox exec '': exit %d, %q; want %s first", code, out, id)
	}
}

func TestRemotePath(t *testing.T) {
	tests := []struct {
		in     string
		id, p  string
		remote bool
	}{
		{"sb-1:/etc/passwd", "sb-1", "/etc/passwd", true},
		{"sb-1:/", "sb-1", "/", true},
		{"sb-1:/a:b", "sb-1", "/a:b", true},
		{"sb-1:relative", "", "", false},
		{":/x", "", "", false},
		{"./sb-1:/x", "", "", false},
		{"/tmp/a:/b", "", "", false},
		{"file.txt", "", "", false},
		{"-", "", "", false},
	}
	for _, tt := range tests {
		id, p, ok := remotePath(tt.in)
		if id != tt.id || p != tt.p || ok != tt.remote {
			t.Errorf("remotePath(%q) = %q, %q, %v; want %q, %q, %v", tt.in, id, p, ok, tt.id, tt.p, tt.remote)
		}
	}
}

func FuzzRemotePath(f *testing.F) {
	for _, s := range []string{"sb-1:/etc/passwd", "a:b", ":/", "/x:/y", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		id, p, ok := remotePath(s)
		if !ok {
			return
		}
		if id == "" || strings.ContainsAny(id, "/:") || !strings.HasPrefix(p, "/") || id+":"+p != s {
			t.Fatalf("remotePath(%q) = %q, %q", s, id, p)
		}
	})
}

func FuzzKeyValues(f *testing.F) {
	for _, s := range []string{"a=b", "=b", "a=", "a", "a=b=c", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		m, err := keyValues("--label", []string{s})
		if err != nil {
			if !strings.Contains(err.Error(), "KEY=VALUE") {
				t.Fatalf("keyValues(%q): %v", s, err)
			}
			return
		}
		for k, v := range m {
			if k == "" || k+"="+v != s {
				t.Fatalf("keyValues(%q) = %v", s, m)
			}
		}
	})
}

// TestSandboxEvents: kiln sandbox events --json prints one event a line.
func TestSandboxEvents(t *testing.T) {
	startKilnd(t)
	pr, pw := io.Pipe()
	done := make(chan int, 1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		var stderr bytes.Buffer
		done <- cmdCobra(ctx, []string{"sandbox", "events", "--json"}, strings.NewReader(""), pw, &stderr)
		pw.Close()
	}()
	lines := make(chan string, 100)
	go func() {
		defer close(lines)
		b := bufio.NewScanner(pr)
		for b.Scan() {
			lines <- b.Text()
		}
	}()
	// The watch may start after a first sandbox: make them until one's
	// creation is reported. Every line must be an event.
	deadline := time.Now().Add(20 * time.Second)
	for {
		_, out, _ := kilnIn(t, "", "sandbox", "create", "--image", "busybox")
		id := strings.TrimSpace(out)
		wait := time.After(200 * time.Millisecond)
	read:
		for {
			select {
			case line := <-lines:
				var ev struct {
					Kind      string `json:"kind"`
					SandboxID string `json:"sandbox_id"`
				}
				if err := json.Unmarshal([]byte(line), &ev); err != nil || ev.SandboxID == "" || !strings.HasPrefix(ev.Kind, "KIND_") {
					t.Fatalf("event line %q (%v)", line, err)
				}
				if ev.SandboxID == id && ev.Kind == "KIND_CREATED" {
					cancel()
					<-done
					return
				}
			case <-wait:
				break read
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("no event printed")
		}
	}
}

// TestTemplateCLI checks the template commands' contracts against
// kilnd: create prints one ID, ls --json parses, rm prints nothing; or,
// while kilnd refuses templates (Unimplemented), each exits 1 with one
// line that names the call and passes the daemon's reason on.
func TestTemplateCLI(t *testing.T) {
	startKilnd(t)
	refused := func(what string, code int, out, errOut string) bool {
		t.Helper()
		if code == 0 {
			return false
		}
		if code != exitFailed || out != "" || strings.Count(errOut, "\n") != 1 || !strings.HasPrefix(errOut, "kiln: ") ||
			!strings.Contains(errOut, "Unimplemented: ") {
			t.Errorf("%s: exit %d, stdout %q, stderr %q", what, code, out, errOut)
		}
		return true
	}
	code, out, errOut := kilnIn(t, "", "template", "create", "py", "--image", "busybox", "--setup", "true")
	if refused("template create", code, out, errOut) {
		code, out, errOut = kilnIn(t, "", "template", "ls", "--json")
		refused("template ls", code, out, errOut)
		return
	}
	tp := oneID(t, "template create", out)
	code, out, errOut = kilnIn(t, "", "template", "ls", "--json")
	var ts []struct {
		ID   string `json:"id"`
		Name string `json:"name"`
	}
	if code != 0 || json.Unmarshal([]byte(out), &ts) != nil || len(ts) != 1 || ts[0].ID != tp || ts[0].Name != "py" {
		t.Fatalf("template ls --json: exit %d, %q, %s", code, out, errOut)
	}
	code, out, errOut = kilnIn(t, "", "sandbox", "create", "--template", "py")
	if code != 0 {
		t.Fatalf("create --template: exit %d: %s", code, errOut)
	}
	sb := oneID(t, "create --template", out)
	if code, out, errOut := kilnIn(t, "", "sandbox", "rm", sb); code != 0 || out != "" {
		t.Fatalf("rm: exit %d, %q, %s", code, out, errOut)
	}
	if code, out, errOut := kilnIn(t, "", "template", "rm", "--wait", "py"); code != 0 || out != "" {
		t.Fatalf("template rm: exit %d, %q, %s", code, out, errOut)
	}
}

// TestSandboxCLISecrets: --secret takes its value from the caller's
// environment (never the command line), the sandbox's execs see it, its
// output shows *** in its place, and inspect names it without the value;
// policy without kilnd networks is refused naming the flag kilnd lacks.
func TestSandboxCLISecrets(t *testing.T) {
	startKilnd(t)
	const value = "kiln-cli-secret-4711"
	t.Setenv("KILN_CLI_TOKEN", value)
	file := filepath.Join(t.TempDir(), "key")
	if err := os.WriteFile(file, []byte("file-secret-0815"), 0o600); err != nil {
		t.Fatal(err)
	}
	code, out, errOut := kilnIn(t, "", "sandbox", "create", "--image", "busybox", "--secret", "KILN_CLI_TOKEN", "--secret", "FROM_FILE=@"+file)
	if code != 0 {
		t.Fatalf("create: exit %d: %s", code, errOut)
	}
	id := oneID(t, "create", out)
	code, out, errOut = kilnIn(t, "", "sandbox", "run", id, `echo "token=$KILN_CLI_TOKEN file=$FROM_FILE"`)
	if code != 0 || out != "token=*** file=***\n" {
		t.Errorf("run: exit %d, stdout %q, stderr %q; want the secrets masked", code, out, errOut)
	}
	code, out, _ = kilnIn(t, "", "sandbox", "inspect", id)
	if code != 0 || strings.Contains(out, value) || !strings.Contains(out, "KILN_CLI_TOKEN") {
		t.Errorf("inspect: exit %d: %s; want the secret's name, not its value", code, out)
	}
	code, _, errOut = kilnIn(t, "", "sandbox", "policy", id, "--egress", "deny-all")
	if code == 0 || !strings.Contains(errOut, "--net-pool") {
		t.Errorf("policy without kilnd networks: exit %d, %q; want a refusal naming --net-pool", code, errOut)
	}
}
