package bench

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kilnvm/kiln/daemon/client"
	"github.com/kilnvm/kiln/snapshot"
)

// KilndSpec says how StartKilnd runs kilnd.
type KilndSpec struct {
	// Binary is the kilnd executable.
	Binary string
	// VMM is the kiln-vmm binary that runs kilnd's VMs (kilnd --vmm).
	VMM string
	// Kernel and Agent are passed on (empty: kilnd's defaults).
	Kernel, Agent string
	// Images is kilnd's images folder.
	Images string
	// Dir is a folder of kilnd's own: its socket, state folder and log go
	// in it. Keep it short: the sandboxes' Unix sockets live under it.
	Dir string
	// MaxMemoryMiB is kilnd's --max-memory (0: kilnd's default, the host's).
	MaxMemoryMiB int
	// CgroupRoot is kilnd's --cgroup-root (empty: kilnd's default, its own
	// cgroup).
	CgroupRoot string
	// Timeout bounds the wait for kilnd to serve (1 minute when zero).
	Timeout time.Duration
}

// KilndArgs is kilnd's command line for s.
func (s KilndSpec) KilndArgs() []string {
	args := []string{
		"--listen", "unix:" + s.Socket(),
		"--state-dir", s.StateDir(),
		"--images", s.Images,
		"--vmm", s.VMM,
	}
	if s.Kernel != "" {
		args = append(args, "--kernel", s.Kernel)
	}
	if s.Agent != "" {
		args = append(args, "--agent", s.Agent)
	}
	if s.MaxMemoryMiB > 0 {
		args = append(args, "--max-memory", strconv.Itoa(s.MaxMemoryMiB))
	}
	if s.CgroupRoot != "" {
		args = append(args, "--cgroup-root", s.CgroupRoot)
	}
	return args
}

// cgroupFS is where cgroup v2 is mounted.
const cgroupFS = "/sys/fs/cgroup"

// inRootCgroup reports whether /proc/self/cgroup (its text) puts the
// process in the root of the cgroup v2 hierarchy ("0::/").
func inRootCgroup(procSelfCgroup string) bool {
	for _, line := range strings.Split(procSelfCgroup, "\n") {
		if strings.TrimSpace(line) == "0::/" {
			return true
		}
	}
	return false
}

// delegatedCgroup makes kilnd a cgroup of its own under the cgroup v2 root
// for a benchmark run, as systemd's Delegate=yes would (the cpu, memory,
// pids and io controllers enabled for it), when this process sits in the
// root cgroup, where kilnd refuses to make per-sandbox cgroups. It returns
// "" (kilnd's default: its own cgroup) otherwise. cleanup removes the
// folder and whatever kilnd left below it.
func delegatedCgroup() (root string, cleanup func(), err error) {
	self, err := os.ReadFile("/proc/self/cgroup")
	if err != nil || !inRootCgroup(string(self)) {
		return "", func() {}, nil
	}
	if err := os.WriteFile(filepath.Join(cgroupFS, "cgroup.subtree_control"), []byte("+cpu +memory +pids +io"), 0); err != nil {
		return "", nil, fmt.Errorf("bench: enabling the cgroup controllers for kilnd: %w", err)
	}
	root, err = os.MkdirTemp(cgroupFS, "kiln-bench-")
	if err != nil {
		return "", nil, fmt.Errorf("bench: a cgroup for kilnd: %w", err)
	}
	return root, func() { removeCgroupTree(root) }, nil
}

// removeCgroupTree removes a cgroup folder and its children, deepest
// first (a cgroup's files cannot be removed, only its empty folders).
func removeCgroupTree(dir string) {
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if e.IsDir() {
			removeCgroupTree(filepath.Join(dir, e.Name()))
		}
	}
	os.Remove(dir)
}

// Socket is where kilnd listens.
func (s KilndSpec) Socket() string { return filepath.Join(s.Dir, "kilnd.sock") }

// StateDir is kilnd's state folder.
func (s KilndSpec) StateDir() string { return filepath.Join(s.Dir, "state") }

// SnapshotKeyFile is the host key kilnd authenticates its snapshots with
// (daemon's snapshotKeyFile: kilnd makes it in its state folder on first
// use).
func (s KilndSpec) SnapshotKeyFile() string { return filepath.Join(s.StateDir(), "snapshot.key") }

// kilndSnapshotKey reads kilnd's snapshot key from file, which kilnd must
// have made: a key made here would authenticate nothing of kilnd's.
func kilndSnapshotKey(file string) ([]byte, error) {
	key, err := snapshot.ReadKey(file)
	if err != nil {
		return nil, fmt.Errorf("kilnd's snapshot key: %w", err)
	}
	return key, nil
}

// LogFile is where kilnd's stderr goes.
func (s KilndSpec) LogFile() string { return filepath.Join(s.Dir, "kilnd.log") }

// Kilnd is a kilnd process StartKilnd started, serving.
type Kilnd struct {
	Spec   KilndSpec
	Client *client.Client

	cmd     *exec.Cmd
	log     *os.File
	done    chan struct{}
	waitErr error
	stop    sync.Once
	stopErr error
}

