package daemon

import (
	"bytes"
	"fmt"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

func TestCheckSecrets(t *testing.T) {
	const value = "s3cr3t-VALUE"
	sec := func(name, v, file string, mode uint32) *kilnpb.Secret {
		return &kilnpb.Secret{Name: name, Value: []byte(v), File: file, FileMode: mode}
	}
	many := make([]*kilnpb.Secret, maxSecrets+1)
	for i := range many {
		many[i] = sec("S"+strings.Repeat("x", i), value, "", 0)
	}
	big := make([]*kilnpb.Secret, 17)
	for i := range big {
		big[i] = sec("B"+strings.Repeat("x", i), strings.Repeat("v", maxSecretValue), "", 0)
	}
	for _, tc := range []struct {
		name string
		in   []*kilnpb.Secret
		want string // part of the error; "" for none
	}{
		{"none", nil, ""},
		{"env and file", []*kilnpb.Secret{sec("TOKEN", value, "", 0), sec("key", value, "/run/key", 0o440)}, ""},
		{"bad name", []*kilnpb.Secret{sec("1TOKEN", value, "", 0)}, "POSIX"},
		{"name with a dash", []*kilnpb.Secret{sec("A-B", value, "", 0)}, "POSIX"},
		{"empty name", []*kilnpb.Secret{sec("", value, "", 0)}, "POSIX"},
		{"long name", []*kilnpb.Secret{sec(strings.Repeat("N", maxSecretName+1), value, "", 0)}, "POSIX"},
		{"twice", []*kilnpb.Secret{sec("A", value, "", 0), sec("A", value+"2", "/a", 0)}, "secret A is given twice"},
		{"short", []*kilnpb.Secret{sec("A", "abc", "", 0)}, "secret A has 3 bytes: at least 4"},
		{"long", []*kilnpb.Secret{sec("A", strings.Repeat("v", maxSecretValue+1), "", 0)}, "at most"},
		{"too many", many, "at most 64"},
		{"too much in all", big, "in all"},
		{"star first", []*kilnpb.Secret{sec("A", "*abcd", "", 0)}, "'*'"},
		{"star last", []*kilnpb.Secret{sec("A", "abcd*", "", 0)}, "'*'"},
		{"mask inside", []*kilnpb.Secret{sec("A", "ab***cd", "", 0)}, "'*'"},
		{"one star inside", []*kilnpb.Secret{sec("A", "ab*cd", "", 0)}, ""},
		{"NUL in env", []*kilnpb.Secret{sec("A", "ab\x00cd", "", 0)}, "NUL"},
		{"NUL in a file", []*kilnpb.Secret{sec("A", "ab\x00cd", "/a", 0)}, ""},
		{"relative file", []*kilnpb.Secret{sec("A", value, "run/a", 0)}, "relative"},
		{"unclean file", []*kilnpb.Secret{sec("A", value, "/run/../a", 0)}, ".."},
		{"root file", []*kilnpb.Secret{sec("A", value, "/", 0)}, "is /"},
		{"one file twice", []*kilnpb.Secret{sec("A", value, "/a", 0), sec("B", value, "/a", 0)}, "one file"},
		{"mode without file", []*kilnpb.Secret{sec("A", value, "", 0o400)}, "no file"},
		{"odd mode", []*kilnpb.Secret{sec("A", value, "/a", 0o4755)}, "permission bits"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, err := checkSecrets("secrets", tc.in)
			if tc.want == "" {
				if err != nil {
					t.Fatalf("checkSecrets: %v", err)
				}
				if len(out) != len(tc.in) {
					t.Fatalf("got %d secrets, want %d", len(out), len(tc.in))
				}
				return
			}
			if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("checkSecrets = %v, want InvalidArgument with %q", err, tc.want)
			}
			for _, s := range tc.in {
				if len(s.Value) >= 4 && strings.Contains(err.Error(), string(s.Value)) {
					t.Fatalf("the error quotes a value: %v", err)
				}
			}
		})
	}
	out, _ := checkSecrets("secrets", []*kilnpb.Secret{sec("F", value, "/f", 0)})
	if out[0].Mode != 0o400 {
		t.Fatalf("a file secret's default mode is %#o, want 0400", out[0].Mode)
	}
}

