package main

import (
	"fmt"

	"github.com/kilnvm/kiln/jail"
)

// resolveJail says whether kilnd, under --jail m, jails its VMM
// processes: euid is kilnd's, kiln the binary they run. Auto without a
// jail gives the reason; true without one is an error naming it.
func resolveJail(m jail.Mode, euid int, kiln string) (jailed bool, why string, err error) {
	if m == jail.ModeOff {
		return false, "--jail=false", nil
	}
	why = jail.Unavailable(euid, kiln)
	if why == "" {
		return true, "", nil
	}
	if m == jail.ModeOn {
		return false, "", fmt.Errorf("--jail: %s", why)
	}
	return false, why, nil
}
