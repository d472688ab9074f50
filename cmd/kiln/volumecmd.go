package main

// kiln volume: volumes made, listed, described and deleted through kilnd.

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/spf13/cobra"

	kilnclient "github.com/kilnvm/kiln/daemon/client"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

func (a *cli) volumeCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "volume",
		Short: "volumes: ext4 file systems kept on the host that sandboxes mount (sandbox create --volume)",
	}
	var (
		size   uint32
		labels []string
		req    *kilnpb.CreateVolumeRequest
	)
	create := &cobra.Command{
		Use:   "create [NAME] [--size MiB]",
		Short: "make an empty volume; print its ID",
		Args:  args(cobra.MaximumNArgs(1)),
		PreRunE: func(cmd *cobra.Command, argv []string) error {
			req = &kilnpb.CreateVolumeRequest{SizeMib: size}
			if len(argv) == 1 {
				req.Name = argv[0]
			}
			var err error
			req.Labels, err = keyValues("--label", labels)
			return err
		},
		RunE: a.call(func(ctx context.Context, c *kilnclient.Client, _ []string) error {
			return a.printID(c.CreateVolume(ctx, req))
		}),
	}
	create.Flags().Uint32Var(&size, "size", 0, "size of its file system in `MiB` (default: the daemon's, 1024)")
	create.Flags().StringArrayVar(&labels, "label", nil, "`k=v` label (repeatable)")

	var asJSON bool
	var only []string
	ls := &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "list volumes and the sandboxes that mount them",
		Args:    args(cobra.NoArgs),
		RunE: a.call(func(ctx context.Context, c *kilnclient.Client, _ []string) error {
			want, err := keyValues("--label", only)
			if err != nil {
				return err
			}
			vs, err := c.ListVolumes(ctx, want)
			if err != nil {
				return err
			}
			return printList(a.stdout, asJSON, byCreated(vs), "ID\tNAME\tSIZE\tMOUNTED IN\tAGE", func(v *kilnpb.Volume, now time.Time) string {
				return fmt.Sprintf("%s\t%s\t%d MiB\t%s\t%s", v.GetId(), v.GetName(), v.GetSizeMib(), volumeUsers(v), age(now, v.GetCreatedUnixMs()))
			})
		}),
	}
	ls.Flags().BoolVar(&asJSON, "json", false, "print a JSON array of volumes (the API's field names)")
	ls.Flags().StringArrayVar(&only, "label", nil, "only volumes with this `k=v` label (repeatable)")

	rm := &cobra.Command{
		Use:   "rm ID|NAME...",
		Short: "delete volumes and their files (refused while a sandbox mounts one)",
		Args:  args(cobra.MinimumNArgs(1)),
		RunE: a.callEach(func(ctx context.Context, c *kilnclient.Client, id string) error {
			return c.DeleteVolume(ctx, id)
		}),
	}
	cmd.AddCommand(create, ls, rm)
	return cmd
}

// volumeUsers is who mounts v, for a table: "-" for none.
func volumeUsers(v *kilnpb.Volume) string {
	var out []string
	for _, u := range v.GetUsers() {
		s := u.GetSandbox() + ":" + u.GetPath()
		if u.GetReadOnly() {
			s += ":ro"
		}
		out = append(out, s)
	}
	if len(out) == 0 {
		return "-"
	}
	return strings.Join(out, ",")
}

// volumeMounts parses --volume NAME:/PATH[:ro|:rw] flags.
func volumeMounts(flags []string) ([]*kilnpb.VolumeMount, error) {
	var out []*kilnpb.VolumeMount
	for _, f := range flags {
		parts := strings.Split(f, ":")
		if len(parts) < 2 || len(parts) > 3 || parts[0] == "" || !strings.HasPrefix(parts[1], "/") {
			return nil, usagef("--volume %q: want NAME:/PATH or NAME:/PATH:ro", f)
		}
		m := &kilnpb.VolumeMount{Volume: parts[0], Path: parts[1]}
		if len(parts) == 3 {
			switch parts[2] {
			case "ro":
				m.ReadOnly = true
			case "rw":
			default:
				return nil, usagef("--volume %q: the mode is ro or rw, not %q", f, parts[2])
			}
		}
		out = append(out, m)
	}
	return out, nil
}
