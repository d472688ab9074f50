package envd

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	processpb "github.com/kilnvm/kiln/daemon/e2b/envd/envdpb/process"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

func TestStartRuns(t *testing.T) {
	e := newEnv(t)
	id := e.sandbox()
	if _, err := e.kiln.MakeDir(ctxT(t), &kilnpb.MakeDirRequest{SandboxId: id, Path: "/work/sub", Parents: true}); err != nil {
		t.Fatal(err)
	}
	for _, cd := range codecs {
		t.Run(cd.name, func(t *testing.T) {
			c := e.process(id, cd.opts)
			tests := []struct {
				name                 string
				req                  *connect.Request[processpb.StartRequest]
				stdout, stderr       string
				code                 int32
				status               string
				stdoutHasSuffix      bool
				anyStderr            bool // a login shell's profile may complain
				wantExited, pidIsSet bool
			}{
				{name: "echo as the SDK runs it", req: connect.NewRequest(&processpb.StartRequest{
					Process: &processpb.ProcessConfig{Cmd: "/bin/bash", Args: []string{"-l", "-c", "echo hello"}}}),
					stdout: "hello\n", anyStderr: true, status: "exit status 0", wantExited: true},
				{name: "non-zero exit", req: startReq("echo out; echo oops >&2; exit 3"),
					stdout: "out\n", stderr: "oops\n", code: 3, status: "exit status 3", wantExited: true},
				{name: "envs", req: startReq(`echo "$FOO-$BAR"`, func(r *processpb.StartRequest) {
					r.Process.Envs = map[string]string{"FOO": "foo", "BAR": "b a r"}
				}), stdout: "foo-b a r\n", status: "exit status 0", wantExited: true},
				{name: "cwd", req: startReq("pwd", func(r *processpb.StartRequest) {
					cwd := "/work/sub"
					r.Process.Cwd = &cwd
				}), stdout: "/work/sub\n", stdoutHasSuffix: true, status: "exit status 0", wantExited: true},
				{name: "relative cwd against root's home", req: startReq("pwd", func(r *processpb.StartRequest) {
					cwd := "../work/sub"
					r.Process.Cwd = &cwd
				}), stdout: "/work/sub\n", stdoutHasSuffix: true, status: "exit status 0", wantExited: true},
				{name: "killed by a signal", req: startReq("kill -9 $$"), code: -1, status: "signal: killed"},
			}
			for _, tc := range tests {
				t.Run(tc.name, func(t *testing.T) {
					r := run(t, c, tc.req)
					if r.err != nil {
						t.Fatal(r.err)
					}
					if r.pid == 0 {
						t.Error("start event without a pid")
					}
					if tc.stdoutHasSuffix {
						if !strings.HasSuffix(r.stdout, tc.stdout) {
							t.Errorf("stdout %q, want ...%q", r.stdout, tc.stdout)
						}
					} else if r.stdout != tc.stdout {
						t.Errorf("stdout %q, want %q", r.stdout, tc.stdout)
					}
					if r.stderr != tc.stderr && !tc.anyStderr {
						t.Errorf("stderr %q, want %q", r.stderr, tc.stderr)
					}
					if r.end == nil {
						t.Fatal("no end event")
					}
					if r.end.GetExitCode() != tc.code || r.end.GetStatus() != tc.status || r.end.GetExited() != tc.wantExited {
						t.Errorf("end %v, want exit code %d, status %q, exited %v", r.end, tc.code, tc.status, tc.wantExited)
					}
				})
			}
		})
	}
}

