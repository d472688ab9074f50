package pid1

import (
	"fmt"
	"reflect"
	"strings"
	"testing"
)

var cmdlineTests = []struct {
	name, in string
	want     Options
}{
	{name: "empty", in: "", want: Options{RootFSType: "ext4"}},
	{name: "unrelated", in: "console=ttyS0 reboot=k panic=-1 quiet\n", want: Options{RootFSType: "ext4"}},
	{
		name: "everything",
		in:   "console=ttyS0 kiln.root=/dev/vda kiln.rootfstype=xfs kiln.rootflags=noatime,discard kiln.ro kiln.hostname=box kiln.debug quiet\n",
		want: Options{Root: "/dev/vda", RootFSType: "xfs", RootFlags: "noatime,discard", ReadOnly: true, Hostname: "box", Debug: true},
	},
	{name: "modules disk", in: "kiln.modules=modules kiln.root=9p:kilnroot", want: Options{RootFSType: "ext4", Root: "9p:kilnroot", Modules: "modules"}},
	{name: "quoted value", in: `kiln.hostname="my box" kiln.ro`, want: Options{RootFSType: "ext4", Hostname: "my box", ReadOnly: true}},
	{name: "quoted parameter", in: `"kiln.hostname=my box" kiln.ro`, want: Options{RootFSType: "ext4", Hostname: "my box", ReadOnly: true}},
	{name: "quotes inside value kept", in: `kiln.rootflags=a"b c"d kiln.ro`, want: Options{RootFSType: "ext4", RootFlags: `a"b c"d`, ReadOnly: true}},
	{name: "unterminated quote runs to the end", in: `kiln.hostname="a b kiln.ro`, want: Options{RootFSType: "ext4", Hostname: "a b kiln.ro"}},
	{name: "empty quoted value", in: `kiln.root="" kiln.hostname="`, want: Options{RootFSType: "ext4"}},
	{name: "value with equals", in: "kiln.rootflags=data=ordered,errors=remount-ro", want: Options{RootFSType: "ext4", RootFlags: "data=ordered,errors=remount-ro"}},
	{name: "init arguments after --", in: "kiln.debug -- kiln.ro kiln.root=/dev/vda", want: Options{RootFSType: "ext4", Debug: true}},
	{name: "-- with a value is a parameter", in: "--=x kiln.ro", want: Options{RootFSType: "ext4", ReadOnly: true}},
	{name: "last wins", in: "kiln.root=/dev/vda kiln.hostname=a kiln.root=/dev/vdb kiln.hostname=b", want: Options{RootFSType: "ext4", Root: "/dev/vdb", Hostname: "b"}},
	{name: "empty fstype is the default", in: "kiln.rootfstype=xfs kiln.rootfstype=", want: Options{RootFSType: "ext4"}},
	{name: "bool values", in: "kiln.ro=0 kiln.debug=on", want: Options{RootFSType: "ext4", Debug: true}},
	{name: "bool switched off", in: "kiln.ro kiln.debug kiln.ro=off kiln.debug=N", want: Options{RootFSType: "ext4"}},
	{name: "bool yes spellings", in: "kiln.ro=Yes kiln.debug=true", want: Options{RootFSType: "ext4", ReadOnly: true, Debug: true}},
	{name: "invalid bool ignored", in: "kiln.ro kiln.ro=maybe kiln.debug=", want: Options{RootFSType: "ext4", ReadOnly: true}},
	{name: "no value for a string", in: "kiln.root kiln.hostname", want: Options{RootFSType: "ext4"}},
	{name: "lookalikes", in: "kiln.rootx=/dev/a xkiln.root=/dev/b kiln.Root=/dev/c kiln.roo kiln_ro", want: Options{RootFSType: "ext4"}},
	{name: "whitespace", in: " \t kiln.ro\t\tkiln.hostname=h\r\n\v\f", want: Options{RootFSType: "ext4", ReadOnly: true, Hostname: "h"}},
	{name: "latin-1 no-break space separates", in: "kiln.hostname=a\xa0kiln.ro", want: Options{RootFSType: "ext4", Hostname: "a", ReadOnly: true}},
	{name: "NUL ends the line", in: "kiln.ro\x00 kiln.debug", want: Options{RootFSType: "ext4", ReadOnly: true}},
}

