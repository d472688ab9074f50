package shim

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/kilnvm/kiln/guest/agentpb"
	"github.com/kilnvm/kiln/guest/client"
	"github.com/kilnvm/kiln/sandbox"
)

// Annotations a pod (through containerd's pod_annotations) or a container
// may carry to size its microVM.
const (
	AnnotationVCPUs     = "io.kiln.vcpus"
	AnnotationMemoryMiB = "io.kiln.memory-mib"
)

// containerd's CRI annotations: what kind of container a spec is, and its
// pod.
const (
	criContainerType = "io.kubernetes.cri.container-type"
	criSandboxID     = "io.kubernetes.cri.sandbox-id"
	criTypeSandbox   = "sandbox"
)

// Bounds on what a spec may ask of a VM.
const (
	maxSpecBytes = 4 << 20
)

// ErrUnsupported is wrapped by the errors of specs that ask for something
// a microVM cannot give (a host namespace, a device).
var ErrUnsupported = errors.New("not supported by the kiln runtime")

// readSpec reads a bundle's config.json, bounded.
func readSpec(bundle string) (*specs.Spec, error) {
	p := filepath.Join(bundle, "config.json")
	f, err := os.Open(p)
	if err != nil {
		return nil, fmt.Errorf("OCI spec: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("OCI spec: %w", err)
	}
	if fi.Size() > maxSpecBytes {
		return nil, fmt.Errorf("OCI spec %s: %d bytes, more than the %d accepted", p, fi.Size(), maxSpecBytes)
	}
	var s specs.Spec
	if err := json.NewDecoder(f).Decode(&s); err != nil {
		return nil, fmt.Errorf("OCI spec %s: %w", p, err)
	}
	return &s, nil
}

// isPodSandbox reports whether s is a CRI pod's sandbox (pause) container,
// which Kiln does not run: the pod's microVM is its application
// container's.
func isPodSandbox(s *specs.Spec) bool {
	return s.Annotations[criContainerType] == criTypeSandbox
}

// checkSpec refuses what a microVM does not give: host namespaces (the
// VM has its own kernel: its PID, IPC, UTS and network namespaces cannot
// be the host's), host devices, and a spec with no process.
func checkSpec(s *specs.Spec) error {
	if s.Process == nil || (len(s.Process.Args) == 0 && !isPodSandbox(s)) {
		return errors.New("OCI spec: no process to run (process.args is empty)")
	}
	if s.Linux == nil {
		return fmt.Errorf("OCI spec: no linux section: %w", ErrUnsupported)
	}
	have := map[specs.LinuxNamespaceType]bool{}
	for _, ns := range s.Linux.Namespaces {
		have[ns.Type] = true
	}
	for _, want := range []struct {
		t    specs.LinuxNamespaceType
		what string
	}{
		{specs.PIDNamespace, "the host's PID namespace (hostPID)"},
		{specs.IPCNamespace, "the host's IPC namespace (hostIPC)"},
		{specs.NetworkNamespace, "the host's network namespace (hostNetwork)"},
	} {
		if !have[want.t] {
			return fmt.Errorf("OCI spec asks for %s: a microVM has a kernel of its own: %w", want.what, ErrUnsupported)
		}
	}
	if n := len(s.Linux.Devices); n > 0 {
		return fmt.Errorf("OCI spec asks for %d host device(s), the first %s: a microVM does not pass host devices through: %w", n, s.Linux.Devices[0].Path, ErrUnsupported)
	}
	if s.Process.Terminal && s.Process.ConsoleSize != nil && (s.Process.ConsoleSize.Height > 65535 || s.Process.ConsoleSize.Width > 65535) {
		return fmt.Errorf("OCI spec: console size %dx%d: want at most 65535 each", s.Process.ConsoleSize.Width, s.Process.ConsoleSize.Height)
	}
	if s.Root == nil || s.Root.Path == "" {
		return errors.New("OCI spec: no root path")
	}
	return nil
}

// vmSize returns the vCPUs and MiB of memory of the VM that runs s: its
// annotations, else its resources (CPU quota over period, rounded up;
// memory limit, rounded up to a MiB), else def's.
func vmSize(s *specs.Spec, defCPUs, defMiB int) (cpus, memMiB int, err error) {
	cpus, memMiB = defCPUs, defMiB
	if r := resources(s); r != nil {
		if c := r.CPU; c != nil && c.Quota != nil && *c.Quota > 0 && c.Period != nil && *c.Period > 0 {
			cpus = int(math.Ceil(float64(*c.Quota) / float64(*c.Period)))
		}
		if m := r.Memory; m != nil && m.Limit != nil && *m.Limit > 0 {
			memMiB = int((*m.Limit + (1 << 20) - 1) >> 20)
		}
	}
	if v, ok := s.Annotations[AnnotationVCPUs]; ok {
		n, perr := strconv.Atoi(strings.TrimSpace(v))
		if perr != nil {
			return 0, 0, fmt.Errorf("annotation %s=%q: want a number of vCPUs", AnnotationVCPUs, v)
		}
		cpus = n
	}
	if v, ok := s.Annotations[AnnotationMemoryMiB]; ok {
		n, perr := strconv.Atoi(strings.TrimSpace(v))
		if perr != nil {
			return 0, 0, fmt.Errorf("annotation %s=%q: want a number of MiB", AnnotationMemoryMiB, v)
		}
		memMiB = n
	}
	if err := sandbox.CheckCPUs(cpus); err != nil {
		return 0, 0, fmt.Errorf("the spec asks for %w", err)
	}
	if memMiB < sandbox.MinMemoryMiB {
		memMiB = sandbox.MinMemoryMiB // the guest's kernel and agent need their share
	}
	if err := sandbox.CheckMemory(memMiB); err != nil {
		return 0, 0, fmt.Errorf("the spec asks for %w", err)
	}
	return cpus, memMiB, nil
}

// netnsPath is the path of the network namespace s joins (CRI's pod
// namespace, where CNI made the pod's interface), or "" for one of its
// own (no network for the VM).
func netnsPath(s *specs.Spec) string {
	if s.Linux == nil {
		return ""
	}
	for _, ns := range s.Linux.Namespaces {
		if ns.Type == specs.NetworkNamespace {
			return ns.Path
		}
	}
	return ""
}

// resolvConf is the host file s mounts on /etc/resolv.conf (CRI's, for
// the pod's DNS), or "".
func resolvConf(s *specs.Spec) string {
	for _, m := range s.Mounts {
		if filepath.Clean(m.Destination) == "/etc/resolv.conf" && filepath.IsAbs(m.Source) {
			return m.Source
		}
	}
	return ""
}

func resources(s *specs.Spec) *specs.LinuxResources {
	if s.Linux == nil {
		return nil
	}
	return s.Linux.Resources
}

// execOptions turns an OCI process into the agent's exec options.
func execOptions(p *specs.Process) (client.ExecOptions, error) {
	if p == nil || len(p.Args) == 0 {
		return client.ExecOptions{}, errors.New("process: no args")
	}
	for _, a := range p.Args {
		if strings.IndexByte(a, 0) >= 0 {
			return client.ExecOptions{}, errors.New("process: an argument holds a NUL byte")
		}
	}
	for _, e := range p.Env {
		if strings.IndexByte(e, 0) >= 0 || !strings.Contains(e, "=") {
			return client.ExecOptions{}, fmt.Errorf("process: environment entry %q: want NAME=VALUE", e)
		}
	}
	cwd := p.Cwd
	if cwd == "" {
		cwd = "/"
	}
	if !filepath.IsAbs(cwd) {
		return client.ExecOptions{}, fmt.Errorf("process: working directory %q is not absolute", cwd)
	}
	o := client.ExecOptions{
		Argv: append([]string(nil), p.Args...),
		Env:  append([]string(nil), p.Env...),
		Dir:  cwd,
		UID:  p.User.UID,
		GID:  p.User.GID,
	}
	if o.UID == 0 && o.GID == 0 {
		o.AsRoot = true
	}
	if p.Terminal {
		o.Pty = &client.PtySize{Rows: 24, Cols: 80}
		if cs := p.ConsoleSize; cs != nil && cs.Height > 0 && cs.Width > 0 {
			o.Pty = &client.PtySize{Rows: uint32(cs.Height), Cols: uint32(cs.Width)}
		}
	}
	return o, nil
}

// checkRootName checks that a container ID can name its root in the
// pod's VM (agentpb.ValidRootName). containerd's own IDs always can.
func checkRootName(id string) error {
	if !agentpb.ValidRootName(id) {
		return fmt.Errorf("container ID %q cannot name a root in the pod's VM: want 1 to %d bytes of A-Z a-z 0-9 . _ -, not . or ..", id, agentpb.MaxRootNameLen)
	}
	return nil
}
