package pid1

import (
	"encoding/binary"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kilnvm/kiln/guestkernel"
	"golang.org/x/sys/unix"
)

// fakeModule returns a minimal ELF64 relocatable object whose .modinfo
// section holds the given key=value strings.
func fakeModule(modinfo ...string) []byte {
	info := []byte(strings.Join(modinfo, "\x00") + "\x00")
	shstr := []byte("\x00.modinfo\x00.shstrtab\x00")
	le := binary.LittleEndian
	const ehsize, shentsize = 64, 64
	infoOff := uint64(ehsize)
	strOff := infoOff + uint64(len(info))
	shoff := (strOff + uint64(len(shstr)) + 7) &^ 7
	buf := make([]byte, shoff+3*shentsize)
	copy(buf, []byte{0x7f, 'E', 'L', 'F', 2, 1, 1})
	le.PutUint16(buf[16:], 1)  // ET_REL
	le.PutUint16(buf[18:], 62) // EM_X86_64
	le.PutUint32(buf[20:], 1)
	le.PutUint64(buf[40:], shoff)
	le.PutUint16(buf[52:], ehsize)
	le.PutUint16(buf[58:], shentsize)
	le.PutUint16(buf[60:], 3) // shnum
	le.PutUint16(buf[62:], 2) // shstrndx
	copy(buf[infoOff:], info)
	copy(buf[strOff:], shstr)
	sh := func(i int, name, typ uint32, off, size uint64) {
		b := buf[shoff+uint64(i)*shentsize:]
		le.PutUint32(b[0:], name)
		le.PutUint32(b[4:], typ)
		le.PutUint64(b[24:], off)
		le.PutUint64(b[32:], size)
		le.PutUint64(b[48:], 1)
	}
	sh(1, 1, 1, infoOff, uint64(len(info)))  // .modinfo, SHT_PROGBITS
	sh(2, 10, 3, strOff, uint64(len(shstr))) // .shstrtab, SHT_STRTAB
	return buf
}

