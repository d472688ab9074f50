package agent

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/accounts"
)

// The trampoline contract. The agent starts every Exec process as
//
//	/proc/self/exe  argv: TrampolineArg0 trampolineTag UID GID GROUPS PATH ARGV...
//
// with the process's stdin, stdout and stderr on fds 0-2 and the write end
// of a report pipe on fd 3 (UID and GID are decimal, or "-" to keep the
// agent's; GROUPS the supplementary gids, decimal and comma-separated,
// "" for none, or "-" for none when UID or GID is set, else the agent's).
// The trampoline marks fd 3 close-on-exec, sets its
// oom_score_adj back to 0, switches credentials if asked and execs PATH
// with ARGV and its own environment. If anything fails it writes
// "<errno> <message>" to fd 3 and exits with trampolineExitCode; if the
// exec succeeds, fd 3 closes without a byte.
const (
	// TrampolineArg0 is the argv[0] the agent gives its trampoline.
	TrampolineArg0 = "kiln-agent-exec"
	// trampolineTag guards against running the trampoline by accident
	// (and versions the argv layout).
	trampolineTag      = "kiln-trampoline-v2"
	trampolineReportFD = 3
	trampolineExitCode = 127
	// trampolineFixedArgs counts the arguments before ARGV.
	trampolineFixedArgs = 6
)

// MaybeRunTrampoline turns the process into the exec trampoline if it was
// started as one, and otherwise returns at once. The agent's main must call
// it first, before any other work (flag parsing, logging, mounts): when it
// is the trampoline it never returns, it execs the target or exits 127.
//
// Unit tests that run a Server must call it first in TestMain, since the
// trampoline re-executes the test binary.
func MaybeRunTrampoline() {
	if !isTrampoline(os.Args) {
		return
	}
	os.Exit(runTrampoline(os.Args[2:]))
}

func isTrampoline(args []string) bool {
	return len(args) > trampolineFixedArgs && args[0] == TrampolineArg0 && args[1] == trampolineTag
}

// trampolineArgv returns the trampoline's argv for running path with argv;
// groups nil keeps the default (see the contract above).
func trampolineArgv(path string, argv []string, uid, gid *uint32, groups []uint32) []string {
	id := func(p *uint32) string {
		if p == nil {
			return "-"
		}
		return strconv.FormatUint(uint64(*p), 10)
	}
	gs := "-"
	if groups != nil {
		parts := make([]string, len(groups))
		for i, g := range groups {
			parts[i] = strconv.FormatUint(uint64(g), 10)
		}
		gs = strings.Join(parts, ",")
	}
	out := make([]string, 0, trampolineFixedArgs+len(argv))
	out = append(out, TrampolineArg0, trampolineTag, id(uid), id(gid), gs, path)
	return append(out, argv...)
}

// parseGroupsArg parses the trampoline's GROUPS argument (not "-").
func parseGroupsArg(s string) ([]int, error) {
	if s == "" {
		return []int{}, nil
	}
	parts := strings.Split(s, ",")
	if len(parts) > accounts.MaxGroups {
		return nil, fmt.Errorf("%d groups, at most %d", len(parts), accounts.MaxGroups)
	}
	out := make([]int, len(parts))
	for i, p := range parts {
		g, err := strconv.ParseUint(p, 10, 32)
		if err != nil {
			return nil, fmt.Errorf("group %q is not a gid", p)
		}
		out[i] = int(g)
	}
	return out, nil
}

// runTrampoline runs the trampoline on args (UID GID GROUPS PATH ARGV...); it
// returns only on failure, with the exit code.
func runTrampoline(args []string) int {
	unix.CloseOnExec(trampolineReportFD)
	report := os.NewFile(trampolineReportFD, "kiln-exec-report")
	fail := func(err error, format string, a ...any) int {
		errno := errnoOf(err)
		text := err.Error()
		if errno != 0 {
			text = errno.Error()
		}
		fmt.Fprintf(report, "%d %s: %s", int(errno), fmt.Sprintf(format, a...), text)
		return trampolineExitCode
	}
	uidArg, gidArg, groupsArg, path, argv := args[0], args[1], args[2], args[3], args[4:]

	// The agent runs with oom_score_adj -1000, which children inherit; a
	// sandboxed process must be killable. Without /proc there is nothing
	// to undo (nor was anything set).
	if f, err := os.OpenFile("/proc/self/oom_score_adj", os.O_WRONLY, 0); err == nil {
		_, err = f.WriteString("0\n")
		f.Close()
		if err != nil {
			return fail(err, "resetting oom_score_adj")
		}
	} else if !os.IsNotExist(err) {
		return fail(err, "opening /proc/self/oom_score_adj")
	}

	if groupsArg != "-" {
		groups, err := parseGroupsArg(groupsArg)
		if err != nil {
			return fail(syscall.EINVAL, "supplementary groups: %v", err)
		}
		if err := syscall.Setgroups(groups); err != nil {
			return fail(err, "setting supplementary groups")
		}
	} else if uidArg != "-" || gidArg != "-" {
		if err := syscall.Setgroups(nil); err != nil {
			return fail(err, "dropping supplementary groups")
		}
	}
	if gidArg != "-" {
		gid, err := strconv.ParseUint(gidArg, 10, 32)
		if err != nil {
			return fail(syscall.EINVAL, "gid %q", gidArg)
		}
		if err := syscall.Setgid(int(gid)); err != nil {
			return fail(err, "setgid %d", gid)
		}
	}
	if uidArg != "-" {
		uid, err := strconv.ParseUint(uidArg, 10, 32)
		if err != nil {
			return fail(syscall.EINVAL, "uid %q", uidArg)
		}
		if err := syscall.Setuid(int(uid)); err != nil {
			return fail(err, "setuid %d", uid)
		}
	}
	err := syscall.Exec(path, argv, os.Environ())
	return fail(err, "exec %s", path)
}

// parseTrampolineReport parses what a failed trampoline wrote:
// "<errno> <message>". A report that does not start with a number is
// returned whole as the message, with errno 0.
func parseTrampolineReport(b []byte) (syscall.Errno, string) {
	s := string(b)
	for i := 0; i < len(s); i++ {
		if s[i] == ' ' {
			n, err := strconv.ParseUint(s[:i], 10, 16)
			if err != nil {
				break
			}
			return syscall.Errno(n), s[i+1:]
		}
	}
	return 0, s
}
