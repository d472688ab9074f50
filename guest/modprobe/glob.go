package modprobe

import "strings"

// normalizeAlias spells an alias or alias pattern as kmod compares them:
// '-' becomes '_', except inside a bracket expression ([0-9] keeps its
// range). An unclosed bracket leaves the rest as it is.
func normalizeAlias(s string) string {
	if !strings.ContainsRune(s, '-') {
		return s
	}
	b := []byte(s)
	for i := 0; i < len(b); i++ {
		switch b[i] {
		case '-':
			b[i] = '_'
		case '[':
			end := strings.IndexByte(s[i:], ']')
			if end < 0 {
				return string(b)
			}
			i += end
		}
	}
	return string(b)
}

// matchGlob reports whether name matches pattern as fnmatch(3) with no
// flags does: '*' any run of bytes ('/' included), '?' one byte, [...]
// one byte of a set (ranges, '!' or '^' negating, ']' first taken
// literally), '\' quoting the next byte. A malformed bracket is a literal
// '['. It takes O(len(pattern) * len(name)) time: one '*' is remembered
// and retried, never a tree of them.
func matchGlob(pattern, name string) bool {
	p, n := 0, 0
	starP, starN := -1, 0
	for n < len(name) {
		if p < len(pattern) {
			switch c := pattern[p]; c {
			case '*':
				starP, starN = p, n
				p++
				continue
			case '?':
				p++
				n++
				continue
			case '[':
				if ok, width := matchClass(pattern[p:], name[n]); width > 0 {
					if ok {
						p += width
						n++
						continue
					}
					break
				}
				if name[n] == '[' {
					p++
					n++
					continue
				}
			case '\\':
				if p+1 < len(pattern) {
					if pattern[p+1] == name[n] {
						p += 2
						n++
						continue
					}
					break
				}
				if name[n] == '\\' {
					p++
					n++
					continue
				}
			default:
				if c == name[n] {
					p++
					n++
					continue
				}
			}
		}
		if starP < 0 {
			return false
		}
		starN++
		p, n = starP+1, starN
	}
	for p < len(pattern) && pattern[p] == '*' {
		p++
	}
	return p == len(pattern)
}

// matchClass matches the byte c against the bracket expression that
// starts class ("[...]..."). It returns whether c is in the set and the
// expression's width; width 0 when class holds no complete expression
// (then '[' is literal).
func matchClass(class string, c byte) (bool, int) {
	i := 1
	negate := false
	if i < len(class) && (class[i] == '!' || class[i] == '^') {
		negate = true
		i++
	}
	in := false
	for first := true; ; first = false {
		if i >= len(class) {
			return false, 0
		}
		lo := class[i]
		if lo == ']' && !first {
			return in != negate, i + 1
		}
		if lo == '\\' && i+1 < len(class) {
			i++
			lo = class[i]
		}
		i++
		hi := lo
		if i+1 < len(class) && class[i] == '-' && class[i+1] != ']' {
			hi = class[i+1]
			if hi == '\\' && i+2 < len(class) {
				hi = class[i+2]
				i++
			}
			i += 2
		}
		if lo <= c && c <= hi {
			in = true
		}
	}
}
