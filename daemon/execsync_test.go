package daemon

import (
	"context"
	"fmt"
	"log/slog"
	"syscall"
	"testing"
)

// listingInstance is an instance whose guest lists what a test gives:
// only Detached and ForgetDetached are called by a sync.
type listingInstance struct {
	Instance
	ds []DetachedExec
}

func (l *listingInstance) Detached(context.Context) ([]DetachedExec, error) { return l.ds, nil }
func (l *listingInstance) ForgetDetached(context.Context, string) error     { return nil }

// runningProcess never exits until released.
type runningProcess struct{ done chan struct{} }

func (p runningProcess) Pid() int                         { return 1 }
func (p runningProcess) Signal(syscall.Signal) error      { return nil }
func (p runningProcess) SignalGroup(syscall.Signal) error { return nil }
func (p runningProcess) Resize(PtySize) error             { return nil }
func (p runningProcess) Wait() (ExitStatus, error) {
	<-p.done
	return ExitStatus{Code: 0}, nil
}

// TestSyncHostileList: a sandbox's list of detached processes is the
// guest's word: a flood of entries, IDs kilnd never gives, oversized
// argv are bounded or skipped, never taken whole.
func TestSyncHostileList(t *testing.T) {
	done := make(chan struct{})
	defer close(done)
	running := runningProcess{done}
	exited := &ExitStatus{Code: 3}
	tests := []struct {
		name string
		ds   []DetachedExec
		want int
	}{
		{"a flood", func() []DetachedExec {
			var ds []DetachedExec
			for i := range 10 * MaxDetached {
				ds = append(ds, DetachedExec{ID: fmt.Sprintf("ex-%d", i), Exit: exited})
			}
			return ds
		}(), keepExited},
		{"a flood of running ones", func() []DetachedExec {
			var ds []DetachedExec
			for i := range 3 * MaxDetached {
				ds = append(ds, DetachedExec{ID: fmt.Sprintf("ex-%d", i), Process: running})
			}
			return ds
		}(), MaxDetached},
		{"IDs kilnd never gives", []DetachedExec{
			{ID: "../etc", Exit: exited}, {ID: "", Exit: exited}, {ID: "sb-1", Exit: exited},
			{ID: "ex-ok", Exit: exited},
		}, 1},
		{"oversized argv", []DetachedExec{
			{ID: "ex-big", Argv: make([]string, maxListedArgv+1), Exit: exited}, {ID: "ex-small", Argv: []string{"sleep"}, Exit: exited},
		}, 1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tbl := newExecTable()
			tbl.sync(context.Background(), &listingInstance{ds: tc.ds}, slog.New(slog.DiscardHandler))
			if got := len(tbl.list()); got != tc.want {
				t.Errorf("%d execs taken, want %d", got, tc.want)
			}
		})
	}
}
