package daemon

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"strings"
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// Secrets (CreateSandboxRequest.secrets, CreateTemplateRequest.secrets)
// reach the guest over the agent channel only:
//
//   - An env secret (no file) is added by kilnd to the environment of
//     every exec it sends the agent. The secret wins: an entry of the
//     sandbox's or the exec's env with a secret's name is dropped.
//   - A file secret is written by the agent (WriteFile, mode file_mode,
//     0400 when 0) before the sandbox is reported ready.
//
// Their values never touch the host's disk: not the sandbox's record
// (which has their names, as GetSandbox does), not the events, not a log
// line, not a snapshot's labels. So that they outlive a restart of kilnd,
// the values are kept in the memory of the sandbox's VMM process (which
// outlives kilnd: Instance.Keep), and read back when the sandbox is taken
// over. A fork's children get their parent's secrets; a rollback keeps
// the sandbox's (its file secrets are written again); a create from a
// template or a checkpoint gets its own request's only (what the guest's
// memory holds of the source's stays, as every other byte of it).
//
// Every exec output stream (stdout and stderr, foreground and background)
// and a template setup's output quoted in an error pass through a masker
// that replaces each secret value with "***". So that the masking is
// exact, values are at least minSecretValue bytes, and may neither begin
// nor end with '*' nor hold "***" (a value could otherwise be made of a
// mask and the bytes beside it). The masking is of verbatim values only:
// a value the guest prints encoded (base64, hex, split) is not found.
//
// A plain secret (Secret.plain: E2B's envVars) is an env secret that is
// kept as secrets are, because its value may be an API key its user put
// there and so must not reach the host's disk, but is not the sandbox
// user's secret: it is not masked in exec output (so any value goes: an
// empty one, "1", one with '*'), and it is the sandbox's env, which an
// exec's own env overrides, not a secret that wins over it. Its name is
// any 1 to maxSecretName bytes without '=' or NUL.
//
// A request's idempotency key covers the secrets' names, files and modes,
// not their values (a digest of a value on disk could be brute-forced): a
// retry with the same request ID and other values gets the sandbox the
// first request made.

// Limits of a request's secrets.
const (
	maxSecrets      = 64
	maxSecretName   = 128
	minSecretValue  = 4
	maxSecretValue  = 64 << 10
	maxSecretsTotal = 1 << 20
)

// secretsKey is the key under which a sandbox's VMM process keeps its
// secrets (Instance.Keep).
const secretsKey = "kiln.secrets"

// secretMask replaces a secret's value in exec output.
const secretMask = "***"

// secret is a secret as the server holds it: in memory only.
type secret struct {
	Name  string `json:"name"`
	Value []byte `json:"value"`
	File  string `json:"file,omitempty"`
	Mode  uint32 `json:"mode,omitempty"`
	Plain bool   `json:"plain,omitempty"` // unmasked, overridden by an exec's env
}

// isPOSIXName says s is a POSIX environment variable name.
func isPOSIXName(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c == '_' || c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || i > 0 && c >= '0' && c <= '9') {
			return false
		}
	}
	return true
}

