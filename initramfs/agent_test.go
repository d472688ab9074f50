package initramfs

import (
	"bytes"
	"compress/gzip"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/kilnvm/kiln/guestkernel"
	"github.com/u-root/u-root/pkg/cpio"
)

// fakeExecutable returns a minimal x86-64 ELF executable, dynamically linked
// (with a PT_INTERP program header) when interp is set.
func fakeExecutable(interp bool) []byte {
	le := binary.LittleEndian
	const ehsize, phentsize = 64, 56
	buf := make([]byte, ehsize+phentsize+32)
	copy(buf, []byte{0x7f, 'E', 'L', 'F', 2, 1, 1})
	le.PutUint16(buf[16:], 2)  // ET_EXEC
	le.PutUint16(buf[18:], 62) // EM_X86_64
	le.PutUint32(buf[20:], 1)
	le.PutUint16(buf[52:], ehsize)
	le.PutUint16(buf[54:], phentsize)
	if interp {
		le.PutUint64(buf[32:], ehsize) // phoff
		le.PutUint16(buf[56:], 1)      // phnum
		ph := buf[ehsize:]
		le.PutUint32(ph[0:], 3) // PT_INTERP
		le.PutUint64(ph[8:], ehsize+phentsize)
		le.PutUint64(ph[32:], 28)
		le.PutUint64(ph[40:], 28)
		copy(buf[ehsize+phentsize:], "/lib64/ld-linux-x86-64.so.2\x00")
	}
	return buf
}

func writeFile(t *testing.T, path string, data []byte, mode os.FileMode) string {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, data, mode); err != nil {
		t.Fatal(err)
	}
	return path
}

// fakeAgentKernel lays out a kernel whose modules tree has the default
// agent modules and their dependencies, as in Debian's 6.1 kernel, with
// virtio_blk gzip-compressed and the failover modules built in. Each
// module's contents are "module <name>".
func fakeAgentKernel(t *testing.T) *guestkernel.Kernel {
	t.Helper()
	dir := t.TempDir()
	const dep = `kernel/drivers/virtio/virtio_ring.ko:
kernel/drivers/virtio/virtio.ko: kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/virtio/virtio_mmio.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/block/virtio_blk.ko.gz: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/net/virtio_net.ko: kernel/drivers/net/net_failover.ko kernel/net/core/failover.ko kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/char/hw_random/virtio-rng.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/net/vmw_vsock/vsock.ko:
kernel/net/vmw_vsock/vmw_vsock_virtio_transport_common.ko: kernel/net/vmw_vsock/vsock.ko
kernel/net/vmw_vsock/vmw_vsock_virtio_transport.ko: kernel/net/vmw_vsock/vmw_vsock_virtio_transport_common.ko kernel/net/vmw_vsock/vsock.ko kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/lib/crc16.ko:
kernel/fs/mbcache.ko:
kernel/fs/jbd2/jbd2.ko:
kernel/fs/ext4/ext4.ko: kernel/lib/crc16.ko kernel/fs/mbcache.ko kernel/fs/jbd2/jbd2.ko
kernel/crypto/crc32c_generic.ko:
kernel/drivers/net/tun.ko:
kernel/fs/netfs/netfs.ko:
kernel/fs/fscache/fscache.ko: kernel/fs/netfs/netfs.ko
kernel/net/9p/9pnet.ko:
kernel/net/9p/9pnet_virtio.ko: kernel/net/9p/9pnet.ko kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/fs/9p/9p.ko: kernel/net/9p/9pnet.ko kernel/fs/netfs/netfs.ko kernel/fs/fscache/fscache.ko
kernel/fs/overlayfs/overlay.ko:
kernel/lib/libcrc32c.ko:
kernel/fs/erofs/erofs.ko: kernel/lib/libcrc32c.ko
`
	writeFile(t, filepath.Join(dir, "modules.dep"), []byte(dep), 0o644)
	writeFile(t, filepath.Join(dir, "modules.builtin"), []byte("kernel/drivers/net/net_failover.ko\nkernel/net/core/failover.ko\n"), 0o644)
	for line := range strings.SplitSeq(strings.TrimSpace(dep), "\n") {
		rel, _, _ := strings.Cut(line, ":")
		data := []byte("module " + guestkernel.ModuleName(rel))
		if strings.HasSuffix(rel, ".gz") {
			var buf bytes.Buffer
			zw := gzip.NewWriter(&buf)
			zw.Write(data)
			if err := zw.Close(); err != nil {
				t.Fatal(err)
			}
			data = buf.Bytes()
		}
		writeFile(t, filepath.Join(dir, rel), data, 0o644)
	}
	return &guestkernel.Kernel{Version: "test", Image: filepath.Join(dir, "vmlinuz"), ModulesDir: dir}
}

