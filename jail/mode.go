package jail

import (
	"fmt"
	"strconv"
)

// Mode is a --jail flag (kilnd's, kiln run's and kiln fork's): ModeAuto
// jails where Unavailable says a jail can be had, ModeOn insists, ModeOff
// never jails. It is a flag.Value; alone, --jail is --jail=true.
type Mode string

// The modes, as the flag spells them.
const (
	ModeAuto Mode = "auto"
	ModeOn   Mode = "true"
	ModeOff  Mode = "false"
)

func (m *Mode) String() string {
	if m == nil || *m == "" {
		return string(ModeAuto)
	}
	return string(*m)
}

// Set takes auto or a bool (flag's forms: 1, t, true, 0, f, false, ...).
func (m *Mode) Set(v string) error {
	if v == string(ModeAuto) {
		*m = ModeAuto
		return nil
	}
	b, err := strconv.ParseBool(v)
	if err != nil {
		return fmt.Errorf("want auto, true or false, not %q", v)
	}
	*m = ModeOff
	if b {
		*m = ModeOn
	}
	return nil
}

// IsBoolFlag lets --jail stand alone for --jail=true.
func (m *Mode) IsBoolFlag() bool { return true }

// Get is the mode's word: a config file gives jail = "auto", or a bool.
func (m *Mode) Get() any { return m.String() }
