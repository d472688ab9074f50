package main

import (
	"fmt"
	"strconv"

	"github.com/kilnvm/kiln/jail"
)

// jailMode is --jail: auto (the default) jails every VMM process when
// kilnd can (as root, with a kiln binary built without cgo) and says why
// when it cannot; true insists (kilnd refuses to start without it); false
// runs VMM processes unjailed.
type jailMode string

const (
	jailAuto jailMode = "auto"
	jailOn   jailMode = "true"
	jailOff  jailMode = "false"
)

func (m *jailMode) String() string {
	if m == nil || *m == "" {
		return string(jailAuto)
	}
	return string(*m)
}

// Set takes auto or a bool (flag's forms: 1, t, true, 0, f, false, ...).
func (m *jailMode) Set(v string) error {
	if v == string(jailAuto) {
		*m = jailAuto
		return nil
	}
	b, err := strconv.ParseBool(v)
	if err != nil {
		return fmt.Errorf("want auto, true or false, not %q", v)
	}
	*m = jailOff
	if b {
		*m = jailOn
	}
	return nil
}

// IsBoolFlag lets --jail stand alone for --jail=true.
func (m *jailMode) IsBoolFlag() bool { return true }

// Get is the mode's word: a config file gives jail = "auto", or a bool.
func (m *jailMode) Get() any { return m.String() }

// resolve says whether kilnd jails its VMM processes: euid is kilnd's,
// kiln the binary they run. Auto without a jail gives the reason; true
// without one is an error naming it.
func (m jailMode) resolve(euid int, kiln string) (jailed bool, why string, err error) {
	if m == jailOff {
		return false, "--jail=false", nil
	}
	why = jail.Unavailable(euid, kiln)
	if why == "" {
		return true, "", nil
	}
	if m == jailOn {
		return false, "", fmt.Errorf("--jail: %s", why)
	}
	return false, why, nil
}
