package vmm

import (
	"errors"
	"fmt"
	"os"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/kvm"
	"github.com/kilnvm/kiln/virtio"
)

// ioEvents are the ioeventfds the VM registers for one transport, so that
// the guest's queue notifications reach the device without a vCPU exit to
// userspace (as Firecracker's device manager, not the device, wires them).
type ioEvents struct {
	vm    *kvm.VM
	regs  []kvm.IOEventFD // as registered, to deassign
	files []*os.File
	wg    sync.WaitGroup
}

// attachIOEvents registers with KVM, for each of m's queues, an ioeventfd
// on the QueueNotify register of the transport at guest-physical base (a
// 4-byte write matching the queue index), and serves each with a goroutine
// that hands the notification to m. Writes that match no queue still
// reach the transport as MMIO exits. close undoes it.
func attachIOEvents(vm *kvm.VM, m *virtio.MMIO, base uint64) (_ *ioEvents, err error) {
	ev := &ioEvents{vm: vm}
	defer func() {
		if err != nil {
			ev.close()
		}
	}()
	for i := range m.NumQueues() {
		fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
		if err != nil {
			return nil, fmt.Errorf("virtio-mmio queue %d: eventfd: %w", i, err)
		}
		// A non-blocking fd goes to the runtime poller, so Close wakes
		// the goroutine reading it.
		f := os.NewFile(uintptr(fd), fmt.Sprintf("virtio-notify-%d", i))
		reg := kvm.IOEventFD{
			DataMatch: uint64(i),
			Addr:      base + virtio.MMIOQueueNotify,
			Len:       4,
			FD:        int32(fd),
			Flags:     kvm.IOEventFDFlagDataMatch,
		}
		if err := vm.IOEventFD(&reg); err != nil {
			f.Close()
			return nil, fmt.Errorf("virtio-mmio queue %d: %w", i, err)
		}
		ev.regs = append(ev.regs, reg)
		ev.files = append(ev.files, f)
	}
	for i, f := range ev.files {
		ev.wg.Add(1)
		go func() {
			defer ev.wg.Done()
			var buf [8]byte
			for {
				if _, err := f.Read(buf[:]); err != nil {
					return // closed
				}
				m.Notify(uint32(i))
			}
		}()
	}
	return ev, nil
}

// close deassigns the ioeventfds, closes them and waits for their
// goroutines. A nil ioEvents has nothing to close.
func (ev *ioEvents) close() error {
	if ev == nil {
		return nil
	}
	var errs []error
	for _, reg := range ev.regs {
		reg.Flags |= kvm.IOEventFDFlagDeassign
		if err := ev.vm.IOEventFD(&reg); err != nil {
			errs = append(errs, err)
		}
	}
	for _, f := range ev.files {
		errs = append(errs, f.Close())
	}
	ev.wg.Wait()
	return errors.Join(errs...)
}
