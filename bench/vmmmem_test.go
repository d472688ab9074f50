package bench

import (
	"strings"
	"testing"

	"github.com/kilnvm/kiln/vmmproc"
)

func TestParseVMMSmaps(t *testing.T) {
	const smaps = `00400000-00500000 r-xp 00000000 08:01 77 /usr/bin/kiln-vmm
Rss:                1024 kB
Pss:                  32 kB
00500000-00510000 rw-p 00100000 08:01 77 /usr/bin/kiln-vmm
Pss:                   8 kB
c000000000-c000400000 rw-p 00000000 00:00 0                              [anon: Go: heap]
Pss:                1200 kB
7f0000000000-7f0000100000 rw-p 00000000 00:00 0                          [anon: Go: page summary]
Pss:                  40 kB
7f1000000000-7f1020000000 rw-s 00000000 00:01 5 /memfd:guest (deleted)
Pss:              100000 kB
7f2000000000-7f2000010000 rw-p 00000000 00:00 0 
Pss:                 300 kB
7f3000000000-7f3000003000 rw-s 00000000 00:0e 9 anon_inode:kvm-vcpu:0
Pss:                  12 kB
7f4000000000-7f4000001000 r--p 00000000 08:01 90 /etc/ld.so.cache
Pss:                   4 kB
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]
Pss:                  16 kB
7ffd10000000-7ffd10002000 r-xp 00000000 00:00 0                          [vdso]
Pss:                   2 kB
`
	guest := []vmmproc.MemoryRange{{Addr: 0x7f1000000000, Size: 0x20000000}}
	m, err := parseVMMSmaps(strings.NewReader(smaps), guest, 77)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name      string
		got, want uint64
	}{
		{"binary", m.Binary, 40 << 10},
		{"go heap", m.GoHeap, 1200 << 10},
		{"go runtime", m.GoRuntime, 40 << 10},
		{"anonymous", m.Anonymous, 300 << 10},
		{"kvm", m.KVM, 12 << 10},
		{"files", m.Files, 4 << 10},
		{"stack", m.Stack, 16 << 10},
		{"other", m.Other, 2 << 10},
		{"total (guest RAM left out)", m.Total(), (40 + 1200 + 40 + 300 + 12 + 4 + 16 + 2) << 10},
	} {
		if c.got != c.want {
			t.Errorf("%s: %d bytes, want %d", c.name, c.got, c.want)
		}
	}
	// Without the executable's inode, its pages count as files.
	m, err = parseVMMSmaps(strings.NewReader(smaps), guest, 0)
	if err != nil {
		t.Fatal(err)
	}
	if m.Binary != 0 || m.Files != 44<<10 {
		t.Errorf("exe unknown: binary %d, files %d", m.Binary, m.Files)
	}
	if _, err := parseVMMSmaps(strings.NewReader("00400000-00500000 r-xp 00000000 08:01 77 /x\nPss: many kB\n"), nil, 0); err == nil {
		t.Error("a Pss that is no number: no error")
	}
}
