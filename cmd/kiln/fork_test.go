package main

import (
	"bytes"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestPrefixWriter(t *testing.T) {
	tests := []struct {
		name   string
		max    int
		writes []string
		want   string // after Flush
	}{
		{"whole lines", 0, []string{"a\nb\n"}, "[0] a\n[0] b\n"},
		{"a line over writes", 0, []string{"he", "llo", "\nwor", "ld\n"}, "[0] hello\n[0] world\n"},
		{"a partial last line is ended", 0, []string{"a\nno end"}, "[0] a\n[0] no end\n"},
		{"empty lines", 0, []string{"\n\n"}, "[0] \n[0] \n"},
		{"nothing", 0, nil, ""},
		{"a line at the cap", 4, []string{"abcd\n"}, "[0] abcd\n"},
		{"a line over the cap is cut", 4, []string{"abcdefghij\nk\n"}, "[0] abcd\n[0] efgh\n[0] ij\n[0] k\n"},
		{"cut across writes", 4, []string{"ab", "cdef", "g", "h", "\n"}, "[0] abcd\n[0] efgh\n[0] \n"},
		{"no newline at all", 3, []string{"abcdefgh"}, "[0] abc\n[0] def\n[0] gh\n"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var out bytes.Buffer
			p := &prefixWriter{w: &out, mu: &sync.Mutex{}, prefix: "[0] ", max: tt.max}
			for _, w := range tt.writes {
				if n, err := p.Write([]byte(w)); n != len(w) || err != nil {
					t.Fatalf("Write(%q) = %d, %v", w, n, err)
				}
			}
			p.Flush()
			if out.String() != tt.want {
				t.Fatalf("output %q, want %q", out.String(), tt.want)
			}
		})
	}
}

// TestPrefixWriterLongLine writes 32 MiB without a newline, in the 32 KiB
// pieces an exec stream delivers, and checks that it comes out whole, in
// lines of maxPrefixedLine bytes each with the prefix, with no more than
// that held. It logs the time: 32 MiB took ~10 s once, when each write
// scanned the whole held line again.
func TestPrefixWriterLongLine(t *testing.T) {
	const size, piece = 32 << 20, 32 << 10
	in := make([]byte, size)
	for i := range in {
		in[i] = 'a' + byte(i%26)
	}
	var out bytes.Buffer
	out.Grow(size + size/maxPrefixedLine*8)
	p := &prefixWriter{w: &out, mu: &sync.Mutex{}, prefix: "[7] "}
	start := time.Now()
	held := 0
	for off := 0; off < size; off += piece {
		p.Write(in[off : off+piece])
		held = max(held, len(p.buf))
	}
	p.Flush()
	elapsed := time.Since(start)
	t.Logf("%d MiB without a newline through the prefixer: %v, at most %d bytes held", size>>20, elapsed, held)
	if held >= maxPrefixedLine {
		t.Fatalf("held %d bytes of a line, cap %d", held, maxPrefixedLine)
	}
	lines := strings.SplitAfter(out.String(), "\n")
	if lines[len(lines)-1] == "" {
		lines = lines[:len(lines)-1]
	}
	if want := size / maxPrefixedLine; len(lines) != want {
		t.Fatalf("%d lines, want %d", len(lines), want)
	}
	var got bytes.Buffer
	for i, l := range lines {
		c, ok := strings.CutPrefix(l, "[7] ")
		if !ok || !strings.HasSuffix(c, "\n") || len(c) != maxPrefixedLine+1 {
			t.Fatalf("line %d: %d bytes, starts %q", i, len(l), l[:min(len(l), 16)])
		}
		got.WriteString(c[:len(c)-1])
	}
	if !bytes.Equal(got.Bytes(), in) {
		t.Fatal("the lines' content is not what was written")
	}
}

// FuzzPrefixWriter: whatever the writes, every output line has the
// prefix, none is over the cap, and the content is what was written.
func FuzzPrefixWriter(f *testing.F) {
	f.Add([]byte("\x04ab\xffcdef\n\xffg"), "p: ")
	f.Add([]byte("\x01\n\n\xff\n"), "")
	f.Fuzz(func(t *testing.T, data []byte, prefix string) {
		if len(data) == 0 || strings.Contains(prefix, "\n") {
			return
		}
		max := 1 + int(data[0]%16)
		var out bytes.Buffer
		p := &prefixWriter{w: &out, mu: &sync.Mutex{}, prefix: prefix, max: max}
		var all []byte
		for _, w := range bytes.Split(data[1:], []byte{0xff}) {
			p.Write(w)
			all = append(all, w...)
			if len(p.buf) >= max {
				t.Fatalf("held %d bytes, cap %d", len(p.buf), max)
			}
		}
		p.Flush()
		var content []byte
		for _, l := range strings.SplitAfter(out.String(), "\n") {
			if l == "" {
				continue
			}
			c, ok := strings.CutPrefix(l, prefix)
			if !ok || !strings.HasSuffix(c, "\n") || len(c) > max+1 {
				t.Fatalf("line %q (cap %d, prefix %q)", l, max, prefix)
			}
			content = append(content, c[:len(c)-1]...)
		}
		// Cutting and Flush add newlines; the rest is what was written.
		if want := bytes.ReplaceAll(all, []byte("\n"), nil); !bytes.Equal(content, want) {
			t.Fatalf("content %q, want %q", content, want)
		}
	})
}

func BenchmarkPrefixWriter32MiBNoNewline(b *testing.B) {
	const size, piece = 32 << 20, 32 << 10
	in := bytes.Repeat([]byte("x"), piece)
	b.SetBytes(size)
	for b.Loop() {
		p := &prefixWriter{w: discard{}, mu: &sync.Mutex{}, prefix: "[0] "}
		for range size / piece {
			p.Write(in)
		}
		p.Flush()
	}
}

// discard is io.Discard without its ReadFrom, as a terminal would be.
type discard struct{}

func (discard) Write(b []byte) (int, error) { return len(b), nil }