func TestSecretEnv(t *testing.T) {
	secs := []secret{{Name: "TOKEN", Value: []byte("tok-1")}, {Name: "KEY", Value: []byte("key-1"), File: "/k"}}
	for _, tc := range []struct {
		env, want []string
	}{
		{nil, []string{"TOKEN=tok-1"}},
		{[]string{"A=1", "TOKEN=mine", "B=2", "TOKEN=again"}, []string{"A=1", "B=2", "TOKEN=tok-1"}},
		{[]string{"KEY=not a secret's env"}, []string{"KEY=not a secret's env", "TOKEN=tok-1"}},
	} {
		if got := secretEnv(tc.env, secs); strings.Join(got, "\n") != strings.Join(tc.want, "\n") {
			t.Errorf("secretEnv(%q) = %q, want %q", tc.env, got, tc.want)
		}
	}
	if got := secretEnv([]string{"A=1"}, nil); len(got) != 1 {
		t.Errorf("secretEnv without secrets = %q", got)
	}
}

func TestSecretsRoundTrip(t *testing.T) {
	in := []secret{{Name: "TOKEN", Value: []byte("tok-1")}, {Name: "KEY", Value: []byte("key\x00\xff"), File: "/k", Mode: 0o400}}
	b, err := encodeSecrets(in)
	if err != nil {
		t.Fatal(err)
	}
	out, err := decodeSecrets(b)
	if err != nil {
		t.Fatal(err)
	}
	if len(out) != 2 || !bytes.Equal(out[1].Value, in[1].Value) || out[1].File != "/k" || out[0].Name != "TOKEN" {
		t.Fatalf("round trip: %+v", out)
	}
	if _, err := decodeSecrets([]byte(`[{"name":"1A","value":"dG9rLTE="}]`)); err == nil || strings.Contains(err.Error(), "tok-1") {
		t.Fatalf("decode of a bad secret: %v", err)
	}
	if _, err := decodeSecrets([]byte("not json")); err == nil {
		t.Fatal("decode of garbage succeeded")
	}
}

// maskAll masks in at once, as a reference: at each place the longest
// value that begins there, else the byte.
func maskAll(in []byte, values [][]byte) []byte {
	var out []byte
	for i := 0; i < len(in); {
		n := 0
		for _, v := range values {
			if len(v) > n && bytes.HasPrefix(in[i:], v) {
				n = len(v)
			}
		}
		if n == 0 {
			out = append(out, in[i])
			i++
			continue
		}
		out = append(out, secretMask...)
		i += n
	}
	return out
}

// maskChunks masks in written in chunks of the sizes cuts gives (cycled).
func maskChunks(in []byte, values [][]byte, cuts []int) []byte {
	var out bytes.Buffer
	w := newMasker(&out, values)
	for i, c := 0, 0; i < len(in); c++ {
		n := 1
		if len(cuts) > 0 {
			n = cuts[c%len(cuts)]
		}
		n = min(max(n, 1), len(in)-i)
		w.Write(in[i : i+n])
		i += n
	}
	flushMasked(w)
	return out.Bytes()
}

