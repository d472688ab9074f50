package main

import (
	"context"
	"time"

	"github.com/spf13/cobra"

	kilnclient "github.com/kilnvm/kiln/daemon/client"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// updateCmd changes a live sandbox's lifetime, timeout action or labels.
func (a *cli) updateCmd() *cobra.Command {
	var (
		timeout, action string
		labels          []string
		clearLabels     bool
		opts            kilnclient.UpdateOptions
	)
	cmd := &cobra.Command{
		Use:               "update ID [--timeout DUR|never] [--timeout-action destroy|hibernate|hibernate-files] [--label K=V...|--clear-labels]",
		Short:             "change a sandbox's lifetime (from now), what its end does, or its labels",
		Args:              args(cobra.ExactArgs(1)),
		ValidArgsFunction: a.completeSandboxes,
		PreRunE: func(cmd *cobra.Command, _ []string) error {
			if cmd.Flags().Changed("timeout") {
				d := time.Duration(-1)
				if timeout != "never" {
					var err error
					if d, err = time.ParseDuration(timeout); err != nil || d <= 0 {
						return usagef("sandbox update: --timeout %q: want a positive duration (90s, 1h) or never", timeout)
					}
				}
				opts.Lifetime = &d
			}
			if cmd.Flags().Changed("timeout-action") {
				var act kilnpb.TimeoutAction
				switch action {
				case "destroy":
					act = kilnpb.TimeoutAction_TIMEOUT_ACTION_DESTROY
				case "hibernate":
					act = kilnpb.TimeoutAction_TIMEOUT_ACTION_HIBERNATE
				case "hibernate-files":
					act = kilnpb.TimeoutAction_TIMEOUT_ACTION_HIBERNATE_FILES
				default:
					return usagef("sandbox update: --timeout-action %q: want destroy, hibernate or hibernate-files", action)
				}
				opts.TimeoutAction = &act
			}
			if clearLabels && len(labels) > 0 {
				return usagef("sandbox update: --clear-labels and --label: give one")
			}
			if clearLabels {
				opts.Labels = map[string]string{}
			} else if len(labels) > 0 {
				var err error
				if opts.Labels, err = keyValues("--label", labels); err != nil {
					return err
				}
			}
			if opts.Lifetime == nil && opts.TimeoutAction == nil && opts.Labels == nil {
				return usagef("sandbox update: nothing to change: give --timeout, --timeout-action, --label or --clear-labels")
			}
			return nil
		},
		RunE: a.call(func(ctx context.Context, c *kilnclient.Client, ids []string) error {
			_, err := c.UpdateSandbox(ctx, ids[0], opts)
			return err
		}),
	}
	cmd.Flags().StringVar(&timeout, "timeout", "", "end the sandbox `DUR` from now (never: no lifetime)")
	cmd.Flags().StringVar(&action, "timeout-action", "", "what the lifetime's end does: `destroy`, hibernate, or hibernate-files (keep only its files)")
	cmd.Flags().StringArrayVar(&labels, "label", nil, "replace the labels with these `k=v` (repeatable)")
	cmd.Flags().BoolVar(&clearLabels, "clear-labels", false, "remove every label")
	return cmd
}