// checkSecrets checks a request's secrets and returns them as the server
// holds them. Its errors name a secret by its name (or index), never by
// its value.
func checkSecrets(field string, in []*kilnpb.Secret) ([]secret, error) {
	if len(in) == 0 {
		return nil, nil
	}
	if len(in) > maxSecrets {
		return nil, status.Errorf(codes.InvalidArgument, "%s: %d secrets, at most %d", field, len(in), maxSecrets)
	}
	names := map[string]bool{}
	files := map[string]string{}
	total := 0
	out := make([]secret, 0, len(in))
	for i, s := range in {
		name, v := s.GetName(), s.GetValue()
		if s.GetPlain() {
			sec, err := checkPlain(field, i, s)
			if err != nil {
				return nil, err
			}
			if names[name] {
				return nil, status.Errorf(codes.InvalidArgument, "%s: secret %.140q is given twice", field, name)
			}
			names[name] = true
			if total += len(v); total > maxSecretsTotal {
				return nil, status.Errorf(codes.InvalidArgument, "%s: the secrets have more than %d bytes in all (at secret %.140q)", field, maxSecretsTotal, name)
			}
			out = append(out, sec)
			continue
		}
		if len(name) > maxSecretName || !isPOSIXName(name) {
			return nil, status.Errorf(codes.InvalidArgument, "%s[%d]: name %.140q: want 1 to %d bytes of letters, digits and '_', not starting with a digit (a POSIX environment variable name)", field, i, name, maxSecretName)
		}
		if names[name] {
			return nil, status.Errorf(codes.InvalidArgument, "%s: secret %s is given twice", field, name)
		}
		names[name] = true
		switch {
		case len(v) < minSecretValue:
			return nil, status.Errorf(codes.InvalidArgument, "%s: secret %s has %d bytes: at least %d, so that exec output can be masked without masking common text", field, name, len(v), minSecretValue)
		case len(v) > maxSecretValue:
			return nil, status.Errorf(codes.InvalidArgument, "%s: secret %s has %d bytes: at most %d", field, name, len(v), maxSecretValue)
		case v[0] == '*' || v[len(v)-1] == '*' || bytes.Contains(v, []byte(secretMask)):
			return nil, status.Errorf(codes.InvalidArgument, "%s: secret %s begins or ends with '*' or holds %q: exec output masks values as %q, so such a value could show through a mask", field, name, secretMask, secretMask)
		}
		total += len(v)
		if total > maxSecretsTotal {
			return nil, status.Errorf(codes.InvalidArgument, "%s: the secrets have more than %d bytes in all (at secret %s)", field, maxSecretsTotal, name)
		}
		sec := secret{Name: name, Value: bytes.Clone(v), File: s.GetFile(), Mode: s.GetFileMode()}
		if sec.File == "" {
			if sec.Mode != 0 {
				return nil, status.Errorf(codes.InvalidArgument, "%s: secret %s has a file_mode but no file", field, name)
			}
			if bytes.IndexByte(v, 0) >= 0 {
				return nil, status.Errorf(codes.InvalidArgument, "%s: secret %s is an environment variable and its value has a NUL byte: give it a file", field, name)
			}
		} else {
			if err := checkPath(field+": secret "+name+"'s file", sec.File); err != nil {
				return nil, err
			}
			if sec.File == "/" {
				return nil, status.Errorf(codes.InvalidArgument, "%s: secret %s's file is /: want a file's path", field, name)
			}
			if o, ok := files[sec.File]; ok {
				return nil, status.Errorf(codes.InvalidArgument, "%s: secrets %s and %s have one file %s", field, o, name, sec.File)
			}
			files[sec.File] = name
			if sec.Mode&^0o777 != 0 {
				return nil, status.Errorf(codes.InvalidArgument, "%s: secret %s: file_mode %#o: want permission bits only (at most 0777)", field, name, sec.Mode)
			}
			if sec.Mode == 0 {
				sec.Mode = 0o400
			}
		}
		out = append(out, sec)
	}
	return out, nil
}

// checkPlain checks the plain secret in[i]; its errors name it by its
// name, never its value.
func checkPlain(field string, i int, s *kilnpb.Secret) (secret, error) {
	name, v := s.GetName(), s.GetValue()
	if name == "" || len(name) > maxSecretName || strings.ContainsAny(name, "=\x00") {
		return secret{}, status.Errorf(codes.InvalidArgument, "%s[%d]: plain variable name %.140q: want 1 to %d bytes without '=' or NUL", field, i, name, maxSecretName)
	}
	switch {
	case s.GetFile() != "" || s.GetFileMode() != 0:
		return secret{}, status.Errorf(codes.InvalidArgument, "%s: plain variable %.140q has a file: a plain secret is an environment variable only", field, name)
	case len(v) > maxSecretValue:
		return secret{}, status.Errorf(codes.InvalidArgument, "%s: plain variable %.140q has %d bytes: at most %d", field, name, len(v), maxSecretValue)
	case bytes.IndexByte(v, 0) >= 0:
		return secret{}, status.Errorf(codes.InvalidArgument, "%s: plain variable %.140q has a NUL byte in its value", field, name)
	}
	return secret{Name: name, Value: bytes.Clone(v), Plain: true}, nil
}

// secretNames returns the secrets' names, in order.
func secretNames(secs []secret) []string {
	if len(secs) == 0 {
		return nil
	}
	out := make([]string, len(secs))
	for i, s := range secs {
		out[i] = s.Name
	}
	return out
}

// secretValues returns the values to mask.
func secretValues(secs []secret) [][]byte {
	var out [][]byte
	for _, s := range secs {
		if s.Plain {
			continue // not masked
		}
		out = append(out, s.Value)
	}
	return out
}

