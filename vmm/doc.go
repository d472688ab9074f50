// Package vmm builds and runs a KVM virtual machine that boots Linux: guest
// RAM on a memfd, one locked OS thread per vCPU, the in-kernel irqchip and
// PIT, the x86-64 boot protocol (bzImage or ELF/PVH), ACPI tables generated in
// Go, a 16550 UART on COM1 and ACPI power registers. VM.Run returns why the
// guest stopped (power-off, reboot, panic, triple fault) or that its context
// was cancelled; Pause and Resume stop every vCPU at an exit boundary.
//
// A VM has one lifecycle (VM.State: created, running, paused, saving,
// stopped): Run's start, Pause, Resume, SaveState, Checkpoint, Fork and
// Close may be called from many goroutines; one runs at a time, the others
// wait their turn, and an operation the state does not allow fails with a
// *StateError (ErrState).
package vmm
