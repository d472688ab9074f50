package modprobe

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
)

// Name is the base name of argv[0] that makes the agent binary modprobe.
const Name = "modprobe"

// IsInvokedAs reports whether a program started with args (os.Args) was
// invoked as modprobe: its argv[0]'s base name is Name (the kernel runs
// its helper with argv[0] the helper's path).
func IsInvokedAs(args []string) bool {
	return len(args) > 0 && filepath.Base(args[0]) == Name
}

// Usage is the command line Main takes.
const Usage = `usage: modprobe [-q] [-b] [-v] [-n] [-D] [-a] [--] NAME [NAME...] [PARAM=VALUE...]
  -q, --quiet          say nothing on failure (the exit status says it)
  -b, --use-blacklist  accepted; there is no blacklist (no /etc/modprobe.d)
  -v, --verbose        print each module loaded, log what is skipped
  -n, --dry-run        resolve, load nothing
  -D, --show-depends   print what would be loaded (insmod PATH, builtin NAME), load nothing
  -a, --all            accepted: every NAME is loaded
NAME is a module or an alias (modules.alias); PARAM=VALUE arguments are
parameters of the one NAME given. Kiln's modprobe: it reads
/lib/modules/$(uname -r), else /run/kiln/modules, and loads only.
`

// options are Main's parsed arguments.
type options struct {
	quiet, verbose, dryRun, show bool
	names                        []string
	params                       []string
}

// parseArgs parses modprobe's arguments: options anywhere before "--",
// short ones combinable (-qb); after them names, and PARAM=VALUE
// parameters (an argument with '=').
func parseArgs(args []string) (options, error) {
	var o options
	dashdash := false
	for _, a := range args {
		switch {
		case dashdash || a == "-" || !strings.HasPrefix(a, "-"):
			if strings.Contains(a, "=") {
				o.params = append(o.params, a)
			} else {
				o.names = append(o.names, a)
			}
		case a == "--":
			dashdash = true
		case strings.HasPrefix(a, "--"):
			switch a {
			case "--quiet":
				o.quiet = true
			case "--use-blacklist", "--all":
			case "--verbose":
				o.verbose = true
			case "--dry-run":
				o.dryRun = true
			case "--show-depends":
				o.show = true
			default:
				return o, fmt.Errorf("unknown option %s", a)
			}
		default:
			for _, c := range a[1:] {
				switch c {
				case 'q':
					o.quiet = true
				case 'b', 'a':
				case 'v':
					o.verbose = true
				case 'n':
					o.dryRun = true
				case 'D':
					o.show = true
				default:
					return o, fmt.Errorf("unknown option -%c", c)
				}
			}
		}
	}
	switch {
	case len(o.names) == 0:
		return o, errors.New("no module named")
	case len(o.params) > 0 && len(o.names) > 1:
		return o, fmt.Errorf("parameters %s with %d modules: give parameters with one", strings.Join(o.params, " "), len(o.names))
	}
	return o, nil
}

// Main is the modprobe command of the running kernel: its tree is
// ModulesRoot/<release>, its modules SysModule. It returns the exit
// status.
func Main(args []string, stdout, stderr io.Writer) int {
	rel, err := Release()
	if err != nil {
		fmt.Fprintf(stderr, "modprobe: %v\n", err)
		return 1
	}
	m := &Modprobe{Dir: TreeDir(rel), SysModule: SysModule, Kernel: Linux()}
	return m.Main(args, stdout, stderr)
}

// TreeDir returns the modules tree of the kernel release: ModulesRoot/
// release when it has a modules.dep, else RunModulesDir when that has
// one (the modules disk of a read-only root without /lib/modules), else
// ModulesRoot/release (which then fails, saying it has no modules.dep).
func TreeDir(release string) string {
	return firstTree(filepath.Join(ModulesRoot, release), RunModulesDir)
}

// firstTree returns the first of dirs with a modules.dep file, else the
// first.
func firstTree(dirs ...string) string {
	for _, d := range dirs {
		if fi, err := os.Stat(filepath.Join(d, depFile)); err == nil && fi.Mode().IsRegular() {
			return d
		}
	}
	return dirs[0]
}

// Main runs modprobe's command line args with m's tree and kernel: 0 when
// every name was loaded (or was loaded already, or is built in), 1 when
// one was not or the arguments are wrong, said on stderr unless -q.
func (m *Modprobe) Main(args []string, stdout, stderr io.Writer) int {
	o, err := parseArgs(args)
	if err != nil {
		fmt.Fprintf(stderr, "modprobe: %v\n%s", err, Usage)
		return 1
	}
	if o.verbose {
		m.Log = slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	} else if m.Log == nil {
		m.Log = slog.New(slog.DiscardHandler)
	}
	m.DryRun = o.dryRun || o.show
	if o.show || o.verbose {
		m.Report = func(line string) { fmt.Fprintln(stdout, line) }
	}
	status := 0
	for _, name := range o.names {
		if err := m.Load(name, strings.Join(o.params, " ")); err != nil {
			status = 1
			if !o.quiet {
				fmt.Fprintf(stderr, "modprobe: %v\n", err)
			}
		}
	}
	return status
}
