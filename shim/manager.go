package shim

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/containerd/containerd/mount"
	"github.com/containerd/containerd/namespaces"
	"github.com/containerd/containerd/runtime/v2/shim"
)

// RuntimeName is the runtime type containerd knows the shim by.
const RuntimeName = "io.containerd.kiln.v2"

// Manager is the shim binary's start and delete commands.
type Manager struct{}

// Name is the runtime's name.
func (Manager) Name() string { return RuntimeName }

// groupLabels put a pod's containers in one shim: its sandbox's ID.
var groupLabels = []string{"io.kiln.group", criSandboxID}

// Start starts the shim's server process for container id (or joins the
// one of its pod), and returns its address. The working directory is the
// bundle.
func (Manager) Start(ctx context.Context, id string, opts shim.StartOpts) (_ string, retErr error) {
	ns, err := namespaces.NamespaceRequired(ctx)
	if err != nil {
		return "", err
	}
	group := id
	if b, err := os.ReadFile("config.json"); err == nil && len(b) <= maxSpecBytes {
		var s struct {
			Annotations map[string]string `json:"annotations"`
		}
		if json.Unmarshal(b, &s) == nil {
			for _, l := range groupLabels {
				if g := s.Annotations[l]; g != "" {
					group = g
					break
				}
			}
		}
	}
	address, err := shim.SocketAddress(ctx, opts.Address, group)
	if err != nil {
		return "", err
	}
	socket, err := shim.NewSocket(address)
	if err != nil {
		if !shim.SocketEaddrinuse(err) {
			return "", fmt.Errorf("shim socket: %w", err)
		}
		if shim.CanConnect(address) { // the pod's shim runs: join it
			if err := shim.WriteAddress("address", address); err != nil {
				return "", err
			}
			return address, nil
		}
		if err := shim.RemoveSocket(address); err != nil {
			return "", fmt.Errorf("removing a stale shim socket: %w", err)
		}
		if socket, err = shim.NewSocket(address); err != nil {
			return "", fmt.Errorf("shim socket: %w", err)
		}
	}
	defer func() {
		if retErr != nil {
			socket.Close()
			_ = shim.RemoveSocket(address)
		}
	}()
	if err := shim.WriteAddress("address", address); err != nil {
		return "", err
	}
	f, err := socket.File()
	if err != nil {
		return "", err
	}
	defer f.Close()
	self, err := os.Executable()
	if err != nil {
		return "", err
	}
	cwd, err := os.Getwd()
	if err != nil {
		return "", err
	}
	args := []string{"-namespace", ns, "-id", id, "-address", opts.Address}
	if opts.Debug {
		args = append(args, "-debug")
	}
	cmd := exec.Command(self, args...)
	cmd.Dir = cwd
	cmd.Env = os.Environ()
	cmd.ExtraFiles = []*os.File{f} // fd 3: the server's listener
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return "", fmt.Errorf("starting the shim server: %w", err)
	}
	go cmd.Wait()
	if err := shim.AdjustOOMScore(cmd.Process.Pid); err != nil {
		cmd.Process.Kill()
		return "", fmt.Errorf("shim OOM score: %w", err)
	}
	return address, nil
}

// Stop cleans up after a shim that is gone (containerd's delete command):
// the container's rootfs is unmounted; its VM died with the shim.
func (Manager) Stop(ctx context.Context, id string) (shim.StopStatus, error) {
	cwd, err := os.Getwd()
	if err != nil {
		return shim.StopStatus{}, err
	}
	bundle := filepath.Join(filepath.Dir(cwd), id)
	if err := mount.UnmountRecursive(filepath.Join(bundle, "rootfs"), 0); err != nil {
		return shim.StopStatus{}, fmt.Errorf("unmounting %s's rootfs: %w", id, err)
	}
	removeVMDir(bundle, id)
	return shim.StopStatus{ExitedAt: time.Now(), ExitStatus: 128 + int(syscall.SIGKILL)}, nil
}

// removeVMDir removes the VM folder the bundle links to (vmLink), if the
// link names one of this container's (an absolute path whose name starts
// with its short ID), and the link.
func removeVMDir(bundle, id string) {
	link := filepath.Join(bundle, vmLink)
	target, err := os.Readlink(link)
	if err != nil {
		return
	}
	if filepath.IsAbs(target) && strings.HasPrefix(filepath.Base(target), shortID(id)+"-") {
		os.RemoveAll(target)
	}
	os.Remove(link)
}
