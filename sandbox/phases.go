package sandbox

import (
	"slices"
	"time"
)

// Phase is one step of a sandbox's start and how long it took.
type Phase struct {
	Name string
	Took time.Duration
}

// The phases of a restore (Restore, RestoreFrozen), in order; a phase a
// path does not have is left out.
const (
	// PhasePrepare: the snapshot's manifest read and authenticated, the
	// devices and disks checked, the image root opened.
	PhasePrepare = "prepare"
	// PhaseMemory: the snapshot checked in full and its memory made
	// ready to map (fs-verity measured, or copied into a sealed memfd
	// and hashed; a cache hit).
	PhaseMemory = "memory"
	// PhaseSpawn: the VMM process started and answering.
	PhaseSpawn = "spawn"
	// PhaseRestore: the VM built from the state, its devices opened.
	PhaseRestore = "restore"
	// PhaseAgent: the VM running until the guest's agent answers.
	PhaseAgent = "agent"
	// PhaseFreshen: the guest made unique (entropy, clock, host name,
	// network card).
	PhaseFreshen = "freshen"
)

// Phases are the steps the sandbox's start took, in order: a restore's
// (the Phase constants); nil for a sandbox that was booted or attached.
func (s *Sandbox) Phases() []Phase { return slices.Clone(s.phases) }

// mark ends the phase name now: it took the time since the last mark (or
// since the start). Only the goroutine that starts the sandbox marks.
func (s *Sandbox) mark(name string) {
	now := time.Now()
	last := s.lastMark
	if last.IsZero() {
		last = s.started
	}
	s.phases = append(s.phases, Phase{Name: name, Took: now.Sub(last)})
	s.lastMark = now
}

// markTimed marks name in a start that is timed: one marked already (a
// restore's first mark is PhasePrepare). A part shared with boots (the
// VMM process's start) so marks restores only.
func (s *Sandbox) markTimed(name string) {
	if s.phases != nil {
		s.mark(name)
	}
}
