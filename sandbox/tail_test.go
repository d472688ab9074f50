package sandbox

import (
	"bytes"
	"fmt"
	"testing"
	"time"
)

func TestTailContent(t *testing.T) {
	tests := []struct {
		name   string
		max    int
		writes []string
		want   string
	}{
		{"empty", 8, nil, ""},
		{"under the cap", 8, []string{"ab", "cd"}, "abcd"},
		{"exactly full", 8, []string{"abcd", "efgh"}, "abcdefgh"},
		{"wraps", 8, []string{"hello ", "world"}, "lo world"},
		{"one write over the cap", 4, []string{"abcdefghij"}, "ghij"},
		{"long write after wrapping", 4, []string{"abc", "de", "0123456"}, "3456"},
		{"wraps at the end of the ring", 5, []string{"abcde", "fghi", "xyz"}, "hixyz"},
		{"zero cap keeps nothing", 0, []string{"abc"}, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tl := newTail(tt.max)
			for _, w := range tt.writes {
				if n, err := tl.Write([]byte(w)); n != len(w) || err != nil {
					t.Fatalf("Write(%q) = %d, %v", w, n, err)
				}
			}
			if got := tl.String(); got != tt.want {
				t.Fatalf("tail %q, want %q", got, tt.want)
			}
		})
	}
}

// TestTailByteAtATime feeds 256 KiB one byte at a time, as the UART does,
// and checks the tail is the last 16 KiB, in order. It logs the time (it
// took 9 s once, when each byte copied the whole tail).
func TestTailByteAtATime(t *testing.T) {
	const size, max = 256 << 10, 16 << 10
	var all bytes.Buffer
	for i := 0; all.Len() < size; i++ {
		fmt.Fprintf(&all, "console line %d\n", i)
	}
	in := all.Bytes()[:size]
	tl := newTail(max)
	start := time.Now()
	for i := range in {
		tl.Write(in[i : i+1])
	}
	elapsed := time.Since(start)
	t.Logf("%d KiB of console, a byte per write, into a %d KiB tail: %v", size>>10, max>>10, elapsed)
	if got := tl.String(); got != string(in[size-max:]) {
		t.Fatalf("tail holds %d bytes, not the last %d of the console (starts %q)", len(got), max, got[:min(len(got), 40)])
	}
}

func BenchmarkTail256KiB(b *testing.B) {
	in := bytes.Repeat([]byte("x"), 256<<10)
	b.SetBytes(int64(len(in)))
	for b.Loop() {
		tl := newTail(16 << 10)
		for i := range in {
			tl.Write(in[i : i+1])
		}
	}
}

// FuzzTail checks the ring against the obvious model: the last max bytes
// of everything written. The input's first byte sizes the tail, the rest
// is split into writes at each 0xff.
func FuzzTail(f *testing.F) {
	f.Add([]byte("\x05abc\xffdefgh\xffij"))
	f.Add([]byte("\x01\xff\xff"))
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) == 0 {
			return
		}
		max := int(data[0] % 32)
		tl := newTail(max)
		var all []byte
		for _, w := range bytes.Split(data[1:], []byte{0xff}) {
			tl.Write(w)
			all = append(all, w...)
		}
		want := all[len(all)-min(len(all), max):]
		if got := tl.String(); got != string(want) {
			t.Fatalf("max %d: tail %q, want %q", max, got, want)
		}
	})
}