func TestStartRefuses(t *testing.T) {
	e := newEnv(t)
	id := e.sandbox()
	c := e.process(id, nil)
	tests := []struct {
		name string
		req  *connect.Request[processpb.StartRequest]
		code connect.Code
	}{
		{"no cmd", connect.NewRequest(&processpb.StartRequest{Process: &processpb.ProcessConfig{}}), connect.CodeInvalidArgument},
		{"no such program", connect.NewRequest(&processpb.StartRequest{Process: &processpb.ProcessConfig{Cmd: "/no/such/program"}}), connect.CodeNotFound},
		{"bad env", startReq("true", func(r *processpb.StartRequest) { r.Process.Envs = map[string]string{"A\x00": "b"} }), connect.CodeInvalidArgument},
		{"bad authorization", startReq("true", func(r *processpb.StartRequest) {}), connect.CodeUnauthenticated},
	}
	tests[3].req.Header().Set("Authorization", "Bearer x")
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r := run(t, c, tc.req)
			wantCode(t, r.err, tc.code)
		})
	}
	// An unknown sandbox is not found.
	r := run(t, e.process("sb-nope", nil), startReq("true"))
	wantCode(t, r.err, connect.CodeNotFound)
}

// TestBackgroundConnectKill: a process outlives its Start call, is
// listed with its tag, followed again by Connect, and killed.
func TestBackgroundConnectKill(t *testing.T) {
	e := newEnv(t)
	id := e.sandbox()
	for _, cd := range codecs {
		t.Run(cd.name, func(t *testing.T) {
			c := e.process(id, cd.opts)
			tag := "bg-" + cd.name
			ctx, cancel := context.WithCancel(ctxT(t))
			s, err := c.Start(ctx, startReq("echo ready; exec sleep 60", func(r *processpb.StartRequest) { r.Tag = &tag }))
			if err != nil {
				t.Fatal(err)
			}
			var pid uint32
			for s.Receive() {
				ev := s.Msg().GetEvent()
				if st := ev.GetStart(); st != nil {
					pid = st.GetPid()
				}
				if string(ev.GetData().GetStdout()) == "ready\n" {
					break
				}
			}
			cancel() // the SDK's client goes; the process stays
			s.Close()

			list, err := c.List(ctxT(t), connect.NewRequest(&processpb.ListRequest{}))
			if err != nil {
				t.Fatal(err)
			}
			var found *processpb.ProcessInfo
			for _, p := range list.Msg.GetProcesses() {
				if p.GetPid() == pid {
					found = p
				}
			}
			if found == nil || found.GetTag() != tag || found.GetConfig().GetCmd() != "/bin/sh" {
				t.Fatalf("list %v: want pid %d tagged %q", list.Msg.GetProcesses(), pid, tag)
			}

			cs, err := c.Connect(ctxT(t), connect.NewRequest(&processpb.ConnectRequest{
				Process: &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Tag{Tag: tag}}}))
			if err != nil {
				t.Fatal(err)
			}
			if !cs.Receive() || cs.Msg().GetEvent().GetStart().GetPid() != pid {
				t.Fatalf("connect's first event %v (%v): want start of %d", cs.Msg(), cs.Err(), pid)
			}
			sel := &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: pid}}
			if _, err := c.SendSignal(ctxT(t), connect.NewRequest(&processpb.SendSignalRequest{Process: sel, Signal: processpb.Signal_SIGNAL_SIGKILL})); err != nil {
				t.Fatal(err)
			}
			r := drain(cs, func() *processpb.ProcessEvent { return cs.Msg().GetEvent() })
			if r.err != nil || r.end == nil || r.end.GetStatus() != "signal: killed" || r.end.GetExited() {
				t.Fatalf("after kill: %+v, want end with signal: killed", r)
			}
			// Gone: a second kill and a Connect are not found.
			_, err = c.SendSignal(ctxT(t), connect.NewRequest(&processpb.SendSignalRequest{Process: sel, Signal: processpb.Signal_SIGNAL_SIGKILL}))
			wantCode(t, err, connect.CodeNotFound)
		})
	}
}

