// Package vmm builds and runs a KVM virtual machine that boots Linux: guest
// RAM on a memfd, one locked OS thread per vCPU, the in-kernel irqchip and
// PIT, the x86-64 boot protocol (bzImage or ELF/PVH), ACPI tables generated in
// Go, a 16550 UART on COM1 and ACPI power registers. VM.Run returns why the
// guest stopped (power-off, reboot, panic, triple fault) or that its context
// was cancelled; Pause and Resume stop every vCPU at an exit boundary.
package vmm
