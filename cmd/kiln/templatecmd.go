package main

// kiln template: templates made, listed and deleted through kilnd.

import (
	"context"
	"fmt"
	"time"

	"github.com/spf13/cobra"

	kilnclient "github.com/kilnvm/kiln/daemon/client"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

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
		req                     *kilnpb.CreateTemplateRequest
	)
	create := &cobra.Command{
		Use:   "create NAME --image REF [--setup 'SHELL COMMAND' | -- CMD [ARG...]]",
		Short: "boot an image, run its setup, keep the snapshot; print the template's ID",
		Args:  args(cobra.MinimumNArgs(1)),
		PreRunE: func(cmd *cobra.Command, argv []string) error {
			if image == "" {
				return usagef("template create: --image is required")
			}
			if err := refuseZero(cmd, "cpus", "mem"); err != nil {
				return err
			}
			req = &kilnpb.CreateTemplateRequest{Name: argv[0], Image: image, PoolSize: pool, RequestId: requestID, Init: initFlag,
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
			req.Egress, req.Secrets, err = guestPolicy(&egress, &secrets)
			return err
		},
		RunE: a.call(func(ctx context.Context, c *kilnclient.Client, _ []string) error {
			return a.printID(c.CreateTemplate(ctx, req))
		}),
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
		RunE: a.call(func(ctx context.Context, c *kilnclient.Client, _ []string) error {
			ts, err := c.ListTemplates(ctx)
			if err != nil {
				return err
			}
			return printList(a.stdout, asJSON, byCreated(ts), "ID\tNAME\tIMAGE\tCPUS\tMEM\tPOOL\tSANDBOXES\tAGE", func(t *kilnpb.Template, now time.Time) string {
				return fmt.Sprintf("%s\t%s\t%s\t%d\t%d\t%d/%d\t%d\t%s", t.GetId(), t.GetName(), t.GetImage(),
					t.GetResources().GetCpus(), t.GetResources().GetMemoryMib(), t.GetPoolReady(), t.GetPoolSize(),
					t.GetSandboxes(), age(now, t.GetCreatedUnixMs()))
			})
		}),
	}
	ls.Flags().BoolVar(&asJSON, "json", false, "print a JSON array of templates (the API's field names)")

	var wait bool
	rm := &cobra.Command{
		Use:               "rm ID|NAME...",
		Short:             "delete templates (refused while sandboxes use one, unless --wait)",
		Args:              args(cobra.MinimumNArgs(1)),
		ValidArgsFunction: a.completeTemplates,
		RunE: a.callEach(func(ctx context.Context, c *kilnclient.Client, id string) error {
			return c.DeleteTemplate(ctx, id, wait)
		}),
	}
	rm.Flags().BoolVar(&wait, "wait", false, "wait until the sandboxes made from it are gone")
	cmd.AddCommand(create, ls, rm)
	return cmd
}
