package sandbox

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/kilnvm/kiln/guest/client"
	"github.com/kilnvm/kiln/snapshot"
	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmm"
)

// MetaFile is the file in a snapshot directory that holds what a sandbox
// needs beyond the VM to come back: its root disk and host name.
const MetaFile = "sandbox.json"

// meta is MetaFile's content.
type meta struct {
	Disk         string `json:"disk,omitempty"`
	DiskReadOnly bool   `json:"disk_read_only,omitempty"`
	Hostname     string `json:"hostname"`
	// MAC is the network card's address when the sandbox has one: a
	// restored sandbox needs a tap of its own (RestoreOptions.Net), and
	// its guest is told its new address.
	MAC string `json:"mac,omitempty"`
}

// Save writes a snapshot of the running sandbox into dir (which must not
// exist): the guest's filesystems are synced through the agent, the VM is
// paused and saved (snapshot.Save: atomic, nothing loadable is left on
// failure), and then it runs on. The root disk is not copied: a sandbox
// restored from dir uses the same image, which must not change meanwhile.
// Extra devices (Options.Devices) cannot be saved.
func (s *Sandbox) Save(ctx context.Context, dir string) error {
	if s.extraDevices {
		return errors.New("sandbox: save: a sandbox with extra devices cannot be saved")
	}
	if err := s.client.Quiesce(ctx, false); err != nil {
		return fmt.Errorf("sandbox: save: quiesce the guest: %w", err)
	}
	if err := s.vm.Pause(ctx); err != nil {
		return fmt.Errorf("sandbox: save: %w", err)
	}
	defer func() {
		if err := s.vm.Resume(); err != nil {
			s.log.Warn("sandbox: resume after save", "err", err)
		}
	}()
	m := meta{Hostname: s.hostname}
	if s.disk != nil {
		m.Disk, m.DiskReadOnly = s.diskPath, s.diskReadOnly
	}
	if s.nic != nil {
		m.MAC = s.nic.MAC().String()
	}
	b, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return fmt.Errorf("sandbox: save: %w", err)
	}
	if err := snapshot.Save(ctx, s.vm, dir, snapshot.WithLogger(s.log)); err != nil {
		return fmt.Errorf("sandbox: %w", err)
	}
	// Written after the snapshot: a snapshot without it does not restore
	// as a sandbox (Restore says so), so a crash in between leaves nothing
	// that restores wrongly.
	if err := writeFileSync(filepath.Join(dir, MetaFile), b); err != nil {
		return fmt.Errorf("sandbox: save: %w", err)
	}
	return nil
}

// writeFileSync writes a new file and syncs it.
func writeFileSync(p string, data []byte) error {
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		os.Remove(p)
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		os.Remove(p)
		return err
	}
	return f.Close()
}

// execHostname is the command that renames the guest.
func execHostname(name string) client.ExecOptions {
	return client.ExecOptions{Argv: []string{"hostname", name}}
}

// RestoreOptions describe a sandbox restored from a snapshot.
type RestoreOptions struct {
	// Console receives the guest's serial console; nil keeps only its
	// tail, for error messages.
	Console io.Writer
	// Dir holds the sandbox's host files (its vsock socket); empty means a
	// new temporary directory, removed by Close. Each restored sandbox
	// needs its own.
	Dir string
	// Hostname, when set, renames the restored guest.
	Hostname string
	// Net is the restored sandbox's network card, required when the
	// snapshot's sandbox had one (and refused when it had none): a tap of
	// its own, and a MAC address (a new random one when nil) that the
	// guest's interface takes over from the snapshot's.
	Net *virtio.NetConfig
	// Timeout bounds the wait for the agent; 0 means 5 minutes (restored
	// clones started together share the CPUs).
	Timeout time.Duration
	Logger  *slog.Logger
}

