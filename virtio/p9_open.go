package virtio

import (
	"errors"
	"io"
)

// fsDevice is an fs device opened from a spec: the 9p device and what
// releases its tree.
type fsDevice struct {
	Device
	closer io.Closer
}

// newFSDevice makes the 9p device for cfg, owning closer.
func newFSDevice(cfg FSConfig, closer io.Closer) (Device, error) {
	dev, err := NewFS(cfg)
	if err != nil {
		return nil, err
	}
	return &fsDevice{Device: dev, closer: closer}, nil
}

// Close closes the device, then releases its tree.
func (d *fsDevice) Close() error {
	var err error
	if c, ok := d.Device.(io.Closer); ok {
		err = c.Close()
	}
	if d.closer != nil {
		err = errors.Join(err, d.closer.Close())
	}
	return err
}

// Diagnose passes on the 9p device's own account, if it gives one.
func (d *fsDevice) Diagnose() string {
	if dg, ok := d.Device.(Diagnoser); ok {
		return dg.Diagnose()
	}
	return ""
}

// Unwrap returns the 9p device.
func (d *fsDevice) Unwrap() Device { return d.Device }
