package sandbox

import (
	"testing"
	"time"
)

// TestPhases checks that marks split the time since the start in order,
// and that a start no mark timed records nothing for a shared part.
func TestPhases(t *testing.T) {
	s := &Sandbox{started: time.Now().Add(-time.Second)}
	s.markTimed(PhaseSpawn) // a boot's VMM process: not timed
	if s.Phases() != nil {
		t.Fatalf("an untimed start has phases %v", s.Phases())
	}
	s.mark(PhasePrepare)
	s.markTimed(PhaseSpawn)
	time.Sleep(10 * time.Millisecond)
	s.mark(PhaseAgent)
	ph := s.Phases()
	if len(ph) != 3 || ph[0].Name != PhasePrepare || ph[1].Name != PhaseSpawn || ph[2].Name != PhaseAgent {
		t.Fatalf("phases %v", ph)
	}
	if ph[0].Took < time.Second || ph[2].Took < 10*time.Millisecond {
		t.Errorf("phases %v: the first should hold the second before it, the last the sleep", ph)
	}
	ph[0].Name = "changed"
	if s.Phases()[0].Name != PhasePrepare {
		t.Error("Phases hands out the sandbox's own slice")
	}
}
