package main

// kiln sandbox exec and run: a command in a sandbox, kiln exiting with its
// exit code, kiln's signals forwarded to it.

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	kilnclient "github.com/kilnvm/kiln/daemon/client"
)

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
	return a.execCommand(&cobra.Command{
		Use:   "exec ID [-i] [-t] [--timeout TIMEOUT] -- CMD [ARG...]",
		Short: "run a command in a sandbox; kiln exits with its exit code",
		Long:  "Run a command in a sandbox; kiln exits with its exit code (128+N after signal N).\n\n" + signalsHelp,
		Args:  args(cobra.MinimumNArgs(2)),
	}, func(cmd *cobra.Command, argv []string) ([]string, error) {
		if d := cmd.ArgsLenAtDash(); d > 1 {
			return nil, usagef("sandbox exec: want ID -- CMD [ARG...], got %d arguments before --", d)
		}
		return argv[1:], nil
	})
}

func (a *cli) runCmd() *cobra.Command {
	return a.execCommand(&cobra.Command{
		Use:   "run ID 'SHELL COMMAND'",
		Short: "run a shell command (sh -c) in a sandbox; kiln exits with its exit code",
		Long:  "Run a shell command (sh -c) in a sandbox; kiln exits with its exit code (128+N after signal N).\n\n" + signalsHelp,
		Args:  args(cobra.ExactArgs(2)),
	}, func(_ *cobra.Command, argv []string) ([]string, error) {
		return []string{"/bin/sh", "-c", argv[1]}, nil
	})
}

// execCommand makes cmd exec or run: it runs in the sandbox argv[0]
// names what command makes of the command line (a.exec), with the exec
// flags.
func (a *cli) execCommand(cmd *cobra.Command, command func(cmd *cobra.Command, argv []string) ([]string, error)) *cobra.Command {
	var ef execFlags
	cmd.ValidArgsFunction = a.completeSandboxes
	cmd.RunE = func(cmd *cobra.Command, argv []string) error {
		run, err := command(cmd, argv)
		if err != nil {
			return err
		}
		return a.exec(cmd.Context(), argv[0], run, ef)
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