// StartKilnd starts kilnd and returns once its health service says it
// serves kiln.v1.Kiln.
func StartKilnd(ctx context.Context, s KilndSpec) (_ *Kilnd, err error) {
	if s.Binary == "" || s.VMM == "" || s.Images == "" || s.Dir == "" {
		return nil, fmt.Errorf("bench: kilnd: binary %q, kiln-vmm %q, images %q and folder %q must all be given", s.Binary, s.VMM, s.Images, s.Dir)
	}
	if s.Timeout <= 0 {
		s.Timeout = time.Minute
	}
	if err := os.MkdirAll(s.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("bench: kilnd: %w", err)
	}
	log, err := os.Create(s.LogFile())
	if err != nil {
		return nil, fmt.Errorf("bench: kilnd: %w", err)
	}
	k := &Kilnd{Spec: s, log: log, done: make(chan struct{})}
	k.cmd = exec.Command(s.Binary, s.KilndArgs()...)
	k.cmd.Stdout, k.cmd.Stderr = log, log
	if err := k.cmd.Start(); err != nil {
		log.Close()
		return nil, fmt.Errorf("bench: kilnd: start %s: %w", s.Binary, err)
	}
	go func() {
		k.waitErr = k.cmd.Wait()
		close(k.done)
	}()
	defer func() {
		if err != nil {
			k.kill()
		}
	}()
	wctx, cancel := context.WithTimeout(ctx, s.Timeout)
	defer cancel()
	for {
		if err := k.ready(wctx); err == nil {
			return k, nil
		} else if wctx.Err() != nil {
			return nil, fmt.Errorf("bench: kilnd did not serve within %v: %w; log: %s", s.Timeout, err, k.LogTail())
		}
		select {
		case <-k.done:
			return nil, fmt.Errorf("bench: kilnd exited before serving (%v); log: %s", k.waitErr, k.LogTail())
		case <-wctx.Done():
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// ready dials kilnd, unless dialled, and asks its health service.
func (k *Kilnd) ready(ctx context.Context) error {
	if k.Client == nil {
		if _, err := os.Stat(k.Spec.Socket()); err != nil {
			return err
		}
		dctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		c, err := client.Dial(dctx, "unix:"+k.Spec.Socket())
		cancel()
		if err != nil {
			return err
		}
		k.Client = c
	}
	hctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	r, err := healthpb.NewHealthClient(k.Client.Conn()).Check(hctx, &healthpb.HealthCheckRequest{Service: "kiln.v1.Kiln"})
	if err != nil {
		return err
	}
	if r.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		return fmt.Errorf("kilnd health: %v", r.GetStatus())
	}
	return nil
}

// LogTail is the end of kilnd's log.
func (k *Kilnd) LogTail() string {
	b, err := os.ReadFile(k.Spec.LogFile())
	if err != nil {
		return fmt.Sprintf("(unreadable: %v)", err)
	}
	return lastBytes(string(b), 2000)
}

// Stop destroys every sandbox kilnd still runs (kilnd leaves them running
// when it stops), deletes its templates, and stops it with SIGTERM
// (SIGKILL after 30 s). It returns what failed.
func (k *Kilnd) Stop(ctx context.Context) error {
	k.stop.Do(func() {
		var errs []error
		if k.Client != nil {
			errs = append(errs, k.destroyAll(ctx))
		}
		if k.Client != nil {
			k.Client.Close()
		}
		k.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-k.done:
		case <-time.After(30 * time.Second):
			k.cmd.Process.Kill()
			<-k.done
			errs = append(errs, errors.New("bench: kilnd did not stop within 30 s of SIGTERM: killed"))
		}
		k.log.Close()
		k.stopErr = errors.Join(errs...)
	})
	return k.stopErr
}

// kill ends kilnd at once (a start that failed).
func (k *Kilnd) kill() {
	k.stop.Do(func() {
		if k.Client != nil {
			k.Client.Close()
		}
		k.cmd.Process.Kill()
		<-k.done
		k.log.Close()
	})
}

// destroyAll destroys the live sandboxes and deletes the templates.
func (k *Kilnd) destroyAll(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	var errs []error
	sbs, err := k.Client.ListSandboxes(ctx, client.ListOptions{})
	if err != nil {
		return fmt.Errorf("bench: kilnd: %w", err)
	}
	for _, sb := range sbs {
		if err := k.Client.DestroySandbox(ctx, sb.GetId()); err != nil && !isCode(err, codes.NotFound) {
			errs = append(errs, err)
		}
	}
	tps, err := k.Client.ListTemplates(ctx)
	if err != nil && !isCode(err, codes.Unimplemented) {
		errs = append(errs, err)
	}
	for _, t := range tps {
		if err := k.Client.DeleteTemplate(ctx, t.GetId(), true); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// isCode says err is a kilnd call refused with code.
func isCode(err error, code codes.Code) bool {
	var e *client.Error
	return errors.As(err, &e) && e.Code == code
}
