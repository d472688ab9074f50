package pid1

import (
	"log/slog"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// helperCalls are InstallModprobeHelper's calls.
var helperCalls = []string{
	"mkdir /run/kiln -rwxr-xr-x",
	"create /run/kiln/modprobe -rwxr-xr-x",
	"mount /proc/self/exe /run/kiln/modprobe  bind ",
	"mount  /run/kiln/modprobe  ro|bind|remount ",
	"write /proc/sys/kernel/modprobe /run/kiln/modprobe",
}

func TestInstallModprobeHelper(t *testing.T) {
	tests := []struct {
		name    string
		errs    map[string]error
		want    []string
		wantErr string
	}{
		{name: "installed", want: helperCalls},
		{name: "read-only root without /run", errs: map[string]error{helperCalls[0]: unix.EROFS}, want: helperCalls[:1]},
		{name: "mkdir fails", errs: map[string]error{helperCalls[0]: unix.ENOSPC}, want: helperCalls[:1], wantErr: "creating /run/kiln"},
		{name: "create fails", errs: map[string]error{helperCalls[1]: unix.EROFS}, want: helperCalls[:2], wantErr: "creating /run/kiln/modprobe"},
		{name: "bind fails", errs: map[string]error{helperCalls[2]: unix.EPERM}, want: helperCalls[:3], wantErr: "binding /proc/self/exe on /run/kiln/modprobe: operation not permitted"},
		{name: "remount fails", errs: map[string]error{helperCalls[3]: unix.EINVAL}, want: helperCalls[:4], wantErr: "making /run/kiln/modprobe read-only"},
		{name: "sysctl fails", errs: map[string]error{helperCalls[4]: unix.EACCES}, want: helperCalls, wantErr: "naming it in /proc/sys/kernel/modprobe"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFake()
			for c, err := range tt.errs {
				f.errs[c] = err
			}
			err := f.sys().InstallModprobeHelper(slog.New(slog.DiscardHandler))
			if tt.wantErr == "" && err != nil {
				t.Fatalf("InstallModprobeHelper: %v", err)
			}
			if tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)) {
				t.Fatalf("InstallModprobeHelper error = %v, want %q", err, tt.wantErr)
			}
			diffCalls(t, f.calls, tt.want)
		})
	}
}
