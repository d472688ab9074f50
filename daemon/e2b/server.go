// Package e2b serves E2B's API for kilnd, so that the unmodified E2B SDKs
// drive Kiln sandboxes: the control plane (REST: sandboxes, their
// timeouts, pause and resume, fork, snapshots, metrics), with API keys and
// tenants, and envd (the in-sandbox API, package envd) on the same
// listener, routed by the E2b-Sandbox-Id header or by a PORT-ID.DOMAIN
// host name, as are a sandbox's other ports (ports.go: proxied into the
// guest through kiln.v1's ForwardPort, behind its traffic access token
// when they are private). It is a translator: everything goes through kiln.v1 (a
// kilnpb.KilnClient), kilnd's own API.
package e2b

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/daemon/e2b/envd"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// Reserved labels: the E2B layer's own, on every sandbox it makes. User
// metadata may not use the prefix.
const (
	LabelPrefix   = "e2b.kiln.dev/"
	TenantLabel   = LabelPrefix + "tenant"
	TemplateLabel = LabelPrefix + "template" // the templateID as the create named it
)

// EnvdPort is envd's port in E2B's sandbox host names.
const EnvdPort = 49983

// ClientID is what the API reports as a sandbox's clientID.
const ClientID = "kiln"

// EnvdHandler serves envd requests for an authorized sandbox
// (*envd.Handler).
type EnvdHandler interface {
	Serve(w http.ResponseWriter, r *http.Request, id string)
}

// Config is a Server's.
type Config struct {
	// Kiln is kilnd's API.
	Kiln kilnpb.KilnClient
	// Keys are the API keys and their tenants.
	Keys *Keys
	// StateDir holds the access-token key and the snapshot index
	// (made 0700 when missing).
	StateDir string
	// Domain, when set, is returned to SDKs as each sandbox's domain and
	// is the domain of PORT-ID.DOMAIN host names.
	Domain string
	// Envd serves envd; nil: envd.New(Kiln, Logger).
	Envd EnvdHandler
	// Health, when set, is what GET /health reports (an error: 503).
	Health func(context.Context) error
	// DefaultTimeout is a sandbox's lifetime when a create names none;
	// 0: 15 seconds, the E2B API's default.
	DefaultTimeout time.Duration
	// ReadTimeout bounds the time a control-plane request's body takes
	// to arrive, and WriteTimeout the time from the request's start to
	// its reply written; 0: none. envd's requests have neither: their
	// streams (process output, file transfers) last as long as they
	// must, and their connections' write deadlines are cleared.
	ReadTimeout, WriteTimeout time.Duration
	Logger                    *slog.Logger
	// Now is the clock (nil: time.Now).
	Now func() time.Time
}

// defaultTimeout is the E2B API's lifetime of a sandbox created without
// a timeout.
const defaultTimeout = 15 * time.Second

// Server is the E2B API over one kilnd.
type Server struct {
	kiln       kilnpb.KilnClient
	keys       *Keys
	tokens     *tokens
	snaps      *snapshotIndex
	domain     string
	envd       EnvdHandler
	health     func(context.Context) error
	defTimeout time.Duration
	readTO     time.Duration // Config.ReadTimeout
	writeTO    time.Duration // Config.WriteTimeout
	log        *slog.Logger
	now        func() time.Time
	mux        *http.ServeMux
	ports      *http.Transport // the ports' proxy's (ports.go)

	authLog   limiter   // of failed authentications' log lines
	admission admission // of tenants' requests against their quotas
	// volumeMu makes a volume's name check and create one step.
	volumeMu sync.Mutex
}

// New makes a Server. It needs kiln, at least one key, and a state folder.
func New(cfg Config) (*Server, error) {
	if cfg.Kiln == nil {
		return nil, errors.New("e2b: no kiln.v1 client")
	}
	if cfg.Keys == nil || cfg.Keys.Len() == 0 {
		return nil, errors.New("e2b: no API keys: give --e2b-api-keys FILE or --e2b-api-key 'KEY TENANT'")
	}
	if strings.ContainsAny(cfg.Domain, "/ \t\r\n") {
		return nil, fmt.Errorf("e2b: domain %q is not a host name", cfg.Domain)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	tok, err := loadTokens(cfg.StateDir)
	if err != nil {
		return nil, fmt.Errorf("e2b: %w", err)
	}
	snaps, err := openSnapshotIndex(cfg.StateDir)
	if err != nil {
		return nil, fmt.Errorf("e2b: %w", err)
	}
	s := &Server{
		kiln: cfg.Kiln, keys: cfg.Keys, tokens: tok, snaps: snaps, domain: cfg.Domain,
		envd: cfg.Envd, health: cfg.Health, defTimeout: cfg.DefaultTimeout, log: log, now: cfg.Now,
		readTO: cfg.ReadTimeout, writeTO: cfg.WriteTimeout,
		authLog: limiter{every: 10 * time.Second},
	}
	if s.envd == nil {
		s.envd = envd.New(cfg.Kiln, log)
	}
	s.ports = portsTransport(cfg.Kiln)
	if s.defTimeout <= 0 {
		s.defTimeout = defaultTimeout
	}
	if s.now == nil {
		s.now = time.Now
	}
	s.routes()
	return s, nil
}

// Handler is the whole API: envd's requests go to envd, the rest to the
// control plane.
func (s *Server) Handler() http.Handler { return http.HandlerFunc(s.serveHTTP) }

// ReloadKeys re-reads the API keys file (kilnd calls it on SIGHUP).
func (s *Server) ReloadKeys() error { return s.keys.Reload() }

// AccessToken is sandbox id's envd access token as given to the API key
// apiKey of tenant.
func (s *Server) AccessToken(id, tenant, apiKey string) string {
	return s.tokens.token(id, tenant, sha256.Sum256([]byte(apiKey)))
}

// callerKey is a control-plane request's context key of its caller.
type callerKey struct{}

// callerOf is the caller of r (the api wrapper put it there).
func callerOf(r *http.Request) caller {
	c, _ := r.Context().Value(callerKey{}).(caller)
	return c
}

func (s *Server) serveHTTP(w http.ResponseWriter, r *http.Request) {
	rc := http.NewResponseController(w)
	if id, port, ok := s.envdTarget(r); ok {
		// A control-plane request before it on this connection may
		// have left a write deadline: a stream must not inherit it.
		// (An error: the writer has no deadlines, as in tests.)
		rc.SetWriteDeadline(time.Time{})
		s.serveEnvd(w, r, id, port)
		return
	}
	if s.writeTO > 0 {
		rc.SetWriteDeadline(time.Now().Add(s.writeTO))
	}
	if r.Body != nil && r.Body != http.NoBody && s.readTO > 0 {
		// The body under a deadline, read here whole (as decodeBody
		// would, up to its bound); then none, so that the server's
		// watch for the client going away does not time out while
		// the request waits on kilnd.
		rc.SetReadDeadline(time.Now().Add(s.readTO))
		b, err := io.ReadAll(io.LimitReader(r.Body, maxBody+1))
		if err != nil {
			// The passed deadline stays, so that the server's read of
			// what is left of the body fails at once; the connection
			// closes after the reply.
			w.Header().Set("Connection", "close")
			writeJSON(w, http.StatusRequestTimeout, apiError{Code: http.StatusRequestTimeout, Message: fmt.Sprintf("reading the request body: %v", err)})
			return
		}
		rc.SetReadDeadline(time.Time{})
		r.Body = io.NopCloser(bytes.NewReader(b))
	}
	s.mux.ServeHTTP(w, r)
}

// envdTarget finds the sandbox and port an envd request is for: its
// E2b-Sandbox-Id (and E2b-Sandbox-Port) headers, else a host name
// PORT-ID.DOMAIN (DOMAIN the configured one, any when none is).
func (s *Server) envdTarget(r *http.Request) (id string, port int, ok bool) {
	if id := r.Header.Get("E2b-Sandbox-Id"); id != "" {
		port := EnvdPort
		if p := r.Header.Get("E2b-Sandbox-Port"); p != "" {
			n, err := strconv.Atoi(p)
			if err != nil || n < 1 || n > 65535 {
				port = -1
			} else {
				port = n
			}
		}
		return id, port, true
	}
	return parseSandboxHost(r.Host, s.domain)
}

// parseSandboxHost parses PORT-ID.DOMAIN[:P].
func parseSandboxHost(host, domain string) (id string, port int, ok bool) {
	if h, _, found := strings.Cut(host, ":"); found && !strings.Contains(h, "]") {
		host = h
	}
	label, rest, found := strings.Cut(host, ".")
	if !found || rest == "" {
		return "", 0, false
	}
	if domain != "" {
		d, _, _ := strings.Cut(domain, ":")
		if !strings.EqualFold(rest, d) {
			return "", 0, false
		}
	}
	p, id, found := strings.Cut(label, "-")
	if !found || id == "" || p == "" || len(p) > 5 {
		return "", 0, false
	}
	n, err := strconv.Atoi(p)
	if err != nil || n < 1 || n > 65535 || strconv.Itoa(n) != p {
		return "", 0, false
	}
	return id, n, true
}

// serveEnvd checks an envd request's access token and sandbox, then
// hands it to envd.
func (s *Server) serveEnvd(w http.ResponseWriter, r *http.Request, id string, port int) {
	if port != EnvdPort {
		s.servePort(w, r, id, port)
		return
	}
	if len(id) > 128 {
		writeConnectError(w, http.StatusUnauthorized, "unauthenticated", "bad sandbox ID")
		return
	}
	tok := r.Header.Get("X-Access-Token")
	if tok == "" {
		s.authFailed(r, "envd: no access token", id)
		writeConnectError(w, http.StatusUnauthorized, "unauthenticated", "missing X-Access-Token header: send the envdAccessToken the sandbox's create or connect returned")
		return
	}
	// The token is checked against the keys of the sandbox's tenant now:
	// a revoked key's tokens fail. An unknown sandbox fails as a wrong
	// token does, so that IDs cannot be probed.
	sb, err := s.kiln.GetSandbox(r.Context(), &kilnpb.GetSandboxRequest{Id: id})
	if status.Code(err) == codes.NotFound {
		err, sb = nil, nil
	}
	if err != nil {
		writeConnectError(w, http.StatusBadGateway, "unavailable", fmt.Sprintf("sandbox %s is not running", id))
		return
	}
	tenant := sb.GetLabels()[TenantLabel]
	if tenant == "" || !s.tokens.check(id, tenant, s.keys.sumsOf(tenant), tok) {
		s.authFailed(r, "envd: wrong access token", id)
		writeConnectError(w, http.StatusUnauthorized, "unauthenticated", "invalid access token for sandbox "+id)
		return
	}
	if !isLive(sb.GetState()) {
		writeConnectError(w, http.StatusBadGateway, "unavailable", fmt.Sprintf("sandbox %s is not running", id))
		return
	}
	if sb.GetState() != kilnpb.SandboxState_SANDBOX_STATE_RUNNING {
		writeConnectError(w, http.StatusBadGateway, "unavailable", fmt.Sprintf("sandbox %s is %s: connect to it to resume it first", id, stateName(sb)))
		return
	}
	s.envd.Serve(w, r, id)
}

// apiHandler is a control-plane handler, called with the caller's
// tenant.
type apiHandler func(w http.ResponseWriter, r *http.Request, tenant string) error

// api wraps h with the API-key check and error replies.
func (s *Server) api(h apiHandler) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("X-API-KEY")
		if key == "" {
			s.authFailed(r, "no API key", "")
			writeJSON(w, http.StatusUnauthorized, apiError{Code: http.StatusUnauthorized, Message: "missing X-API-KEY header"})
			return
		}
		c, ok, reloadErr := s.keys.lookup(key)
		tenant := c.tenant
		if reloadErr != nil {
			s.log.Error("e2b: the API keys file changed and is unusable; the keys read before still hold", "err", reloadErr)
		}
		if !ok {
			s.authFailed(r, "unknown API key", "")
			writeJSON(w, http.StatusUnauthorized, apiError{Code: http.StatusUnauthorized, Message: "invalid API key"})
			return
		}
		r = r.WithContext(context.WithValue(r.Context(), callerKey{}, c))
		if err := h(w, r, tenant); err != nil {
			code, msg := statusOf(err)
			lvl := slog.LevelDebug
			if code >= 500 {
				lvl = slog.LevelWarn
			}
			if code == http.StatusServiceUnavailable || code == http.StatusTooManyRequests {
				lvl = slog.LevelInfo
			}
			// The whole error for the operator, not the reply's
			// (which says less of the host).
			s.log.Log(r.Context(), lvl, "e2b: request failed", "method", r.Method, "path", r.URL.Path, "tenant", tenant, "status", code, "reply", msg, "err", err)
			writeError(w, err)
		}
	}
}

