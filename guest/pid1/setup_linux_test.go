package pid1

import (
	"log/slog"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func TestSetup(t *testing.T) {
	modules := map[string]string{"virtio_ring.ko": "", "virtio.ko": "virtio_ring"}
	loads := []string{`finit virtio_ring.ko ""`, `finit virtio.ko ""`}
	path := "setenv PATH=" + DefaultPath
	tests := []struct {
		name     string
		cmdline  string
		setup    func(f *fakeSys)
		want     []string
		wantOpts Options
		wantErr  string
	}{
		{
			name:     "initramfs root",
			cmdline:  "console=ttyS0 quiet\n",
			want:     concat(freshBoot[:20], []string{path}, loads, []string{"linkup lo"}),
			wantOpts: Options{RootFSType: "ext4"},
		},
		{
			name:     "PATH given, hostname",
			cmdline:  "kiln.hostname=box kiln.debug\n",
			setup:    func(f *fakeSys) { f.env["PATH"] = "/bin" },
			want:     concat(freshBoot[:20], loads, []string{"sethostname box", "linkup lo"}),
			wantOpts: Options{RootFSType: "ext4", Hostname: "box", Debug: true},
		},
		{
			name:     "disk root",
			cmdline:  "kiln.root=/dev/vda kiln.hostname=box\n",
			setup:    func(f *fakeSys) { f.exist["/dev/vda"] = true },
			want:     concat(freshBoot[:20], []string{path}, loads, []string{"sethostname box", "linkup lo"}, switchCalls),
			wantOpts: Options{RootFSType: "ext4", Root: "/dev/vda", Hostname: "box"},
		},
		{
			name:    "mount fails",
			setup:   func(f *fakeSys) { f.errs["mount proc /proc proc nosuid|nodev|noexec "] = unix.EPERM },
			want:    freshBoot[:2],
			wantErr: "mounting proc on /proc: operation not permitted",
		},
		{
			name:    "module fails",
			setup:   func(f *fakeSys) { f.errs[loads[0]] = unix.ENOEXEC },
			want:    concat(freshBoot[:20], []string{path}, loads[:1]),
			wantErr: "loading module virtio_ring",
		},
		{
			name:     "bad hostname",
			cmdline:  "kiln.hostname=" + strings.Repeat("x", 65) + " kiln.root=/dev/vda",
			want:     concat(freshBoot[:20], []string{path}, loads),
			wantOpts: Options{RootFSType: "ext4", Root: "/dev/vda", Hostname: strings.Repeat("x", 65)},
			wantErr:  "want 1 to 64 bytes",
		},
		{
			name:     "root fails",
			cmdline:  "kiln.root=/dev/vda",
			setup:    func(f *fakeSys) { f.exist["/dev/vda"] = true; f.errs[switchCalls[1]] = unix.EINVAL },
			want:     concat(freshBoot[:20], []string{path}, loads, []string{"linkup lo"}, switchCalls[:2]),
			wantOpts: Options{RootFSType: "ext4", Root: "/dev/vda"},
			wantErr:  "mounting /dev/vda",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFake()
			f.files["/proc/cmdline"] = tt.cmdline
			if tt.setup != nil {
				tt.setup(f)
			}
			opts, err := f.sys().setup(slog.New(slog.DiscardHandler), writeModules(t, modules))
			if tt.wantErr == "" && err != nil {
				t.Fatalf("Setup: %v", err)
			}
			if tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)) {
				t.Fatalf("Setup error = %v, want %q", err, tt.wantErr)
			}
			if opts != tt.wantOpts {
				t.Errorf("options = %+v, want %+v", opts, tt.wantOpts)
			}
			diffCalls(t, f.calls, tt.want)
		})
	}
}

func TestSetupNoCmdline(t *testing.T) {
	f := newFake()
	f.env["PATH"] = "/bin"
	if _, err := f.sys().setup(nil, t.TempDir()); err == nil || !strings.Contains(err.Error(), "reading the kernel command line") {
		t.Fatalf("Setup error = %v, want one about the command line", err)
	}
}

func concat(parts ...[]string) []string {
	var out []string
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}
