package pid1

import (
	"reflect"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func TestSetHostname(t *testing.T) {
	tests := []struct {
		name, host string
		fail       error
		want       []string
		wantErr    string
	}{
		{name: "ok", host: "sandbox-1", want: []string{"sethostname sandbox-1"}},
		{name: "64 bytes", host: strings.Repeat("h", 64), want: []string{"sethostname " + strings.Repeat("h", 64)}},
		{name: "too long", host: strings.Repeat("h", 65), wantErr: "want 1 to 64 bytes"},
		{name: "empty", host: "", wantErr: "want 1 to 64 bytes"},
		{name: "refused", host: "h", fail: unix.EPERM, want: []string{"sethostname h"}, wantErr: `setting hostname "h": operation not permitted`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFake()
			if tt.fail != nil {
				f.errs["sethostname "+tt.host] = tt.fail
			}
			err := f.sys().SetHostname(tt.host)
			if tt.wantErr == "" && err != nil {
				t.Fatal(err)
			}
			if tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)) {
				t.Fatalf("error = %v, want %q", err, tt.wantErr)
			}
			diffCalls(t, f.calls, tt.want)
		})
	}
}

func TestPowerOffAndReboot(t *testing.T) {
	tests := []struct {
		name    string
		do      func(s *Sys) error
		call    string
		fail    bool
		wantErr string
	}{
		{name: "power off", do: (*Sys).PowerOff, call: "reboot 0x4321fedc"},
		{name: "power off fails", do: (*Sys).PowerOff, call: "reboot 0x4321fedc", fail: true, wantErr: "powering off: operation not permitted"},
		{name: "reboot", do: (*Sys).Reboot, call: "reboot 0x1234567"},
		{name: "reboot fails", do: (*Sys).Reboot, call: "reboot 0x1234567", fail: true, wantErr: "rebooting: operation not permitted"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFake()
			if tt.fail {
				f.errs[tt.call] = unix.EPERM
			}
			err := tt.do(f.sys())
			if tt.wantErr == "" && err != nil {
				t.Fatal(err)
			}
			if tt.wantErr != "" && (err == nil || err.Error() != tt.wantErr) {
				t.Fatalf("error = %v, want %q", err, tt.wantErr)
			}
			diffCalls(t, f.calls, []string{"sync", tt.call})
		})
	}
}

// TestLinux checks that the real Sys has every call; it makes none.
func TestLinux(t *testing.T) {
	s := Linux()
	for name, fn := range map[string]any{
		"Mount": s.Mount, "Unmount": s.Unmount, "MkdirAll": s.MkdirAll, "Symlink": s.Symlink, "Stat": s.Stat,
		"ReadFile": s.ReadFile, "WriteFile": s.WriteFile, "Chdir": s.Chdir, "Chroot": s.Chroot,
		"Sethostname": s.Sethostname, "FinitModule": s.FinitModule, "Sync": s.Sync, "RebootSyscall": s.RebootSyscall,
		"Sleep": s.Sleep, "LookupEnv": s.LookupEnv, "Setenv": s.Setenv,
	} {
		if reflectNil(fn) {
			t.Errorf("Linux().%s is nil", name)
		}
	}
}

func reflectNil(fn any) bool { return reflect.ValueOf(fn).IsNil() }
