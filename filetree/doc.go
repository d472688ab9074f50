// Package filetree is the file calls of a sandbox's guest on a Unix file
// tree: write a file whole (mode, owner, missing parents), read it, stat
// and list (to a depth) with owners named by the tree's account files,
// make a directory, move, remove and watch, on absolute paths of the tree.
// Their errors are gRPC statuses, with the codes and messages the guest
// agent answers with (Status maps an errno). The guest agent serves its
// own root with it (a Tree whose Root is "/"); kilnd's test double, a host
// folder taken as a sandbox's root.
package filetree
