package daemon_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/cgroup"
	"github.com/kilnvm/kiln/daemon/kilnpb"
	"github.com/kilnvm/kiln/internal/kvmtest"
)

// smapsPart is what /proc/PID/smaps says of a set of a process's
// mappings, KiB.
type smapsPart struct {
	Size, RSS, PSS, Anon, File int64
}

func (p *smapsPart) add(q smapsPart) {
	p.Size += q.Size
	p.RSS += q.RSS
	p.PSS += q.PSS
	p.Anon += q.Anon
	p.File += q.File
}

func (p smapsPart) String() string {
	return fmt.Sprintf("rss %d pss %d anon %d file %d", p.RSS>>10, p.PSS>>10, p.Anon>>10, p.File>>10)
}

// memSplit is a VMM process's memory split by mapping: the guest's RAM
// (the mappings of its memfd or memory file and the anonymous ones of the
// file's holes among them, guestMiB in all), the binary's own mappings,
// the rest (Go's heap and stacks: anonymous).
type memSplit struct {
	Guest, Binary, Other smapsPart
	// Big are the headers and RSS (MiB) of the other mappings of more
	// than 4 MiB resident.
	Big []string
}

// mapping is one of /proc/PID/smaps's.
type mapping struct {
	start, end uint64
	path       string
	header     string
	part       smapsPart
}

// readSmaps splits the mappings of process pid.
func readSmaps(t *testing.T, pid int32, guestMiB int64) memSplit {
	t.Helper()
	exe, _ := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid))
	f, err := os.Open(fmt.Sprintf("/proc/%d/smaps", pid))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var maps []*mapping
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) == 0 {
			continue
		}
		if !strings.HasSuffix(fs[0], ":") { // a mapping's header
			lo, hi, _ := strings.Cut(fs[0], "-")
			a, _ := strconv.ParseUint(lo, 16, 64)
			b, _ := strconv.ParseUint(hi, 16, 64)
			mp := &mapping{start: a, end: b, header: strings.Join(fs, " ")}
			if len(fs) >= 6 {
				mp.path = fs[5]
			}
			maps = append(maps, mp)
			continue
		}
		if len(fs) < 2 || len(maps) == 0 {
			continue
		}
		n, _ := strconv.ParseInt(fs[1], 10, 64)
		p := &maps[len(maps)-1].part
		switch fs[0] {
		case "Size:":
			p.Size = n
		case "Rss:":
			p.RSS = n
		case "Pss:":
			p.PSS = n
		case "Anonymous:":
			p.Anon = n
		}
	}
	guestFile := func(mp *mapping) bool {
		// A booted guest's memfd, a snapshot's memory file, or the
		// sealed copy of one a restore maps (snapshot format 3).
		return strings.Contains(mp.path, "kiln-guest-ram") || strings.Contains(mp.path, "kiln-snapshot-memory") || filepath.Base(mp.path) == "memory"
	}
	// The guest's RAM: guestMiB from its file's lowest mapping (guest
	// page 0 always holds data), anonymous holes included (one the
	// kernel merged with a neighbour of the same flags counts whole).
	lo := ^uint64(0)
	for _, mp := range maps {
		if guestFile(mp) {
			lo = min(lo, mp.start)
		}
	}
	hi := lo + uint64(guestMiB)<<20
	guest := map[*mapping]bool{}
	for _, mp := range maps {
		if mp.start < hi && mp.end > lo && (guestFile(mp) || mp.path == "") {
			guest[mp] = true
		}
	}
	var s memSplit
	for _, mp := range maps {
		mp.part.File = mp.part.RSS - mp.part.Anon
		switch {
		case guest[mp]:
			s.Guest.add(mp.part)
		case mp.path == exe:
			s.Binary.add(mp.part)
		default:
			s.Other.add(mp.part)
			if mp.part.RSS > 4<<10 {
				s.Big = append(s.Big, fmt.Sprintf("%s rss %d anon %d", mp.header, mp.part.RSS>>10, mp.part.Anon>>10))
			}
		}
	}
	return s
}