// Restore starts a sandbox from the snapshot in dir (written by Save) and
// waits until its agent answers. Memory comes back copy-on-write from the
// snapshot's memory file, so many sandboxes restored from one snapshot
// share the pages none of them wrote. The guest then gets fresh entropy
// (its RNG would otherwise repeat every clone's) and the host's time.
func Restore(ctx context.Context, dir string, opts RestoreOptions) (_ *Sandbox, err error) {
	start := time.Now()
	log := opts.Logger
	if log == nil {
		log = slog.Default()
	}
	if opts.Hostname != "" {
		if err := CheckHostname(opts.Hostname); err != nil {
			return nil, err
		}
	}
	info, err := snapshot.Info(dir)
	if err != nil {
		return nil, fmt.Errorf("sandbox: %w", err)
	}
	var m meta
	b, err := os.ReadFile(filepath.Join(dir, MetaFile))
	if err != nil {
		return nil, fmt.Errorf("sandbox: snapshot %s is not a sandbox's: %w", dir, err)
	}
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("sandbox: snapshot %s: %s: %w", dir, MetaFile, err)
	}
	s, err := newSandbox(log, opts.Dir, m.Hostname, start)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			s.Close(context.Background())
		}
	}()
	s.diskPath, s.diskReadOnly = m.Disk, m.DiskReadOnly
	if err := checkNewNIC("snapshot "+dir, m.MAC != "", opts.Net != nil, "RestoreOptions.Net"); err != nil {
		return nil, err
	}
	s.netCfg = opts.Net
	cfg := vmm.Config{CPUs: info.CPUs, MemoryMiB: info.MemoryMiB, Logger: log}
	if cfg.Devices, err = s.openDevices(nil); err != nil {
		return nil, err
	}
	cfg.Console = s.consoleWriter(opts.Console)
	if s.vm, err = snapshot.Load(dir, cfg); err != nil {
		return nil, fmt.Errorf("sandbox: %w", err)
	}
	s.run()
	timeout := opts.Timeout
	if timeout <= 0 {
		timeout = 5 * time.Minute
	}
	if err := s.connect(ctx, timeout); err != nil {
		return nil, err
	}
	if err := s.freshen(ctx, opts.Hostname, m.MAC); err != nil {
		return nil, err
	}
	return s, nil
}

// freshen makes a restored guest unique: new entropy for its RNG, the
// host's time, a new host name when asked, and its network card's new
// address where the snapshot's card had oldMAC.
func (s *Sandbox) freshen(ctx context.Context, hostname, oldMAC string) error {
	seed := make([]byte, 64)
	if _, err := rand.Read(seed); err != nil {
		return fmt.Errorf("sandbox: entropy for the guest: %w", err)
	}
	if _, err := s.client.Reseed(ctx, seed); err != nil {
		return fmt.Errorf("sandbox: reseed the guest's RNG: %w", err)
	}
	if err := s.client.SetClock(ctx, time.Now()); err != nil {
		return fmt.Errorf("sandbox: set the guest's clock: %w", err)
	}
	if hostname != "" && hostname != s.hostname {
		if err := checkCmdlineWord("hostname", hostname); err != nil {
			return err
		}
		if st, err := s.client.Exec(ctx, execHostname(hostname)); err != nil || !st.Success() {
			return fmt.Errorf("sandbox: set the host name to %s: %v %v", hostname, st, err)
		}
		s.hostname = hostname
	}
	if s.nic != nil && oldMAC != "" && oldMAC != s.nic.MAC().String() {
		if st, err := s.client.Exec(ctx, execSetMAC(oldMAC, s.nic.MAC().String())); err != nil || !st.Success() {
			return fmt.Errorf("sandbox: give the guest's interface its new MAC address %s: %v %v", s.nic.MAC(), st, err)
		}
	}
	return nil
}

// checkNewNIC checks that a restored or forked sandbox gets a network card
// of its own (given by field) exactly when what it comes from (what) has
// one.
func checkNewNIC(what string, had, given bool, field string) error {
	switch {
	case had && !given:
		return fmt.Errorf("sandbox: %s has a network card: %s must give each new sandbox a tap of its own", what, field)
	case !had && given:
		return fmt.Errorf("sandbox: %s has no network card for %s", what, field)
	}
	return nil
}

// execSetMAC is the command that moves the guest interface with address
// oldMAC to newMAC (busybox or iproute2 ip; virtio-net takes a new address
// while up).
func execSetMAC(oldMAC, newMAC string) client.ExecOptions {
	const script = `for d in /sys/class/net/*; do
  if [ "$(cat "$d/address")" = "$1" ]; then exec ip link set dev "${d##*/}" address "$2"; fi
done
echo "no interface has address $1" >&2; exit 1`
	return client.ExecOptions{Argv: []string{"sh", "-c", script, "setmac", oldMAC, newMAC}}
}
