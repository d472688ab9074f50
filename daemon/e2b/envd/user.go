package envd

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"path"
	"strings"

	"connectrpc.com/connect"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

func errorf(format string, args ...any) error { return fmt.Errorf(format, args...) }

// maxUser is the longest user name taken (useradd's limit is 32).
const maxUser = 64

// checkUser refuses a user name that no /etc/passwd would hold: empty is
// fine (the default user), else 1 to 64 of [A-Za-z0-9._-], not starting
// with '-'.
func checkUser(u string) error {
	if u == "" {
		return nil
	}
	if len(u) > maxUser {
		return fmt.Errorf("user name is %d bytes: at most %d", len(u), maxUser)
	}
	if u[0] == '-' {
		return fmt.Errorf("user name %q starts with '-'", u)
	}
	for i := 0; i < len(u); i++ {
		c := u[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-') {
			return fmt.Errorf("user name %q has a %q: want letters, digits, '.', '_' or '-'", u, c)
		}
	}
	return nil
}

// userFromAuth is the user a request runs as, by envd's rule:
// "Authorization: Basic base64(user:)" (what follows the colon, a
// password, is ignored); no header: "" (the sandbox's default user, root).
func userFromAuth(hdr http.Header) (string, error) {
	v := hdr.Get("Authorization")
	if v == "" {
		return "", nil
	}
	scheme, cred, ok := strings.Cut(strings.TrimSpace(v), " ")
	if !ok || !strings.EqualFold(scheme, "Basic") {
		return "", errors.New("authorization: want Basic base64(user:)")
	}
	raw, err := base64.StdEncoding.DecodeString(strings.TrimSpace(cred))
	if err != nil {
		return "", fmt.Errorf("authorization: the Basic credentials are not base64: %w", err)
	}
	user, _, _ := strings.Cut(string(raw), ":")
	if err := checkUser(user); err != nil {
		return "", fmt.Errorf("authorization: %w", err)
	}
	return user, nil
}

// requestUser is userFromAuth as a Connect error.
func requestUser(hdr http.Header) (string, error) {
	u, err := userFromAuth(hdr)
	if err != nil {
		return "", connect.NewError(connect.CodeUnauthenticated, err)
	}
	return u, nil
}

// maxPath is the longest path taken (Linux's PATH_MAX).
const maxPath = 4096

// resolvePath makes p absolute and clean: relative to home as envd does
// ("" is home itself); ".." cannot climb above /.
func resolvePath(p, home string) (string, error) {
	if len(p) > maxPath {
		return "", fmt.Errorf("path is %d bytes: at most %d", len(p), maxPath)
	}
	if strings.IndexByte(p, 0) >= 0 {
		return "", fmt.Errorf("path %q has a NUL byte", p)
	}
	if p == "~" || strings.HasPrefix(p, "~/") {
		p = home + p[1:]
	}
	if !strings.HasPrefix(p, "/") {
		p = home + "/" + p
	}
	return path.Clean(p), nil
}

// homeCache keeps users' home folders by sandbox, bounded.
type homeCache struct {
	m map[homeKey]string // guarded by Handler.mu
}

type homeKey struct{ sandbox, user string }

const maxHomes = 4096

// maxPasswd bounds the /etc/passwd read to find a home.
const maxPasswd = 1 << 20

// home is user's home folder in sandbox: /root for root and the default
// user; else its /etc/passwd entry's, or /home/USER without one.
func (h *Handler) home(ctx context.Context, sandbox, user string) string {
	if user == "" || user == "root" {
		return "/root"
	}
	k := homeKey{sandbox, user}
	h.mu.Lock()
	dir, ok := h.homes.m[k]
	h.mu.Unlock()
	if ok {
		return dir
	}
	dir = "/home/" + user
	if d, err := h.passwdHome(ctx, sandbox, user); err == nil && d != "" {
		dir = d
	}
	h.mu.Lock()
	if len(h.homes.m) >= maxHomes {
		clear(h.homes.m)
	}
	h.homes.m[k] = dir
	h.mu.Unlock()
	return dir
}

// passwdHome reads user's home from the sandbox's /etc/passwd.
func (h *Handler) passwdHome(ctx context.Context, sandbox, user string) (string, error) {
	stream, err := h.kiln.ReadFile(ctx, &kilnpb.ReadFileRequest{SandboxId: sandbox, Path: "/etc/passwd"})
	if err != nil {
		return "", err
	}
	var buf bytes.Buffer
	for buf.Len() < maxPasswd {
		c, err := stream.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			return "", err
		}
		buf.Write(c.GetData())
	}
	return homeIn(buf.Bytes(), user), nil
}

// homeIn is user's home in an /etc/passwd's text, "" when it is not
// there (or its home is not absolute).
func homeIn(passwd []byte, user string) string {
	sc := bufio.NewScanner(bytes.NewReader(passwd))
	sc.Buffer(make([]byte, 4096), 64<<10)
	for sc.Scan() {
		f := strings.Split(sc.Text(), ":")
		if len(f) >= 6 && f[0] == user && strings.HasPrefix(f[5], "/") {
			return path.Clean(f[5])
		}
	}
	return ""
}

// httpError answers a plain HTTP request (/files) with envd's JSON error
// body.
func httpError(w http.ResponseWriter, code int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	}{code, msg})
}
