package e2b

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/daemon/client"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// Labels of a sandbox's ports: PrivateTrafficLabel ("true") when its create
// set network.allowPublicTraffic false, so that a request to its ports
// must carry its traffic access token; MaskHostLabel, network.
// maskRequestHost, the Host header its ports get (${PORT}: the port).
const (
	PrivateTrafficLabel = LabelPrefix + "private-traffic"
	MaskHostLabel       = LabelPrefix + "mask-request-host"
)

// TrafficTokenHeader carries a sandbox's traffic access token to its ports.
const TrafficTokenHeader = "E2b-Traffic-Access-Token"

// maxMaskHost bounds network.maskRequestHost.
const maxMaskHost = 253

// trafficToken is sandbox id's traffic access token: the HMAC-SHA256 of
// its ID under the access-token key (the token of every client of the
// sandbox alike, as E2B's is, so that whoever the sandbox's creator gives
// it to reaches its ports).
func (t *tokens) trafficToken(id string) string {
	m := hmac.New(sha256.New, t.key)
	m.Write([]byte("kiln-e2b-traffic-v1\x00"))
	m.Write([]byte(id))
	return base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

// portLabels checks a create's network settings for its ports and
// returns the labels that keep them.
func portLabels(n *networkConfig) (map[string]string, error) {
	out := map[string]string{}
	if n == nil {
		return out, nil
	}
	if n.AllowPublicTraffic != nil && !*n.AllowPublicTraffic {
		out[PrivateTrafficLabel] = "true"
	}
	if n.MaskRequestHost != nil {
		m := *n.MaskRequestHost
		if m == "" || len(m) > maxMaskHost || strings.ContainsFunc(m, func(r rune) bool { return r <= ' ' || r == 0x7f || r == '/' }) {
			return nil, errorf(http.StatusBadRequest, "network.maskRequestHost %q: want a host name (and :port or :${PORT}) of at most %d bytes", m, maxMaskHost)
		}
		out[MaskHostLabel] = m
	}
	return out, nil
}

// trafficToken is what the create of a sandbox with private ports returns.
func (s *Server) trafficToken(sb *kilnpb.Sandbox) string {
	if sb.GetLabels()[PrivateTrafficLabel] != "true" {
		return ""
	}
	return s.tokens.trafficToken(sb.GetId())
}

// portsTransport is the transport of the ports' proxy: its connections
// are kiln.v1 ForwardPort calls, to the address "ID:PORT".
func portsTransport(kc kilnpb.KilnClient) *http.Transport {
	return &http.Transport{
		DialContext: func(ctx context.Context, _, addr string) (net.Conn, error) {
			id, p, err := net.SplitHostPort(addr)
			if err != nil {
				return nil, err
			}
			port, err := strconv.Atoi(p)
			if err != nil {
				return nil, fmt.Errorf("port %q: %w", p, err)
			}
			return client.DialPort(ctx, kc, id, port)
		},
		MaxIdleConnsPerHost:   8,
		IdleConnTimeout:       30 * time.Second,
		ResponseHeaderTimeout: 0, // a port's server takes the time it takes
		DisableCompression:    true,
	}
}

// servePort proxies a request for port of sandbox id (HTTP, WebSocket
// alike) into the sandbox, once its traffic token checks when its ports
// are private.
func (s *Server) servePort(w http.ResponseWriter, r *http.Request, id string, port int) {
	if id == "" || len(id) > 128 {
		writeJSON(w, http.StatusBadGateway, apiError{Code: http.StatusBadGateway, Message: "bad sandbox ID"})
		return
	}
	sb, err := s.kiln.GetSandbox(r.Context(), &kilnpb.GetSandboxRequest{Id: id})
	if status.Code(err) == codes.NotFound || err == nil && (sb.GetLabels()[TenantLabel] == "" || !isLive(sb.GetState())) {
		writeJSON(w, http.StatusBadGateway, apiError{Code: http.StatusBadGateway, Message: fmt.Sprintf("sandbox %s not found", id)})
		return
	}
	if err != nil {
		writeError(w, err)
		return
	}
	if sb.GetLabels()[PrivateTrafficLabel] == "true" {
		tok := r.Header.Get(TrafficTokenHeader)
		if tok == "" || !hmac.Equal([]byte(tok), []byte(s.tokens.trafficToken(id))) {
			why := "missing " + TrafficTokenHeader + " header"
			if tok != "" {
				why = "wrong " + TrafficTokenHeader
			}
			s.authFailed(r, "ports: "+why, id)
			writeJSON(w, http.StatusUnauthorized, apiError{Code: http.StatusUnauthorized,
				Message: fmt.Sprintf("%s: sandbox %s's ports are private (allowPublicTraffic false): send the trafficAccessToken its create returned", why, id)})
			return
		}
	}
	if sb.GetState() == kilnpb.SandboxState_SANDBOX_STATE_PAUSED {
		writeJSON(w, http.StatusBadGateway, apiError{Code: http.StatusBadGateway, Message: fmt.Sprintf("sandbox %s is paused: connect to it to resume it", id)})
		return
	}
	mask := sb.GetLabels()[MaskHostLabel]
	proxy := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.Out.URL.Scheme = "http"
			pr.Out.URL.Host = net.JoinHostPort(id, strconv.Itoa(port))
			pr.Out.Host = pr.In.Host
			if mask != "" {
				pr.Out.Host = strings.ReplaceAll(mask, "${PORT}", strconv.Itoa(port))
			}
			// What routes and authorizes the request stays here.
			for _, h := range []string{TrafficTokenHeader, "E2b-Sandbox-Id", "E2b-Sandbox-Port", "X-Access-Token"} {
				pr.Out.Header.Del(h)
			}
			pr.SetXForwarded()
		},
		Transport:     s.ports,
		FlushInterval: -1, // streams (server-sent events) as they come
		ErrorLog:      slog.NewLogLogger(s.log.Handler(), slog.LevelDebug),
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			code := http.StatusBadGateway
			msg := fmt.Sprintf("port %d of sandbox %s: %v", port, id, err)
			if status.Code(err) == codes.Unavailable {
				if st, ok := status.FromError(err); ok {
					msg = st.Message()
				}
			}
			writeJSON(w, code, apiError{Code: code, Message: msg})
		},
	}
	proxy.ServeHTTP(w, r)
}
