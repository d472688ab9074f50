// Package pid1 does the chores of the Kiln guest agent when it runs as /init,
// process 1 of the sandbox VM: mounting the pseudo-filesystems, loading the
// kernel modules the initramfs carries, reading Kiln's parameters from the
// kernel command line, setting the hostname, switching from the initramfs to
// a root filesystem on a block device, and powering the VM off. With
// kiln.init=systemd it also installs the agent as a systemd service of an
// image root (InstallAgentService), for process 1 to exec /sbin/init.
//
// Every system call goes through a Sys, a struct of functions, so that tests
// can check the logic without touching the host. Linux returns the real
// one; the package-level functions (MountBase, LoadModules, SwitchRoot,
// Setup, ...) use it.
package pid1
