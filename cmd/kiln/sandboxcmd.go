package main

// kiln sandbox: the commands over kilnd's sandboxes (exec and run are in
// sandboxexec.go, cp in sandboxcp.go, mv in sandboxtty.go, policy in
// sandboxnet.go, update in sandboxupdate.go, port-forward in
// portforward.go).

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"

	kilnclient "github.com/kilnvm/kiln/daemon/client"
	"github.com/kilnvm/kiln/daemon/kilnpb"
	"github.com/kilnvm/kiln/sandbox"
)

func (a *cli) sandboxCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:     "sandbox",
		Aliases: []string{"sb"},
		Short:   "sandboxes run by kilnd: create, ls, exec, run, cp, mv, checkpoint, rollback, fork, rm, ...",
	}
	cmd.AddCommand(a.createCmd(), a.lsCmd(), a.inspectCmd(), a.execCmd(), a.runCmd(), a.cpCmd(), a.mvCmd(),
		a.psCmd(), a.killCmd(), a.pauseCmd(true), a.pauseCmd(false), a.eventsCmd(),
		a.checkpointCmd(), a.checkpointsCmd(), a.rollbackCmd(), a.forkCmd(), a.rmCmd(), a.policyCmd())
	cmd.AddCommand(a.updateCmd(), a.portForwardCmd())
	return cmd
}

func (a *cli) createCmd() *cobra.Command {
	var (
		image, template, checkpoint, requestID string
		initFlag                               string
		cpus, mem, disk                        uint32
		lifetime, idle                         time.Duration
		env, labels, volumes                   []string
		egress                                 egressFlags
		secrets                                secretFlags
		req                                    *kilnpb.CreateSandboxRequest
	)
	cmd := &cobra.Command{
		Use:   "create (--image REF | --template T | --checkpoint C) [flags]",
		Short: "start a sandbox and print its ID",
		Args:  args(cobra.NoArgs),
		PreRunE: func(cmd *cobra.Command, _ []string) error {
			if err := refuseZero(cmd, "cpus", "mem"); err != nil {
				return err
			}
			req = &kilnpb.CreateSandboxRequest{Init: initFlag,
				Resources:     &kilnpb.Resources{Cpus: cpus, MemoryMib: mem, DiskMib: disk},
				Env:           env,
				LifetimeMs:    lifetimeMs(lifetime),
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
			if req.Volumes, err = volumeMounts(volumes); err != nil {
				return err
			}
			req.Egress, req.Secrets, err = guestPolicy(&egress, &secrets)
			return err
		},
		RunE: a.call(func(ctx context.Context, c *kilnclient.Client, _ []string) error {
			return a.printID(c.CreateSandbox(ctx, req))
		}),
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
	f.StringArrayVarP(&volumes, "volume", "v", nil, "mount volume `NAME:/PATH[:ro]` (repeatable; kiln volume create makes one)")
	f.StringVar(&requestID, "request-id", "", "client-chosen `ID` that makes a retry return the same sandbox")
	egress.register(f)
	secrets.register(f)
	cmd.RegisterFlagCompletionFunc("template", a.completeTemplates)
	return cmd
}

// lifetimeMs is a --timeout as kiln.v1 takes it: 0 the daemon's default,
// -1 (any negative) none.
func lifetimeMs(d time.Duration) int64 {
	if d < 0 {
		return -1
	}
	return d.Milliseconds()
}

// guestPolicy is what --egress, --allow, --deny, --secret and
// --secret-file give a sandbox (create) or a template's setup.
func guestPolicy(egress *egressFlags, secrets *secretFlags) (*kilnpb.EgressPolicy, []*kilnpb.Secret, error) {
	p, err := egress.policy()
	if err != nil {
		return nil, nil, err
	}
	secs, err := secrets.secrets()
	if err != nil {
		return nil, nil, err
	}
	return p, secs, nil
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
		opts        kilnclient.ListOptions
	)
	cmd := &cobra.Command{
		Use:     "ls [flags]",
		Aliases: []string{"list"},
		Short:   "list sandboxes (the live ones unless --all or --state)",
		Args:    args(cobra.NoArgs),
		PreRunE: func(*cobra.Command, []string) error {
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
			return nil
		},
		RunE: a.call(func(ctx context.Context, c *kilnclient.Client, _ []string) error {
			sbs, err := c.ListSandboxes(ctx, opts)
			if err != nil {
				return err
			}
			return printList(a.stdout, asJSON, byCreated(sbs), "ID\tSTATE\tFROM\tCPUS\tMEM\tAGE\tLABELS", func(sb *kilnpb.Sandbox, now time.Time) string {
				return fmt.Sprintf("%s\t%s\t%s\t%d\t%d\t%s\t%s", sb.GetId(), stateName(sb.GetState()), source(sb),
					sb.GetResources().GetCpus(), sb.GetResources().GetMemoryMib(),
					age(now, sb.GetCreatedUnixMs()), joinLabels(sb.GetLabels()))
			})
		}),
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

func (a *cli) inspectCmd() *cobra.Command {
	return &cobra.Command{
		Use:               "inspect ID",
		Short:             "print one sandbox as JSON",
		Args:              args(cobra.ExactArgs(1)),
		ValidArgsFunction: a.completeSandboxes,
		RunE: a.call(func(ctx context.Context, c *kilnclient.Client, ids []string) error {
			sb, err := c.GetSandbox(ctx, ids[0])
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
		}),
	}
}

func (a *cli) psCmd() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:               "ps ID",
		Short:             "list a sandbox's execs, background ones included",
		Args:              args(cobra.ExactArgs(1)),
		ValidArgsFunction: a.completeSandboxes,
		RunE: a.call(func(ctx context.Context, c *kilnclient.Client, ids []string) error {
			execs, err := c.ListExecs(ctx, ids[0])
			if err != nil {
				return err
			}
			return printList(a.stdout, asJSON, execs, "EXEC\tPID\tBACKGROUND\tAGE\tSTATUS\tCOMMAND", func(e *kilnpb.ExecInfo, now time.Time) string {
				st := "running"
				switch x := e.GetExit(); {
				case x == nil:
				case x.GetSignal() != 0:
					st = fmt.Sprintf("killed by signal %d", x.GetSignal())
				default:
					st = fmt.Sprintf("exited %d", x.GetExitCode())
				}
				return fmt.Sprintf("%s\t%d\t%v\t%s\t%s\t%s", e.GetExecId(), e.GetPid(), e.GetBackground(),
					age(now, e.GetStartedUnixMs()), st, strings.Join(e.GetArgv(), " "))
			})
		}),
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
		PreRunE: func(*cobra.Command, []string) error {
			if sig < 0 || sig > 64 {
				return usagef("sandbox kill: --signal %d: want 1 to 64", sig)
			}
			return nil
		},
		RunE: a.call(func(ctx context.Context, c *kilnclient.Client, argv []string) error {
			return c.KillExec(ctx, argv[0], argv[1], syscall.Signal(sig))
		}),
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
	var hibernate, keepFiles bool
	cmd := &cobra.Command{
		Use:               use,
		Short:             short,
		Args:              args(cobra.MinimumNArgs(1)),
		ValidArgsFunction: a.completeSandboxes,
		RunE: a.callEach(func(ctx context.Context, c *kilnclient.Client, id string) error {
			var err error
			switch {
			case keepFiles:
				_, err = c.HibernateSandboxFiles(ctx, id)
			case hibernate:
				_, err = c.HibernateSandbox(ctx, id)
			case pause:
				_, err = c.PauseSandbox(ctx, id)
			default:
				_, err = c.ResumeSandbox(ctx, id)
			}
			return err
		}),
	}
	if pause {
		cmd.Flags().BoolVar(&hibernate, "hibernate", false, "write each sandbox's state to kilnd's disk and stop its VM, freeing its memory (resume restores it)")
		cmd.Flags().BoolVar(&keepFiles, "keep-files", false, "hibernate keeping only each sandbox's files (its image root's writes, /tmp), not its memory: resume boots it again with them, its processes gone")
	}
	return cmd
}

func (a *cli) eventsCmd() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "events [ID...]",
		Short: "print sandboxes' state changes as they happen (all sandboxes unless IDs are given)",
		RunE: a.call(func(ctx context.Context, c *kilnclient.Client, ids []string) error {
			w, err := c.WatchEvents(ctx, ids...)
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
		}),
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
		RunE: a.call(func(ctx context.Context, c *kilnclient.Client, ids []string) error {
			return a.printID(c.Checkpoint(ctx, ids[0], opts))
		}),
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
		RunE: a.call(func(ctx context.Context, c *kilnclient.Client, ids []string) error {
			cks, err := c.ListCheckpoints(ctx, ids[0])
			if err != nil {
				return err
			}
			return printList(a.stdout, asJSON, byCreated(cks), "ID\tPARENT\tAGE\tPERSISTED\tKEEP", func(ck *kilnpb.CheckpointInfo, now time.Time) string {
				parent := ck.GetParentId()
				if parent == "" {
					parent = "-"
				}
				return fmt.Sprintf("%s\t%s\t%s\t%v\t%v", ck.GetId(), parent, age(now, ck.GetCreatedUnixMs()), ck.GetPersisted(), ck.GetKeep())
			})
		}),
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
		RunE: a.call(func(ctx context.Context, c *kilnclient.Client, argv []string) error {
			_, err := c.Rollback(ctx, argv[0], argv[1])
			return err
		}),
	}
}

