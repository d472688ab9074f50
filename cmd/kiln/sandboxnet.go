package main

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"strconv"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	kilnclient "github.com/kilnvm/kiln/daemon/client"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// egressModes maps --egress names to kiln.v1's modes.
var egressModes = map[string]kilnpb.EgressPolicy_Mode{
	"allow-all":  kilnpb.EgressPolicy_MODE_ALLOW_ALL,
	"deny-all":   kilnpb.EgressPolicy_MODE_DENY_ALL,
	"allow-list": kilnpb.EgressPolicy_MODE_ALLOW_LIST,
	"deny-list":  kilnpb.EgressPolicy_MODE_DENY_LIST,
}

// egressFlags are --egress, --allow and --deny: a sandbox's egress policy.
type egressFlags struct {
	mode         string
	allow, deny  []string
	requiredMode bool // sandbox policy: something must be given
}

func (e *egressFlags) register(f *pflag.FlagSet) {
	f.StringVar(&e.mode, "egress", "", "egress `MODE`: allow-all, deny-all, allow-list or deny-list (default: kilnd's, or the list --allow/--deny imply)")
	f.StringArrayVar(&e.allow, "allow", nil, "with allow-list: a `CIDR`, address or domain (*.example.com for its subdomains) the sandbox may reach (repeatable)")
	f.StringArrayVar(&e.deny, "deny", nil, "with deny-list: a `CIDR`, address or domain it may not reach (repeatable)")
}

// policy is the policy the flags give; nil when none was given (kilnd's
// default applies).
func (e *egressFlags) policy() (*kilnpb.EgressPolicy, error) {
	if e.mode == "" && len(e.allow) == 0 && len(e.deny) == 0 {
		if e.requiredMode {
			return nil, usagef("give --egress, --allow or --deny")
		}
		return nil, nil
	}
	if len(e.allow) > 0 && len(e.deny) > 0 {
		return nil, usagef("--allow and --deny do not mix: a policy is an allow list or a deny list")
	}
	mode := e.mode
	switch {
	case mode == "" && len(e.allow) > 0:
		mode = "allow-list"
	case mode == "" && len(e.deny) > 0:
		mode = "deny-list"
	}
	m, ok := egressModes[mode]
	if !ok {
		return nil, usagef("--egress %q: want allow-all, deny-all, allow-list or deny-list", e.mode)
	}
	entries := e.allow
	switch m {
	case kilnpb.EgressPolicy_MODE_ALLOW_LIST:
		if len(e.deny) > 0 {
			return nil, usagef("--egress allow-list takes --allow, not --deny")
		}
	case kilnpb.EgressPolicy_MODE_DENY_LIST:
		if len(e.allow) > 0 {
			return nil, usagef("--egress deny-list takes --deny, not --allow")
		}
		entries = e.deny
	default:
		if len(e.allow)+len(e.deny) > 0 {
			return nil, usagef("--egress %s takes no --allow or --deny", mode)
		}
	}
	p := &kilnpb.EgressPolicy{Mode: m}
	for _, x := range entries {
		x = strings.TrimSpace(x)
		switch {
		case x == "":
			return nil, usagef("an empty --allow/--deny entry")
		case strings.Contains(x, "/"):
			if _, err := netip.ParsePrefix(x); err != nil {
				return nil, usagef("%q is not a CIDR: %v", x, err)
			}
			p.Cidrs = append(p.Cidrs, x)
		default:
			if _, err := netip.ParseAddr(x); err == nil {
				p.Cidrs = append(p.Cidrs, x)
			} else {
				p.Domains = append(p.Domains, x) // kilnd checks its syntax
			}
		}
	}
	return p, nil
}

// secretFlags are --secret and --secret-file. Values never come from the
// command line, where ps shows them: from the caller's environment or a
// host file.
type secretFlags struct {
	env, files []string
	getenv     func(string) (string, bool)
	readFile   func(string) ([]byte, error)
}