// writeModules lays out fake modules in a new directory: files maps a
// relative path to the module's depends= value, or to "!raw:" and the
// file's contents.
func writeModules(t *testing.T, files map[string]string) string {
	t.Helper()
	dir := t.TempDir()
	for p, deps := range files {
		full := filepath.Join(dir, p)
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			t.Fatal(err)
		}
		data := []byte(strings.TrimPrefix(deps, "!raw:"))
		if !strings.HasPrefix(deps, "!raw:") {
			data = fakeModule("license=GPL", "depends="+deps, "name="+guestkernel.ModuleName(p))
		}
		if err := os.WriteFile(full, data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// virtioMods is a flat initramfs module directory like the agent's.
var virtioMods = map[string]string{
	"virtio_ring.ko":                       "",
	"virtio.ko":                            "virtio_ring",
	"virtio_mmio.ko":                       "virtio,virtio_ring",
	"virtio_blk.ko":                        "virtio,virtio_ring",
	"vsock.ko":                             "",
	"vmw_vsock_virtio_transport.ko":        "vmw_vsock_virtio_transport_common,vsock,virtio,virtio_ring",
	"vmw_vsock_virtio_transport_common.ko": "vsock",
	"crc16.ko":                             "",
	"mbcache.ko":                           "",
	"jbd2.ko":                              "",
	"ext4.ko":                              "crc16,mbcache,jbd2",
	"crc32c_generic.ko":                    "",
}

func finits(names ...string) []string {
	calls := make([]string, len(names))
	for i, n := range names {
		calls[i] = "finit " + n + ".ko \"\""
	}
	return calls
}

func TestLoadModules(t *testing.T) {
	tests := []struct {
		name    string
		files   map[string]string
		errs    map[string]error // finit of module name -> error
		missing bool             // no directory at all
		want    []string         // module files loaded, in order, without .ko
		wantErr []string
	}{
		{
			name:  "agent modules",
			files: virtioMods,
			want: []string{"crc16", "crc32c_generic", "mbcache", "jbd2", "ext4", "virtio_ring", "virtio",
				"virtio_blk", "virtio_mmio", "vsock", "vmw_vsock_virtio_transport_common", "vmw_vsock_virtio_transport"},
		},
		{
			name:  "dependency built in",
			files: map[string]string{"virtio_blk.ko": "virtio,virtio_ring", "virtio_net.ko": "net_failover,virtio"},
			want:  []string{"virtio_blk", "virtio_net"},
		},
		{
			name:  "nested directories and dashes",
			files: map[string]string{"kernel/b/virtio-rng.ko": "virtio", "kernel/a/virtio.ko": "", "README": "!raw:not a module"},
			want:  []string{"virtio", "virtio-rng"},
		},
		{
			name:  "already loaded",
			files: map[string]string{"a.ko": "", "b.ko": "a"},
			errs:  map[string]error{"a": unix.EEXIST},
			want:  []string{"a", "b"},
		},
		{
			name:    "failure skips dependents only",
			files:   map[string]string{"a.ko": "", "b.ko": "a", "c.ko": "b", "d.ko": ""},
			errs:    map[string]error{"a": unix.ENOEXEC},
			want:    []string{"a", "d"},
			wantErr: []string{"loading module a (", "exec format error", "module b not loaded: its dependency a failed", "module c not loaded: its dependency b failed"},
		},
		{
			name:    "cycle",
			files:   map[string]string{"a.ko": "b", "b.ko": "c", "c.ko": "a", "d.ko": ""},
			wantErr: []string{"kernel module dependency cycle: a -> b -> c -> a"},
		},
		{
			name:    "self dependency",
			files:   map[string]string{"a.ko": "a"},
			wantErr: []string{"cycle: a -> a"},
		},
		{
			name:    "not ELF",
			files:   map[string]string{"a.ko": "", "junk.ko": "!raw:junk"},
			wantErr: []string{"junk.ko"},
		},
		{
			name:    "no modinfo",
			files:   map[string]string{"empty.ko": "!raw:\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x01\x00\x3e\x00\x01\x00\x00\x00" + strings.Repeat("\x00", 24) + "\x00\x00\x00\x00\x40\x00\x00\x00\x00\x00\x40\x00\x00\x00\x00\x00"},
			wantErr: []string{"empty.ko has no .modinfo section"},
		},
		{
			name:    "two files of one module",
			files:   map[string]string{"x/a.ko": "", "y/a.ko": ""},
			wantErr: []string{"module a is both"},
		},
		{name: "empty directory", files: map[string]string{}},
		{name: "no directory", missing: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := writeModules(t, tt.files)
			if tt.missing {
				dir = filepath.Join(dir, "nonexistent")
			}
			f := newFake()
			for name, err := range tt.errs {
				f.errs[finits(name)[0]] = err
			}
			err := f.sys().LoadModules(dir, slog.New(slog.DiscardHandler))
			for _, w := range tt.wantErr {
				if err == nil || !strings.Contains(err.Error(), w) {
					t.Errorf("LoadModules error = %v, want one mentioning %q", err, w)
				}
			}
			if len(tt.wantErr) == 0 && err != nil {
				t.Errorf("LoadModules: %v", err)
			}
			diffCalls(t, f.calls, finits(tt.want...))
		})
	}
}

func TestLoadModulesNameFromModinfo(t *testing.T) {
	dir := t.TempDir()
	// The file names differ from the modules' names; depends= uses the
	// latter.
	for file, info := range map[string][]string{
		"zz.ko": {"name=virtio", "depends="},
		"aa.ko": {"name=virtio_blk", "depends=virtio"},
	} {
		if err := os.WriteFile(filepath.Join(dir, file), fakeModule(info...), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	f := newFake()
	if err := f.sys().LoadModules(dir, nil); err != nil {
		t.Fatal(err)
	}
	diffCalls(t, f.calls, []string{`finit zz.ko ""`, `finit aa.ko ""`})
}

// TestLoadModulesCachedKernel orders the agent's default modules of the
// cached Debian kernel, as the agent image carries them: each module must be
// loaded after every dependency depmod found for it.
func TestLoadModulesCachedKernel(t *testing.T) {
	k, err := guestkernel.Find()
	if errors.Is(err, guestkernel.ErrNotCached) {
		t.Skip(err)
	}
	if err != nil {
		t.Fatal(err)
	}
	order, err := k.ModuleLoadOrder("virtio_mmio", "virtio_blk", "virtio_net", "virtio_rng",
		"vmw_vsock_virtio_transport", "ext4", "crc32c_generic")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	deps := map[string][]string{}
	for _, m := range order {
		ko, err := guestkernel.ReadModule(m.Path)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, m.Name+".ko"), ko, 0o644); err != nil {
			t.Fatal(err)
		}
		deps[m.Name] = m.Depends
	}
	f := newFake()
	if err := f.sys().LoadModules(dir, nil); err != nil {
		t.Fatal(err)
	}
	if len(f.calls) != len(order) {
		t.Fatalf("loaded %d modules, want %d: %q", len(f.calls), len(order), f.calls)
	}
	loaded := map[string]bool{}
	for _, c := range f.calls {
		name := strings.TrimSuffix(strings.Fields(c)[1], ".ko")
		for _, d := range deps[name] {
			if !loaded[d] {
				t.Errorf("%s loaded before its dependency %s", name, d)
			}
		}
		loaded[name] = true
	}
}