// memStatMiB is a cgroup's memory.stat, MiB.
func memStatMiB(t *testing.T, dir string) map[string]uint64 {
	t.Helper()
	st := map[string]uint64{}
	for _, line := range strings.Split(readTrim(t, filepath.Join(dir, "memory.stat")), "\n") {
		k, v, _ := strings.Cut(line, " ")
		n, _ := strconv.ParseUint(v, 10, 64)
		st[k] = n >> 20
	}
	return st
}

// memStat picks a cgroup's memory.current and memory.stat's anon, file,
// shmem and file_mapped, MiB.
func memStat(t *testing.T, dir string) string {
	t.Helper()
	st := memStatMiB(t, dir)
	peak := "-"
	if _, err := os.Stat(filepath.Join(dir, "memory.peak")); err == nil {
		peak = strconv.FormatUint(readMiB(t, filepath.Join(dir, "memory.peak")), 10)
	}
	return fmt.Sprintf("current %d peak %s anon %d file %d shmem %d file_mapped %d kernel %d",
		readMiB(t, filepath.Join(dir, "memory.current")), peak, st["anon"], st["file"], st["shmem"], st["file_mapped"], st["kernel"])
}

// TestKVMDaemonMemory measures (and logs, "MEM" lines) what a sandbox's
// cgroup is charged for, split by the VMM process's mappings (smaps) and
// memory.stat: booted from an image, restored from a template (first and
// second: the template's pages are charged to neither), a fork child;
// idle and after the guest writes most of its memory. Each stays within
// memory.max = guest + the default VMM overhead, its memory.stat shows
// no page of the template's file (nor its holes) charged to it, and an
// image-booted VMM has freed its boot's kernel and initrd.
func TestKVMDaemonMemory(t *testing.T) {
	kvmtest.Require(t)
	m := testCgroupRoot(t)
	e := newKVMEnv(t)
	e.stop()
	e.cfg.Cgroups = m
	e.cfg.VMMOverheadMiB = overheadMiB
	e.cfg.MemoryOvercommit = 3
	e.startKVM()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	began := time.Now()
	self := readTrim(t, "/proc/self/cgroup")
	t.Logf("kilnd (this test) is in %s; kiln root %s", self, memStat(t, filepath.Dir(m.Path("x"))))

	const guest = 512
	report := func(label string, sb *kilnpb.Sandbox) memSplit {
		s := readSmaps(t, sb.Pid, guest)
		t.Logf("MEM %-22s guest[%v] binary[%v] other[%v] | cgroup %s", label, s.Guest, s.Binary, s.Other, memStat(t, m.Path(sb.Id)))
		for _, b := range s.Big {
			t.Logf("MEM   big other mapping: %s", b)
		}
		// The VMM's own: what the default overhead is for.
		if s.Other.Anon > 40<<10 {
			t.Errorf("%s: the VMM process holds %d MiB of anonymous memory beyond the guest's RAM, want under 40", label, s.Other.Anon>>10)
		}
		return s
	}
	const fill = "mkdir -p /mnt/f && mount -t tmpfs -o size=200m f /mnt/f && dd if=/dev/zero of=/mnt/f/f bs=1M count=192 2>/dev/null; sync; echo ok"
	// within checks that sandbox sb's cgroup stayed within memory.max,
	// no OOM, and holds no more than fileMax MiB of page cache.
	within := func(label string, sb *kilnpb.Sandbox, fileMax uint64) {
		dir := m.Path(sb.Id)
		st := memStatMiB(t, dir)
		max, peak := readMiB(t, filepath.Join(dir, "memory.max")), readMiB(t, filepath.Join(dir, "memory.peak"))
		ev, err := cgroup.ParseEvents(readTrim(t, filepath.Join(dir, "memory.events")))
		if err != nil || peak > max || ev.OOM != 0 || ev.Max != 0 {
			t.Errorf("%s: memory.peak %d MiB, memory.max %d, memory.events %+v (%v): want within the limit", label, peak, max, ev, err)
		}
		if st["file"] > fileMax {
			t.Errorf("%s: memory.stat file %d MiB (shmem %d), want at most %d: pages of a file others share charged to the sandbox", label, st["file"], st["shmem"], fileMax)
		}
	}

	img := e.createImage(0)
	report("a image idle", img) // its boot's kernel and initrd freed
	// The guest's RAM is its VMM's memfd: shmem, file in memory.stat.
	within("a image idle", img, 160)
	e.shOut(img.Id, fill)
	report("a image +192", img)
	within("a image +192", img, 340)
	kids, err := e.forkCtx(ctx, &kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_SandboxId{SandboxId: img.Id}, Count: 1})
	if err != nil || len(kids) != 1 {
		t.Fatalf("fork: %v, %v", kids, err)
	}
	report("a parent after fork", img)
	// Its memory is now a base its VMM process pays for, and what it
	// writes next is copies on top: its limit grew by a guest's worth
	// (growCgroup), so rewriting its memory does not get it OOM-killed.
	if got, want := readMiB(t, filepath.Join(m.Path(img.Id), "memory.max")), uint64(2*guest+overheadMiB); got != want {
		t.Errorf("the fork parent's memory.max: %d MiB, want %d (two guests' worth and the overhead)", got, want)
	}
	e.shOut(img.Id, "rm /mnt/f/f; dd if=/dev/zero of=/mnt/f/f bs=1M count=192 2>/dev/null; sync; echo ok")
	report("a parent rewrote 192", img)
	within("a parent rewrote 192", img, 340)
	e.shOut(kids[0].Id, "rm /mnt/f/f; echo ok")
	report("d child idle", kids[0])
	e.shOut(kids[0].Id, "dd if=/dev/zero of=/mnt/f/g bs=1M count=320 2>/dev/null; echo ok")
	report("d child +320", kids[0])
	within("d child +320", kids[0], 8)
	for _, id := range []string{img.Id, kids[0].Id} {
		if _, err := e.c.DestroySandbox(ctx, &kilnpb.DestroySandboxRequest{Id: id}); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("kiln root after a, d: %s", memStat(t, filepath.Dir(m.Path("x"))))

	tp, err := e.c.CreateTemplate(ctx, &kilnpb.CreateTemplateRequest{Name: "mem", Image: e.image, RequestId: nextReq(),
		Setup: []string{"sh", "-c", "mkdir -p /mnt/t && mount -t tmpfs -o size=130m t /mnt/t && dd if=/dev/urandom of=/mnt/t/t bs=1M count=128 2>/dev/null"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("template %s; kiln root %s", tp.Id, memStat(t, filepath.Dir(m.Path("x"))))
	var sbs []*kilnpb.Sandbox
	for i, label := range []string{"b template 1st", "c template 2nd"} {
		sb, err := e.c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{RequestId: nextReq(),
			Source: &kilnpb.CreateSandboxRequest_Template{Template: "mem"}})
		if err != nil {
			t.Fatal(err)
		}
		sbs = append(sbs, sb)
		report(label+" idle", sb)
		e.shOut(sb.Id, "cat /mnt/t/t > /dev/null; echo ok")
		report(label+" read128", sb)
		e.shOut(sb.Id, "rm /mnt/t/t; echo ok")
		report(label+" rm128", sb)
		e.shOut(sb.Id, "mkdir -p /mnt/f && mount -t tmpfs -o size=330m f /mnt/f && dd if=/dev/zero of=/mnt/f/f bs=1M count=320 2>/dev/null; sync; echo ok")
		report(label+" +320", sb)
		within(label+" +320", sb, 8)
		if i == 1 {
			report("b template 1st then", sbs[0])
		}
	}
	t.Logf("kiln root at the end: %s", memStat(t, filepath.Dir(m.Path("x"))))
	t.Logf("TestKVMDaemonMemory took %v", time.Since(began).Round(time.Millisecond))
}