func (s *secretFlags) register(f *pflag.FlagSet) {
	f.StringArrayVar(&s.env, "secret", nil, "env secret `NAME` (its value from this shell's $NAME) or NAME=@FILE (from a host file): in every exec's environment, never on kilnd's disk, masked as *** in output (repeatable)")
	f.StringArrayVar(&s.files, "secret-file", nil, "file secret `NAME=GUESTPATH:HOSTFILE[:MODE]`: HOSTFILE's bytes written to GUESTPATH in the guest (mode 0400 unless MODE, octal) (repeatable)")
}

func (s *secretFlags) secrets() ([]*kilnpb.Secret, error) {
	getenv, readFile := s.getenv, s.readFile
	if getenv == nil {
		getenv = os.LookupEnv
	}
	if readFile == nil {
		readFile = os.ReadFile
	}
	var out []*kilnpb.Secret
	for _, e := range s.env {
		name, src, hasSrc := strings.Cut(e, "=")
		if name == "" {
			return nil, usagef("--secret %q: want NAME or NAME=@FILE", e)
		}
		var v []byte
		switch {
		case !hasSrc:
			val, ok := getenv(name)
			if !ok {
				return nil, usagef("--secret %s: $%s is not set in this shell (or give NAME=@FILE)", name, name)
			}
			v = []byte(val)
		case strings.HasPrefix(src, "@"):
			b, err := readFile(src[1:])
			if err != nil {
				return nil, usagef("--secret %s: %v", name, err)
			}
			v = b
		default:
			return nil, usagef("--secret %s=...: a value on the command line shows in ps; give NAME (from $NAME) or NAME=@FILE", name)
		}
		out = append(out, &kilnpb.Secret{Name: name, Value: v})
	}
	for _, e := range s.files {
		name, rest, ok := strings.Cut(e, "=")
		parts := strings.Split(rest, ":")
		if !ok || name == "" || len(parts) < 2 || len(parts) > 3 || parts[0] == "" || parts[1] == "" {
			return nil, usagef("--secret-file %q: want NAME=GUESTPATH:HOSTFILE[:MODE]", e)
		}
		b, err := readFile(parts[1])
		if err != nil {
			return nil, usagef("--secret-file %s: %v", name, err)
		}
		sec := &kilnpb.Secret{Name: name, Value: b, File: parts[0]}
		if len(parts) == 3 {
			m, err := strconv.ParseUint(parts[2], 8, 32)
			if err != nil {
				return nil, usagef("--secret-file %s: mode %q is not octal", name, parts[2])
			}
			sec.FileMode = uint32(m)
		}
		out = append(out, sec)
	}
	return out, nil
}

// policyCmd is `kiln sandbox policy ID`: UpdateNetworkPolicy.
func (a *cli) policyCmd() *cobra.Command {
	e := egressFlags{requiredMode: true}
	var p *kilnpb.EgressPolicy
	cmd := &cobra.Command{
		Use:               "policy ID (--egress MODE | --allow X... | --deny X...)",
		Short:             "replace a running sandbox's egress policy, at once",
		Args:              args(cobra.ExactArgs(1)),
		ValidArgsFunction: a.completeSandboxes,
		PreRunE: func(*cobra.Command, []string) (err error) {
			p, err = e.policy()
			return err
		},
		RunE: a.call(func(ctx context.Context, c *kilnclient.Client, ids []string) error {
			sb, err := c.UpdateNetworkPolicy(ctx, ids[0], p)
			if err != nil {
				return err
			}
			n := sb.GetNetwork()
			fmt.Fprintf(a.stdout, "%s %s %s\n", sb.GetId(), n.GetAddress(), egressString(n.GetEgress()))
			return nil
		}),
	}
	e.register(cmd.Flags())
	return cmd
}

// egressString is a policy in one line: "allow-list 10.0.0.0/8,example.com".
func egressString(p *kilnpb.EgressPolicy) string {
	mode := "allow-all"
	for k, v := range egressModes {
		if v == p.GetMode() {
			mode = k
		}
	}
	list := append(append([]string(nil), p.GetCidrs()...), p.GetDomains()...)
	if len(list) == 0 {
		return mode
	}
	return mode + " " + strings.Join(list, ",")
}