func TestMask(t *testing.T) {
	vals := func(vs ...string) [][]byte {
		var out [][]byte
		for _, v := range vs {
			out = append(out, []byte(v))
		}
		return out
	}
	for _, tc := range []struct {
		name   string
		values [][]byte
		in     string
		want   string
	}{
		{"no values", nil, "hunter22 stays", "hunter22 stays"},
		{"one", vals("hunter22"), "pw=hunter22\n", "pw=***\n"},
		{"twice", vals("hunter22"), "hunter22hunter22", "******"},
		{"two values", vals("hunter22", "tok-abc"), "a hunter22 b tok-abc c", "a *** b *** c"},
		{"longest wins", vals("abcd", "abcdef"), "xabcdefx", "x***x"},
		{"leftmost wins", vals("cdefgh", "abcd"), "abcdefgh", "***efgh"},
		{"overlap", vals("aaaa"), "aaaaaaa", "***aaa"},
		{"prefix only", vals("hunter22"), "hunter2", "hunter2"},
		{"empty input", vals("hunter22"), "", ""},
		{"binary", vals("\x00\xff\x00\xff"), "a\x00\xff\x00\xffb", "a***b"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := string(maskAll([]byte(tc.in), tc.values)); got != tc.want {
				t.Fatalf("reference masks %q to %q, want %q", tc.in, got, tc.want)
			}
			for _, cuts := range [][]int{{1 << 20}, {1}, {2, 3}, {7}, {3, 1, 4, 1, 5}} {
				if got := string(maskChunks([]byte(tc.in), tc.values, cuts)); got != tc.want {
					t.Fatalf("in chunks %v: %q masked to %q, want %q", cuts, tc.in, got, tc.want)
				}
			}
		})
	}
}

// TestMaskHoldsBack checks that a value split across writes is not let
// through before the rest comes, and that Flush lets the rest through.
func TestMaskHoldsBack(t *testing.T) {
	var out bytes.Buffer
	w := newMasker(&out, [][]byte{[]byte("hunter22")})
	w.Write([]byte("pw=hunt"))
	if strings.Contains(out.String(), "hunt") {
		t.Fatalf("let through a value's start: %q", out.String())
	}
	w.Write([]byte("er22 ok hunt"))
	flushMasked(w)
	if got := out.String(); got != "pw=*** ok hunt" {
		t.Fatalf("got %q", got)
	}
}

func FuzzMask(f *testing.F) {
	f.Add([]byte("pw=hunter22 and hunter22hunter2"), []byte("hunter22"), []byte("tok-abcd"), uint8(3))
	f.Add([]byte("aaaaaaaaaa"), []byte("aaaa"), []byte("aaaaaa"), uint8(1))
	f.Add([]byte("x\x00\xffabcdabcd"), []byte("cdab"), []byte("abcd"), uint8(2))
	f.Fuzz(func(t *testing.T, in, v1, v2 []byte, cut uint8) {
		var values [][]byte
		for _, v := range [][]byte{v1, v2} {
			// What checkSecrets admits.
			if len(v) < minSecretValue || len(v) > 64 || v[0] == '*' || v[len(v)-1] == '*' || bytes.Contains(v, []byte(secretMask)) {
				continue
			}
			values = append(values, v)
		}
		got := maskChunks(in, values, []int{int(cut%16) + 1, int(cut/16) + 1})
		for _, v := range values {
			if bytes.Contains(got, v) {
				t.Fatalf("masked output %q holds value %q (input %q)", got, v, in)
			}
		}
		// The unmasked bytes pass unchanged and in order: the output is
		// the input with each masked match replaced, however it was cut.
		if want := maskAll(in, values); !bytes.Equal(got, want) {
			t.Fatalf("in chunks of %d: %q masked to %q, want %q", cut, in, got, want)
		}
		if len(values) == 0 && !bytes.Equal(got, in) {
			t.Fatalf("nothing to mask, yet %q became %q", in, got)
		}
	})
}

func BenchmarkMask(b *testing.B) {
	chunk := bytes.Repeat([]byte("some ordinary exec output, line after line\n"), 32<<10/44)
	for _, n := range []int{1, 8, maxSecrets} {
		var values [][]byte
		for i := range n {
			values = append(values, []byte("secret-value-"+strings.Repeat("x", i)))
		}
		b.Run(fmt.Sprintf("values=%d", n), func(b *testing.B) {
			b.SetBytes(int64(len(chunk)))
			for b.Loop() {
				w := newMasker(discard{}, values)
				w.Write(chunk)
				flushMasked(w)
			}
		})
	}
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }
