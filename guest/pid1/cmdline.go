package pid1

import (
	"strconv"
	"strings"
)

// DefaultRootFSType is the root filesystem type when kiln.rootfstype is not
// given.
const DefaultRootFSType = "ext4"

// Options are Kiln's parameters on the kernel command line.
type Options struct {
	// Root is the block device to make the root filesystem (kiln.root=),
	// e.g. /dev/vda; "erofs:SERIAL" for an image laid out as EROFS on the
	// virtio disk whose serial is SERIAL, or "9p:TAG" for an image served
	// over virtio-9p under mount tag TAG (SwitchRootImage); "" keeps the
	// initramfs as the root.
	Root string
	// RootFSType is the root filesystem's type (kiln.rootfstype=),
	// DefaultRootFSType when not given or empty.
	RootFSType string
	// RootFlags are the root filesystem's mount options (kiln.rootflags=),
	// comma-separated as for mount -o.
	RootFlags string
	// ReadOnly mounts the root filesystem read-only (kiln.ro).
	ReadOnly bool
	// Hostname is the hostname to set (kiln.hostname=); "" leaves the
	// kernel's.
	Hostname string
	// Debug asks for verbose logging (kiln.debug).
	Debug bool
	// OverlayMiB caps an image root's writable layer, the tmpfs in guest
	// RAM under the overlay (kiln.overlaysize=, in MiB); 0: tmpfs's own
	// default, half the guest's memory. An invalid value is ignored.
	OverlayMiB int
	// Modules is the serial of the virtio disk that holds the kernel's
	// modules tree (kiln.modules=, the host's device ID: "modules"),
	// which Setup mounts read-only at /lib/modules/<release> of the final
	// root (MountModulesDisk); "" when there is none.
	Modules string
	// Init is what process 1 becomes once the root is ready (kiln.init=):
	// "" or InitAgent, the agent; InitSystemd, the root's /sbin/init with
	// the agent as a service. Any other value is kept, for the agent to
	// refuse (CheckInit).
	Init string
	// Image is the image config of an image root, read by Setup (not from
	// the command line); nil otherwise.
	Image *ImageConfig
}

// The transports of an image root: a kiln.root= that starts with one of
// them followed by ':' names an image root rather than a block device.
const (
	ImageEROFS = "erofs" // kiln.root=erofs:SERIAL, an EROFS disk
	Image9P    = "9p"    // kiln.root=9p:TAG, a virtio-9p mount tag
)

// ImageTag returns the tag of an image root (kiln.root=erofs:SERIAL or
// 9p:TAG), or "" when the root is not one.
func (o Options) ImageTag() string {
	_, tag := o.ImageRoot()
	return tag
}

// ImageRoot returns the transport (ImageEROFS or Image9P) and tag of an
// image root, or "", "" when the root is not one.
func (o Options) ImageRoot() (transport, tag string) {
	for _, t := range []string{ImageEROFS, Image9P} {
		if tag, ok := strings.CutPrefix(o.Root, t+":"); ok && tag != "" {
			return t, tag
		}
	}
	return "", ""
}

// ParseCmdline returns Kiln's parameters on the kernel command line cmdline
// (the contents of /proc/cmdline). It splits the line as the kernel does:
// parameters are separated by spaces outside double quotes, a value may be
// quoted (kiln.hostname="a b"), and "--" ends the kernel's parameters (what
// follows is for init). The last of repeated parameters wins. kiln.ro and
// kiln.debug take an optional boolean value as the kernel's bool parameters
// do (y, n, 1, 0, on, off, ...); an invalid one is ignored. Unknown
// parameters are ignored.
func ParseCmdline(cmdline string) Options {
	o := Options{RootFSType: DefaultRootFSType}
	for _, p := range kernelParams(cmdline) {
		switch p.name {
		case "kiln.root":
			o.Root = p.value
		case "kiln.rootfstype":
			o.RootFSType = p.value
			if o.RootFSType == "" {
				o.RootFSType = DefaultRootFSType
			}
		case "kiln.rootflags":
			o.RootFlags = p.value
		case "kiln.ro":
			setBool(&o.ReadOnly, p)
		case "kiln.hostname":
			o.Hostname = p.value
		case "kiln.debug":
			setBool(&o.Debug, p)
		case "kiln.modules":
			o.Modules = p.value
		case "kiln.init":
			o.Init = p.value
		case "kiln.overlaysize":
			if n, err := strconv.Atoi(p.value); err == nil && n > 0 && n <= 1<<30 {
				o.OverlayMiB = n
			}
		}
	}
	return o
}

// setBool sets *b from a bool parameter as the kernel's param_set_bool
// does: no value means true; an invalid value changes nothing.
func setBool(b *bool, p param) {
	if !p.hasValue {
		*b = true
		return
	}
	if v, ok := parseBool(p.value); ok {
		*b = v
	}
}

// parseBool parses a boolean as the kernel's kstrtobool: by its first
// character (y, t, 1 or n, f, 0, any case), or on/off.
func parseBool(s string) (value, ok bool) {
	if s == "" {
		return false, false
	}
	switch s[0] {
	case 'y', 'Y', 't', 'T', '1':
		return true, true
	case 'n', 'N', 'f', 'F', '0':
		return false, true
	case 'o', 'O':
		if len(s) > 1 {
			switch s[1] {
			case 'n', 'N':
				return true, true
			case 'f', 'F':
				return false, true
			}
		}
	}
	return false, false
}

// param is one kernel command line parameter.
type param struct {
	name, value string
	hasValue    bool // there was an '='
}

// kernelParams splits a kernel command line into parameters as the kernel's
// parse_args does, stopping at "--". The line ends at a NUL byte, as the
// kernel's C string would.
func kernelParams(cmdline string) []param {
	if i := strings.IndexByte(cmdline, 0); i >= 0 {
		cmdline = cmdline[:i]
	}
	var params []param
	args := skipSpaces(cmdline)
	for args != "" {
		var p param
		p, args = nextArg(args)
		if !p.hasValue && p.name == "--" {
			break
		}
		params = append(params, p)
	}
	return params
}

// nextArg is the kernel's next_arg (lib/cmdline.c): it takes the first
// parameter off args, which does not start with a space, and returns it and
// the rest without leading spaces.
func nextArg(args string) (param, string) {
	quoted, inQuote := false, false
	if args[0] == '"' {
		args = args[1:]
		quoted, inQuote = true, true
	}
	equals := 0 // 0: none, as in the kernel (a leading '=' does not count)
	i := 0
	for ; i < len(args); i++ {
		c := args[i]
		if isSpace(c) && !inQuote {
			break
		}
		if equals == 0 && c == '=' {
			equals = i
		}
		if c == '"' {
			inQuote = !inQuote
		}
	}
	end := i // where the kernel puts the terminating NUL
	var p param
	valStart := 0
	if equals != 0 {
		p.hasValue = true
		valStart = equals + 1
		// Don't include quotes in the value.
		if valStart < i && args[valStart] == '"' {
			valStart++
			if args[i-1] == '"' {
				end = i - 1
			}
		}
	}
	if quoted && i > 0 && args[i-1] == '"' {
		end = i - 1
	}
	if p.hasValue {
		p.name = args[:equals]
		if valStart < end {
			p.value = args[valStart:end]
		}
	} else {
		p.name = args[:end]
	}
	rest := args[i:]
	if i < len(args) {
		rest = args[i+1:]
	}
	return p, skipSpaces(rest)
}

func skipSpaces(s string) string {
	for s != "" && isSpace(s[0]) {
		s = s[1:]
	}
	return s
}

// isSpace is the kernel's isspace: its ctype table is Latin-1, where 0xa0
// (no-break space) is a space too.
func isSpace(c byte) bool {
	switch c {
	case ' ', '\t', '\n', '\v', '\f', '\r', 0xa0:
		return true
	}
	return false
}