// authFailed logs a refused caller, at most every few seconds (a caller
// may try many keys).
func (s *Server) authFailed(r *http.Request, why, sandbox string) {
	if n, ok := s.authLog.allow(s.now()); ok {
		args := []any{"why", why, "remote", r.RemoteAddr, "path", r.URL.Path}
		if sandbox != "" {
			args = append(args, "sandbox", sandbox)
		}
		if n > 0 {
			args = append(args, "suppressed", n)
		}
		s.log.Warn("e2b: refused a caller", args...)
	}
}

// limiter lets one event through every so often and counts the others.
type limiter struct {
	every time.Duration

	mu         sync.Mutex
	last       time.Time
	suppressed int
}

// allow reports whether to log now, with how many were suppressed since
// the last one logged.
func (l *limiter) allow(now time.Time) (int, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.last.IsZero() && now.Sub(l.last) < l.every {
		l.suppressed++
		return 0, false
	}
	n := l.suppressed
	l.last, l.suppressed = now, 0
	return n, true
}

func (s *Server) routes() {
	m := http.NewServeMux()
	m.HandleFunc("GET /health", s.serveHealth)
	m.HandleFunc("POST /v2/sandboxes", s.api(s.createSandbox))
	m.HandleFunc("POST /sandboxes", s.api(s.createSandbox))
	m.HandleFunc("GET /v2/sandboxes", s.api(s.listSandboxes))
	m.HandleFunc("GET /sandboxes", s.api(s.listSandboxes))
	m.HandleFunc("GET /sandboxes/{id}", s.api(s.getSandbox))
	m.HandleFunc("DELETE /sandboxes/{id}", s.api(s.killSandbox))
	m.HandleFunc("POST /sandboxes/{id}/timeout", s.api(s.setTimeout))
	m.HandleFunc("POST /sandboxes/{id}/pause", s.api(s.pauseSandbox))
	m.HandleFunc("POST /v2/sandboxes/{id}/connect", s.api(s.connectSandbox))
	m.HandleFunc("POST /sandboxes/{id}/connect", s.api(s.connectSandbox))
	m.HandleFunc("POST /sandboxes/{id}/resume", s.api(s.connectSandbox))
	m.HandleFunc("POST /sandboxes/{id}/fork", s.api(s.forkSandbox))
	m.HandleFunc("POST /sandboxes/{id}/snapshots", s.api(s.createSnapshot))
	m.HandleFunc("GET /snapshots", s.api(s.listSnapshots))
	m.HandleFunc("POST /snapshots/{id}/fork", s.api(s.forkSnapshot))
	m.HandleFunc("DELETE /templates/{id}", s.api(s.deleteSnapshot))
	m.HandleFunc("GET /sandboxes/{id}/metrics", s.api(s.sandboxMetrics))
	m.HandleFunc("PUT /sandboxes/{id}/network", s.api(s.updateNetwork))
	m.HandleFunc("POST /volumes", s.api(s.createVolume))
	m.HandleFunc("GET /volumes", s.api(s.listVolumes))
	m.HandleFunc("GET /volumes/{id}", s.api(s.getVolume))
	m.HandleFunc("DELETE /volumes/{id}", s.api(s.deleteVolume))
	m.HandleFunc("/volumecontent/", s.volumeContentHandler)
	m.HandleFunc("/", s.api(func(w http.ResponseWriter, r *http.Request, _ string) error {
		return errorf(http.StatusNotFound, "%s %s is not part of the API Kiln serves", r.Method, r.URL.Path)
	}))
	s.mux = m
}

func (s *Server) serveHealth(w http.ResponseWriter, r *http.Request) {
	if s.health != nil {
		if err := s.health(r.Context()); err != nil {
			writeJSON(w, http.StatusServiceUnavailable, apiError{Code: http.StatusServiceUnavailable, Message: "kilnd is not serving: " + err.Error()})
			return
		}
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
}
