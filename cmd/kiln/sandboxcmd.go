package main

// kiln sandbox, kiln template and kiln completion: the CLI of kilnd,
// through package daemon/client. These command trees are cobra's (with
// shell completion); the daemon-less commands (run, fork, boot, ...) keep
// their flag parsing and are listed in the tree so that completion names
// them.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sort"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	kilnclient "github.com/kilnvm/kiln/daemon/client"
	"github.com/kilnvm/kiln/daemon/kilnpb"
	"github.com/kilnvm/kiln/sandbox"
)

// cobraCommands are the first arguments main hands to the cobra tree
// (__complete and __completeNoDesc are what completion scripts call).
var cobraCommands = map[string]bool{
	"sandbox": true, "template": true, "completion": true,
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
	root.AddCommand(a.sandboxCmd(), a.templateCmd())
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

func (a *cli) sandboxCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:     "sandbox",
		Aliases: []string{"sb"},
		Short:   "sandboxes run by kilnd: create, ls, exec, run, cp, mv, checkpoint, rollback, fork, rm, ...",
	}
	cmd.AddCommand(a.createCmd(), a.lsCmd(), a.inspectCmd(), a.execCmd(), a.runCmd(), a.cpCmd(), a.mvCmd(),
		a.psCmd(), a.killCmd(), a.pauseCmd(true), a.pauseCmd(false), a.eventsCmd(),
		a.checkpointCmd(), a.checkpointsCmd(), a.rollbackCmd(), a.forkCmd(), a.rmCmd(), a.policyCmd())
	cmd.AddCommand(a.updateCmd())
	return cmd
}

