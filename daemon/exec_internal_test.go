package daemon

import (
	"syscall"
	"testing"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// TestExecTableEndBefore: after a boot, the execs of the earlier machine
// not seen to exit are ended as killed; the new machine's, and those
// that exited, stay as they are.
func TestExecTableEndBefore(t *testing.T) {
	var old, cur Instance = &struct{ Instance }{}, &struct{ Instance }{}
	tb := newExecTable()
	entry := func(id string, inst Instance, exit *kilnpb.ExecExit) *execEntry {
		e := &execEntry{info: &kilnpb.ExecInfo{ExecId: id, Exit: exit}, inst: inst, done: make(chan struct{})}
		if exit != nil {
			close(e.done)
		}
		tb.add(e)
		return e
	}
	lost := entry("ex-lost", old, nil)
	exited := entry("ex-exited", old, &kilnpb.ExecExit{ExitCode: 3})
	running := entry("ex-new", cur, nil)
	tb.endBefore(cur)
	select {
	case <-lost.done:
	default:
		t.Fatal("the earlier machine's exec is not done")
	}
	if x := lost.info.Exit; x == nil || x.Signal != int32(syscall.SIGKILL) || x.ExitCode != -1 {
		t.Errorf("the earlier machine's exec: %v", x)
	}
	if exited.info.Exit.ExitCode != 3 {
		t.Errorf("an exited exec changed: %v", exited.info.Exit)
	}
	select {
	case <-running.done:
		t.Error("the new machine's exec was ended")
	default:
	}
}
