package main

// kiln template: templates made, listed and deleted through kilnd.

import (
	"fmt"
	"sort"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

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
