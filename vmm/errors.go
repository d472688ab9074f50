package vmm

// ConfigError says that a VM cannot be what it was asked to be: a spec
// that does not validate, a kernel or initrd that cannot be read or does
// not fit, a device whose image or tap cannot be opened, a restore's
// overrides that do not fit the snapshot. The caller must change its
// input; trying again will not help. Other errors of New and Restore are
// the host's (KVM, memory). Match it with errors.As.
type ConfigError struct {
	Err error
}

func (e *ConfigError) Error() string { return e.Err.Error() }

func (e *ConfigError) Unwrap() error { return e.Err }