func TestParseCmdline(t *testing.T) {
	for _, tt := range cmdlineTests {
		t.Run(tt.name, func(t *testing.T) {
			if got := ParseCmdline(tt.in); got != tt.want {
				t.Fatalf("ParseCmdline(%q) =\n\t%+v, want\n\t%+v", tt.in, got, tt.want)
			}
		})
	}
}

func TestKernelParams(t *testing.T) {
	p := func(name string) param { return param{name: name} }
	pv := func(name, value string) param { return param{name: name, value: value, hasValue: true} }
	tests := []struct {
		in   string
		want []param
	}{
		{"", nil},
		{"   ", nil},
		{"a b=c", []param{p("a"), pv("b", "c")}},
		{`a="b c" d`, []param{pv("a", "b c"), p("d")}},
		{`"a b" c`, []param{p("a b"), p("c")}},
		{`"a=b c"`, []param{pv("a", "b c")}},
		{`a=""`, []param{pv("a", "")}},
		{`a="`, []param{pv("a", "")}},
		{`a=`, []param{pv("a", "")}},
		{`"`, []param{p("")}},
		{`""`, []param{p("")}},
		{`"" x`, []param{p(""), p("x")}},
		{`a"b c"d e`, []param{p(`a"b c"d`), p("e")}},
		{`a="b"c d`, []param{pv("a", `b"c`), p("d")}},
		{`=a=b`, []param{pv("=a", "b")}},
		{`=a`, []param{p("=a")}},
		{`"=a=b"`, []param{pv("=a", "b")}},
		{"a -- b", []param{p("a")}},
		{`a "--" b`, []param{p("a")}},
		{"a --x b", []param{p("a"), p("--x"), p("b")}},
	}
	for _, tt := range tests {
		if got := kernelParams(tt.in); !reflect.DeepEqual(got, tt.want) {
			t.Errorf("kernelParams(%q) = %+v, want %+v", tt.in, got, tt.want)
		}
	}
}

func TestParseBool(t *testing.T) {
	tests := []struct {
		in        string
		value, ok bool
	}{
		{"1", true, true}, {"y", true, true}, {"Y", true, true}, {"yes", true, true}, {"t", true, true}, {"True", true, true},
		{"on", true, true}, {"ON", true, true}, {"0", false, true}, {"n", false, true}, {"no", false, true}, {"F", false, true},
		{"off", false, true}, {"oFF", false, true}, {"", false, false}, {"o", false, false}, {"ox", false, false}, {"2", false, false},
		{"maybe", false, false},
	}
	for _, tt := range tests {
		if v, ok := parseBool(tt.in); v != tt.value || ok != tt.ok {
			t.Errorf("parseBool(%q) = %v, %v; want %v, %v", tt.in, v, ok, tt.value, tt.ok)
		}
	}
}

func FuzzParseCmdline(f *testing.F) {
	for _, tt := range cmdlineTests {
		f.Add(tt.in)
	}
	f.Fuzz(func(t *testing.T, in string) {
		o := ParseCmdline(in)
		if o.RootFSType == "" {
			t.Fatalf("ParseCmdline(%q): empty RootFSType", in)
		}
		if again := ParseCmdline(" \t" + in); again != o {
			t.Fatalf("leading spaces change the result: %+v, then %+v", o, again)
		}
		for _, p := range kernelParams(in) {
			if p.name == "--" && !p.hasValue {
				t.Fatalf("kernelParams(%q) returned the terminator", in)
			}
		}
		// Options whose values a quoted parameter can hold survive being
		// written out and parsed again.
		for _, v := range []string{o.Root, o.RootFSType, o.RootFlags, o.Hostname, o.Modules} {
			if strings.ContainsAny(v, "\"\x00") {
				return
			}
		}
		line := plainQuote(o)
		if again := ParseCmdline(line); again != o {
			t.Fatalf("ParseCmdline(%q) = %+v, want %+v (from %q)", line, again, o, in)
		}
	})
}

// plainQuote writes o as Kiln's parameters with every value in double
// quotes, unescaped (the kernel has no escapes).
func plainQuote(o Options) string {
	return fmt.Sprintf(`kiln.root="%s" kiln.rootfstype="%s" kiln.rootflags="%s" kiln.hostname="%s" kiln.ro=%v kiln.debug=%v`,
		o.Root, o.RootFSType, o.RootFlags, o.Hostname, o.ReadOnly, o.Debug) + fmt.Sprintf(` kiln.modules="%s"`, o.Modules)
}
