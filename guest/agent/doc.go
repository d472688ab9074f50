// Package agent implements kiln-agent's gRPC service (package
// guest/agentpb): running processes, moving files, reporting on the guest
// and the snapshot hooks (quiesce, reseed, set clock, power off).
//
// The agent runs as PID 1, so it must reap every orphan that the kernel
// re-parents to it. A [Reaper] is therefore the only caller of wait4 in the
// process: it reaps on SIGCHLD and hands the status of the processes it
// started to their waiters. Nothing else in the agent may wait for children
// (os/exec's Cmd.Wait would race with it) while a Reaper runs in orphan mode.
//
// Processes started by Exec go through a trampoline: the agent re-executes
// its own binary (/proc/self/exe) with argv[0] "kiln-agent-exec"; the
// trampoline gives the process back a normal OOM score (the agent protects
// itself with -1000, which children would inherit), switches credentials if
// asked and execs the target, reporting a failed exec through a close-on-exec
// pipe. The binary's main must therefore call [MaybeRunTrampoline] first.
//
// Every process of an Exec runs in its own process group, so a timeout or a
// cancelled call kills the whole group. With Config.CgroupRoot set, each
// Exec also runs in its own cgroup below a "sandbox" cgroup that caps the
// number of tasks and the memory, so that a fork bomb or a memory hog fails
// inside the sandbox while the agent keeps answering.
//
// A detached Exec (ExecStart.detach_id) is not killed when its call ends:
// the Server keeps it in a table by ID, reads its output on (keeping the
// last 64 KiB of each stream) and records its exit, and ListDetached,
// SignalDetached, WaitDetached and ForgetDetached reach it from any later
// connection, so that the host's side may restart without touching it;
// AttachDetached streams its output from then on to any number of callers,
// dropping one that falls behind rather than holding the process back.
//
// An Exec with a pty runs on a new pseudo-terminal in a session of its own
// (the terminal its controlling one; setsid and TIOCSCTTY), whose size a
// resize request sets (TIOCSWINSZ, so the kernel sends SIGWINCH). An Exec
// with a user runs as that user of the guest's /etc/passwd, with the
// groups /etc/group lists it in (package accounts reads them); file calls
// may give what they create to a user too, and describe owners by name.
// Watch watches a directory tree with inotify (package dirwatch).
//
// All state belongs to a [Server] (or to its Reaper): there are no globals,
// and several Servers may run in one process (as tests do).
package agent
