package modprobe

import (
	"path"
	"strings"
	"testing"
	"time"
)

func TestMatchGlob(t *testing.T) {
	tests := []struct {
		pattern, name string
		want          bool
	}{
		{"fs_overlay", "fs_overlay", true},
		{"fs_overlay", "fs_overlayx", false},
		{"", "", true},
		{"", "a", false},
		{"*", "", true},
		{"*", "a/b", true},
		{"a*", "abc", true},
		{"a*c", "abbbc", true},
		{"a*c", "abbbcd", false},
		{"a*b*c", "axbxxc", true},
		{"a?c", "abc", true},
		{"a?c", "ac", false},
		{"pci:v00008086d*sv*sd*bc*sc*i*", "pci:v00008086d00001234sv00001AF4sd00001100bc02sc00i00", true},
		{"pci:v00008086d*sv*sd*bc*sc*i*", "pci:v000010ECd00001234sv00001AF4sd00001100bc02sc00i00", false},
		{"usb:v13FDp3940d0[0-2]*dc*", "usb:v13FDp3940d01dc00", true},
		{"usb:v13FDp3940d0[0-2]*dc*", "usb:v13FDp3940d05dc00", false},
		{"d[!0-2]x", "d5x", true},
		{"d[!0-2]x", "d1x", false},
		{"d[^0-2]x", "d5x", true},
		{"[]]", "]", true},
		{"[!]]", "a", true},
		{"[a-]", "-", true},
		{"[abc", "[abc", true},
		{"[abc", "a", false},
		{`a\*b`, "a*b", true},
		{`a\*b`, "axb", false},
		{`a\`, `a\`, true},
		{"cpu:type:x86,ven*fam*mod*:feature:*0081*", "cpu:type:x86,ven0000fam0006mod0055:feature:,0000,0081,", true},
		{"of:N*T*Cfoo,bar", "of:NdevTtypeCfoo,bar", true},
		{"of:N*T*Cfoo,bar", "of:NdevTtypeCfoo,baz", false},
	}
	for _, tt := range tests {
		if got := matchGlob(tt.pattern, tt.name); got != tt.want {
			t.Errorf("matchGlob(%q, %q) = %v, want %v", tt.pattern, tt.name, got, tt.want)
		}
	}
}

// TestMatchGlobLinear: a pattern of many stars against a long name that
// does not match ends at once (no exponential backtracking).
func TestMatchGlobLinear(t *testing.T) {
	pattern := strings.Repeat("*a", 200) + "b"
	name := strings.Repeat("a", 4000)
	start := time.Now()
	if matchGlob(pattern, name) {
		t.Fatal("matched")
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("took %v", d)
	}
}

func TestNormalizeAlias(t *testing.T) {
	for _, tt := range [][2]string{
		{"fs-overlay", "fs_overlay"},
		{"nft-chain-2-nat", "nft_chain_2_nat"},
		{"usb:v1d0[0-2]*-x", "usb:v1d0[0-2]*_x"},
		{"a[b-", "a[b-"},
		{"plain", "plain"},
	} {
		if got := normalizeAlias(tt[0]); got != tt[1] {
			t.Errorf("normalizeAlias(%q) = %q, want %q", tt[0], got, tt[1])
		}
	}
}

// FuzzMatchGlob checks matchGlob against path.Match where their
// languages agree (ASCII: path.Match takes runes, fnmatch here bytes; no '/', no '\', no negation: path.Match's is '^',
// fnmatch's '!'; no ']' first in a bracket; well-formed) and that it
// never panics.
func FuzzMatchGlob(f *testing.F) {
	f.Add("usb:v13FDp3940d0[0-2]*dc*", "usb:v13FDp3940d01dc00")
	f.Add("a*b?c[!x-z]", "aXXbqcw")
	f.Add("a*b?c[x-z]", "aXXbqcy")
	f.Add("[", "[")
	f.Add("*[a-]*", "x-y")
	f.Fuzz(func(t *testing.T, pattern, name string) {
		if len(pattern) > 256 || len(name) > 256 {
			return
		}
		got := matchGlob(pattern, name)
		if strings.ContainsAny(pattern+name, `/\^!`) || strings.Contains(pattern, "[]") || !ascii(pattern+name) {
			return
		}
		want, err := path.Match(pattern, name)
		if err != nil {
			return
		}
		if got != want {
			t.Errorf("matchGlob(%q, %q) = %v, path.Match says %v", pattern, name, got, want)
		}
	})
}

func ascii(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] >= 0x80 {
			return false
		}
	}
	return true
}
