package sandbox

import "testing"

func TestOptionsInit(t *testing.T) {
	for _, tt := range []struct {
		o       Options
		ok      bool
		cmdline string
	}{
		{Options{}, true, ""},
		{Options{Image: "x", Init: InitAgent}, true, ""},
		{Options{Image: "x", Init: InitSystemd}, true, " kiln.init=systemd"},
		{Options{Init: InitSystemd}, false, ""},
		{Options{Image: "x", Init: "sysvinit"}, false, ""},
		{Options{Image: "x", Init: "systemd kiln.root=/dev/vda"}, false, ""},
	} {
		err := tt.o.checkInit()
		if (err == nil) != tt.ok {
			t.Errorf("%+v: checkInit = %v", tt.o, err)
		}
		if err == nil && tt.o.initCmdline() != tt.cmdline {
			t.Errorf("%+v: initCmdline %q, want %q", tt.o, tt.o.initCmdline(), tt.cmdline)
		}
	}
}