// withoutValues returns a copy of secrets with their values dropped, for
// a request's idempotency key.
func withoutValues(in []*kilnpb.Secret) []*kilnpb.Secret {
	if len(in) == 0 {
		return nil
	}
	out := make([]*kilnpb.Secret, len(in))
	for i, s := range in {
		out[i] = &kilnpb.Secret{Name: s.GetName(), File: s.GetFile(), FileMode: s.GetFileMode(), Plain: s.GetPlain()}
	}
	return out
}

// secretEnv returns env with the env secrets added: an entry with a
// secret's name is dropped (the secret wins).
func secretEnv(env []string, secs []secret) []string {
	var names map[string]bool
	var add []string
	for _, s := range secs {
		if s.File != "" || s.Plain {
			continue
		}
		if names == nil {
			names = map[string]bool{}
		}
		names[s.Name] = true
		add = append(add, s.Name+"="+string(s.Value))
	}
	if len(add) == 0 {
		return env
	}
	out := make([]string, 0, len(env)+len(add))
	for _, e := range env {
		if k, _, _ := strings.Cut(e, "="); !names[k] {
			out = append(out, e)
		}
	}
	return append(out, add...)
}

// plainEnv returns the sandbox's env with its plain secrets after it
// (an exec's env, after both, overrides them).
func plainEnv(env []string, secs []secret) []string {
	var out []string
	for _, s := range secs {
		if s.Plain {
			if out == nil {
				out = append(make([]string, 0, len(env)+len(secs)), env...)
			}
			out = append(out, s.Name+"="+string(s.Value))
		}
	}
	if out == nil {
		return env
	}
	return out
}

// encodeSecrets is what a VMM process keeps of a sandbox's secrets.
func encodeSecrets(secs []secret) ([]byte, error) {
	b, err := json.Marshal(secs)
	if err != nil {
		return nil, fmt.Errorf("daemon: encode the secrets: %w", err) // names no value
	}
	return b, nil
}

// decodeSecrets reads back what encodeSecrets made, checked as a
// request's secrets are.
func decodeSecrets(b []byte) ([]secret, error) {
	var secs []secret
	if err := json.Unmarshal(b, &secs); err != nil {
		return nil, errors.New("daemon: the secrets the VMM process kept do not decode") // names no value
	}
	in := make([]*kilnpb.Secret, len(secs))
	for i, s := range secs {
		in[i] = &kilnpb.Secret{Name: s.Name, Value: s.Value, File: s.File, FileMode: s.Mode, Plain: s.Plain}
	}
	out, err := checkSecrets("kept secrets", in)
	if err != nil {
		return nil, fmt.Errorf("daemon: %s", status.Convert(err).Message())
	}
	return out, nil
}

// keepSecrets has inst's VMM process keep secs (nothing when there are
// none).
func keepSecrets(ctx context.Context, inst Instance, secs []secret) error {
	if len(secs) == 0 {
		return nil
	}
	b, err := encodeSecrets(secs)
	if err != nil {
		return err
	}
	defer clear(b)
	if err := inst.Keep(ctx, secretsKey, b); err != nil {
		return fmt.Errorf("keep the secrets in the VMM process: %w", err)
	}
	return nil
}

// keptSecrets reads back the secrets inst's VMM process keeps; none when
// it keeps none.
func keptSecrets(ctx context.Context, inst Instance) ([]secret, error) {
	b, err := inst.Kept(ctx, secretsKey)
	if errors.Is(err, ErrNotKept) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	defer clear(b)
	return decodeSecrets(b)
}

// writeSecretFiles has the agent write the file secrets.
func writeSecretFiles(ctx context.Context, inst Instance, secs []secret) error {
	for _, s := range secs {
		if s.File == "" {
			continue
		}
		if _, err := inst.WriteFile(ctx, s.File, bytes.NewReader(s.Value), fs.FileMode(s.Mode), true, ""); err != nil {
			return callErr("write secret "+s.Name+" to "+s.File, err)
		}
	}
	return nil
}