func TestStdin(t *testing.T) {
	e := newEnv(t)
	id := e.sandbox()
	for _, cd := range codecs {
		t.Run(cd.name, func(t *testing.T) {
			c := e.process(id, cd.opts)
			yes := true
			s, err := c.Start(ctxT(t), startReq("cat; echo done", func(r *processpb.StartRequest) { r.Stdin = &yes }))
			if err != nil {
				t.Fatal(err)
			}
			if !s.Receive() {
				t.Fatal(s.Err())
			}
			sel := &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: s.Msg().GetEvent().GetStart().GetPid()}}
			for _, in := range []*processpb.ProcessInput{
				{Input: &processpb.ProcessInput_Stdin{Stdin: []byte("abc ")}},
				{Input: &processpb.ProcessInput_Pty{Pty: []byte("def\n")}},
			} {
				if _, err := c.SendInput(ctxT(t), connect.NewRequest(&processpb.SendInputRequest{Process: sel, Input: in})); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := c.CloseStdin(ctxT(t), connect.NewRequest(&processpb.CloseStdinRequest{Process: sel})); err != nil {
				t.Fatal(err)
			}
			r := drain(s, func() *processpb.ProcessEvent { return s.Msg().GetEvent() })
			if r.err != nil || r.stdout != "abc def\ndone\n" || r.end.GetExitCode() != 0 {
				t.Fatalf("%+v: want abc def, done, exit 0", r)
			}
		})
	}
}

// TestStreamInput: the client-streaming input call.
func TestStreamInput(t *testing.T) {
	e := newEnv(t)
	id := e.sandbox()
	c := e.process(id, nil)
	yes := true
	s, err := c.Start(ctxT(t), startReq("cat", func(r *processpb.StartRequest) { r.Stdin = &yes }))
	if err != nil {
		t.Fatal(err)
	}
	if !s.Receive() {
		t.Fatal(s.Err())
	}
	sel := &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: s.Msg().GetEvent().GetStart().GetPid()}}
	in := c.StreamInput(ctxT(t))
	msgs := []*processpb.StreamInputRequest{
		{Event: &processpb.StreamInputRequest_Start{Start: &processpb.StreamInputRequest_StartEvent{Process: sel}}},
		{Event: &processpb.StreamInputRequest_Data{Data: &processpb.StreamInputRequest_DataEvent{Input: &processpb.ProcessInput{Input: &processpb.ProcessInput_Stdin{Stdin: []byte("abc")}}}}},
		{Event: &processpb.StreamInputRequest_Keepalive{Keepalive: &processpb.StreamInputRequest_KeepAlive{}}},
		{Event: &processpb.StreamInputRequest_Data{Data: &processpb.StreamInputRequest_DataEvent{Input: &processpb.ProcessInput{Input: &processpb.ProcessInput_Stdin{Stdin: []byte("def")}}}}},
	}
	for _, m := range msgs {
		if err := in.Send(m); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := in.CloseAndReceive(); err != nil {
		t.Fatal(err)
	}
	if _, err := c.CloseStdin(ctxT(t), connect.NewRequest(&processpb.CloseStdinRequest{Process: sel})); err != nil {
		t.Fatal(err)
	}
	r := drain(s, func() *processpb.ProcessEvent { return s.Msg().GetEvent() })
	if r.err != nil || r.stdout != "abcdef" {
		t.Fatalf("%+v: want abcdef", r)
	}
}

