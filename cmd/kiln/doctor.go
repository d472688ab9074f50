package main

// kiln doctor: whether this host can run kilnd, one line a check, with a
// hint for each that is not ok (package hostcheck).

import (
	"encoding/json"
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/kilnvm/kiln/hostcheck"
)

func (a *cli) doctorCmd() *cobra.Command {
	h := hostcheck.Default()
	var asJSON, noNetwork bool
	cmd := &cobra.Command{
		Use:   "doctor [--json]",
		Short: "check this host for kilnd: KVM, cgroup v2 delegation, nftables, tun, netns, disk, guest kernel, agent",
		Long: `Check this host for kilnd, one line a check: ok, warn or FAIL, its name and
what was found, and for each that is not ok a hint. Exits 1 when a check
kilnd needs fails. Run it as root, as kilnd runs.`,
		Args: args(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			h.Network = !noNetwork
			rs := h.Run(a.ctx)
			if asJSON {
				if err := writeDoctorJSON(a.stdout, rs); err != nil {
					return err
				}
			} else {
				writeDoctor(a.stdout, rs)
			}
			if hostcheck.Failed(rs) {
				return exitError{exitFailed}
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.BoolVar(&asJSON, "json", false, "print the results as JSON")
	f.StringVar(&h.StateDir, "state-dir", h.StateDir, "kilnd's state `DIR`, whose free space is checked")
	f.StringVar(&h.CgroupRoot, "cgroup-root", "", "kilnd's --cgroup-root `PATH` (\"\": kilnd.service's cgroup, else this process's; \"none\": no cgroups)")
	f.StringVar(&h.KernelCache, "kernel-cache", h.KernelCache, "Kiln's cache `DIR` with the guest kernel (kilnd.service: /var/cache/kiln)")
	f.StringVar(&h.Agent, "agent", "", "the kiln-agent `FILE` (default: $KILN_AGENT, else beside kiln)")
	f.StringVar(&h.VMM, "vmm", "", "the kiln-vmm `FILE` (default: $KILN_VMM, else beside kiln, else on $PATH)")
	f.BoolVar(&noNetwork, "no-network", false, "kilnd runs without --net-pool: the network checks are not required")
	return cmd
}

// writeDoctor prints one line a check and a hint under each that is not
// ok.
func writeDoctor(w io.Writer, rs []hostcheck.Result) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	for _, r := range rs {
		fmt.Fprintf(tw, "%s\t%s\t%s\n", r.Status, r.Name, r.Detail)
		if r.Status != hostcheck.OK && r.Hint != "" {
			fmt.Fprintf(tw, "\t\thint: %s\n", r.Hint)
		}
	}
	tw.Flush()
	if hostcheck.Failed(rs) {
		fmt.Fprintln(w, "kilnd cannot run sandboxes here until the FAIL lines above are fixed")
	}
}

// doctorReport is kiln doctor --json's output.
type doctorReport struct {
	OK     bool               `json:"ok"`
	Checks []hostcheck.Result `json:"checks"`
}

func writeDoctorJSON(w io.Writer, rs []hostcheck.Result) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(doctorReport{OK: !hostcheck.Failed(rs), Checks: rs})
}
