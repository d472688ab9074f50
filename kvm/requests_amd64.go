package kvm

// IoctlRequests returns every ioctl request number this package issues, on
// /dev/kvm, a VM or a vCPU: the list a seccomp filter allows for a VMM
// (package seccomp). A new ioctl added to numbers_amd64.go or
// vcpu_state.go belongs here too; TestIoctlRequestsComplete checks it.
func IoctlRequests() []uintptr {
	// KVM_RUN and KVM_IRQ_LINE come first: a seccomp filter compares an
	// ioctl's request with each allowed one in turn (the kernel caches
	// no verdict for a call whose arguments it checks), and these two
	// are made on every VM exit and interrupt.
	return []uintptr{
		reqRun, reqIRQLine,
		reqGetAPIVersion, reqCreateVM, reqGetMSRIndexList, reqCheckExtension,
		reqGetVCPUMmapSize, reqGetSupportedCPUID, reqCreateVCPU,
		reqSetUserMemoryRegion, reqSetTSSAddr, reqSetIdentityMapAddr,
		reqCreateIRQChip, reqGetIRQChip, reqSetIRQChip, reqIRQFD,
		reqCreatePIT2, reqIOEventFD, reqSetClock, reqGetClock, reqGetPIT2,
		reqSetPIT2, reqEnableCap,

		reqGetRegs, reqSetRegs, reqGetSregs, reqSetSregs, reqGetMSRs,
		reqSetMSRs, reqGetFPU, reqSetFPU, reqGetLAPIC, reqSetLAPIC,
		reqSetCPUID2, reqGetCPUID2, reqGetMPState, reqSetMPState,
		reqGetVCPUEvents, reqSetVCPUEvents, reqGetTSCKHz, reqSetTSCKHz,
		reqGetXSave, reqSetXSave, reqGetXCRs, reqSetXCRs, reqKVMClockCtrl,
		reqGetXSave2, reqGetDebugRegs, reqSetDebugRegs,
	}
}