func TestProcessErrors(t *testing.T) {
	e := newEnv(t)
	id := e.sandbox()
	c := e.process(id, []connect.ClientOption{connect.WithProtoJSON()})
	nope := &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: 1 << 30}}
	tag := &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Tag{Tag: "nope"}}
	_, err := c.SendSignal(ctxT(t), connect.NewRequest(&processpb.SendSignalRequest{Process: nope, Signal: processpb.Signal_SIGNAL_SIGTERM}))
	wantCode(t, err, connect.CodeNotFound)
	_, err = c.SendSignal(ctxT(t), connect.NewRequest(&processpb.SendSignalRequest{Process: nope}))
	wantCode(t, err, connect.CodeInvalidArgument)
	_, err = c.SendInput(ctxT(t), connect.NewRequest(&processpb.SendInputRequest{Process: tag,
		Input: &processpb.ProcessInput{Input: &processpb.ProcessInput_Stdin{Stdin: []byte("x")}}}))
	wantCode(t, err, connect.CodeNotFound)
	_, err = c.CloseStdin(ctxT(t), connect.NewRequest(&processpb.CloseStdinRequest{Process: &processpb.ProcessSelector{}}))
	wantCode(t, err, connect.CodeInvalidArgument)
	cs, err := c.Connect(ctxT(t), connect.NewRequest(&processpb.ConnectRequest{Process: nope}))
	if err == nil {
		cs.Receive()
		err = cs.Err()
	}
	wantCode(t, err, connect.CodeNotFound)

	// A process without stdin takes no input, and one without a pty no
	// resize.
	s, err := c.Start(ctxT(t), startReq("exec sleep 60"))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if !s.Receive() {
		t.Fatal(s.Err())
	}
	sel := &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: s.Msg().GetEvent().GetStart().GetPid()}}
	_, err = c.SendInput(ctxT(t), connect.NewRequest(&processpb.SendInputRequest{Process: sel,
		Input: &processpb.ProcessInput{Input: &processpb.ProcessInput_Stdin{Stdin: []byte("x")}}}))
	wantCode(t, err, connect.CodeFailedPrecondition)
	_, err = c.Update(ctxT(t), connect.NewRequest(&processpb.UpdateRequest{Process: sel,
		Pty: &processpb.PTY{Size: &processpb.PTY_Size{Cols: 100, Rows: 40}}}))
	wantCode(t, err, connect.CodeFailedPrecondition)
	if _, err := c.SendSignal(ctxT(t), connect.NewRequest(&processpb.SendSignalRequest{Process: sel, Signal: processpb.Signal_SIGNAL_SIGTERM})); err != nil {
		t.Fatal(err)
	}
	r := drain(s, func() *processpb.ProcessEvent { return s.Msg().GetEvent() })
	if r.end.GetStatus() != "signal: terminated" {
		t.Fatalf("after SIGTERM: %+v", r)
	}
}

// TestKeepalive: a stream that carries nothing gets keepalive events at
// the interval the client asks.
func TestKeepalive(t *testing.T) {
	e := newEnv(t)
	id := e.sandbox()
	c := e.process(id, []connect.ClientOption{connect.WithProtoJSON()})
	req := startReq("sleep 2.5")
	req.Header().Set(keepaliveHeader, "1")
	r := run(t, c, req)
	if r.err != nil || r.end == nil {
		t.Fatalf("%+v", r)
	}
	if r.keepalives == 0 {
		t.Fatal("no keepalive event in 2.5 s at a 1 s interval")
	}
}

func TestKeepaliveInterval(t *testing.T) {
	tests := []struct {
		hdr  string
		want time.Duration
	}{
		{"", 50 * time.Second}, {"x", 50 * time.Second}, {"-3", 50 * time.Second},
		{"1", time.Second}, {"50", 50 * time.Second}, {"100000", 300 * time.Second},
	}
	for _, tc := range tests {
		h := map[string][]string{}
		if tc.hdr != "" {
			h[keepaliveHeader] = []string{tc.hdr}
		}
		if got := keepaliveInterval(h); got != tc.want {
			t.Errorf("%q: %v, want %v", tc.hdr, got, tc.want)
		}
	}
}