func (a *cli) forkCmd() *cobra.Command {
	var (
		n              uint32
		labels         []string
		lifetime, idle time.Duration
		requestID      string
		req            *kilnpb.ForkRequest
	)
	cmd := &cobra.Command{
		Use:               "fork ID|CKPT -n N",
		Short:             "start N children of a sandbox or a checkpoint; print their IDs as they are ready",
		Args:              args(cobra.ExactArgs(1)),
		ValidArgsFunction: a.completeSandboxes,
		PreRunE: func(*cobra.Command, []string) error {
			if n == 0 {
				return usagef("sandbox fork: -n %d: fork at least one child", n)
			}
			req = &kilnpb.ForkRequest{Count: n, LifetimeMs: lifetimeMs(lifetime), IdleTimeoutMs: idle.Milliseconds(), RequestId: requestID}
			var err error
			req.Labels, err = keyValues("--label", labels)
			return err
		},
		RunE: a.call(func(ctx context.Context, c *kilnclient.Client, argv []string) error {
			// IDs are opaque: a sandbox ID is one GetSandbox knows.
			_, err := c.GetSandbox(ctx, argv[0])
			switch status.Code(err) {
			case codes.OK:
				req.Source = &kilnpb.ForkRequest_SandboxId{SandboxId: argv[0]}
			case codes.NotFound:
				req.Source = &kilnpb.ForkRequest_CheckpointId{CheckpointId: argv[0]}
			default:
				return err
			}
			for sb, err := range c.Fork(ctx, req) {
				if err := a.printID(sb, err); err != nil {
					return err
				}
			}
			return nil
		}),
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
		RunE: a.callEach(func(ctx context.Context, c *kilnclient.Client, id string) error {
			return c.DestroySandbox(ctx, id)
		}),
	}
}
