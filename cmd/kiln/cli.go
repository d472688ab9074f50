package main

// kiln sandbox, kiln template and kiln completion: the CLI of kilnd,
// through package daemon/client. These command trees are cobra's (with
// shell completion); the daemon-less commands (run, fork, boot, ...) keep
// their flag parsing and are listed in the tree so that completion names
// them.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	kilnclient "github.com/kilnvm/kiln/daemon/client"
)

// cobraCommands are the first arguments main hands to the cobra tree
// (__complete and __completeNoDesc are what completion scripts call).
var cobraCommands = map[string]bool{
	"sandbox": true, "template": true, "volume": true, "completion": true,
	"doctor":                  true,
	cobra.ShellCompRequestCmd: true, cobra.ShellCompNoDescRequestCmd: true,
}

// Exit codes of the daemon commands (exec and run exit with the
// command's own code, else 125, 126 or 127 as kiln run does).
const exitFailed = 1

// exitError ends a command with an exit code; its message, if any, has
// been printed.
type exitError struct{ code int }

func (e exitError) Error() string { return fmt.Sprintf("exit %d", e.code) }

// usageError is a bad command line (exit 2).
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

func usagef(format string, args ...any) error { return usageError{fmt.Errorf(format, args...)} }

// cli is one invocation's state: where kilnd is and the connection, made
// on first use.
type cli struct {
	ctx            context.Context
	stdin          io.Reader
	stdout, stderr io.Writer
	host           string
	tokenFile      string
	c              *kilnclient.Client
	// notify, when set, stands in for signal.Notify while a foreground
	// exec forwards kiln's signals; stop stands in for signal.Stop.
	notify func(ch chan<- os.Signal, sigs ...os.Signal) (stop func())
	// interruptWindow is how soon a second signal ends the exec call
	// rather than being forwarded; 0: defaultInterruptWindow.
	interruptWindow time.Duration
}

func (a *cli) client() (*kilnclient.Client, error) {
	if a.c != nil {
		return a.c, nil
	}
	host := a.host
	if host == "" {
		host = os.Getenv("KILN_HOST")
	}
	if host == "" {
		host = kilnclient.DefaultHost
	}
	var opts []kilnclient.Option
	switch {
	case a.tokenFile != "":
		b, err := os.ReadFile(a.tokenFile)
		if err != nil {
			return nil, fmt.Errorf("--token-file: %w", err)
		}
		line, _, _ := strings.Cut(string(b), "\n")
		opts = append(opts, kilnclient.WithToken(strings.TrimSpace(line)))
	case os.Getenv("KILN_TOKEN") != "":
		opts = append(opts, kilnclient.WithToken(os.Getenv("KILN_TOKEN")))
	}
	ctx, cancel := context.WithTimeout(a.ctx, 10*time.Second)
	defer cancel()
	c, err := kilnclient.Dial(ctx, host, opts...)
	if err != nil {
		return nil, err
	}
	a.c = c
	return c, nil
}

// cmdCobra runs the cobra tree on args and returns the exit code.
func cmdCobra(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	a := &cli{ctx: ctx, stdin: stdin, stdout: stdout, stderr: stderr}
	return a.main(args)
}

// main runs the cobra tree on args and returns the exit code.
func (a *cli) main(args []string) int {
	ctx := a.ctx
	defer func() {
		if a.c != nil {
			a.c.Close()
		}
	}()
	root := a.root()
	root.SetArgs(args)
	err := root.ExecuteContext(ctx)
	var ee exitError
	var ue usageError
	switch {
	case err == nil:
		return exitOK
	case errors.As(err, &ee):
		return ee.code
	case errors.As(err, &ue):
		a.printErr(err)
		return exitUsage
	}
	a.printErr(err)
	return exitFailed
}

// printErr prints err on stderr as one line, "kiln: " first once.
func (a *cli) printErr(err error) {
	msg := err.Error()
	if !strings.HasPrefix(msg, "kiln: ") {
		msg = "kiln: " + msg
	}
	fmt.Fprintln(a.stderr, msg)
}

func (a *cli) root() *cobra.Command {
	root := &cobra.Command{
		Use:           "kiln",
		Short:         "Linux microVM sandboxes on KVM",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.SetIn(a.stdin)
	root.SetOut(a.stdout)
	root.SetErr(a.stderr)
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError{err} })
	root.PersistentFlags().StringVar(&a.host, "host", "", "kilnd address: unix:PATH, unix:///PATH or tcp://HOST:PORT (default $KILN_HOST, else "+kilnclient.DefaultHost+")")
	root.PersistentFlags().StringVar(&a.tokenFile, "token-file", "", "`FILE` holding the bearer token a TCP host needs (default $KILN_TOKEN, the token itself)")
	root.AddCommand(a.sandboxCmd(), a.templateCmd(), a.volumeCmd())
	root.AddCommand(a.doctorCmd())
	// The daemon-less commands, so that completion lists them; main runs
	// them before the cobra tree sees them.
	for _, c := range []struct{ name, short string }{
		{"boot", "boot a kernel and stream its serial console"},
		{"run", "run a command in a new sandbox, without kilnd"},
		{"fork", "restore N clones of a snapshot and run a command in each"},
		{"image", "OCI images: pull, import, ls, rm, inspect, convert, gc"},
		{"bench", "Kiln beside QEMU microvm"},
	} {
		root.AddCommand(&cobra.Command{
			Use: c.name, Short: c.short, DisableFlagParsing: true,
			RunE: func(cmd *cobra.Command, args []string) error {
				if code := run(append([]string{c.name}, args...), a.stdin, a.stdout, a.stderr); code != 0 {
					return exitError{code}
				}
				return nil
			},
		})
	}
	return root
}