// TestStartTimeout: a Start's Connect-Timeout-Ms is its process's
// lifetime, as envd's (the SDKs' commands.run timeout, 60 s by default,
// ends the command, background ones too), and a Start without one leaves
// its process to run on after the call.
func TestStartTimeout(t *testing.T) {
	e := newEnv(t)
	id := e.sandbox()
	c := e.process(id, []connect.ClientOption{connect.WithProtoJSON()})
	listed := func(pid uint32) bool {
		list, err := c.List(ctxT(t), connect.NewRequest(&processpb.ListRequest{}))
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range list.Msg.GetProcesses() {
			if p.GetPid() == pid {
				return true
			}
		}
		return false
	}
	start := func(ctx context.Context) (uint32, *connect.ServerStreamForClient[processpb.StartResponse]) {
		s, err := c.Start(ctx, startReq("exec sleep 60"))
		if err != nil {
			t.Fatal(err)
		}
		if !s.Receive() || s.Msg().GetEvent().GetStart() == nil {
			t.Fatalf("first event %v (%v): want start", s.Msg(), s.Err())
		}
		return s.Msg().GetEvent().GetStart().GetPid(), s
	}

	// The client's deadline is sent as Connect-Timeout-Ms.
	ctx, cancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
	defer cancel()
	pid, s := start(ctx)
	r := drain(s, func() *processpb.ProcessEvent { return s.Msg().GetEvent() })
	s.Close()
	if connect.CodeOf(r.err) != connect.CodeDeadlineExceeded && r.end == nil {
		t.Fatalf("the stream past its deadline: %+v", r)
	}
	for end := time.Now().Add(10 * time.Second); listed(pid); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("process %d still runs 10 s past its call's 1.5 s timeout", pid)
		}
	}

	// No deadline: the process outlives the call.
	ctx, cancel = context.WithCancel(context.Background())
	pid, s = start(ctx)
	cancel()
	s.Close()
	time.Sleep(2 * time.Second)
	if !listed(pid) {
		t.Fatalf("process %d, started without a timeout, is gone when its call is", pid)
	}
	sel := &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: pid}}
	if _, err := c.SendSignal(ctxT(t), connect.NewRequest(&processpb.SendSignalRequest{Process: sel, Signal: processpb.Signal_SIGNAL_SIGKILL})); err != nil {
		t.Fatal(err)
	}
}

func TestProcessTimeoutMs(t *testing.T) {
	for _, tc := range []struct {
		hdr  string
		want int64
		bad  bool
	}{{"", 0, false}, {"0", 0, false}, {"60000", 60000, false}, {"x", 0, true}, {"-1", 0, true}} {
		h := http.Header{}
		if tc.hdr != "" {
			h.Set(timeoutHeader, tc.hdr)
		}
		got, err := processTimeoutMs(h)
		if got != tc.want || (err != nil) != tc.bad {
			t.Errorf("%q: %d, %v; want %d (error %v)", tc.hdr, got, err, tc.want, tc.bad)
		}
	}
}

// TestProcessTable: the table is bounded, and a sandbox's entries go
// when it ends.
func TestProcessTable(t *testing.T) {
	e := newEnv(t, WithLimits(Limits{ProcessesPerSandbox: 2}))
	id := e.sandbox()
	c := e.process(id, nil)
	var streams []*connect.ServerStreamForClient[processpb.StartResponse]
	for range 2 {
		yes := true // the double's process then waits for its stdin too
		s, err := c.Start(ctxT(t), startReq("exec sleep 60", func(r *processpb.StartRequest) { r.Stdin = &yes }))
		if err != nil {
			t.Fatal(err)
		}
		if !s.Receive() {
			t.Fatal(s.Err())
		}
		streams = append(streams, s)
	}
	r := run(t, c, startReq("true"))
	wantCode(t, r.err, connect.CodeResourceExhausted)
	streams[1].Close()
	if _, err := e.kiln.DestroySandbox(ctxT(t), &kilnpb.DestroySandboxRequest{Id: id}); err != nil {
		t.Fatal(err)
	}
	// A follower learns the sandbox went: its process's end, or
	// Unavailable.
	s := streams[0]
	r = drain(s, func() *processpb.ProcessEvent { return s.Msg().GetEvent() })
	if r.end == nil && connect.CodeOf(r.err) != connect.CodeUnavailable {
		t.Fatalf("after the sandbox ended: %+v (%v)", r, r.err)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		e.h.mu.Lock()
		n := len(e.h.sandboxes)
		e.h.mu.Unlock()
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the table still holds %d sandboxes after the sandbox ended", n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestConnectNotHeld: a process another Handler started (as after a
// restart of kilnd) is followed through AttachExec and signalled
// through ListExecs. Needs kilnd's AttachExec.
func TestConnectNotHeld(t *testing.T) {
	e := newEnv(t)
	id := e.sandbox()
	c := e.process(id, nil)
	s, err := c.Start(ctxT(t), startReq("read line; echo got $line; exec sleep 60", func(r *processpb.StartRequest) {
		yes := true
		r.Stdin = &yes
	}))
	if err != nil {
		t.Fatal(err)
	}
	if !s.Receive() {
		t.Fatal(s.Err())
	}
	pid := s.Msg().GetEvent().GetStart().GetPid()
	sel := &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: pid}}
	s.Close()

	// A second Handler does not hold it.
	other := New(e.kiln, nil)
	defer other.Close()
	e.h, other = other, e.h
	defer func() { e.h = other }()
	_, err = c.SendInput(ctxT(t), connect.NewRequest(&processpb.SendInputRequest{Process: sel,
		Input: &processpb.ProcessInput{Input: &processpb.ProcessInput_Stdin{Stdin: []byte("x\n")}}}))
	wantCode(t, err, connect.CodeFailedPrecondition)

	probe, err := e.kiln.AttachExec(ctxT(t), &kilnpb.AttachExecRequest{SandboxId: id, ExecId: "ex-nope"})
	if err == nil {
		_, err = probe.Recv()
	}
	needs(t, err, "AttachExec")

	cs, err := c.Connect(ctxT(t), connect.NewRequest(&processpb.ConnectRequest{Process: sel}))
	if err != nil {
		t.Fatal(err)
	}
	if !cs.Receive() || cs.Msg().GetEvent().GetStart().GetPid() != pid {
		t.Fatalf("connect's first event %v (%v)", cs.Msg(), cs.Err())
	}
	if _, err := c.SendSignal(ctxT(t), connect.NewRequest(&processpb.SendSignalRequest{Process: sel, Signal: processpb.Signal_SIGNAL_SIGKILL})); err != nil {
		t.Fatal(err)
	}
	r := drain(cs, func() *processpb.ProcessEvent { return cs.Msg().GetEvent() })
	if r.err != nil || r.end.GetStatus() != "signal: killed" {
		t.Fatalf("%+v", r)
	}
}