// installSecrets gives inst, a new machine of b, b's secrets: kept in its
// VMM process, and (files) the file secrets written.
func (s *Server) installSecrets(ctx context.Context, b *box, inst Instance, files bool) error {
	b.mu.Lock()
	secs := b.secrets
	b.mu.Unlock()
	if len(secs) == 0 {
		return nil
	}
	if err := keepSecrets(ctx, inst, secs); err != nil {
		return callErr("sandbox "+b.id, err)
	}
	if files {
		if err := writeSecretFiles(ctx, inst, secs); err != nil {
			return status.Errorf(status.Code(err), "sandbox %s: %s", b.id, status.Convert(err).Message())
		}
	}
	return nil
}

// masker is a streaming writer that replaces every secret value in what
// passes through it with secretMask, also a value split across writes:
// it holds back the last len(longest)-1 bytes until more come or Flush.
// Of the values that match at one place the longest is masked, and the
// leftmost place first, so that the output does not depend on how the
// input is cut into writes. Safe for concurrent use.
type masker struct {
	w      io.Writer
	values [][]byte
	maxLen int

	mu  sync.Mutex
	buf []byte
}

// newMasker returns w itself when there is nothing to mask.
func newMasker(w io.Writer, values [][]byte) io.Writer {
	m := &masker{w: w}
	for _, v := range values {
		if len(v) == 0 {
			continue
		}
		m.values = append(m.values, v)
		m.maxLen = max(m.maxLen, len(v))
	}
	if len(m.values) == 0 {
		return w
	}
	return m
}

// flushMasked flushes w when it is a masker.
func flushMasked(w io.Writer) error {
	if m, ok := w.(*masker); ok {
		return m.Flush()
	}
	return nil
}

func (m *masker) Write(p []byte) (int, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.buf = append(m.buf, p...)
	out := m.scan(false)
	if len(out) > 0 {
		if _, err := m.w.Write(out); err != nil {
			return len(p), err
		}
	}
	return len(p), nil
}

// Flush writes what is held back: the stream has ended.
func (m *masker) Flush() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := m.scan(true)
	if len(out) == 0 {
		return nil
	}
	_, err := m.w.Write(out)
	return err
}

// scan masks m.buf and returns what can be written: all of it when
// final, else all but what a value may still begin in.
func (m *masker) scan(final bool) []byte {
	b := m.buf
	// next[i] is where values[i] next occurs at or after pos (-1: not
	// in b).
	next := make([]int, len(m.values))
	for i, v := range m.values {
		next[i] = bytes.Index(b, v)
	}
	var out []byte
	pos := 0
	for {
		at, n := -1, 0
		for i, v := range m.values {
			if next[i] >= 0 && next[i] < pos {
				if j := bytes.Index(b[pos:], v); j >= 0 {
					next[i] = pos + j
				} else {
					next[i] = -1
				}
			}
			if k := next[i]; k >= 0 && (at < 0 || k < at || k == at && len(v) > n) {
				at, n = k, len(v)
			}
		}
		// A match is certain once no longer value could begin at or
		// before it: maxLen bytes from it are in b.
		if at < 0 || !final && len(b)-at < m.maxLen {
			break
		}
		out = append(out, b[pos:at]...)
		out = append(out, secretMask...)
		pos = at + n
	}
	end := len(b)
	if !final {
		end = max(pos, len(b)-(m.maxLen-1))
	}
	out = append(out, b[pos:end]...)
	m.buf = append(m.buf[:0], b[end:]...)
	return out
}

// adoptSecrets reads back the secrets of b, a sandbox taken over, from
// inst's VMM process. A sandbox whose secrets did not come back runs on
// without them (its execs lack the env secrets and mask nothing): one log
// line says so.
func (s *Server) adoptSecrets(ctx context.Context, b *box, inst Instance) []secret {
	b.mu.Lock()
	names := b.rec.SecretNames
	b.mu.Unlock()
	if len(names) == 0 {
		return nil
	}
	secs, err := keptSecrets(ctx, inst)
	if err == nil && len(secs) == 0 {
		err = errors.New("its VMM process keeps none")
	}
	if err != nil {
		s.log.Warn("the secrets of a sandbox taken over are lost: its execs run without them", "sandbox", b.id, "secrets", names, "err", err)
		return nil
	}
	return secs
}

// cloneSecrets copies secs, values too: each box has its own.
func cloneSecrets(secs []secret) []secret {
	if len(secs) == 0 {
		return nil
	}
	out := make([]secret, len(secs))
	for i, s := range secs {
		out[i] = s
		out[i].Value = bytes.Clone(s.Value)
	}
	return out
}
