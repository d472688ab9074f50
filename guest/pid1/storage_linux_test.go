package pid1

import (
	"io/fs"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// bindCalls are bindContainerStorage's calls for a directory d it binds.
func bindCalls(d string) []string {
	return []string{
		"mkdir /kiln/rw/storage" + d + " -rwx--x--x",
		"mkdir /newroot" + d + " -rwx--x--x",
		"mount /kiln/rw/storage" + d + " /newroot" + d + "  bind ",
	}
}

func TestBindContainerStorage(t *testing.T) {
	dir := fs.ModeDir | 0o755
	debian := map[string]fs.FileMode{"/newroot/var": dir, "/newroot/var/lib": dir}
	with := func(extra map[string]fs.FileMode) map[string]fs.FileMode {
		m := map[string]fs.FileMode{}
		for k, v := range debian {
			m[k] = v
		}
		for k, v := range extra {
			m[k] = v
		}
		return m
	}
	all := append(append(bindCalls("/var/lib/docker"), bindCalls("/var/lib/containerd")...), bindCalls("/var/lib/containers")...)
	tests := []struct {
		name    string
		modes   map[string]fs.FileMode
		errs    map[string]error
		want    []string
		wantErr string
	}{
		{name: "no /var/lib (busybox)", modes: map[string]fs.FileMode{"/newroot/var": dir}},
		{name: "no /var"},
		{name: "debian: all three created and bound", modes: debian, want: all},
		{name: "an existing docker folder is bound over",
			modes: with(map[string]fs.FileMode{"/newroot/var/lib/docker": dir}), want: all},
		{name: "a link at the folder is left alone",
			modes: with(map[string]fs.FileMode{"/newroot/var/lib/docker": fs.ModeSymlink | 0o777}), want: all[3:]},
		{name: "a file at the folder is left alone",
			modes: with(map[string]fs.FileMode{"/newroot/var/lib/containerd": 0o644}), want: append(bindCalls("/var/lib/docker"), bindCalls("/var/lib/containers")...)},
		{name: "a link in the parent: nothing",
			modes: map[string]fs.FileMode{"/newroot/var": dir, "/newroot/var/lib": fs.ModeSymlink | 0o777}},
		{name: "a link at /var: nothing",
			modes: map[string]fs.FileMode{"/newroot/var": fs.ModeSymlink | 0o777}},
		{name: "lstat fails", modes: debian, errs: map[string]error{"lstat /newroot/var/lib": unix.EIO},
			wantErr: "container storage /var/lib/docker: input/output error"},
		{name: "bind refused", modes: debian,
			errs:    map[string]error{"mount /kiln/rw/storage/var/lib/docker /newroot/var/lib/docker  bind ": unix.EPERM},
			want:    bindCalls("/var/lib/docker"),
			wantErr: "binding /kiln/rw/storage/var/lib/docker on /newroot/var/lib/docker: operation not permitted"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFake()
			for k, v := range tt.modes {
				f.modes[k] = v
			}
			for k, v := range tt.errs {
				f.errs[k] = v
			}
			err := f.sys().bindContainerStorage(ContainerStorageDirs, nil)
			if tt.wantErr == "" && err != nil || tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)) {
				t.Fatalf("err = %v, want %q", err, tt.wantErr)
			}
			diffCalls(t, f.calls, tt.want)
		})
	}
}

// TestSwitchRootImageStorage: an image with /var/lib gets its container
// storage bound from the tmpfs between the overlay and the switch.
func TestSwitchRootImageStorage(t *testing.T) {
	f := newFake()
	f.modes["/newroot/var"] = fs.ModeDir | 0o755
	f.modes["/newroot/var/lib"] = fs.ModeDir | 0o755
	if err := f.sys().SwitchRootImage(Image9P, "kilnroot", "", 0, t.TempDir()+"/none", nil); err != nil {
		t.Fatal(err)
	}
	var want []string
	want = append(want, imageCalls[:12]...)
	for _, d := range ContainerStorageDirs {
		want = append(want, bindCalls(d)...)
	}
	want = append(want, imageCalls[12:]...)
	diffCalls(t, f.calls, want)
}
