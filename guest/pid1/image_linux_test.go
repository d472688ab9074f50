package pid1

import (
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

const nineMount = "mount kilnroot /kiln/lower 9p ro " + ImageMountOptions

// imageCalls is SwitchRootImage's calls for tag kilnroot, no options, no
// modules.
var imageCalls = append([]string{
	"mkdir /kiln/lower -rwxr-xr-x",
	"mkdir /kiln/rw -rwxr-xr-x",
	"mkdir /newroot -rwxr-xr-x",
	nineMount,
	"mount tmpfs /kiln/rw tmpfs 0 mode=0755",
	"mkdir /kiln/rw/upper -rwxr-xr-x",
	"mkdir /kiln/rw/work -rwxr-xr-x",
	"mount overlay /newroot overlay 0 lowerdir=/kiln/lower,upperdir=/kiln/rw/upper,workdir=/kiln/rw/work",
	"mkdir /run/kiln/image -rwxr-xr-x",
	"mount /kiln/lower /run/kiln/image  bind ",
	"mkdir /run/kiln/rw -rwx------",
	"mount /kiln/rw /run/kiln/rw  bind ",
}, switchCalls[2:]...)

func TestSwitchRootImage(t *testing.T) {
	erofsMount := "mount /dev/vdb /kiln/lower erofs ro "
	erofsCalls := replaced(imageCalls, 3, erofsMount)
	withDisk := func(f *fakeSys) {
		f.files["/sys/block/vda/serial"] = "modules"
		f.files["/sys/block/vdb/serial"] = "kilnroot\n"
		f.exist["/dev/vdb"] = true
	}
	tests := []struct {
		name       string
		transport  string
		tag, flags string
		upperMiB   int
		setup      func(f *fakeSys)
		want       []string
		wantSleeps int
		wantErr    string
	}{
		{name: "mounts and enters", tag: "kilnroot", want: imageCalls},
		{name: "capped writable layer", tag: "kilnroot", upperMiB: 256,
			want: replaced(imageCalls, 4, "mount tmpfs /kiln/rw tmpfs 0 mode=0755,size=256m")},
		{name: "extra options", tag: "kilnroot", flags: "noatime,debug=0",
			want: replaced(imageCalls, 3, "mount kilnroot /kiln/lower 9p ro|noatime "+ImageMountOptions+",debug=0")},
		{name: "device never appears", tag: "kilnroot",
			setup:      func(f *fakeSys) { f.errs[nineMount] = unix.ENOENT },
			wantErr:    `mounting 9p tag "kilnroot"`,
			wantSleeps: int(imageMountWait / rootPoll)},
		{name: "other mount error at once", tag: "kilnroot",
			setup:   func(f *fakeSys) { f.errs[nineMount] = unix.EINVAL },
			wantErr: "invalid argument"},
		{name: "overlay refused", tag: "kilnroot",
			setup: func(f *fakeSys) {
				f.errs["mount overlay /newroot overlay 0 lowerdir=/kiln/lower,upperdir=/kiln/rw/upper,workdir=/kiln/rw/work"] = unix.ENODEV
			},
			wantErr: "mounting the overlay"},
		{name: "no tag", wantErr: "no image tag"},
		{name: "unknown transport", transport: "nfs", tag: "kilnroot", wantErr: `image transport "nfs"`},
		{name: "erofs: mounts the disk by serial", transport: ImageEROFS, tag: "kilnroot", setup: withDisk, want: erofsCalls},
		{name: "erofs: extra options", transport: ImageEROFS, tag: "kilnroot", flags: "noatime,user_xattr", setup: withDisk,
			want: replaced(erofsCalls, 3, "mount /dev/vdb /kiln/lower erofs ro|noatime user_xattr")},
		{name: "erofs: no such disk", transport: ImageEROFS, tag: "kilnroot",
			setup:      func(f *fakeSys) { f.files["/sys/block/vda/serial"] = "modules" },
			wantErr:    `no virtio disk with serial "kilnroot" appeared within 10s`,
			wantSleeps: int(imageMountWait / rootPoll)},
		{name: "erofs: mount refused", transport: ImageEROFS, tag: "kilnroot",
			setup: func(f *fakeSys) {
				withDisk(f)
				f.errs[erofsMount] = unix.EINVAL
			},
			wantErr: `mounting the image's erofs disk /dev/vdb (serial "kilnroot"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFake()
			if tt.setup != nil {
				tt.setup(f)
			}
			transport := tt.transport
			if transport == "" {
				transport = Image9P
			}
			err := f.sys().SwitchRootImage(transport, tt.tag, tt.flags, tt.upperMiB, t.TempDir()+"/none", nil)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err = %v, want one containing %q", err, tt.wantErr)
				}
				if f.sleeps != tt.wantSleeps {
					t.Errorf("slept %d times, want %d", f.sleeps, tt.wantSleeps)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			diffCalls(t, f.calls, tt.want)
		})
	}
}

func TestReadImageConfig(t *testing.T) {
	f := newFake()
	c, err := f.sys().ReadImageConfig()
	if err != nil || c.User != "" || len(c.Env) != 0 {
		t.Fatalf("missing file: %+v, %v", c, err)
	}
	f.files[ImageConfigPath] = `{"Env":["A=1"],"WorkingDir":"/w","User":"app","Cmd":["x"]}`
	c, err = f.sys().ReadImageConfig()
	if err != nil || c.User != "app" || c.WorkingDir != "/w" || len(c.Env) != 1 {
		t.Fatalf("got %+v, %v", c, err)
	}
	f.files[ImageConfigPath] = `{"Env":`
	if _, err := f.sys().ReadImageConfig(); err == nil {
		t.Fatal("truncated config: no error")
	}
}

func TestOverlaySize(t *testing.T) {
	for in, want := range map[string]int{"kiln.overlaysize=512": 512, "kiln.overlaysize=0": 0, "kiln.overlaysize=-3": 0, "kiln.overlaysize=lots": 0, "": 0} {
		if got := ParseCmdline(in).OverlayMiB; got != want {
			t.Errorf("%q: %d MiB, want %d", in, got, want)
		}
	}
}

func TestImageTag(t *testing.T) {
	for _, tc := range []struct{ in, transport, tag string }{
		{"kiln.root=9p:kilnroot", Image9P, "kilnroot"},
		{"kiln.root=erofs:kilnroot", ImageEROFS, "kilnroot"},
		{"kiln.root=erofs:", "", ""},
		{"kiln.root=/dev/vda", "", ""},
		{"", "", ""},
	} {
		o := ParseCmdline(tc.in)
		if tr, tag := o.ImageRoot(); tr != tc.transport || tag != tc.tag || o.ImageTag() != tc.tag {
			t.Errorf("%q: %q %q (ImageTag %q), want %q %q", tc.in, tr, tag, o.ImageTag(), tc.transport, tc.tag)
		}
	}
}