func (a *cli) createCmd() *cobra.Command {
	var (
		image, template, checkpoint, requestID string
		initFlag                               string
		cpus, mem, disk                        uint32
		lifetime, idle                         time.Duration
		env, labels                            []string
		egress                                 egressFlags
		secrets                                secretFlags
	)
	cmd := &cobra.Command{
		Use:   "create (--image REF | --template T | --checkpoint C) [flags]",
		Short: "start a sandbox and print its ID",
		Args:  args(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := refuseZero(cmd, "cpus", "mem"); err != nil {
				return err
			}
			req := &kilnpb.CreateSandboxRequest{Init: initFlag,
				Resources:     &kilnpb.Resources{Cpus: cpus, MemoryMib: mem, DiskMib: disk},
				Env:           env,
				LifetimeMs:    lifetime.Milliseconds(),
				IdleTimeoutMs: idle.Milliseconds(),
				RequestId:     requestID,
			}
			n := 0
			if image != "" {
				req.Source, n = &kilnpb.CreateSandboxRequest_Image{Image: image}, n+1
			}
			if template != "" {
				req.Source, n = &kilnpb.CreateSandboxRequest_Template{Template: template}, n+1
			}
			if checkpoint != "" {
				req.Source, n = &kilnpb.CreateSandboxRequest_Checkpoint{Checkpoint: checkpoint}, n+1
			}
			if n != 1 {
				return usagef("sandbox create: give exactly one of --image, --template and --checkpoint")
			}
			if lifetime < 0 {
				req.LifetimeMs = -1
			}
			if idle < 0 {
				return usagef("sandbox create: --idle-timeout %v is negative (0 means none)", idle)
			}
			if err := checkEnv(env); err != nil {
				return err
			}
			var err error
			if req.Labels, err = keyValues("--label", labels); err != nil {
				return err
			}
			if req.Egress, err = egress.policy(); err != nil {
				return err
			}
			if req.Secrets, err = secrets.secrets(); err != nil {
				return err
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			sb, err := c.CreateSandbox(cmd.Context(), req)
			if err != nil {
				return err
			}
			fmt.Fprintln(a.stdout, sb.GetId())
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&image, "image", "", "image `REF` to boot (pulled when missing)")
	f.StringVar(&template, "template", "", "template `ID` or name to restore")
	f.StringVar(&checkpoint, "checkpoint", "", "checkpoint `ID` to restore")
	f.StringVar(&initFlag, "init", "", "with --image, process 1: agent (default) or systemd (the image's /sbin/init, the agent a service)")
	f.Uint32Var(&cpus, "cpus", 0, fmt.Sprintf("vCPUs (default: the daemon's, %d)", sandbox.DefaultCPUs))
	f.Uint32Var(&mem, "mem", 0, fmt.Sprintf("guest memory in `MiB` (default: the daemon's, %d)", sandbox.DefaultMemoryMiB))
	f.Uint32Var(&disk, "disk", 0, "writable layer cap in `MiB` (default: half the memory)")
	f.DurationVar(&lifetime, "timeout", 0, "destroy the sandbox this long after it starts (0: the daemon's default; negative: never)")
	f.DurationVar(&idle, "idle-timeout", 0, "destroy it after this long without an exec or file call (0: never)")
	f.StringArrayVarP(&env, "env", "e", nil, "`K=V` added to every exec's environment (repeatable)")
	f.StringArrayVar(&labels, "label", nil, "`k=v` label (repeatable)")
	f.StringVar(&requestID, "request-id", "", "client-chosen `ID` that makes a retry return the same sandbox")
	egress.register(f)
	secrets.register(f)
	cmd.RegisterFlagCompletionFunc("template", a.completeTemplates)
	return cmd
}

// states maps --state names to the API's.
var states = map[string]kilnpb.SandboxState{
	"starting":  kilnpb.SandboxState_SANDBOX_STATE_STARTING,
	"running":   kilnpb.SandboxState_SANDBOX_STATE_RUNNING,
	"paused":    kilnpb.SandboxState_SANDBOX_STATE_PAUSED,
	"destroyed": kilnpb.SandboxState_SANDBOX_STATE_DESTROYED,
	"failed":    kilnpb.SandboxState_SANDBOX_STATE_FAILED,
	"timed-out": kilnpb.SandboxState_SANDBOX_STATE_TIMED_OUT,
	"stopped":   kilnpb.SandboxState_SANDBOX_STATE_STOPPED,
}

func stateName(s kilnpb.SandboxState) string {
	for k, v := range states {
		if v == s {
			return k
		}
	}
	return strings.ToLower(s.String())
}

func (a *cli) lsCmd() *cobra.Command {
	var (
		asJSON, all bool
		labels      []string
		stateNames  []string
	)
	cmd := &cobra.Command{
		Use:     "ls [flags]",
		Aliases: []string{"list"},
		Short:   "list sandboxes (the live ones unless --all or --state)",
		Args:    args(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			opts := kilnclient.ListOptions{}
			var err error
			if opts.Labels, err = keyValues("--label", labels); err != nil {
				return err
			}
			for _, n := range stateNames {
				s, ok := states[n]
				if !ok {
					return usagef("--state %q: want one of starting, running, paused, destroyed, failed, timed-out", n)
				}
				opts.States = append(opts.States, s)
			}
			if all {
				opts.States = nil
				for _, s := range states {
					opts.States = append(opts.States, s)
				}
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			sbs, err := c.ListSandboxes(cmd.Context(), opts)
			if err != nil {
				return err
			}
			sort.Slice(sbs, func(i, j int) bool { return sbs[i].GetCreatedUnixMs() < sbs[j].GetCreatedUnixMs() })
			if asJSON {
				return writeJSON(a.stdout, sbs)
			}
			tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "ID\tSTATE\tFROM\tCPUS\tMEM\tAGE\tLABELS")
			now := time.Now()
			for _, sb := range sbs {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\t%s\t%s\n", sb.GetId(), stateName(sb.GetState()), source(sb),
					sb.GetResources().GetCpus(), sb.GetResources().GetMemoryMib(),
					age(now, sb.GetCreatedUnixMs()), joinLabels(sb.GetLabels()))
			}
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print a JSON array of sandboxes (the API's field names)")
	cmd.Flags().BoolVarP(&all, "all", "a", false, "ended sandboxes too")
	cmd.Flags().StringArrayVar(&labels, "label", nil, "only sandboxes with this `k=v` label (repeatable)")
	cmd.Flags().StringArrayVar(&stateNames, "state", nil, "only sandboxes in this `STATE` (repeatable)")
	return cmd
}

func source(sb *kilnpb.Sandbox) string {
	switch {
	case sb.GetTemplate() != "":
		return "template " + sb.GetTemplate()
	case sb.GetCheckpoint() != "":
		return "checkpoint " + sb.GetCheckpoint()
	case sb.GetImage() != "":
		return "image " + sb.GetImage()
	}
	return "-"
}

func age(now time.Time, unixMs int64) string {
	if unixMs == 0 {
		return "-"
	}
	d := now.Sub(time.UnixMilli(unixMs))
	switch {
	case d < time.Minute:
		return d.Round(time.Second).String()
	case d < time.Hour:
		return d.Round(time.Minute).String()
	}
	return d.Round(time.Hour).String()
}

func joinLabels(m map[string]string) string {
	if len(m) == 0 {
		return "-"
	}
	kv := make([]string, 0, len(m))
	for k, v := range m {
		kv = append(kv, k+"="+v)
	}
	sort.Strings(kv)
	return strings.Join(kv, ",")
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

func (a *cli) inspectCmd() *cobra.Command {
	return &cobra.Command{
		Use:               "inspect ID",
		Short:             "print one sandbox as JSON",
		Args:              args(cobra.ExactArgs(1)),
		ValidArgsFunction: a.completeSandboxes,
		RunE: func(cmd *cobra.Command, ids []string) error {
			c, err := a.client()
			if err != nil {
				return err
			}
			sb, err := c.GetSandbox(cmd.Context(), ids[0])
			if err != nil {
				return err
			}
			j, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(sb)
			if err != nil {
				return err
			}
			// protojson varies its spacing on purpose; settle it.
			var b bytes.Buffer
			if err := json.Indent(&b, j, "", "  "); err != nil {
				return err
			}
			b.WriteByte('\n')
			_, err = a.stdout.Write(b.Bytes())
			return err
		},
	}
}

// execFlags are exec's and run's.
type execFlags struct {
	interactive bool
	timeout     time.Duration
	env         []string
	cwd         string
	background  bool
	tty         bool
	user        string
}

func (e *execFlags) add(cmd *cobra.Command) {
	f := cmd.Flags()
	f.BoolVarP(&e.interactive, "interactive", "i", false, "pass kiln's stdin to the command")
	f.BoolVarP(&e.tty, "tty", "t", false, "run the command on a terminal of this terminal's size (kiln's own in raw mode until it ends; implies -i)")
	f.StringVarP(&e.user, "user", "u", "", "run as this `USER` of the sandbox's /etc/passwd")
	f.DurationVar(&e.timeout, "timeout", 0, "kill the command after this long (0: never)")
	f.StringArrayVarP(&e.env, "env", "e", nil, "`K=V` for the command's environment (repeatable)")
	f.StringVarP(&e.cwd, "workdir", "w", "", "working `DIR` in the sandbox")
	f.BoolVarP(&e.background, "detach", "d", false, "leave the command running in the background and print its exec ID")
}

func (a *cli) execCmd() *cobra.Command {
	var ef execFlags
	cmd := &cobra.Command{
		Use:               "exec ID [-i] [-t] [--timeout TIMEOUT] -- CMD [ARG...]",
		Short:             "run a command in a sandbox; kiln exits with its exit code",
		Long:              "Run a command in a sandbox; kiln exits with its exit code (128+N after signal N).\n\n" + signalsHelp,
		Args:              args(cobra.MinimumNArgs(2)),
		ValidArgsFunction: a.completeSandboxes,
		RunE: func(cmd *cobra.Command, argv []string) error {
			if d := cmd.ArgsLenAtDash(); d > 1 {
				return usagef("sandbox exec: want ID -- CMD [ARG...], got %d arguments before --", d)
			}
			return a.exec(cmd.Context(), argv[0], argv[1:], ef)
		},
	}
	ef.add(cmd)
	return cmd
}

func (a *cli) runCmd() *cobra.Command {
	var ef execFlags
	cmd := &cobra.Command{
		Use:               "run ID 'SHELL COMMAND'",
		Short:             "run a shell command (sh -c) in a sandbox; kiln exits with its exit code",
		Long:              "Run a shell command (sh -c) in a sandbox; kiln exits with its exit code (128+N after signal N).\n\n" + signalsHelp,
		Args:              args(cobra.ExactArgs(2)),
		ValidArgsFunction: a.completeSandboxes,
		RunE: func(cmd *cobra.Command, argv []string) error {
			return a.exec(cmd.Context(), argv[0], []string{"/bin/sh", "-c", argv[1]}, ef)
		},
	}
	ef.add(cmd)
	return cmd
}

// exec runs argv in a sandbox and ends kiln with its exit code: 128+N
// after signal N; 125 when kiln or kilnd failed, 126 when the command
// could not be started, 127 when it was not found. While a foreground
// command runs, SIGINT, SIGTERM, SIGHUP and SIGQUIT are forwarded to its
// process group; a second within the interrupt window (2 s) ends the call
// and the command, and kiln exits 128+N.
func (a *cli) exec(ctx context.Context, id string, argv []string, ef execFlags) error {
	if err := checkEnv(ef.env); err != nil {
		return err
	}
	if ef.timeout < 0 {
		return usagef("--timeout %v is negative", ef.timeout)
	}
	c, err := a.client()
	if err != nil {
		a.printErr(err)
		return exitError{exitRunFailed}
	}
	opts := kilnclient.ExecOptions{Argv: argv, Env: ef.env, Cwd: ef.cwd, Timeout: ef.timeout,
		Stdout: a.stdout, Stderr: a.stderr, Background: ef.background, User: ef.user}
	if ef.interactive {
		opts.Stdin = a.stdin
	}
	if ef.tty {
		if ef.background {
			return usagef("--tty and --detach: a detached command has no terminal here to show")
		}
		restore, err := a.onTerminal(&opts)
		if err != nil {
			return err
		}
		defer restore()
	}
	var res *kilnclient.ExecResult
	if ef.background {
		// Its call ends once it has started: nothing to forward.
		res, err = c.Exec(ctx, id, opts)
		if err != nil && ctx.Err() != nil {
			fmt.Fprintf(a.stderr, "kiln: interrupted while starting %s in the background\n", argv[0])
			return exitError{128 + int(syscall.SIGINT)}
		}
	} else {
		var fwd *forwarder
		ctx, fwd = a.forwardSignals(ctx)
		opts.Signals = fwd.out
		res, err = c.Exec(ctx, id, opts)
		if sig, ended := fwd.stop(); ended && err != nil {
			// A second signal (or the end of kiln's context) ended the
			// call, and with it the command, before its exit came back.
			// Exit as a shell does after that signal.
			fmt.Fprintf(a.stderr, "kiln: interrupted; %s was killed\n", argv[0])
			return exitError{128 + int(sig)}
		}
	}
	if err != nil {
		a.printErr(err)
		return exitError{a.execFailure(err, id)}
	}
	if ef.background {
		fmt.Fprintln(a.stdout, res.ExecID)
		return nil
	}
	if res.TimedOut {
		fmt.Fprintf(a.stderr, "kiln: %s killed after --timeout %v\n", argv[0], ef.timeout)
	}
	if res.OOMKilled {
		fmt.Fprintf(a.stderr, "kiln: %s was killed: the sandbox ran out of memory\n", argv[0])
	}
	code := res.ExitCode
	if res.Signal != 0 {
		code = 128 + res.Signal
	}
	if code != 0 {
		return exitError{code}
	}
	return nil
}

// signalsHelp is exec's and run's word on signals.
const signalsHelp = `While the command runs in the foreground, SIGINT (Ctrl-C), SIGTERM, SIGHUP
and SIGQUIT sent to kiln are forwarded to its process group, so that its own
handling runs; a second signal within 2 s of one forwarded ends kiln instead,
killing the command. With -d nothing is forwarded.`

// defaultInterruptWindow is how soon after a forwarded signal a second
// one ends kiln sandbox exec instead of being forwarded too.
const defaultInterruptWindow = 2 * time.Second

// forwarder passes the signals kiln gets (SIGINT, SIGTERM, SIGHUP,
// SIGQUIT) to a foreground exec's process group while the exec runs, so
// that the command's own handling (cleanup, its exit code) happens. A
// second signal within the interrupt window of a forwarded one ends the
// call instead, which kills the command, as does the end of kiln's
// context for a reason other than a signal.
type forwarder struct {
	out    chan syscall.Signal
	cancel context.CancelFunc
	quit   chan struct{}
	done   chan struct{}
	unhook func()
	// Set by run before done is closed.
	ended bool
	sig   syscall.Signal
}

// forwardSignals starts forwarding; Exec runs under the context it
// returns, and fwd.stop must be called once Exec has returned.
func (a *cli) forwardSignals(ctx context.Context) (context.Context, *forwarder) {
	notify := a.notify
	if notify == nil {
		notify = func(ch chan<- os.Signal, sigs ...os.Signal) func() {
			signal.Notify(ch, sigs...)
			return func() { signal.Stop(ch) }
		}
	}
	window := a.interruptWindow
	if window <= 0 {
		window = defaultInterruptWindow
	}
	// main's signal.NotifyContext ends ctx at the first SIGINT or SIGTERM:
	// the call runs apart from it, and run decides what that end means.
	execCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	in := make(chan os.Signal, 8)
	f := &forwarder{out: make(chan syscall.Signal, 8), cancel: cancel, quit: make(chan struct{}), done: make(chan struct{})}
	f.unhook = notify(in, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGQUIT)
	go f.run(ctx, in, window)
	return execCtx, f
}

func (f *forwarder) run(ctx context.Context, in <-chan os.Signal, window time.Duration) {
	defer close(f.done)
	var last time.Time // when the last signal was forwarded
	intTerm := false   // a SIGINT or SIGTERM came, which ends ctx too
	// handle forwards s, or ends the call if it came too soon after the
	// last; it reports whether run is over.
	handle := func(s os.Signal) bool {
		sig, ok := s.(syscall.Signal)
		if !ok {
			return false
		}
		intTerm = intTerm || sig == syscall.SIGINT || sig == syscall.SIGTERM
		if !last.IsZero() && time.Since(last) < window {
			f.ended, f.sig = true, sig
			f.cancel()
			return true
		}
		last = time.Now()
		select {
		case f.out <- sig:
		case <-f.quit:
			return true
		}
		return false
	}
	ctxDone := ctx.Done()
	for {
		select {
		case <-f.quit:
			return
		case s := <-in:
			if handle(s) {
				return
			}
		case <-ctxDone:
			ctxDone = nil
			if intTerm {
				continue // main's NotifyContext saw that signal too
			}
			// The signal that ended ctx reaches in too, at about the same
			// moment: give it a little time to show which end this is.
			t := time.NewTimer(50 * time.Millisecond)
			select {
			case s := <-in:
				t.Stop()
				if handle(s) {
					return
				}
			case <-t.C:
				f.ended, f.sig = true, syscall.SIGINT
				f.cancel()
				return
			case <-f.quit:
				t.Stop()
				return
			}
		}
	}
}

// stop ends forwarding and says whether (and by which signal) forwarder
// ended the call rather than the command.
func (f *forwarder) stop() (syscall.Signal, bool) {
	f.unhook()
	close(f.quit)
	<-f.done
	f.cancel()
	return f.sig, f.ended
}

// execFailure is the exit code of an exec that failed before an exit
// status: NotFound is the command's unless the sandbox is what is
// missing.
func (a *cli) execFailure(err error, id string) int {
	switch status.Code(err) {
	case codes.NotFound:
		if _, gerr := a.c.GetSandbox(a.ctx, id); status.Code(gerr) == codes.NotFound {
			return exitRunFailed
		}
		return exitNotFound
	case codes.InvalidArgument, codes.PermissionDenied:
		return exitCannotInvoke // a bad working directory, not executable
	}
	return exitRunFailed
}

func (a *cli) psCmd() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:               "ps ID",
		Short:             "list a sandbox's execs, background ones included",
		Args:              args(cobra.ExactArgs(1)),
		ValidArgsFunction: a.completeSandboxes,
		RunE: func(cmd *cobra.Command, ids []string) error {
			c, err := a.client()
			if err != nil {
				return err
			}
			execs, err := c.ListExecs(cmd.Context(), ids[0])
			if err != nil {
				return err
			}
			if asJSON {
				return writeJSON(a.stdout, execs)
			}
			tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "EXEC\tPID\tBACKGROUND\tAGE\tSTATUS\tCOMMAND")
			now := time.Now()
			for _, e := range execs {
				st := "running"
				switch x := e.GetExit(); {
				case x == nil:
				case x.GetSignal() != 0:
					st = fmt.Sprintf("killed by signal %d", x.GetSignal())
				default:
					st = fmt.Sprintf("exited %d", x.GetExitCode())
				}
				fmt.Fprintf(tw, "%s\t%d\t%v\t%s\t%s\t%s\n", e.GetExecId(), e.GetPid(), e.GetBackground(),
					age(now, e.GetStartedUnixMs()), st, strings.Join(e.GetArgv(), " "))
			}
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print a JSON array of execs")
	return cmd
}

func (a *cli) killCmd() *cobra.Command {
	var sig int
	cmd := &cobra.Command{
		Use:               "kill ID EXEC",
		Short:             "send a signal (default SIGKILL) to an exec's process",
		Args:              args(cobra.ExactArgs(2)),
		ValidArgsFunction: a.completeSandboxes,
		RunE: func(cmd *cobra.Command, argv []string) error {
			if sig < 0 || sig > 64 {
				return usagef("sandbox kill: --signal %d: want 1 to 64", sig)
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			return c.KillExec(cmd.Context(), argv[0], argv[1], syscall.Signal(sig))
		},
	}
	cmd.Flags().IntVarP(&sig, "signal", "s", 0, "signal `N` (0: SIGKILL)")
	return cmd
}

// pauseCmd is pause (stop the vCPUs, or hibernate) or resume.
func (a *cli) pauseCmd(pause bool) *cobra.Command {
	use, short := "resume ID...", "start paused sandboxes' vCPUs again, or restore hibernated ones"
	if pause {
		use, short = "pause ID...", "stop sandboxes' vCPUs (memory and state stay), or hibernate them (--hibernate)"
	}
	var hibernate bool
	cmd := &cobra.Command{
		Use:               use,
		Short:             short,
		Args:              args(cobra.MinimumNArgs(1)),
		ValidArgsFunction: a.completeSandboxes,
		RunE: func(cmd *cobra.Command, ids []string) error {
			c, err := a.client()
			if err != nil {
				return err
			}
			failed := false
			for _, id := range ids {
				var err error
				switch {
				case hibernate:
					_, err = c.HibernateSandbox(cmd.Context(), id)
				case pause:
					_, err = c.PauseSandbox(cmd.Context(), id)
				default:
					_, err = c.ResumeSandbox(cmd.Context(), id)
				}
				if err != nil {
					a.printErr(err)
					failed = true
				}
			}
			if failed {
				return exitError{exitFailed}
			}
			return nil
		},
	}
	if pause {
		cmd.Flags().BoolVar(&hibernate, "hibernate", false, "write each sandbox's state to kilnd's disk and stop its VM, freeing its memory (resume restores it)")
	}
	return cmd
}

func (a *cli) eventsCmd() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "events [ID...]",
		Short: "print sandboxes' state changes as they happen (all sandboxes unless IDs are given)",
		RunE: func(cmd *cobra.Command, ids []string) error {
			c, err := a.client()
			if err != nil {
				return err
			}
			w, err := c.WatchEvents(cmd.Context(), ids...)
			if err != nil {
				return err
			}
			defer w.Close()
			opts := protojson.MarshalOptions{UseProtoNames: true}
			for ev, err := range w.All() {
				if err != nil {
					return err
				}
				if asJSON {
					j, err := opts.Marshal(ev)
					if err != nil {
						return err
					}
					// One event a line, whatever spacing protojson chose.
					var b bytes.Buffer
					if err := json.Compact(&b, j); err != nil {
						return err
					}
					fmt.Fprintf(a.stdout, "%s\n", b.Bytes())
					continue
				}
				kind := strings.ToLower(strings.TrimPrefix(ev.GetKind().String(), "KIND_"))
				line := fmt.Sprintf("%s %s %s", time.UnixMilli(ev.GetUnixMs()).Format(time.RFC3339Nano), kind, ev.GetSandboxId())
				if ev.GetReason() != "" {
					line += " " + ev.GetReason()
				}
				fmt.Fprintln(a.stdout, line)
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print each event as a JSON object on a line of its own")
	return cmd
}

func (a *cli) checkpointCmd() *cobra.Command {
	var opts kilnclient.CheckpointOptions
	cmd := &cobra.Command{
		Use:               "checkpoint ID",
		Short:             "checkpoint a sandbox and print the checkpoint's ID",
		Args:              args(cobra.ExactArgs(1)),
		ValidArgsFunction: a.completeSandboxes,
		RunE: func(cmd *cobra.Command, ids []string) error {
			c, err := a.client()
			if err != nil {
				return err
			}
			ck, err := c.Checkpoint(cmd.Context(), ids[0], opts)
			if err != nil {
				return err
			}
			fmt.Fprintln(a.stdout, ck.GetId())
			return nil
		},
	}
	cmd.Flags().BoolVar(&opts.Persist, "persist", false, "write it to the daemon's state folder (by default it is held in memory by the sandbox's VMM process: it survives a restart of the daemon, not the sandbox)")
	cmd.Flags().BoolVar(&opts.Keep, "keep", false, "keep it when the sandbox is destroyed (implies --persist)")
	return cmd
}

func (a *cli) checkpointsCmd() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:               "checkpoints ID",
		Short:             "list a sandbox's checkpoint tree",
		Args:              args(cobra.ExactArgs(1)),
		ValidArgsFunction: a.completeSandboxes,
		RunE: func(cmd *cobra.Command, ids []string) error {
			c, err := a.client()
			if err != nil {
				return err
			}
			cks, err := c.ListCheckpoints(cmd.Context(), ids[0])
			if err != nil {
				return err
			}
			sort.Slice(cks, func(i, j int) bool { return cks[i].GetCreatedUnixMs() < cks[j].GetCreatedUnixMs() })
			if asJSON {
				return writeJSON(a.stdout, cks)
			}
			tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "ID\tPARENT\tAGE\tPERSISTED\tKEEP")
			now := time.Now()
			for _, ck := range cks {
				parent := ck.GetParentId()
				if parent == "" {
					parent = "-"
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%v\t%v\n", ck.GetId(), parent, age(now, ck.GetCreatedUnixMs()), ck.GetPersisted(), ck.GetKeep())
			}
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print a JSON array")
	return cmd
}

func (a *cli) rollbackCmd() *cobra.Command {
	return &cobra.Command{
		Use:               "rollback ID CKPT",
		Short:             "return a sandbox to one of its checkpoints, in place",
		Args:              args(cobra.ExactArgs(2)),
		ValidArgsFunction: a.completeSandboxes,
		RunE: func(cmd *cobra.Command, argv []string) error {
			c, err := a.client()
			if err != nil {
				return err
			}
			_, err = c.Rollback(cmd.Context(), argv[0], argv[1])
			return err
		},
	}
}

func (a *cli) forkCmd() *cobra.Command {
	var (
		n              uint32
		labels         []string
		lifetime, idle time.Duration
		requestID      string
	)
	cmd := &cobra.Command{
		Use:               "fork ID|CKPT -n N",
		Short:             "start N children of a sandbox or a checkpoint; print their IDs as they are ready",
		Args:              args(cobra.ExactArgs(1)),
		ValidArgsFunction: a.completeSandboxes,
		RunE: func(cmd *cobra.Command, argv []string) error {
			if n == 0 {
				return usagef("sandbox fork: -n %d: fork at least one child", n)
			}
			req := &kilnpb.ForkRequest{Count: n, LifetimeMs: lifetime.Milliseconds(), IdleTimeoutMs: idle.Milliseconds(), RequestId: requestID}
			if lifetime < 0 {
				req.LifetimeMs = -1
			}
			var err error
			if req.Labels, err = keyValues("--label", labels); err != nil {
				return err
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			// IDs are opaque: a sandbox ID is one GetSandbox knows.
			_, err = c.GetSandbox(ctx, argv[0])
			switch status.Code(err) {
			case codes.OK:
				req.Source = &kilnpb.ForkRequest_SandboxId{SandboxId: argv[0]}
			case codes.NotFound:
				req.Source = &kilnpb.ForkRequest_CheckpointId{CheckpointId: argv[0]}
			default:
				return err
			}
			for sb, err := range c.Fork(ctx, req) {
				if err != nil {
					return err
				}
				fmt.Fprintln(a.stdout, sb.GetId())
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.Uint32VarP(&n, "count", "n", 1, "how many children")
	f.StringArrayVar(&labels, "label", nil, "`k=v` label of every child (repeatable)")
	f.DurationVar(&lifetime, "timeout", 0, "each child's lifetime (0: the daemon's default; negative: never)")
	f.DurationVar(&idle, "idle-timeout", 0, "each child's idle timeout (0: never)")
	f.StringVar(&requestID, "request-id", "", "client-chosen `ID` that makes a retry return the same children")
	return cmd
}

func (a *cli) rmCmd() *cobra.Command {
	return &cobra.Command{
		Use:               "rm ID...",
		Aliases:           []string{"destroy"},
		Short:             "destroy sandboxes",
		Args:              args(cobra.MinimumNArgs(1)),
		ValidArgsFunction: a.completeSandboxes,
		RunE: func(cmd *cobra.Command, ids []string) error {
			c, err := a.client()
			if err != nil {
				return err
			}
			failed := false
			for _, id := range ids {
				if err := c.DestroySandbox(cmd.Context(), id); err != nil {
					a.printErr(err)
					failed = true
				}
			}
			if failed {
				return exitError{exitFailed}
			}
			return nil
		},
	}
}

func (a *cli) templateCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "template",
		Short: "templates: an image booted once, set up, and kept as a snapshot to create sandboxes from",
	}
	var (
		image, setup, requestID string
		initFlag                string
		cpus, mem, pool         uint32
		egress                  egressFlags
		secrets                 secretFlags
	)
	create := &cobra.Command{
		Use:   "create NAME --image REF [--setup 'SHELL COMMAND' | -- CMD [ARG...]]",
		Short: "boot an image, run its setup, keep the snapshot; print the template's ID",
		Args:  args(cobra.MinimumNArgs(1)),
		RunE: func(cmd *cobra.Command, argv []string) error {
			if image == "" {
				return usagef("template create: --image is required")
			}
			if err := refuseZero(cmd, "cpus", "mem"); err != nil {
				return err
			}
			req := &kilnpb.CreateTemplateRequest{Name: argv[0], Image: image, PoolSize: pool, RequestId: requestID, Init: initFlag,
				Resources: &kilnpb.Resources{Cpus: cpus, MemoryMib: mem}}
			switch {
			case setup != "" && len(argv) > 1:
				return usagef("template create: give --setup or a command after --, not both")
			case setup != "":
				req.Setup = []string{"/bin/sh", "-c", setup}
			case len(argv) > 1:
				if cmd.ArgsLenAtDash() != 1 {
					return usagef("template create: want NAME -- CMD [ARG...]")
				}
				req.Setup = argv[1:]
			}
			var err error
			if req.Egress, err = egress.policy(); err != nil {
				return err
			}
			if req.Secrets, err = secrets.secrets(); err != nil {
				return err
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			t, err := c.CreateTemplate(cmd.Context(), req)
			if err != nil {
				return err
			}
			fmt.Fprintln(a.stdout, t.GetId())
			return nil
		},
	}
	f := create.Flags()
	f.StringVar(&image, "image", "", "image `REF` to boot")
	f.StringVar(&setup, "setup", "", "shell command run once before the snapshot")
	f.StringVar(&initFlag, "init", "", "process 1 of the template's sandbox: agent (default) or systemd")
	f.Uint32Var(&cpus, "cpus", 0, "vCPUs of its sandboxes")
	f.Uint32Var(&mem, "mem", 0, "memory of its sandboxes in `MiB`")
	f.Uint32Var(&pool, "pool", 0, "sandboxes kept restored and ready")
	f.StringVar(&requestID, "request-id", "", "client-chosen `ID` that makes a retry return the same template")
	egress.register(f) // the setup's
	secrets.register(f)

	var asJSON bool
	ls := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "list templates",
		Args:    args(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := a.client()
			if err != nil {
				return err
			}
			ts, err := c.ListTemplates(cmd.Context())
			if err != nil {
				return err
			}
			sort.Slice(ts, func(i, j int) bool { return ts[i].GetCreatedUnixMs() < ts[j].GetCreatedUnixMs() })
			if asJSON {
				return writeJSON(a.stdout, ts)
			}
			tw := tabwriter.NewWriter(a.stdout, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "ID\tNAME\tIMAGE\tCPUS\tMEM\tPOOL\tSANDBOXES\tAGE")
			now := time.Now()
			for _, t := range ts {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\t%d/%d\t%d\t%s\n", t.GetId(), t.GetName(), t.GetImage(),
					t.GetResources().GetCpus(), t.GetResources().GetMemoryMib(), t.GetPoolReady(), t.GetPoolSize(),
					t.GetSandboxes(), age(now, t.GetCreatedUnixMs()))
			}
			return tw.Flush()
		},
	}
	ls.Flags().BoolVar(&asJSON, "json", false, "print a JSON array of templates (the API's field names)")

	var wait bool
	rm := &cobra.Command{
		Use:               "rm ID|NAME...",
		Short:             "delete templates (refused while sandboxes use one, unless --wait)",
		Args:              args(cobra.MinimumNArgs(1)),
		ValidArgsFunction: a.completeTemplates,
		RunE: func(cmd *cobra.Command, ids []string) error {
			c, err := a.client()
			if err != nil {
				return err
			}
			failed := false
			for _, id := range ids {
				if err := c.DeleteTemplate(cmd.Context(), id, wait); err != nil {
					a.printErr(err)
					failed = true
				}
			}
			if failed {
				return exitError{exitFailed}
			}
			return nil
		},
	}
	rm.Flags().BoolVar(&wait, "wait", false, "wait until the sandboxes made from it are gone")
	cmd.AddCommand(create, ls, rm)
	return cmd
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
