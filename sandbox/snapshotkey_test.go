package sandbox

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/snapshot"
)

// TestRestoreRefusesForeignSnapshot: a crafted snapshot whose root disk
// is a host file (and whose memory file links to one) is refused before
// either is opened, whatever MAC it carries: only this host's key
// authenticates a snapshot, and the disk paths of one it does not are
// never used.
func TestRestoreRefusesForeignSnapshot(t *testing.T) {
	host := t.TempDir()
	target := filepath.Join(host, "etc-shadow")
	if err := os.WriteFile(target, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	ino, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(ino)
	if _, err := unix.InotifyAddWatch(ino, target, unix.IN_OPEN); err != nil {
		t.Fatal(err)
	}
	opens := func() int {
		n := 0
		buf := make([]byte, 4096)
		for {
			m, err := unix.Read(ino, buf)
			if err != nil || m <= 0 {
				return n
			}
			for off := 0; off+unix.SizeofInotifyEvent <= m; off += unix.SizeofInotifyEvent + int(binary.NativeEndian.Uint32(buf[off+12:])) {
				if binary.NativeEndian.Uint32(buf[off+4:])&unix.IN_OPEN != 0 {
					n++
				}
			}
		}
	}

	manifest := map[string]any{
		"format": snapshot.FormatVersion, "created": "2026-01-01T00:00:00Z", "cpus": 1, "memory_mib": 16,
		"devices": []map[string]any{
			{"id": RootDevice, "kind": "blk", "block": map[string]any{"path": target}},
			{"id": ModulesDevice, "kind": "blk", "block": map[string]any{"path": target, "read_only": true}},
			{"id": VsockDevice, "kind": "vsock", "vsock": map[string]any{"cid": 3, "socket": filepath.Join(host, "v.sock")}},
		},
		"labels":        map[string]string{LabelHostname: "evil"},
		"state_version": 1, "state_size": 2, "state_sha256": strings.Repeat("00", 32),
		"memory_size": 16 << 20, "memory_layout": []map[string]any{{"guest_addr": 0, "size": 16 << 20, "offset": 0}},
		"memory_sha256": strings.Repeat("00", 32),
	}
	b, _ := json.Marshal(manifest)
	key := bytes.Repeat([]byte{7}, snapshot.KeySize)
	for _, mac := range []string{"", strings.Repeat("ab", 32)} {
		dir := filepath.Join(t.TempDir(), "snap")
		os.Mkdir(dir, 0o700)
		os.WriteFile(filepath.Join(dir, snapshot.ManifestFile), b, 0o600)
		os.WriteFile(filepath.Join(dir, snapshot.StateFile), []byte("{}"), 0o600)
		os.Symlink(target, filepath.Join(dir, snapshot.MemoryFile))
		if mac != "" {
			os.WriteFile(filepath.Join(dir, snapshot.MACFile), []byte(mac), 0o600)
		}
		sb, err := Restore(context.Background(), dir, RestoreOptions{SnapshotKey: key, Dir: t.TempDir()})
		if sb != nil {
			sb.Close(context.Background())
			t.Fatal("restored a crafted snapshot")
		}
		if !errors.Is(err, snapshot.ErrAuth) {
			t.Fatalf("MAC %q: err = %v, want %v", mac, err, snapshot.ErrAuth)
		}
		if strings.Contains(err.Error(), mac) && mac != "" {
			t.Fatalf("err = %v repeats the MAC", err)
		}
		if n := opens(); n != 0 {
			t.Fatalf("MAC %q: the host file a crafted snapshot names was opened %d times", mac, n)
		}
	}
	// The watch does see opens.
	f, _ := os.Open(target)
	f.Close()
	if opens() != 1 {
		t.Fatal("inotify missed an open")
	}
}

func TestSnapshotKey(t *testing.T) {
	if _, err := snapshotKey([]byte("short")); err == nil {
		t.Fatal("a 5-byte key taken")
	}
	k := bytes.Repeat([]byte{1}, 32)
	if got, err := snapshotKey(k); err != nil || !bytes.Equal(got, k) {
		t.Fatalf("snapshotKey(k) = %x, %v", got, err)
	}
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
	p := SnapshotKeyFile()
	if !strings.HasPrefix(p, os.Getenv("XDG_CONFIG_HOME")) {
		t.Fatalf("key file %s not under the config folder", p)
	}
	a, err := snapshotKey(nil)
	if err != nil {
		t.Fatal(err)
	}
	b, err := snapshotKey(nil)
	if err != nil || !bytes.Equal(a, b) {
		t.Fatalf("the default key changed: %v", err)
	}
}
