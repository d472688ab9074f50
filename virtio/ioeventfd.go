package virtio

import (
	"errors"
	"fmt"
	"os"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/kvm"
)

// ioEvents are the ioeventfds that carry a transport's queue notifications
// without a vCPU exit to userspace.
type ioEvents struct {
	vm    *kvm.VM
	regs  []kvm.IOEventFD // as registered, to deassign
	files []*os.File
	wg    sync.WaitGroup
}

// AttachIOEventFD registers with KVM, for each queue, an ioeventfd on the
// QueueNotify register of this transport at guest-physical base (a 4-byte
// write matching the queue index), and serves each with a goroutine that
// calls the device's QueueNotify. Writes that match no queue still reach
// Write. Close undoes it.
func (m *MMIO) AttachIOEventFD(vm *kvm.VM, base uint64) (err error) {
	m.mu.Lock()
	attached := m.ioevents != nil
	m.mu.Unlock()
	if attached {
		return errors.New("virtio-mmio: ioeventfds already attached")
	}
	ev := &ioEvents{vm: vm}
	defer func() {
		if err != nil {
			ev.close()
		}
	}()
	for i := range m.queues {
		fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
		if err != nil {
			return fmt.Errorf("virtio-mmio queue %d: eventfd: %w", i, err)
		}
		// A non-blocking fd goes to the runtime poller, so Close wakes
		// the goroutine reading it.
		f := os.NewFile(uintptr(fd), fmt.Sprintf("virtio-notify-%d", i))
		reg := kvm.IOEventFD{
			DataMatch: uint64(i),
			Addr:      base + MMIOQueueNotify,
			Len:       4,
			FD:        int32(fd),
			Flags:     kvm.IOEventFDFlagDataMatch,
		}
		if err := vm.IOEventFD(&reg); err != nil {
			f.Close()
			return fmt.Errorf("virtio-mmio queue %d: %w", i, err)
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
				m.notify(uint32(i))
			}
		}()
	}
	m.mu.Lock()
	m.ioevents = ev
	m.mu.Unlock()
	return nil
}

// close deassigns the ioeventfds, closes them and waits for their
// goroutines.
func (ev *ioEvents) close() error {
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

// Close resets the device and releases the transport's ioeventfds. Call it
// before closing the KVM VM they were registered with.
func (m *MMIO) Close() error {
	m.mu.Lock()
	ev := m.ioevents
	m.ioevents = nil
	m.mu.Unlock()
	var err error
	if ev != nil {
		err = ev.close()
	}
	m.Reset()
	return err
}
