package e2b

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"crypto/tls"
	"encoding/base64"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"slices"
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
// maskRequestHost, the Host header its ports get (${PORT}: the port);
// HTTPSPortsLabel, network.httpsPorts, the ports that serve HTTPS (comma
// separated), which the proxy reaches over TLS without verifying the
// certificate (a sandbox's own is self-signed).
const (
	PrivateTrafficLabel = LabelPrefix + "private-traffic"
	MaskHostLabel       = LabelPrefix + "mask-request-host"
	HTTPSPortsLabel     = LabelPrefix + "https-ports"
)

// TrafficTokenHeader carries a sandbox's traffic access token to its ports.
const TrafficTokenHeader = "E2b-Traffic-Access-Token"

// maxMaskHost bounds network.maskRequestHost; maxHTTPSPorts,
// network.httpsPorts.
const (
	maxMaskHost   = 253
	maxHTTPSPorts = 64
)

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
	if len(n.HTTPSPorts) > maxHTTPSPorts {
		return nil, errorf(http.StatusBadRequest, "network.httpsPorts: %d ports, at most %d", len(n.HTTPSPorts), maxHTTPSPorts)
	}
	var ports []string
	for _, p := range n.HTTPSPorts {
		switch {
		case p < 1 || p > 65535:
			return nil, errorf(http.StatusBadRequest, "network.httpsPorts: %d is not a port (1 to 65535)", p)
		case p == EnvdPort:
			return nil, errorf(http.StatusBadRequest, "network.httpsPorts: %d is envd's port, which cannot be listed", p)
		}
		if s := strconv.Itoa(p); !slices.Contains(ports, s) {
			ports = append(ports, s)
		}
	}
	if len(ports) > 0 {
		out[HTTPSPortsLabel] = strings.Join(ports, ",")
	}
	return out, nil
}

// httpsPorts are sb's network.httpsPorts.
func httpsPorts(sb *kilnpb.Sandbox) []int {
	var out []int
	for _, s := range strings.Split(sb.GetLabels()[HTTPSPortsLabel], ",") {
		if p, err := strconv.Atoi(s); err == nil {
			out = append(out, p)
		}
	}
	return out
}

// httpsPort says port of sb serves HTTPS (network.httpsPorts).
func httpsPort(sb *kilnpb.Sandbox, port int) bool {
	l := sb.GetLabels()[HTTPSPortsLabel]
	return l != "" && slices.Contains(strings.Split(l, ","), strconv.Itoa(port))
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
		// A sandbox's HTTPS ports (network.httpsPorts) have certificates
		// of their own making: not verified, as E2B's proxy does not.
		TLSClientConfig:       &tls.Config{InsecureSkipVerify: true},
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
	scheme := "http"
	if httpsPort(sb, port) {
		scheme = "https"
	}
	proxy := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.Out.URL.Scheme = scheme
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
