package sandbox

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/fsverity"
	"github.com/kilnvm/kiln/snapshot"
)

// verityDir mounts a fresh ext4 made with the verity feature (a loop
// image in the test's temporary folder) and returns a folder on it, or ""
// when the test cannot (not root: it says so). As root it must work: the
// KVM tests' L1 has the tools (mkfs.ext4, mount) and the modules (loop,
// ext4).
func verityDir(t *testing.T) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Log("not root: no ext4 with fs-verity to save on (the mapped restore is not checked)")
		return ""
	}
	tmp := t.TempDir()
	img, mnt := filepath.Join(tmp, "verity.img"), filepath.Join(tmp, "mnt")
	if err := os.Mkdir(mnt, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 1<<30); err != nil {
		t.Fatal(err)
	}
	for _, argv := range [][]string{
		{"mkfs.ext4", "-q", "-F", "-b", "4096", "-O", "verity", img},
		{"mount", "-o", "loop", img, mnt},
	} {
		if out, err := exec.Command(argv[0], argv[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%s: %v: %s", strings.Join(argv, " "), err, out)
		}
	}
	t.Cleanup(func() {
		if err := unix.Unmount(mnt, 0); err != nil {
			t.Errorf("unmount %s: %v", mnt, err)
		}
	})
	return mnt
}

// mappedFrom sums the Rss of the mappings of path in process pid.
func mappedFrom(t *testing.T, pid int, path string) (rss uint64, found bool) {
	t.Helper()
	f, err := os.Open(fmt.Sprintf("/proc/%d/smaps", pid))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	in := false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		fields := strings.Fields(line)
		if len(fields) >= 5 && strings.Contains(fields[0], "-") && !strings.HasSuffix(fields[0], ":") {
			in = len(fields) >= 6 && strings.Join(fields[5:], " ") == path
			found = found || in
			continue
		}
		if in && fields[0] == "Rss:" {
			kb, _ := strconv.ParseUint(fields[1], 10, 64)
			rss += kb << 10
		}
	}
	return rss, found
}

// checkVerityRestore restores the snapshot saved on an fs-verity file
// system at dir: the manifest names the memory file's digest, the VM maps
// that file (no copy: what is resident after the first exec is what the
// guest touched since, less than the file's data), and a memory file
// crafted after the save is refused, sealed with fs-verity or not. check
// runs the restored sandbox's first execs, then (once what it mapped is
// measured) after its further checks (a fork).
func checkVerityRestore(t *testing.T, ctx context.Context, dir string, opts RestoreOptions, check, after func(*Sandbox)) {
	m, err := snapshot.Info(dir)
	if err != nil {
		t.Fatal(err)
	}
	if m.MemoryVerity == "" {
		t.Fatalf("a snapshot saved on ext4 with the verity feature has no fs-verity digest")
	}
	mem := filepath.Join(dir, snapshot.MemoryFile)
	if _, err := os.OpenFile(mem, os.O_WRONLY, 0); !errors.Is(err, syscall.EPERM) {
		t.Errorf("the sealed memory file opened for writing: %v", err)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(mem, &st); err != nil {
		t.Fatal(err)
	}
	data := uint64(st.Blocks) * 512

	r, err := Restore(ctx, dir, opts)
	if err != nil {
		t.Fatalf("Restore: %v", err)
	}
	check(r)
	rss, found := mappedFrom(t, r.PID(), mem)
	after(r)
	r.Close(context.Background())
	if !found {
		t.Fatalf("the restored VM does not map its memory file %s", mem)
	}
	t.Logf("restored over the memory file itself: %.1f MiB of it resident after the first execs, of %.1f MiB of data in the file (%d MiB of guest RAM)",
		float64(rss)/(1<<20), float64(data)/(1<<20), m.MemoryMiB)
	if rss >= data {
		t.Errorf("%d bytes of the memory file resident, the file's data is %d: the restore read it all", rss, data)
	}

	// Crafted after the save: a copy with one byte flipped in its
	// first data page (both made from the saved file first), put in
	// place of the memory file.
	craftedPath := func(sealed bool) string { return filepath.Join(filepath.Dir(dir), fmt.Sprintf("crafted-%v", sealed)) }
	for _, sealed := range []bool{true, false} {
		copyFlipped(t, mem, craftedPath(sealed))
	}
	for _, sealed := range []bool{true, false} {
		crafted := craftedPath(sealed)
		if sealed {
			f := mustOpen(t, crafted)
			if err := fsverity.Enable(f); err != nil {
				t.Fatal(err)
			}
			f.Close()
		}
		if err := os.Rename(crafted, mem); err != nil {
			t.Fatal(err)
		}
		r, err := Restore(ctx, dir, opts)
		if err == nil {
			r.Close(context.Background())
			t.Errorf("a memory file crafted after the save (fs-verity: %v) restored", sealed)
			continue
		}
		if !errors.Is(err, snapshot.ErrChecksum) {
			t.Errorf("a memory file crafted after the save (fs-verity: %v): %v, want ErrChecksum", sealed, err)
		}
		if strings.Contains(err.Error(), m.MemoryVerity) || strings.Contains(err.Error(), m.MemorySHA256) {
			t.Errorf("the refusal names the digest: %v", err)
		}
	}
}

func mustOpen(t *testing.T, p string) *os.File {
	t.Helper()
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

// copyFlipped copies the sparse file from to to (its data only, holes
// left holes) with one bit flipped in its first byte of data.
func copyFlipped(t *testing.T, from, to string) {
	t.Helper()
	src := mustOpen(t, from)
	fi, err := src.Stat()
	if err != nil {
		t.Fatal(err)
	}
	dst, err := os.OpenFile(to, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer dst.Close()
	if err := dst.Truncate(fi.Size()); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1<<20)
	first := true
	for off := int64(0); off < fi.Size(); {
		data, err := unix.Seek(int(src.Fd()), off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		hole, err := unix.Seek(int(src.Fd()), data, unix.SEEK_HOLE)
		if err != nil {
			t.Fatal(err)
		}
		for p := data; p < hole; {
			n, err := src.ReadAt(buf[:min(int64(len(buf)), hole-p)], p)
			if err != nil {
				t.Fatal(err)
			}
			if first {
				buf[0] ^= 0x40
				first = false
			}
			if _, err := dst.WriteAt(buf[:n], p); err != nil {
				t.Fatal(err)
			}
			p += int64(n)
		}
		off = hole
	}
	if first {
		t.Fatalf("%s holds no data to flip", from)
	}
}
