package vmm

import (
	"context"
	"time"
)

// reportSuppressedLogs writes, every interval of the VM's log limit until
// stop, the "suppressed" lines of messages the guest made it drop, so that
// a storm that ends is reported while the VM runs on, not only at Close.
func (v *VM) reportSuppressedLogs(stop <-chan struct{}) {
	tick := time.NewTicker(v.logLimit.Interval())
	defer tick.Stop()
	for {
		select {
		case <-stop:
			return
		case <-tick.C:
			v.logLimit.ReportExpired(context.Background())
		}
	}
}
