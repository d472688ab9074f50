// Package jail confines a VMM process (package vmmproc) so that a guest
// that took it over lands in an empty, unprivileged box: Enter makes the
// process's mounts private, builds a root on a tmpfs holding only what
// the VMM needs (bind mounts at the same paths as on the host), pivots
// into it, sets rlimits, drops every capability (bounding and ambient
// sets too), takes a per-sandbox uid and gid and sets NO_NEW_PRIVS, on
// every thread. IDs hands out those per-sandbox ids, each held by a
// locked file whose descriptor the VMM process inherits. The namespaces
// (mount, PID, network, IPC, UTS) are the parent's to give at clone time
// (vmmproc.StartConfig.Jail); Enter checks that it has a mount namespace
// of its own before it touches a mount. Linux only; the process must not
// use cgo (the runtime then reaches every thread: syscall.AllThreadsSyscall).
package jail