// modulesIn returns the names of the .ko files in lib/modules of entries.
func modulesIn(got map[string]readEntry) []string {
	var mods []string
	for name := range got {
		if m, ok := strings.CutPrefix(name, AgentModulesDir+"/"); ok {
			mods = append(mods, strings.TrimSuffix(m, ".ko"))
		}
	}
	sort.Strings(mods)
	return mods
}

func TestAgentImage(t *testing.T) {
	dir := t.TempDir()
	agent := writeFile(t, filepath.Join(dir, "kiln-agent"), fakeExecutable(false), 0o755)
	busybox := writeFile(t, filepath.Join(dir, "busybox"), fakeExecutable(false), 0o755)
	extra := writeFile(t, filepath.Join(dir, "hosts"), []byte("127.0.0.1 localhost\n"), 0o640)
	k := fakeAgentKernel(t)
	base := map[string]readEntry{
		"init":       {mode: cpio.S_IFREG | 0o755, data: string(fakeExecutable(false))},
		"proc":       {mode: cpio.S_IFDIR | 0o555},
		"sys":        {mode: cpio.S_IFDIR | 0o555},
		"dev":        {mode: cpio.S_IFDIR | 0o755},
		"tmp":        {mode: cpio.S_IFDIR | cpio.S_ISVTX | 0o777},
		"run":        {mode: cpio.S_IFDIR | 0o755},
		"newroot":    {mode: cpio.S_IFDIR | 0o755},
		"etc":        {mode: cpio.S_IFDIR | 0o755},
		"root":       {mode: cpio.S_IFDIR | 0o700},
		"etc/passwd": {mode: cpio.S_IFREG | 0o644, data: "root:x:0:0:root:/root:/bin/sh\n"},
		"etc/group":  {mode: cpio.S_IFREG | 0o644, data: "root:x:0:\n"},
	}
	tests := []struct {
		name        string
		image       AgentImage
		wantModules []string
		want        map[string]readEntry // besides base
		wantCount   int                  // entries in all
	}{
		{
			name:      "agent only",
			image:     AgentImage{Agent: agent},
			wantCount: len(base),
		},
		{
			name:  "default modules",
			image: AgentImage{Agent: agent, Kernel: k},
			wantModules: []string{"crc16", "crc32c_generic", "ext4", "jbd2", "mbcache", "virtio", "virtio_blk", "virtio_mmio",
				"virtio_net", "virtio_ring", "virtio_rng", "vmw_vsock_virtio_transport", "vmw_vsock_virtio_transport_common", "vsock"},
			want: map[string]readEntry{
				"lib":                               {mode: cpio.S_IFDIR | 0o755},
				"lib/modules":                       {mode: cpio.S_IFDIR | 0o755},
				"lib/modules/virtio_blk.ko":         {mode: cpio.S_IFREG | 0o644, data: "module virtio_blk"},
				"lib/modules/virtio_rng.ko":         {mode: cpio.S_IFREG | 0o644, data: "module virtio_rng"},
				"lib/modules/ext4.ko":               {mode: cpio.S_IFREG | 0o644, data: "module ext4"},
				"lib/modules/virtio_ring.ko":        {mode: cpio.S_IFREG | 0o644, data: "module virtio_ring"},
				"lib/modules/crc32c_generic.ko":     {mode: cpio.S_IFREG | 0o644, data: "module crc32c_generic"},
				"lib/kiln/image-modules":            {mode: cpio.S_IFDIR | 0o755},
				"lib/kiln/image-modules/9p.ko":      {mode: cpio.S_IFREG | 0o644, data: "module 9p"},
				"lib/kiln/image-modules/overlay.ko": {mode: cpio.S_IFREG | 0o644, data: "module overlay"},
				"lib/kiln/image-modules/netfs.ko":   {mode: cpio.S_IFREG | 0o644, data: "module netfs"},
				"lib/kiln/image-modules/erofs.ko":   {mode: cpio.S_IFREG | 0o644, data: "module erofs"},
			},
			wantCount: len(base) + 2 + 14 + 2 + 8,
		},
		{
			name:  "no image modules",
			image: AgentImage{Agent: agent, Kernel: k, NoImageModules: true},
			wantModules: []string{"crc16", "crc32c_generic", "ext4", "jbd2", "mbcache", "virtio", "virtio_blk", "virtio_mmio",
				"virtio_net", "virtio_ring", "virtio_rng", "vmw_vsock_virtio_transport", "vmw_vsock_virtio_transport_common", "vsock"},
			wantCount: len(base) + 2 + 14,
		},
		{
			name:        "chosen modules, busybox, extra files",
			image:       AgentImage{Agent: agent, Kernel: k, Modules: []string{"tun", "virtio-blk"}, Busybox: true, Files: map[string]string{"etc/hosts": extra, "/opt/tool": agent}},
			wantModules: []string{"tun", "virtio", "virtio_blk", "virtio_ring"},
			want: map[string]readEntry{
				"bin":         {mode: cpio.S_IFDIR | 0o755},
				"bin/busybox": {mode: cpio.S_IFREG | 0o755, data: string(fakeExecutable(false))},
				"bin/sh":      {mode: cpio.S_IFLNK | 0o777, data: "busybox"},
				"bin/mount":   {mode: cpio.S_IFLNK | 0o777, data: "busybox"},
				"etc/hosts":   {mode: cpio.S_IFREG | 0o640, data: "127.0.0.1 localhost\n"},
				"opt/tool":    {mode: cpio.S_IFREG | 0o755, data: string(fakeExecutable(false))},
			},
			wantCount: len(base) + 2 + 4 + 2 + len(BusyboxApplets()) + 2 + 1 + 2 + 8,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b, err := tt.image.build(busybox)
			if err != nil {
				t.Fatal(err)
			}
			_, got := readBack(t, build(t, b))
			for name, w := range base {
				if got[name] != w {
					t.Errorf("%s = {%#o %q}, want {%#o %q}", name, got[name].mode, got[name].data, w.mode, w.data)
				}
			}
			for name, w := range tt.want {
				if got[name] != w {
					t.Errorf("%s = {%#o %q}, want {%#o %q}", name, got[name].mode, got[name].data, w.mode, w.data)
				}
			}
			if mods := modulesIn(got); strings.Join(mods, " ") != strings.Join(tt.wantModules, " ") {
				t.Errorf("modules = %q, want %q", mods, tt.wantModules)
			}
			if len(got) != tt.wantCount {
				t.Errorf("%d entries, want %d", len(got), tt.wantCount)
			}
			if tt.image.Busybox {
				for _, a := range BusyboxApplets() {
					if got["bin/"+a].data != "busybox" {
						t.Errorf("no /bin/%s applet link", a)
					}
				}
			}
		})
	}
}

