package guestkernel

import (
	"bytes"
	"compress/gzip"
	"encoding/binary"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
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

// fakeKernel lays out a modules tree: mods maps a relative .ko path to its
// depends= value.
func fakeKernel(t *testing.T, mods map[string]string, extra map[string]string) *Kernel {
	t.Helper()
	dir := t.TempDir()
	for p, deps := range mods {
		full := filepath.Join(dir, p)
		must(t, os.MkdirAll(filepath.Dir(full), 0o755))
		name := ModuleName(p)
		must(t, os.WriteFile(full, fakeModule("license=GPL", "depends="+deps, "name="+name), 0o644))
	}
	for p, content := range extra {
		must(t, os.WriteFile(filepath.Join(dir, p), []byte(content), 0o644))
	}
	return &Kernel{Version: "test", Image: filepath.Join(dir, "vmlinuz"), ModulesDir: dir}
}

var testMods = map[string]string{
	"kernel/virt/lib/irqbypass.ko":          "",
	"kernel/drivers/crypto/ccp/ccp.ko":      "",
	"kernel/arch/x86/kvm/kvm.ko":            "irqbypass",
	"kernel/arch/x86/kvm/kvm-amd.ko":        "kvm,ccp",
	"kernel/drivers/virtio/virtio_ring.ko":  "",
	"kernel/drivers/virtio/virtio.ko":       "virtio_ring",
	"kernel/net/9p/9pnet.ko":                "",
	"kernel/net/9p/9pnet_virtio.ko":         "virtio,9pnet,virtio_ring",
	"kernel/fs/9p/9p.ko":                    "9pnet,fscache",
	"kernel/drivers/net/tun.ko":             "",
	"kernel/drivers/needs-missing/broke.ko": "nonesuch",
}

const testModulesDep = `kernel/virt/lib/irqbypass.ko:
kernel/drivers/crypto/ccp/ccp.ko:
kernel/arch/x86/kvm/kvm.ko: kernel/virt/lib/irqbypass.ko
kernel/arch/x86/kvm/kvm-amd.ko: kernel/arch/x86/kvm/kvm.ko kernel/virt/lib/irqbypass.ko kernel/drivers/crypto/ccp/ccp.ko
kernel/drivers/virtio/virtio_ring.ko:
kernel/drivers/virtio/virtio.ko: kernel/drivers/virtio/virtio_ring.ko
kernel/net/9p/9pnet.ko:
kernel/net/9p/9pnet_virtio.ko: kernel/drivers/virtio/virtio.ko kernel/net/9p/9pnet.ko kernel/drivers/virtio/virtio_ring.ko
kernel/fs/9p/9p.ko: kernel/net/9p/9pnet.ko kernel/fs/fscache/fscache.ko
kernel/drivers/net/tun.ko:
kernel/drivers/needs-missing/broke.ko: kernel/nonesuch.ko
`

func TestModuleLoadOrder(t *testing.T) {
	builtin := map[string]string{"modules.builtin": "kernel/fs/fscache/fscache.ko\n"}
	withDep := map[string]string{"modules.builtin": builtin["modules.builtin"], "modules.dep": testModulesDep}
	tests := []struct {
		name    string
		extra   map[string]string
		load    []string
		want    []string
		wantErr string
	}{
		{name: "kvm via modinfo", load: []string{"kvm-amd"}, want: []string{"irqbypass", "kvm", "ccp", "kvm_amd"}},
		{name: "9p via modinfo, fscache built in", load: []string{"9p", "9pnet_virtio"}, extra: builtin,
			want: []string{"9pnet", "9p", "virtio_ring", "virtio", "9pnet_virtio"}},
		{name: "kvm via modules.dep", load: []string{"kvm_amd"}, extra: withDep, want: []string{"irqbypass", "kvm", "ccp", "kvm_amd"}},
		{name: "9p via modules.dep", load: []string{"9p", "9pnet_virtio"}, extra: withDep,
			want: []string{"9pnet", "9p", "virtio_ring", "virtio", "9pnet_virtio"}},
		{name: "builtin fscache missing", load: []string{"9p"}, wantErr: "fscache (needed by 9p)"},
		{name: "unknown module", load: []string{"nonesuch"}, wantErr: "nonesuch"},
		{name: "missing dependency", load: []string{"broke"}, wantErr: "nonesuch (needed by broke)"},
		{name: "duplicates loaded once", load: []string{"tun", "tun.ko", "tun"}, want: []string{"tun"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			k := fakeKernel(t, testMods, tt.extra)
			mods, err := k.ModuleLoadOrder(tt.load...)
			if tt.wantErr != "" {
				if !errors.Is(err, ErrModuleNotFound) || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error = %v, want ErrModuleNotFound mentioning %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, m := range mods {
				got = append(got, m.Name)
				if _, err := os.Stat(m.Path); err != nil {
					t.Errorf("module %s: %v", m.Name, err)
				}
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Fatalf("load order = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestModuleLoadOrderCycle(t *testing.T) {
	k := fakeKernel(t, map[string]string{"kernel/a.ko": "b", "kernel/b.ko": "a"}, nil)
	if _, err := k.ModuleLoadOrder("a"); err == nil || !strings.Contains(err.Error(), "cycle") {
		t.Fatalf("error = %v, want a dependency cycle", err)
	}
}

func TestModuleLoadOrderNotELF(t *testing.T) {
	k := fakeKernel(t, nil, nil)
	must(t, os.WriteFile(filepath.Join(k.ModulesDir, "junk.ko"), []byte("not elf"), 0o644))
	if _, err := k.ModuleLoadOrder("junk"); err == nil || !strings.Contains(err.Error(), "junk.ko") {
		t.Fatalf("error = %v, want one naming junk.ko", err)
	}
}

func TestParseModulesDep(t *testing.T) {
	tests := []struct {
		name, in string
		want     []Module
		wantErr  string
	}{
		{name: "ok", in: "kernel/b-c.ko: kernel/a.ko\n\nkernel/a.ko:\n", want: []Module{
			{Name: "a", Path: "kernel/a.ko"},
			{Name: "b_c", Path: "kernel/b-c.ko", Depends: []string{"a"}},
		}},
		{name: "no colon", in: "kernel/a.ko kernel/b.ko\n", wantErr: "line 1"},
		{name: "absolute", in: "/kernel/a.ko:\n", wantErr: "line 1"},
		{name: "escape", in: "kernel/a.ko:\nkernel/b.ko: ../x.ko\n", wantErr: "line 2"},
		{name: "twice", in: "kernel/a.ko:\nother/a.ko:\n", wantErr: "listed twice"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseModulesDep(strings.NewReader(tt.in))
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error = %v, want %q", err, tt.wantErr)
				}
				return
			}
			if err != nil || !reflect.DeepEqual(got, tt.want) {
				t.Fatalf("got %+v, %v; want %+v", got, err, tt.want)
			}
		})
	}
}

func TestParseModinfoDepends(t *testing.T) {
	tests := []struct {
		in   string
		want []string
	}{
		{"license=GPL\x00depends=kvm,ccp\x00name=kvm_amd\x00", []string{"kvm", "ccp"}},
		{"depends=\x00", nil},
		{"name=x\x00", nil},
		{"depends=virtio-ring, 9pnet\x00", []string{"virtio_ring", "9pnet"}},
	}
	for _, tt := range tests {
		if got := ParseModinfoDepends([]byte(tt.in)); !reflect.DeepEqual(got, tt.want) {
			t.Errorf("ParseModinfoDepends(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}

func FuzzParseModulesDep(f *testing.F) {
	f.Add(testModulesDep)
	f.Add("a.ko:\n")
	f.Fuzz(func(t *testing.T, in string) {
		mods, err := ParseModulesDep(strings.NewReader(in))
		if err != nil {
			return
		}
		for _, m := range mods {
			if m.Name == "" || strings.HasPrefix(m.Path, "/") || strings.Contains(m.Path, "..") && strings.Contains("/"+m.Path+"/", "/../") {
				t.Fatalf("accepted bad entry %+v", m)
			}
		}
	})
}

func FuzzParseModinfoDepends(f *testing.F) {
	f.Add([]byte("depends=kvm,ccp\x00name=kvm_amd\x00"))
	f.Fuzz(func(t *testing.T, in []byte) {
		for _, d := range ParseModinfoDepends(in) {
			if d == "" || strings.Contains(d, ",") {
				t.Fatalf("bad dependency %q from %q", d, in)
			}
		}
	})
}

func TestReadModule(t *testing.T) {
	ko := fakeModule("license=GPL", "depends=", "name=m")
	dir := t.TempDir()
	write := func(name string, data []byte) string {
		p := filepath.Join(dir, name)
		must(t, os.WriteFile(p, data, 0o644))
		return p
	}
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	_, err := zw.Write(ko)
	must(t, err)
	must(t, zw.Close())
	compressed := func(tool string) []byte {
		if _, err := exec.LookPath(tool); err != nil {
			return nil
		}
		out, err := exec.Command("sh", "-c", tool+" -c < "+write("m.raw", ko)).Output()
		must(t, err)
		return out
	}
	tests := []struct {
		name    string
		file    string
		data    []byte // nil: do not create
		tool    string // skip when missing
		wantErr string
	}{
		{name: "plain", file: "m.ko", data: ko},
		{name: "gzip", file: "m.ko.gz", data: gz.Bytes()},
		{name: "xz", file: "m.ko.xz", data: compressed("xz"), tool: "xz"},
		{name: "zstd", file: "m.ko.zst", data: compressed("zstd"), tool: "zstd"},
		{name: "missing", file: "gone.ko", wantErr: "gone.ko"},
		{name: "missing xz", file: "gone.ko.xz", wantErr: "gone.ko.xz"},
		{name: "corrupt gzip", file: "bad.ko.gz", data: []byte("not gzip"), wantErr: "bad.ko.gz"},
		{name: "unknown type", file: "m.ko.bz2", data: []byte("x"), wantErr: "unknown file type"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.tool != "" {
				if _, err := exec.LookPath(tt.tool); err != nil {
					t.Skipf("%s not installed", tt.tool)
				}
			}
			p := filepath.Join(dir, tt.file)
			if tt.data != nil {
				p = write(tt.file, tt.data)
			}
			got, err := ReadModule(p)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error = %v, want one mentioning %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, ko) {
				t.Fatalf("got %d bytes, want the %d of the module", len(got), len(ko))
			}
		})
	}
}

func TestInsmodScript(t *testing.T) {
	order := []Module{{Name: "virtio"}, {Name: "virtio_ring"}, {Name: "virtio_mmio", Depends: []string{"virtio", "virtio_ring"}}}
	s, err := InsmodScript(order, "echo done\n", "test")
	if err != nil {
		t.Fatal(err)
	}
	i1 := strings.Index(s, "insmod /lib/modules/virtio.ko ")
	i2 := strings.Index(s, "insmod /lib/modules/virtio_ring.ko ")
	i3 := strings.Index(s, "insmod /lib/modules/virtio_mmio.ko ")
	mount := strings.Index(s, "mount -t devtmpfs devtmpfs /dev")
	if mount < 0 || i1 < mount || i2 < i1 || i3 < i2 || !strings.HasSuffix(s, "\necho done\n") || !strings.Contains(s, "'test: insmod virtio failed'") {
		t.Fatalf("init script out of order or untagged:\n%s", s)
	}
	if _, err := InsmodScript([]Module{{Name: "x;reboot"}}, "", "test"); err == nil {
		t.Fatal("a module name with shell syntax was accepted")
	}
}