// args wraps a cobra positional-argument check as a usage error.
func args(check cobra.PositionalArgs) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if err := check(cmd, args); err != nil {
			return usageError{fmt.Errorf("%s: %w", cmd.CommandPath(), err)}
		}
		return nil
	}
}

// keyValues parses repeated K=V flags.
func keyValues(flag string, kvs []string) (map[string]string, error) {
	if len(kvs) == 0 {
		return nil, nil
	}
	m := make(map[string]string, len(kvs))
	for _, kv := range kvs {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return nil, usagef("%s %q: want KEY=VALUE", flag, kv)
		}
		m[k] = v
	}
	return m, nil
}

func checkEnv(env []string) error {
	for _, kv := range env {
		if k, _, ok := strings.Cut(kv, "="); !ok || k == "" {
			return usagef("-e %q: want KEY=VALUE", kv)
		}
	}
	return nil
}

// writeJSON prints msgs as one JSON array, each in protojson with the
// proto file's field names.
func writeJSON[T proto.Message](w io.Writer, msgs []T) error {
	opts := protojson.MarshalOptions{UseProtoNames: true}
	var b strings.Builder
	b.WriteString("[")
	for i, m := range msgs {
		if i > 0 {
			b.WriteString(",")
		}
		j, err := opts.Marshal(m)
		if err != nil {
			return fmt.Errorf("encoding JSON: %w", err)
		}
		b.Write(j)
	}
	b.WriteString("]\n")
	_, err := io.WriteString(w, b.String())
	return err
}

// A command that calls kilnd has one shape, which these helpers give it
// so that the command states only what is its own:
//
//   - cobra checks its positional arguments (args), and its PreRunE reads
//     the rest of the command line, so that a bad one is a usage error
//     (exit 2) before kilnd is dialed;
//   - its RunE is call (or callEach, over IDs): kilnd is dialed and the
//     command makes its call;
//   - the answer is printed: an ID on a line (printID), a listing as a
//     table or with --json (printList), or nothing. A failed call is
//     printed as one line, "kiln: " first, and kiln exits 1 (main).
//
// exec and run (sandboxexec.go) have exit codes of their own and dial
// for themselves.

// call is the RunE of a command that calls kilnd: it dials kilnd and
// runs do, with the command's context and arguments.
func (a *cli) call(do func(ctx context.Context, c *kilnclient.Client, args []string) error) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, args []string) error {
		c, err := a.client()
		if err != nil {
			return err
		}
		return do(cmd.Context(), c, args)
	}
}

// callEach is call for a command over IDs (rm, pause, ...): do runs for
// each in turn; a failure is printed and the rest still run, and the
// command exits 1 after them.
func (a *cli) callEach(do func(ctx context.Context, c *kilnclient.Client, id string) error) func(*cobra.Command, []string) error {
	return a.call(func(ctx context.Context, c *kilnclient.Client, ids []string) error {
		failed := false
		for _, id := range ids {
			if err := do(ctx, c, id); err != nil {
				a.printErr(err)
				failed = true
			}
		}
		if failed {
			return exitError{exitFailed}
		}
		return nil
	})
}

// printID prints the ID of what a call made (a sandbox, a checkpoint, a
// template) on a line of its own, or returns the call's error.
func (a *cli) printID(made interface{ GetId() string }, err error) error {
	if err != nil {
		return err
	}
	fmt.Fprintln(a.stdout, made.GetId())
	return nil
}

// printList prints a listing to w: with --json (asJSON) one JSON array
// (writeJSON); else a table aligned in columns, header over a row of
// each item, both tab-separated.
func printList[T proto.Message](w io.Writer, asJSON bool, items []T, header string, row func(x T, now time.Time) string) error {
	if asJSON {
		return writeJSON(w, items)
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, header)
	now := time.Now()
	for _, x := range items {
		fmt.Fprintln(tw, row(x, now))
	}
	return tw.Flush()
}

// byCreated sorts items oldest first, and returns them.
func byCreated[T interface{ GetCreatedUnixMs() int64 }](items []T) []T {
	sort.Slice(items, func(i, j int) bool { return items[i].GetCreatedUnixMs() < items[j].GetCreatedUnixMs() })
	return items
}

// completeSandboxes offers the live sandboxes' IDs for the first argument.
func (a *cli) completeSandboxes(cmd *cobra.Command, argv []string, _ string) ([]cobra.Completion, cobra.ShellCompDirective) {
	if len(argv) > 0 {
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	c, err := a.client()
	if err != nil {
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	sbs, err := c.ListSandboxes(a.ctx, kilnclient.ListOptions{})
	if err != nil {
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	var out []cobra.Completion
	for _, sb := range sbs {
		out = append(out, cobra.CompletionWithDesc(sb.GetId(), stateName(sb.GetState())+" "+source(sb)))
	}
	return out, cobra.ShellCompDirectiveNoFileComp
}

// completeTemplates offers the templates' names (or IDs, for unnamed ones).
func (a *cli) completeTemplates(cmd *cobra.Command, _ []string, _ string) ([]cobra.Completion, cobra.ShellCompDirective) {
	c, err := a.client()
	if err != nil {
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	ts, err := c.ListTemplates(a.ctx)
	if err != nil {
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	var out []cobra.Completion
	for _, t := range ts {
		name := t.GetName()
		if name == "" {
			name = t.GetId()
		}
		out = append(out, cobra.CompletionWithDesc(name, t.GetImage()))
	}
	return out, cobra.ShellCompDirectiveNoFileComp
}