func TestAgentImageDeterministic(t *testing.T) {
	dir := t.TempDir()
	agent := writeFile(t, filepath.Join(dir, "kiln-agent"), fakeExecutable(false), 0o755)
	files := map[string]string{}
	for i := range 20 {
		name := string(rune('a'+i)) + ".txt"
		files["data/"+name] = writeFile(t, filepath.Join(dir, name), []byte(name), 0o644)
	}
	img := AgentImage{Agent: agent, Kernel: fakeAgentKernel(t), Busybox: true, Files: files}
	var first []byte
	for i := range 3 {
		b, err := img.build(agent)
		if err != nil {
			t.Fatal(err)
		}
		var buf bytes.Buffer
		if _, err := b.WriteGzip(&buf); err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			first = buf.Bytes()
		} else if !bytes.Equal(first, buf.Bytes()) {
			t.Fatalf("build %d differs from the first", i+1)
		}
	}
}

func TestAgentImageErrors(t *testing.T) {
	dir := t.TempDir()
	agent := writeFile(t, filepath.Join(dir, "kiln-agent"), fakeExecutable(false), 0o755)
	dynamic := writeFile(t, filepath.Join(dir, "dynamic"), fakeExecutable(true), 0o755)
	script := writeFile(t, filepath.Join(dir, "script"), []byte("#!/bin/sh\n"), 0o755)
	k := fakeAgentKernel(t)
	tests := []struct {
		name    string
		image   AgentImage
		busybox string
		wantErr string
		is      error
	}{
		{name: "no agent", image: AgentImage{}, wantErr: "no agent binary"},
		{name: "missing agent", image: AgentImage{Agent: filepath.Join(dir, "none")}, wantErr: "none"},
		{name: "agent not ELF", image: AgentImage{Agent: script}, wantErr: "script is not an ELF executable"},
		{name: "dynamic agent", image: AgentImage{Agent: dynamic}, wantErr: "dynamic is dynamically linked"},
		{name: "unknown module", image: AgentImage{Agent: agent, Kernel: k, Modules: []string{"nonesuch"}}, wantErr: "nonesuch", is: guestkernel.ErrModuleNotFound},
		{name: "missing busybox", image: AgentImage{Agent: agent, Busybox: true}, busybox: filepath.Join(dir, "none"), wantErr: "busybox-static"},
		{name: "dynamic busybox", image: AgentImage{Agent: agent, Busybox: true}, busybox: dynamic, wantErr: "dynamically linked"},
		{name: "extra file clashes", image: AgentImage{Agent: agent, Files: map[string]string{"/etc/passwd": script}}, wantErr: "duplicate path etc/passwd"},
		{name: "extra file missing", image: AgentImage{Agent: agent, Files: map[string]string{"x": filepath.Join(dir, "none")}}, wantErr: "none"},
		{name: "extra file escapes", image: AgentImage{Agent: agent, Files: map[string]string{"../x": script}}, wantErr: `".."`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			bb := tt.busybox
			if bb == "" {
				bb = agent
			}
			_, err := tt.image.build(bb)
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("Build error = %v, want one mentioning %q", err, tt.wantErr)
			}
			if tt.is != nil && !errors.Is(err, tt.is) {
				t.Fatalf("Build error = %v, want one wrapping %v", err, tt.is)
			}
		})
	}
}

