package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"

	"github.com/kilnvm/kiln/jail"
	"github.com/kilnvm/kiln/sandbox"
	"github.com/kilnvm/kiln/vmmproc"
)

// cmdVMM is `kiln vmm`, hidden: a VMM process as cmd/kiln-vmm is one
// (vmmproc.Main), kept so that a parent configured with [kiln, "vmm"]
// (kilnd's deprecated --kiln) still works. The VMM processes kiln and
// kilnd start run kiln-vmm (sandbox.FindVMM), which links none of the CLI.
func cmdVMM(ctx context.Context, args []string) int {
	return vmmproc.Main(ctx, args)
}

// vmmProcess returns the options that run a sandbox's VM in a VMM
// process of vmm (the kiln-vmm binary, sandbox.FindVMM), jailed (package
// jail) when jailIDs is set: the folder of the jails' id locks.
func vmmProcess(vmm, jailIDs string) (*sandbox.ProcessOptions, error) {
	po := &sandbox.ProcessOptions{Command: []string{vmm}}
	if jailIDs != "" {
		ids, err := jail.NewIDs(jailIDs, jail.FirstID, jail.IDCount)
		if err != nil {
			return nil, err
		}
		po.Jail = &sandbox.JailOptions{IDs: ids}
	}
	return po, nil
}

// findVMMProcess is vmmProcess of the kiln-vmm sandbox.FindVMM finds.
func findVMMProcess(jailIDs string) (*sandbox.ProcessOptions, error) {
	vmm, err := sandbox.FindVMM()
	if err != nil {
		return nil, err
	}
	return vmmProcess(vmm, jailIDs)
}

// vmmFlags are kiln run's and kiln fork's say in where each VM runs.
type vmmFlags struct {
	inProcess  *bool
	vmmProcess *bool // deprecated: a VMM process is the default
	jail       *jail.Mode
	ids        *string
}

func addVMMFlags(fs *flag.FlagSet) vmmFlags {
	f := vmmFlags{jail: new(jail.Mode)}
	*f.jail = jail.ModeAuto
	f.inProcess = fs.Bool("in-process", false, "run the VM in this process (embedding, debugging), not in a VMM process of its own: its vCPU threads alone are under the seccomp filter")
	f.vmmProcess = fs.Bool("vmm-process", true, "deprecated, the default: each VM in a VMM process of its own (kiln-vmm: $KILN_VMM, else beside kiln, else on $PATH); --vmm-process=false is --in-process")
	fs.Var(f.jail, "jail", "auto, true or false: jail each VMM process (namespaces of its own, a root holding only what it needs, a uid of its own, no capabilities; image chunks are fetched by this process for it); auto jails as root with a kiln-vmm built with CGO_ENABLED=0")
	f.ids = fs.String("jail-ids", jail.DefaultIDsDir, "with a jail, `DIR` whose jail-ids folder holds the locks of the jails' uids (kilnd's --jail-ids)")
	return f
}

// vmmChoice is what the flags asked, for placeVM.
type vmmChoice struct {
	inProcess  bool
	vmmProcess *bool // nil: --vmm-process not given
	jail       jail.Mode
	idsGiven   bool
}

func (f vmmFlags) choice(fs *flag.FlagSet) vmmChoice {
	c := vmmChoice{inProcess: *f.inProcess, jail: *f.jail}
	fs.Visit(func(fl *flag.Flag) {
		switch fl.Name {
		case "vmm-process":
			c.vmmProcess = f.vmmProcess
		case "jail-ids":
			c.idsGiven = true
		}
	})
	return c
}

// placement is where a sandbox's VM runs.
type placement struct {
	inProcess bool
	jail      bool
	why       string // in a VMM process without a jail: why not
	vmm       string // the kiln-vmm binary its VMM process runs
}

// placeVM decides where each VM runs, as kilnd does: in a VMM process
// of its own (seccomp filter, NO_NEW_PRIVS), jailed where a jail can be
// had (jail.Unavailable: root and a cgo-free kiln-vmm), unless the flags say
// otherwise; contradictory flags are an error naming them. euid is this
// process's, vmm the kiln-vmm binary its VMM processes run.
func placeVM(c vmmChoice, euid int, vmm string) (placement, error) {
	if c.vmmProcess != nil {
		if *c.vmmProcess && c.inProcess {
			return placement{}, errors.New("--in-process and --vmm-process contradict each other: give one")
		}
		if !*c.vmmProcess {
			c.inProcess = true // the old spelling of --in-process
		}
	}
	if c.inProcess {
		switch {
		case c.jail == jail.ModeOn:
			return placement{}, errors.New("--jail jails a VMM process, and --in-process runs none: give one")
		case c.idsGiven:
			return placement{}, errors.New("--jail-ids: no jail with --in-process")
		}
		return placement{inProcess: true}, nil
	}
	if c.jail == jail.ModeOff {
		if c.idsGiven {
			return placement{}, errors.New("--jail-ids: no jail with --jail=false")
		}
		return placement{why: "--jail=false"}, nil
	}
	why := jail.Unavailable(euid, vmm)
	if why == "" {
		return placement{jail: true}, nil
	}
	if c.jail == jail.ModeOn {
		return placement{}, fmt.Errorf("--jail: %s", why)
	}
	return placement{why: why}, nil
}

// placement decides where VMs run: placeVM, for this process and the
// kiln-vmm binary sandbox.FindVMM finds. Without one, only --in-process
// (or a flag error) places a VM.
func (f vmmFlags) placement(fs *flag.FlagSet) (placement, error) {
	c := f.choice(fs)
	vmm, err := sandbox.FindVMM()
	if err != nil {
		if pl, perr := placeVM(c, os.Geteuid(), ""); perr != nil || pl.inProcess {
			return pl, perr
		}
		return placement{}, fmt.Errorf("%w; or run the VM in this process: --in-process", err)
	}
	pl, err := placeVM(c, os.Geteuid(), vmm)
	pl.vmm = vmm
	return pl, err
}

// processOptions returns the ProcessOptions of pl (nil: in this
// process), and says on log why a VMM process goes unjailed: a warning
// as root (it keeps root's capabilities), else at debug level (a normal
// user's VMM process has none, and the filter and NO_NEW_PRIVS).
func (f vmmFlags) processOptions(pl placement, log *slog.Logger) (*sandbox.ProcessOptions, error) {
	if pl.inProcess {
		return nil, nil
	}
	ids := ""
	if pl.jail {
		ids = *f.ids
	} else if os.Geteuid() == 0 {
		log.Warn("VMM processes are not jailed: they run as root, with its capabilities", "why", pl.why)
	} else {
		log.Debug("VMM processes are not jailed", "why", pl.why)
	}
	po, err := vmmProcess(pl.vmm, ids)
	if err != nil {
		return nil, fmt.Errorf("VMM process: %w", err)
	}
	return po, nil
}
