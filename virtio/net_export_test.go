package virtio

// InNetnsForTest runs fn on a thread inside the network namespace at path,
// for the external KVM test's HTTP listener.
func InNetnsForTest(path string, fn func() error) error { return inNetns(path, fn) }

// NetnsDirForTest is where named network namespaces live.
const NetnsDirForTest = netnsDir
