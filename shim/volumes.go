package shim

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/kilnvm/kiln/guest/client"
)

// A container's spec.Mounts (Kubernetes volumes, CRI's /etc files, the
// OCI defaults) as the pod's VM takes them:
//
//   - under /proc, /sys and /dev, and a tmpfs on /run: the guest's own
//     (its kernel's proc and sysfs, its devices; its /run holds the
//     agent's state);
//   - a tmpfs: a tmpfs in the guest;
//   - a bound host file (/etc/hosts, /etc/hostname, /etc/resolv.conf):
//     its bytes, written into the root at Create (at most 1 MiB; writes
//     in the guest stay there);
//   - a bound host folder of an emptyDir (kubelet's
//     kubernetes.io~empty-dir): a folder in guest RAM, shared by the pod's
//     containers that mount it, for the VM's life;
//   - a read-only bound host folder (ConfigMaps, Secrets, projected
//     service account tokens, read-only hostPath): served read-only on
//     the root's 9p device beside the rootfs (VM.ServeDir), shared by the
//     containers that mount it;
//   - a writable host folder (hostPath, a persistent volume) is refused at
//     Create: its writes would not reach the host.

// maxFileVolume is the largest host file a container's mount copies in.
const maxFileVolume = 1 << 20

// emptyDirMarker is in the host path of every emptyDir the kubelet makes.
const emptyDirMarker = "/volumes/kubernetes.io~empty-dir/"

// volume is one of a container's mounts as its VM takes it.
type volume struct {
	mount  client.Mount
	source string // the host folder of a tree
}

// guestDirs are the destinations whose mounts the guest provides.
var guestDirs = []string{"/proc", "/sys", "/dev"}

// planVolumes turns s's mounts into the VM's, reading the host files
// they bind. An error wraps ErrUnsupported for a mount the VM cannot
// take.
func planVolumes(s *specs.Spec) ([]volume, error) {
	var out []volume
	for _, m := range s.Mounts {
		dest := filepath.Clean(m.Destination)
		if !filepath.IsAbs(m.Destination) {
			return nil, fmt.Errorf("mount destination %q is not an absolute path", m.Destination)
		}
		if underAny(dest, guestDirs) {
			continue
		}
		ro := slices.Contains(m.Options, "ro")
		bind := m.Type == "bind" || slices.Contains(m.Options, "bind") || slices.Contains(m.Options, "rbind")
		switch {
		case m.Type == "tmpfs" && !bind:
			if dest == "/run" {
				continue
			}
			size, err := tmpfsSize(m.Options)
			if err != nil {
				return nil, fmt.Errorf("tmpfs mount on %s: %w", dest, err)
			}
			out = append(out, volume{mount: client.Mount{Destination: dest, Kind: client.MountTmpfs, Size: size}})
		case bind:
			v, err := bindVolume(m.Source, dest, ro)
			if err != nil {
				return nil, err
			}
			out = append(out, v)
		default:
			return nil, fmt.Errorf("a %q mount on %s: the kiln runtime takes bind and tmpfs mounts: %w", m.Type, dest, ErrUnsupported)
		}
	}
	return out, nil
}

// bindVolume is the volume of a host path bound on dest.
func bindVolume(src, dest string, ro bool) (volume, error) {
	if !filepath.IsAbs(src) {
		return volume{}, fmt.Errorf("bind mount on %s: source %q is not an absolute path", dest, src)
	}
	fi, err := os.Stat(src)
	if err != nil {
		return volume{}, fmt.Errorf("bind mount on %s: %w", dest, err)
	}
	switch {
	case fi.Mode().IsRegular():
		if fi.Size() > maxFileVolume {
			return volume{}, fmt.Errorf("bind mount of the file %s (%d bytes) on %s: the kiln runtime copies files of at most %d bytes into the guest: %w", src, fi.Size(), dest, maxFileVolume, ErrUnsupported)
		}
		f, err := os.Open(src)
		if err != nil {
			return volume{}, fmt.Errorf("bind mount on %s: %w", dest, err)
		}
		defer f.Close()
		b, err := io.ReadAll(io.LimitReader(f, maxFileVolume+1))
		if err != nil {
			return volume{}, fmt.Errorf("bind mount on %s: reading %s: %w", dest, src, err)
		}
		if len(b) > maxFileVolume {
			return volume{}, fmt.Errorf("bind mount of the file %s on %s: it grew past %d bytes: %w", src, dest, maxFileVolume, ErrUnsupported)
		}
		return volume{mount: client.Mount{Destination: dest, Kind: client.MountFile, Data: b, Mode: uint32(fi.Mode().Perm())}}, nil
	case fi.IsDir() && strings.Contains(src, emptyDirMarker):
		return volume{mount: client.Mount{Destination: dest, Kind: client.MountVolume, Name: "e-" + pathKey(src), ReadOnly: ro}}, nil
	case fi.IsDir() && ro:
		return volume{mount: client.Mount{Destination: dest, Kind: client.MountTree, Name: "v-" + pathKey(src), ReadOnly: true}, source: src}, nil
	case fi.IsDir():
		return volume{}, fmt.Errorf("a writable host folder %s on %s: the kiln runtime shares host folders read-only (writes in the guest would not reach the host); mount it read-only or use an emptyDir: %w", src, dest, ErrUnsupported)
	}
	return volume{}, fmt.Errorf("bind mount of %s on %s: a %s is not shared into a VM: %w", src, dest, fi.Mode().Type(), ErrUnsupported)
}

// pathKey names a host path in the guest: 16 hex digits of its hash.
func pathKey(p string) string {
	h := sha256.Sum256([]byte(p))
	return hex.EncodeToString(h[:8])
}

// underAny reports whether p is one of dirs or beneath one.
func underAny(p string, dirs []string) bool {
	for _, d := range dirs {
		if p == d || strings.HasPrefix(p, d+"/") {
			return true
		}
	}
	return false
}

// tmpfsSize is the size= option of a tmpfs mount in bytes (k, m, g
// suffixes; 0: none).
func tmpfsSize(opts []string) (uint64, error) {
	for _, o := range opts {
		v, ok := strings.CutPrefix(o, "size=")
		if !ok {
			continue
		}
		mult := uint64(1)
		switch {
		case strings.HasSuffix(v, "k"), strings.HasSuffix(v, "K"):
			mult, v = 1<<10, v[:len(v)-1]
		case strings.HasSuffix(v, "m"), strings.HasSuffix(v, "M"):
			mult, v = 1<<20, v[:len(v)-1]
		case strings.HasSuffix(v, "g"), strings.HasSuffix(v, "G"):
			mult, v = 1<<30, v[:len(v)-1]
		}
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil || n > (1<<62)/mult {
			return 0, fmt.Errorf("size %q: want bytes, with k, m or g", o[len("size="):])
		}
		return n * mult, nil
	}
	return 0, nil
}