// TestAgentImageCachedKernel builds the default image from the cached
// Debian kernel (make kernel) and this machine's busybox: every default
// module resolves, and the modules come out as uncompressed ELF objects.
func TestAgentImageCachedKernel(t *testing.T) {
	k, err := guestkernel.Find()
	if errors.Is(err, guestkernel.ErrNotCached) {
		t.Skip(err)
	}
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(HostBusybox); err != nil {
		t.Skip(err)
	}
	b, err := AgentImage{Agent: HostBusybox, Kernel: k, Busybox: true}.Build()
	if err != nil {
		t.Fatal(err)
	}
	_, got := readBack(t, build(t, b))
	mods := modulesIn(got)
	have := map[string]bool{}
	for _, m := range mods {
		have[m] = true
		if data := got[AgentModulesDir+"/"+m+".ko"].data; !strings.HasPrefix(data, "\x7fELF") {
			t.Errorf("module %s is not an uncompressed ELF object", m)
		}
	}
	order, err := k.ModuleLoadOrder(DefaultAgentModules()...)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range order {
		if !have[m.Name] {
			t.Errorf("module %s missing", m.Name)
		}
	}
	if len(mods) != len(order) {
		t.Errorf("image has modules %q, want the %d of %v", mods, len(order), DefaultAgentModules())
	}
}

func TestImageConfigArchive(t *testing.T) {
	data, err := ImageConfigArchive([]byte(`{"User":"app"}`))
	if err != nil {
		t.Fatal(err)
	}
	_, got := readBack(t, data)
	if e := got[ImageConfigPath]; e.data != `{"User":"app"}` || e.mode != cpio.S_IFREG|0o644 {
		t.Errorf("%s = {%#o %q}", ImageConfigPath, e.mode, e.data)
	}
	if len(data)%4 != 0 {
		t.Errorf("archive of %d bytes: not 4-byte aligned, so it cannot be appended", len(data))
	}
}
