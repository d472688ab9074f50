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
// (the one mapping of guestMiB), the Go heap (the runtime's arenas from
// 0xc000000000), the binary's own mappings, the rest.
type memSplit struct {
	Guest, Heap, Binary, Other smapsPart
	// Big are the headers and RSS (KiB) of the other mappings of more
	// than 4 MiB resident.
	Big []string
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
	var s memSplit
	var cur *smapsPart
	var part smapsPart
	var header string
	flush := func() {
		if cur != nil {
			part.File = part.RSS - part.Anon
			cur.add(part)
			if cur == &s.Other && part.RSS > 4<<10 {
				s.Big = append(s.Big, fmt.Sprintf("%s rss %d anon %d", header, part.RSS>>10, part.Anon>>10))
			}
		}
		cur, part = nil, smapsPart{}
	}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) == 0 {
			continue
		}
		if !strings.HasSuffix(fs[0], ":") { // a mapping's header
			flush()
			header = strings.Join(fs, " ")
			lo, hi, _ := strings.Cut(fs[0], "-")
			a, _ := strconv.ParseUint(lo, 16, 64)
			b, _ := strconv.ParseUint(hi, 16, 64)
			path := ""
			if len(fs) >= 6 {
				path = fs[5]
			}
			switch {
			case int64(b-a) == guestMiB<<20:
				cur = &s.Guest
			case path == "" && a >= 0xc000000000 && a < 0xc100000000:
				cur = &s.Heap
			case path == exe:
				cur = &s.Binary
			default:
				cur = &s.Other
			}
			continue
		}
		if len(fs) < 2 {
			continue
		}
		n, _ := strconv.ParseInt(fs[1], 10, 64)
		switch fs[0] {
		case "Size:":
			part.Size = n
		case "Rss:":
			part.RSS = n
		case "Pss:":
			part.PSS = n
		case "Anonymous:":
			part.Anon = n
		}
	}
	flush()
	return s
}

// memStat picks a cgroup's memory.current and memory.stat's anon, file,
// shmem and file_mapped, MiB.
func memStat(t *testing.T, dir string) string {
	t.Helper()
	st := map[string]uint64{}
	for _, line := range strings.Split(readTrim(t, filepath.Join(dir, "memory.stat")), "\n") {
		k, v, _ := strings.Cut(line, " ")
		n, _ := strconv.ParseUint(v, 10, 64)
		st[k] = n >> 20
	}
	peak := "-"
	if _, err := os.Stat(filepath.Join(dir, "memory.peak")); err == nil {
		peak = strconv.FormatUint(readMiB(t, filepath.Join(dir, "memory.peak")), 10)
	}
	return fmt.Sprintf("current %d peak %s anon %d file %d shmem %d file_mapped %d kernel %d",
		readMiB(t, filepath.Join(dir, "memory.current")), peak, st["anon"], st["file"], st["shmem"], st["file_mapped"], st["kernel"])
}

// TestKVMDaemonMemory measures what a sandbox's cgroup is charged for:
// image-booted, restored from a template (first and second), a fork
// child; idle and after the guest writes 192 MiB.
func TestKVMDaemonMemory(t *testing.T) {
	kvmtest.Require(t)
	m := testCgroupRoot(t)
	e := newKVMEnv(t)
	e.stop()
	e.cfg.Cgroups = m
	e.cfg.VMMOverheadMiB = 512 // room: the figures, not the limit
	e.cfg.MemoryOvercommit = 3
	e.startKVM()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	began := time.Now()
	self := readTrim(t, "/proc/self/cgroup")
	t.Logf("kilnd (this test) is in %s; kiln root %s", self, memStat(t, filepath.Dir(m.Path("x"))))

	const guest = 512
	report := func(label string, sb *kilnpb.Sandbox) {
		s := readSmaps(t, sb.Pid, guest)
		t.Logf("MEM %-22s guest[%v] heap[%v] binary[%v] other[%v] | cgroup %s", label, s.Guest, s.Heap, s.Binary, s.Other, memStat(t, m.Path(sb.Id)))
		for _, b := range s.Big {
			t.Logf("MEM   big other mapping: %s", b)
		}
	}
	const fill = "mkdir -p /mnt/f && mount -t tmpfs -o size=200m f /mnt/f && dd if=/dev/zero of=/mnt/f/f bs=1M count=192 2>/dev/null; sync; echo ok"
	measure := func(label string, sb *kilnpb.Sandbox) {
		report(label+" idle", sb)
		e.shOut(sb.Id, fill)
		report(label+" +192", sb)
	}

	img := e.createImage(0)
	measure("a image", img)
	kids, err := e.forkCtx(ctx, &kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_SandboxId{SandboxId: img.Id}, Count: 1})
	if err != nil || len(kids) != 1 {
		t.Fatalf("fork: %v, %v", kids, err)
	}
	report("a parent after fork", img)
	e.shOut(img.Id, "rm /mnt/f/f; dd if=/dev/zero of=/mnt/f/f bs=1M count=192 2>/dev/null; echo ok")
	report("a parent rewrite", img)
	e.shOut(kids[0].Id, "rm /mnt/f/f; echo ok")
	report("d child idle", kids[0])
	e.shOut(kids[0].Id, "dd if=/dev/zero of=/mnt/f/g bs=1M count=160 2>/dev/null; echo ok")
	report("d child +160", kids[0])
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
		e.shOut(sb.Id, fill)
		report(label+" +192", sb)
		if i == 1 {
			report("b template 1st then", sbs[0])
		}
	}
	t.Logf("kiln root at the end: %s", memStat(t, filepath.Dir(m.Path("x"))))
	t.Logf("TestKVMDaemonMemory took %v", time.Since(began).Round(time.Millisecond))
	_ = cgroup.DefaultMount
}