// TestPty: a process on a terminal, typed into and resized. Needs the
// agent's pty support in kilnd.
func TestPty(t *testing.T) {
	e := newEnv(t)
	id := e.sandbox()
	c := e.process(id, []connect.ClientOption{connect.WithProtoJSON()})
	s, err := c.Start(ctxT(t), connect.NewRequest(&processpb.StartRequest{
		Process: &processpb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", "stty size; read l; stty size; echo got $l"}},
		Pty:     &processpb.PTY{Size: &processpb.PTY_Size{Cols: 91, Rows: 33}}}))
	if err != nil {
		t.Fatal(err)
	}
	if !s.Receive() {
		t.Fatal(s.Err())
	}
	sel := &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: s.Msg().GetEvent().GetStart().GetPid()}}
	var out strings.Builder
	for !strings.Contains(out.String(), "\n") && s.Receive() {
		out.Write(s.Msg().GetEvent().GetData().GetPty())
		out.Write(s.Msg().GetEvent().GetData().GetStdout())
		out.Write(s.Msg().GetEvent().GetData().GetStderr())
		if end := s.Msg().GetEvent().GetEnd(); end != nil {
			break
		}
	}
	if !strings.Contains(out.String(), "33 91") {
		c.SendSignal(ctxT(t), connect.NewRequest(&processpb.SendSignalRequest{Process: sel, Signal: processpb.Signal_SIGNAL_SIGKILL}))
		t.Fatalf("not on a terminal of 33x91: stty said %q", out.String())
	}
	if _, err := c.Update(ctxT(t), connect.NewRequest(&processpb.UpdateRequest{Process: sel,
		Pty: &processpb.PTY{Size: &processpb.PTY_Size{Cols: 120, Rows: 50}}})); err != nil {
		t.Fatal(err)
	}
	if _, err := c.SendInput(ctxT(t), connect.NewRequest(&processpb.SendInputRequest{Process: sel,
		Input: &processpb.ProcessInput{Input: &processpb.ProcessInput_Pty{Pty: []byte("hi\n")}}})); err != nil {
		t.Fatal(err)
	}
	r := drain(s, func() *processpb.ProcessEvent { return s.Msg().GetEvent() })
	if r.err != nil || !strings.Contains(r.pty, "50 120") || !strings.Contains(r.pty, "got hi") || r.stdout != "" {
		t.Fatalf("%+v: want the new size and got hi on the pty", r)
	}
}
