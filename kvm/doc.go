// Package kvm is a thin, typed layer over the Linux KVM API (Documentation/virt/kvm/api.rst).
//
// It opens /dev/kvm, creates VMs and vCPUs, and wraps each ioctl Kiln uses in a
// method whose argument is a Go struct laid out exactly like the kernel's. It
// holds no policy: what a VM looks like is decided in package vmm. Every ioctl
// except KVM_RUN is retried on EINTR; KVM_RUN reports EINTR to its caller, which
// is how a vCPU is kicked out of the guest (see VCPU.Run).
package kvm
