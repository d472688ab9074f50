// Package daemon is kilnd's core: the kiln.v1 gRPC service (kilnpb) over
// the sandboxes of one host. A Backend runs the sandboxes: kilnd wires in
// vmmbackend's, which runs each in a VMM process of its own; the daemon
// imports no VMM layer and no guest package, and the Backend and Instance
// interfaces speak its own plain types (backend.go). The server keeps
// the sandboxes' records in a state folder, so that a restarted server
// takes every running sandbox over and lists it again, and enforces host
// limits, request IDs, and lifetime and idle timeouts.
//
// # A sandbox's lifecycle
//
// A sandbox (a box, in the code) is in one state at a time (boxState, in
// boxstate.go), which only its gate changes. Every operation on it asks
// the gate first: begin(op) refuses the operation with a
// *boxStateError naming the state, which the API answers as
// FailedPrecondition (and the E2B API as 409 Conflict), or moves the box
// to the operation's in-progress state; done(op, err) moves it on to
// where the operation ends, on success or on failure:
//
//	operation  may begin in                      while it runs  ok           failed
//	start      (a box is born starting)          starting       running      failed
//	attach     running, paused, as recorded (1)  starting       as it began  failed
//	pause      running                           pausing (2)    paused       running
//	resume     paused                            resuming (2)   running      paused
//	hibernate  running, paused                   hibernating    hibernated   as it began
//	wake       hibernated                        waking         running      hibernated
//	rollback   running                           rolling back   running      running (3)
//	destroy    any (4)                           ending         destroyed
//	stop       any (4)                           ending         stopped
//	fail       any (4)                           ending         failed
//	timeout    running, paused                   ending         timed out
//	use        running: exec, files, checkpoint, fork, a metrics sample
//	lend       running, paused: hand out an in-memory checkpoint
//	update     any (4) or starting: lifetime, timeout action, labels, egress
//	metrics    any (4) or starting: read the samples
//
// (1) A kilnd that starts takes the live sandboxes of its records over: a
// box read from its record is in the state it records (one recorded
// starting as running), and attaching its VMM process is the operation;
// a hibernated one has none to attach. (2) A pause or resume holds the
// box's lock over its call, so no other call sees these states. (3) Once
// its old machine is closed, a rollback that fails ends the sandbox as
// failed (fail). (4) Any state but starting (a destroy waits for its
// create to finish), ending and the four final ones (destroyed, stopped,
// failed, timed out).
//
// An end but a timeout (destroy, stop, fail) may begin while another
// operation is in progress: it takes the box over, and that operation's
// done then changes nothing and tells it so, so that it closes what it
// held (a machine it took out of the box or made). So a destroy during
// a rollback, hibernation or wake stands, whatever that operation does
// next. Use, lend, update and metrics change no state; the others do not
// begin while one is in progress.
//
// The API shows a box's state as kilnpb's: starting and rolling back as
// STARTING, hibernated and waking as PAUSED with hibernated set, and an
// in-progress state without one of its own (pausing, resuming,
// hibernating, ending) as the state before it. The record's state (on
// disk) is written from the gate's outcome only; its hibernated field is
// what a restarted kilnd reads the hibernated state from.
package daemon
