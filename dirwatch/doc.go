// Package dirwatch watches a directory tree with Linux's inotify: the
// entries created, written, removed, renamed away and changed in a
// directory and, recursively, in its subdirectories (those created later
// included), as plain events. The guest agent's Watch serves it; kilnd's
// test double watches host folders with it.
package dirwatch
