package e2b

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/netip"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/kilnvm/kiln/daemon/e2b/envd"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// The API's shapes (the SDK's components.schemas), as far as Kiln fills
// them.

// sandboxJSON is the schema's Sandbox: what create, connect and fork
// return.
type sandboxJSON struct {
	SandboxID          string  `json:"sandboxID"`
	TemplateID         string  `json:"templateID"`
	ClientID           string  `json:"clientID"`
	EnvdVersion        string  `json:"envdVersion"`
	EnvdAccessToken    string  `json:"envdAccessToken,omitempty"`
	TrafficAccessToken string  `json:"trafficAccessToken,omitempty"`
	Domain             *string `json:"domain,omitempty"`
}

// listedSandbox is the schema's ListedSandbox.
type listedSandbox struct {
	SandboxID   string            `json:"sandboxID"`
	TemplateID  string            `json:"templateID"`
	ClientID    string            `json:"clientID"`
	EnvdVersion string            `json:"envdVersion"`
	CPUCount    uint32            `json:"cpuCount"`
	MemoryMB    uint32            `json:"memoryMB"`
	DiskSizeMB  uint32            `json:"diskSizeMB"`
	StartedAt   string            `json:"startedAt"`
	EndAt       string            `json:"endAt"`
	State       string            `json:"state"`
	Metadata    map[string]string `json:"metadata"`
	// VolumeMounts are its volumes (E2B's names).
	VolumeMounts []volumeMount `json:"volumeMounts,omitempty"`
}

// sandboxDetail is the schema's SandboxDetail.
type sandboxDetail struct {
	listedSandbox
	EnvdAccessToken     string      `json:"envdAccessToken,omitempty"`
	Domain              *string     `json:"domain,omitempty"`
	AllowInternetAccess *bool       `json:"allowInternetAccess,omitempty"`
	Lifecycle           lifecycle   `json:"lifecycle"`
	Network             *networkOut `json:"network,omitempty"`
}

type lifecycle struct {
	AutoResume bool   `json:"autoResume"`
	OnTimeout  string `json:"onTimeout"` // kill or pause
}

type networkOut struct {
	AllowOut []string `json:"allowOut,omitempty"`
	DenyOut  []string `json:"denyOut,omitempty"`
	// What the create set of the sandbox's ports (ports.go).
	AllowPublicTraffic *bool  `json:"allowPublicTraffic,omitempty"`
	MaskRequestHost    string `json:"maskRequestHost,omitempty"`
	HTTPSPorts         []int  `json:"httpsPorts,omitempty"`
}

// newSandbox is the schema's NewSandbox (v1 and v2).
type newSandbox struct {
	TemplateID          string            `json:"templateID"`
	Timeout             *int64            `json:"timeout"`
	Metadata            map[string]string `json:"metadata"`
	EnvVars             map[string]string `json:"envVars"`
	AllowInternetAccess *bool             `json:"allow_internet_access"`
	Network             *networkConfig    `json:"network"`
	AutoPause           *bool             `json:"autoPause"`
	AutoPauseMemory     *bool             `json:"autoPauseMemory"`
	AutoResume          *struct {
		Enabled bool `json:"enabled"`
	} `json:"autoResume"`
	Secure       *bool             `json:"secure"`
	IAM          json.RawMessage   `json:"iam"`
	MCP          json.RawMessage   `json:"mcp"`
	VolumeMounts []json.RawMessage `json:"volumeMounts"`
}

// networkConfig is the schema's SandboxNetworkConfig and
// SandboxNetworkUpdateConfig.
type networkConfig struct {
	AllowOut            []string        `json:"allowOut"`
	DenyOut             []string        `json:"denyOut"`
	AllowInternetAccess *bool           `json:"allow_internet_access"` // the update's
	AllowPublicTraffic  *bool           `json:"allowPublicTraffic"`
	EgressProxy         json.RawMessage `json:"egressProxy"`
	HTTPSPorts          []int           `json:"httpsPorts"`
	MaskRequestHost     *string         `json:"maskRequestHost"`
	Rules               json.RawMessage `json:"rules"`
}

type timeoutRequest struct {
	Timeout *int64 `json:"timeout"`
}

type connectRequest struct {
	Timeout *int64 `json:"timeout"`
	Memory  *bool  `json:"memory"`
}

type pauseRequest struct {
	Memory *bool `json:"memory"`
}

type forkRequest struct {
	Count   *int64 `json:"count"`
	Timeout *int64 `json:"timeout"`
}

type forkResult struct {
	Sandbox *sandboxJSON `json:"sandbox,omitempty"`
	Error   *apiError    `json:"error,omitempty"`
}

type sandboxMetric struct {
	Timestamp     string  `json:"timestamp"`
	TimestampUnix int64   `json:"timestampUnix"`
	CPUCount      uint32  `json:"cpuCount"`
	CPUUsedPct    float64 `json:"cpuUsedPct"`
	MemUsed       uint64  `json:"memUsed"`
	MemTotal      uint64  `json:"memTotal"`
	MemCache      uint64  `json:"memCache"`
	DiskUsed      uint64  `json:"diskUsed"`
	DiskTotal     uint64  `json:"diskTotal"`
}

// requestID is a new kiln.v1 request ID: the SDK does not retry a
// create, so each is its own.
func requestID() string {
	b := make([]byte, 12)
	rand.Read(b) // never fails (crypto/rand)
	return "e2b-" + hex.EncodeToString(b)
}

// set reports whether an optional JSON value was given (and not null).
func set(raw json.RawMessage) bool {
	s := strings.TrimSpace(string(raw))
	return s != "" && s != "null"
}

// maxTimeout bounds a timeout in seconds (so that its milliseconds fit).
const maxTimeout = math.MaxInt64 / 1000 / 2

// lifetimeMS is a timeout field's lifetime in milliseconds.
func lifetimeMS(field string, secs *int64, def time.Duration) (int64, error) {
	if secs == nil {
		return def.Milliseconds(), nil
	}
	if *secs <= 0 || *secs > maxTimeout {
		return 0, errorf(http.StatusBadRequest, "%s %d: want a number of seconds above 0", field, *secs)
	}
	return *secs * 1000, nil
}

func isLive(st kilnpb.SandboxState) bool {
	switch st {
	case kilnpb.SandboxState_SANDBOX_STATE_STARTING, kilnpb.SandboxState_SANDBOX_STATE_RUNNING, kilnpb.SandboxState_SANDBOX_STATE_PAUSED:
		return true
	}
	return false
}

// stateName is a live sandbox's state as the API names it.
func stateName(sb *kilnpb.Sandbox) string {
	if sb.GetState() == kilnpb.SandboxState_SANDBOX_STATE_PAUSED {
		return "paused"
	}
	return "running"
}

// owned is sandbox id when it is live and tenant's; else not found, as
// for an unknown ID.
func (s *Server) owned(ctx context.Context, tenant, id string) (*kilnpb.Sandbox, error) {
	if id == "" || len(id) > 128 {
		return nil, notFound(id)
	}
	sb, err := s.kiln.GetSandbox(ctx, &kilnpb.GetSandboxRequest{Id: id})
	if status.Code(err) == codes.NotFound || err == nil && (sb.GetLabels()[TenantLabel] != tenant || !isLive(sb.GetState())) {
		return nil, notFound(id)
	}
	return sb, err
}

func (s *Server) domainPtr() *string {
	if s.domain == "" {
		return nil
	}
	d := s.domain
	return &d
}

// accessToken is sb's envd access token for r's caller (its API key).
func (s *Server) accessToken(r *http.Request, sb *kilnpb.Sandbox) string {
	c := callerOf(r)
	return s.tokens.token(sb.GetId(), c.tenant, c.key)
}

func (s *Server) sandboxJSON(r *http.Request, sb *kilnpb.Sandbox) *sandboxJSON {
	return &sandboxJSON{
		SandboxID:          sb.GetId(),
		TemplateID:         templateID(sb),
		ClientID:           ClientID,
		EnvdVersion:        envd.Version,
		EnvdAccessToken:    s.accessToken(r, sb),
		TrafficAccessToken: s.trafficToken(sb),
		Domain:             s.domainPtr(),
	}
}

// templateID is what a sandbox was created from, as its create named it.
func templateID(sb *kilnpb.Sandbox) string {
	if t := sb.GetLabels()[TemplateLabel]; t != "" {
		return t
	}
	if sb.GetTemplate() != "" {
		return sb.GetTemplate()
	}
	return sb.GetCheckpoint()
}

// metadata is a sandbox's labels less the reserved ones.
func metadata(labels map[string]string) map[string]string {
	out := map[string]string{}
	for k, v := range labels {
		if !strings.HasPrefix(k, LabelPrefix) {
			out[k] = v
		}
	}
	return out
}

// never is the endAt of a sandbox without a lifetime.
var never = time.Date(9999, 12, 31, 23, 59, 59, 0, time.UTC)

func rfc3339(ms int64) string {
	if ms == 0 {
		return never.Format(time.RFC3339)
	}
	return time.UnixMilli(ms).UTC().Format(time.RFC3339Nano)
}

func listed(sb *kilnpb.Sandbox) listedSandbox {
	res := sb.GetResources()
	disk := res.GetDiskMib()
	if disk == 0 {
		disk = res.GetMemoryMib() / 2 // a zero cap is half the guest's memory
	}
	return listedSandbox{
		SandboxID:    sb.GetId(),
		TemplateID:   templateID(sb),
		ClientID:     ClientID,
		EnvdVersion:  envd.Version,
		CPUCount:     res.GetCpus(),
		MemoryMB:     res.GetMemoryMib(),
		DiskSizeMB:   disk,
		StartedAt:    rfc3339(sb.GetCreatedUnixMs()),
		EndAt:        rfc3339(sb.GetExpiresUnixMs()),
		State:        stateName(sb),
		Metadata:     metadata(sb.GetLabels()),
		VolumeMounts: volumeMountsOut(sb),
	}
}

// checkMetadata refuses metadata that would pass for the layer's own
// labels.
func checkMetadata(field string, m map[string]string) error {
	for k := range m {
		if strings.HasPrefix(k, LabelPrefix) {
			return errorf(http.StatusBadRequest, "%s key %q: the prefix %q is reserved", field, k, LabelPrefix)
		}
	}
	return nil
}

// egressFrom maps E2B's network settings onto a Kiln egress policy; nil
// when they ask for nothing but the default (full access). Kiln's policy
// is an allow list or a deny list: a mix of both is refused, as is what
// Kiln does not do (rules, proxies, ports).
func egressFrom(allowInternet *bool, n *networkConfig) (*kilnpb.EgressPolicy, error) {
	if n == nil {
		n = &networkConfig{}
	}
	switch {
	case set(n.Rules):
		return nil, errorf(http.StatusBadRequest, "network.rules: Kiln does not rewrite sandboxes' requests")
	case set(n.EgressProxy):
		return nil, errorf(http.StatusBadRequest, "network.egressProxy: Kiln does not send egress through a proxy")
	}
	if allowInternet == nil {
		allowInternet = n.AllowInternetAccess
	}
	denyAll := allowInternet != nil && !*allowInternet
	var denyRest []string
	for _, d := range n.DenyOut {
		if d == "0.0.0.0/0" || d == "::/0" {
			denyAll = true
		} else {
			denyRest = append(denyRest, d)
		}
	}
	split := func(field string, list []string) (*kilnpb.EgressPolicy, error) {
		p := &kilnpb.EgressPolicy{}
		for i, e := range list {
			e = strings.TrimSpace(e)
			if e == "" {
				return nil, errorf(http.StatusBadRequest, "%s[%d] is empty", field, i)
			}
			if _, err := netip.ParsePrefix(e); err == nil {
				p.Cidrs = append(p.Cidrs, e)
			} else if _, err := netip.ParseAddr(e); err == nil {
				p.Cidrs = append(p.Cidrs, e)
			} else {
				p.Domains = append(p.Domains, e)
			}
		}
		return p, nil
	}
	switch {
	case denyAll && len(n.AllowOut) == 0:
		return &kilnpb.EgressPolicy{Mode: kilnpb.EgressPolicy_MODE_DENY_ALL}, nil
	case denyAll:
		p, err := split("network.allowOut", n.AllowOut)
		if err != nil {
			return nil, err
		}
		p.Mode = kilnpb.EgressPolicy_MODE_ALLOW_LIST
		return p, nil
	case len(denyRest) > 0 && len(n.AllowOut) > 0:
		return nil, errorf(http.StatusBadRequest, "network: allowOut with a denyOut that is not 0.0.0.0/0: Kiln's egress is an allow list (deny all but allowOut) or a deny list, not both")
	case len(denyRest) > 0:
		p, err := split("network.denyOut", denyRest)
		if err != nil {
			return nil, err
		}
		p.Mode = kilnpb.EgressPolicy_MODE_DENY_LIST
		return p, nil
	}
	return nil, nil
}

// egressErr says a refused egress policy is a bad request when kilnd
// has no networks for it.
func egressErr(err error) error {
	if st, ok := status.FromError(err); ok && st.Code() == codes.FailedPrecondition {
		return errorf(http.StatusBadRequest, "network settings: %s", st.Message())
	}
	return err
}

func (s *Server) createSandbox(w http.ResponseWriter, r *http.Request, tenant string) error {
	var req newSandbox
	if err := decodeBody(w, r, &req); err != nil {
		return err
	}
	if req.TemplateID == "" {
		return errorf(http.StatusBadRequest, "templateID is required")
	}
	switch {
	case req.AutoResume != nil && req.AutoResume.Enabled:
		return errorf(http.StatusBadRequest, "autoResume: Kiln resumes a paused sandbox on connect only")
	case set(req.IAM):
		return errorf(http.StatusBadRequest, "iam: Kiln issues no workload identity tokens")
	case set(req.MCP):
		return errorf(http.StatusBadRequest, "mcp: Kiln runs no MCP gateway")
	}
	if err := checkMetadata("metadata", req.Metadata); err != nil {
		return err
	}
	life, err := lifetimeMS("timeout", req.Timeout, s.defTimeout)
	if err != nil {
		return err
	}
	egress, err := egressFrom(req.AllowInternetAccess, req.Network)
	if err != nil {
		return err
	}
	creq := &kilnpb.CreateSandboxRequest{LifetimeMs: life, Egress: egress, RequestId: requestID()}
	var memMiB uint64 // the new sandbox's, for the tenant's quota
	if snap, ok := s.snaps.find(tenant, req.TemplateID); ok {
		creq.Source = &kilnpb.CreateSandboxRequest_Checkpoint{Checkpoint: snap.ID}
		memMiB = uint64(snap.MemoryMiB)
	} else {
		tp, err := s.kiln.GetTemplate(r.Context(), &kilnpb.GetTemplateRequest{Id: req.TemplateID})
		if status.Code(err) == codes.NotFound {
			return errorf(http.StatusNotFound, "template %q not found (neither a Kiln template's name or ID nor a snapshot of yours)", req.TemplateID)
		}
		if err != nil {
			return err
		}
		creq.Source = &kilnpb.CreateSandboxRequest_Template{Template: tp.GetId()}
		memMiB = uint64(tp.GetResources().GetMemoryMib())
	}
	creq.Labels, err = portLabels(req.Network)
	if err != nil {
		return err
	}
	creq.Labels[TenantLabel] = tenant
	creq.Labels[TemplateLabel] = req.TemplateID
	if creq.Volumes, err = s.volumeMounts(r, tenant, req.VolumeMounts, creq.Labels); err != nil {
		return err
	}
	for k, v := range req.Metadata {
		creq.Labels[k] = v
	}
	keys := make([]string, 0, len(req.EnvVars))
	for k := range req.EnvVars {
		if k == "" || strings.ContainsAny(k, "=\x00") {
			return errorf(http.StatusBadRequest, "envVars: %q is not a variable name", k)
		}
		keys = append(keys, k)
	}
	if len(keys) > maxEnvVars {
		return errorf(http.StatusBadRequest, "envVars: %d variables, at most %d", len(keys), maxEnvVars)
	}
	sort.Strings(keys)
	// envVars often hold API keys: they go to kilnd as plain secrets,
	// kept in memory only (kilnd's and the sandbox's VMM process's;
	// records, checkpoints and hibernated state name them only), not as
	// the sandbox's env, which its record keeps on disk. The cost: a
	// sandbox hibernated across a restart of kilnd, or created from a
	// snapshot, has no envVars but its own create's (docs/security.md).
	for _, k := range keys {
		creq.Secrets = append(creq.Secrets, &kilnpb.Secret{Name: k, Value: []byte(req.EnvVars[k]), Plain: true})
	}
	if req.AutoPause != nil && *req.AutoPause {
		creq.TimeoutAction = kilnpb.TimeoutAction_TIMEOUT_ACTION_HIBERNATE
		if req.AutoPauseMemory != nil && !*req.AutoPauseMemory {
			creq.TimeoutAction = kilnpb.TimeoutAction_TIMEOUT_ACTION_HIBERNATE_FILES
		}
	}
	admitted, err := s.admit(r.Context(), tenant, usage{Sandboxes: 1, MemoryMiB: memMiB})
	if err != nil {
		return err
	}
	defer admitted()
	sb, err := s.kiln.CreateSandbox(r.Context(), creq)
	if err != nil {
		if egress != nil {
			err = egressErr(err)
		}
		return err
	}
	s.log.Info("e2b: created a sandbox", "sandbox", sb.GetId(), "tenant", tenant, "template", req.TemplateID)
	writeJSON(w, http.StatusCreated, s.sandboxJSON(r, sb))
	return nil
}

// maxEnvVars is the most envVars a create takes: kilnd's most secrets.
const maxEnvVars = 64

// maxList is the most sandboxes a page lists.
const maxList = 100

// pythonSDK says r comes from E2B's Python SDK, by the lang header
// both SDKs send ("python"; the npm SDK's is "js").
func pythonSDK(r *http.Request) bool { return r.Header.Get("lang") == "python" }

// unescapePair undoes the encoding E2B's Python SDK gives each metadata
// key and value of a list's filter before it form-encodes the pairs
// (quote, then urlencode: one encoding more than the npm SDK's). E2B's
// API decodes a filter's pairs once more than a query string, which is
// right for the Python SDK only; this does it for the Python SDK, so
// that a value with a space, '@', '&' or '%' matches from both SDKs.
func unescapePair(k, v string) (string, string, error) {
	uk, err := url.QueryUnescape(k)
	if err != nil {
		return "", "", fmt.Errorf("key %q: %v", k, err)
	}
	uv, err := url.QueryUnescape(v)
	if err != nil {
		return "", "", fmt.Errorf("value %q: %v", v, err)
	}
	return uk, uv, nil
}

func (s *Server) listSandboxes(w http.ResponseWriter, r *http.Request, tenant string) error {
	q := r.URL.Query()
	labels := map[string]string{}
	if m := q.Get("metadata"); m != "" {
		mq, err := url.ParseQuery(m)
		if err != nil {
			return errorf(http.StatusBadRequest, "metadata %q: want URL-encoded key=value pairs: %v", m, err)
		}
		py := pythonSDK(r)
		for k, vs := range mq {
			v := vs[len(vs)-1]
			if py {
				if k, v, err = unescapePair(k, v); err != nil {
					return errorf(http.StatusBadRequest, "metadata %q: %v", m, err)
				}
			}
			labels[k] = v
		}
		if err := checkMetadata("metadata", labels); err != nil {
			return err
		}
	}
	labels[TenantLabel] = tenant
	wantRunning, wantPaused := true, true
	if st := q.Get("state"); st != "" {
		wantRunning, wantPaused = false, false
		for _, v := range strings.Split(st, ",") {
			switch strings.TrimSpace(v) {
			case "running":
				wantRunning = true
			case "paused":
				wantPaused = true
			default:
				return errorf(http.StatusBadRequest, "state %q: want running and/or paused", v)
			}
		}
	}
	var after time.Time
	if v := q.Get("startedAfter"); v != "" {
		t, err := time.Parse(time.RFC3339Nano, v)
		if err != nil {
			return errorf(http.StatusBadRequest, "startedAfter %q: want an RFC 3339 time", v)
		}
		after = t
	}
	limit := maxList
	if v := q.Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > maxList {
			return errorf(http.StatusBadRequest, "limit %q: want 1 to %d", v, maxList)
		}
		limit = n
	}
	desc := false
	switch q.Get("order") {
	case "", "asc":
	case "desc":
		desc = true
	default:
		return errorf(http.StatusBadRequest, "order %q: want asc or desc", q.Get("order"))
	}
	var cur *cursor
	if v := q.Get("nextToken"); v != "" {
		c, err := parseCursor(v)
		if err != nil {
			return err
		}
		cur = &c
	}
	tmpl := q.Get("template")

	resp, err := s.kiln.ListSandboxes(r.Context(), &kilnpb.ListSandboxesRequest{Labels: labels})
	if err != nil {
		return err
	}
	sbs := resp.GetSandboxes()
	// Oldest first, by creation then ID, as kilnd lists them: a stable
	// order, which the page cursor is a place in.
	less := func(a, b cursor) bool {
		if a.ms != b.ms {
			return a.ms < b.ms
		}
		return a.id < b.id
	}
	sort.SliceStable(sbs, func(i, j int) bool {
		ci, cj := cursorOf(sbs[i]), cursorOf(sbs[j])
		if desc {
			return less(cj, ci)
		}
		return less(ci, cj)
	})
	out := []listedSandbox{}
	var next string
	for _, sb := range sbs {
		c := cursorOf(sb)
		if cur != nil && (!desc && !less(*cur, c) || desc && !less(c, *cur)) {
			continue
		}
		paused := sb.GetState() == kilnpb.SandboxState_SANDBOX_STATE_PAUSED
		if paused && !wantPaused || !paused && !wantRunning {
			continue
		}
		if !after.IsZero() && !time.UnixMilli(sb.GetCreatedUnixMs()).After(after) {
			continue
		}
		if tmpl != "" && tmpl != templateID(sb) && tmpl != sb.GetTemplate() {
			continue
		}
		if len(out) == limit {
			next = out[len(out)-1].cursor()
			break
		}
		out = append(out, listed(sb))
	}
	if next != "" {
		w.Header().Set("X-Next-Token", next)
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

// cursor is a place in the sandboxes' order: a page's last one.
type cursor struct {
	ms int64
	id string
}

func cursorOf(sb *kilnpb.Sandbox) cursor { return cursor{sb.GetCreatedUnixMs(), sb.GetId()} }

func (l listedSandbox) cursor() string {
	t, _ := time.Parse(time.RFC3339Nano, l.StartedAt)
	return base64.RawURLEncoding.EncodeToString([]byte(strconv.FormatInt(t.UnixMilli(), 10) + ":" + l.SandboxID))
}

func parseCursor(v string) (cursor, error) {
	bad := errorf(http.StatusBadRequest, "nextToken %q is not one this API gave out", v)
	b, err := base64.RawURLEncoding.DecodeString(v)
	if err != nil {
		return cursor{}, bad
	}
	ms, id, ok := strings.Cut(string(b), ":")
	n, err := strconv.ParseInt(ms, 10, 64)
	if !ok || err != nil || id == "" {
		return cursor{}, bad
	}
	return cursor{n, id}, nil
}

func (s *Server) getSandbox(w http.ResponseWriter, r *http.Request, tenant string) error {
	sb, err := s.owned(r.Context(), tenant, r.PathValue("id"))
	if err != nil {
		return err
	}
	d := sandboxDetail{
		listedSandbox:   listed(sb),
		EnvdAccessToken: s.accessToken(r, sb),
		Domain:          s.domainPtr(),
		Lifecycle:       lifecycle{OnTimeout: "kill"},
	}
	if sb.GetTimeoutAction() == kilnpb.TimeoutAction_TIMEOUT_ACTION_HIBERNATE {
		d.Lifecycle.OnTimeout = "pause"
	}
	if n := sb.GetNetwork(); n != nil {
		eg := n.GetEgress()
		allow := eg.GetMode() != kilnpb.EgressPolicy_MODE_DENY_ALL && eg.GetMode() != kilnpb.EgressPolicy_MODE_ALLOW_LIST
		d.AllowInternetAccess = &allow
		list := append(append([]string(nil), eg.GetCidrs()...), eg.GetDomains()...)
		switch eg.GetMode() {
		case kilnpb.EgressPolicy_MODE_ALLOW_LIST:
			d.Network = &networkOut{AllowOut: list, DenyOut: []string{"0.0.0.0/0"}}
		case kilnpb.EgressPolicy_MODE_DENY_LIST:
			d.Network = &networkOut{DenyOut: list}
		case kilnpb.EgressPolicy_MODE_DENY_ALL:
			d.Network = &networkOut{DenyOut: []string{"0.0.0.0/0"}}
		}
	}
	if l := sb.GetLabels(); l[PrivateTrafficLabel] != "" || l[MaskHostLabel] != "" || l[HTTPSPortsLabel] != "" {
		if d.Network == nil {
			d.Network = &networkOut{}
		}
		public := l[PrivateTrafficLabel] != "true"
		d.Network.AllowPublicTraffic, d.Network.MaskRequestHost, d.Network.HTTPSPorts = &public, l[MaskHostLabel], httpsPorts(sb)
	}
	writeJSON(w, http.StatusOK, d)
	return nil
}

func (s *Server) killSandbox(w http.ResponseWriter, r *http.Request, tenant string) error {
	sb, err := s.owned(r.Context(), tenant, r.PathValue("id"))
	if err != nil {
		return err
	}
	if _, err := s.kiln.DestroySandbox(r.Context(), &kilnpb.DestroySandboxRequest{Id: sb.GetId()}); err != nil {
		if status.Code(err) == codes.NotFound {
			return notFound(sb.GetId())
		}
		return err
	}
	s.log.Info("e2b: killed a sandbox", "sandbox", sb.GetId(), "tenant", tenant)
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (s *Server) setTimeout(w http.ResponseWriter, r *http.Request, tenant string) error {
	var req timeoutRequest
	if err := decodeBody(w, r, &req); err != nil {
		return err
	}
	if req.Timeout == nil {
		return errorf(http.StatusBadRequest, "timeout is required")
	}
	life, err := lifetimeMS("timeout", req.Timeout, 0)
	if err != nil {
		return err
	}
	sb, err := s.owned(r.Context(), tenant, r.PathValue("id"))
	if err != nil {
		return err
	}
	if _, err := s.kiln.UpdateSandbox(r.Context(), &kilnpb.UpdateSandboxRequest{Id: sb.GetId(), LifetimeMs: proto.Int64(life)}); err != nil {
		return err
	}
	s.log.Debug("e2b: set a sandbox's timeout", "sandbox", sb.GetId(), "seconds", *req.Timeout)
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (s *Server) pauseSandbox(w http.ResponseWriter, r *http.Request, tenant string) error {
	var req pauseRequest
	if err := decodeBody(w, r, &req); err != nil {
		return err
	}
	sb, err := s.owned(r.Context(), tenant, r.PathValue("id"))
	if err != nil {
		return err
	}
	if sb.GetState() == kilnpb.SandboxState_SANDBOX_STATE_PAUSED {
		return errorf(http.StatusConflict, "sandbox %q is already paused", sb.GetId())
	}
	admitted, err := s.admit(r.Context(), tenant, usage{HibernatedMiB: hibernatedMiB(sb)})
	if err != nil {
		return err
	}
	defer admitted()
	// memory false keeps the files only: the VMM process goes, and a
	// connect boots the image again with them.
	filesOnly := req.Memory != nil && !*req.Memory
	if _, err := s.kiln.PauseSandbox(r.Context(), &kilnpb.PauseSandboxRequest{Id: sb.GetId(), Hibernate: true, FilesOnly: filesOnly}); err != nil {
		return err
	}
	s.log.Info("e2b: paused a sandbox", "sandbox", sb.GetId(), "tenant", tenant, "files_only", filesOnly)
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (s *Server) connectSandbox(w http.ResponseWriter, r *http.Request, tenant string) error {
	var req connectRequest
	if err := decodeBody(w, r, &req); err != nil {
		return err
	}
	var life int64
	if req.Timeout != nil {
		var err error
		if life, err = lifetimeMS("timeout", req.Timeout, 0); err != nil {
			return err
		}
	}
	sb, err := s.owned(r.Context(), tenant, r.PathValue("id"))
	if err != nil {
		return err
	}
	if req.Memory != nil && !*req.Memory && !sb.GetFilesOnly() {
		return errorf(http.StatusBadRequest, "memory=false (reboot on resume): Kiln boots on resume only a sandbox paused with memory false; this one resumes with its memory")
	}
	code := http.StatusOK
	if sb.GetState() == kilnpb.SandboxState_SANDBOX_STATE_PAUSED {
		admitted, err := s.admit(r.Context(), tenant, usage{MemoryMiB: uint64(sb.GetResources().GetMemoryMib())})
		if err != nil {
			return err
		}
		sb, err = s.kiln.ResumeSandbox(r.Context(), &kilnpb.ResumeSandboxRequest{Id: sb.GetId()})
		admitted()
		if err != nil {
			return err
		}
		code = http.StatusCreated
		s.log.Info("e2b: resumed a sandbox", "sandbox", sb.GetId(), "tenant", tenant)
	}
	// A connect extends the sandbox's life to the timeout from now; it
	// never shortens it.
	if life > 0 {
		until := s.now().UnixMilli() + life
		if exp := sb.GetExpiresUnixMs(); exp != 0 && exp < until {
			if sb, err = s.kiln.UpdateSandbox(r.Context(), &kilnpb.UpdateSandboxRequest{Id: sb.GetId(), LifetimeMs: proto.Int64(life)}); err != nil {
				return err
			}
		}
	}
	writeJSON(w, code, s.sandboxJSON(r, sb))
	return nil
}

func (s *Server) forkSandbox(w http.ResponseWriter, r *http.Request, tenant string) error {
	count, life, err := decodeFork(w, r, s.defTimeout)
	if err != nil {
		return err
	}
	parent, err := s.owned(r.Context(), tenant, r.PathValue("id"))
	if err != nil {
		return err
	}
	// A paused sandbox (hibernated: E2B's pause) forks from its saved
	// state; kilnd says so when it cannot.
	return s.fork(w, r, tenant, count, parent.GetResources().GetMemoryMib(), &kilnpb.ForkRequest{
		Source: &kilnpb.ForkRequest_SandboxId{SandboxId: parent.GetId()},
		Count:  uint32(count), Labels: parent.GetLabels(), LifetimeMs: life, RequestId: requestID(),
	}, "sandbox "+parent.GetId())
}

// forkSnapshot is POST /snapshots/{id}/fork: count sandboxes restored
// from one of the tenant's snapshots at once, as creates from it would
// be, with the fork's E2B-shaped result per child.
func (s *Server) forkSnapshot(w http.ResponseWriter, r *http.Request, tenant string) error {
	count, life, err := decodeFork(w, r, s.defTimeout)
	if err != nil {
		return err
	}
	snap, ok := s.snaps.find(tenant, r.PathValue("id"))
	if !ok {
		return errorf(http.StatusNotFound, "snapshot %q not found", r.PathValue("id"))
	}
	return s.fork(w, r, tenant, count, snap.MemoryMiB, &kilnpb.ForkRequest{
		Source: &kilnpb.ForkRequest_CheckpointId{CheckpointId: snap.ID},
		Count:  uint32(count), Labels: map[string]string{TenantLabel: tenant, TemplateLabel: snap.ID},
		LifetimeMs: life, RequestId: requestID(),
	}, "snapshot "+snap.ID)
}

// decodeFork reads a fork's body: its count (1 to 256, 1 when none) and
// its children's lifetime in milliseconds.
func decodeFork(w http.ResponseWriter, r *http.Request, def time.Duration) (int64, int64, error) {
	var req forkRequest
	if err := decodeBody(w, r, &req); err != nil {
		return 0, 0, err
	}
	count := int64(1)
	if req.Count != nil {
		count = *req.Count
	}
	if count < 1 || count > 256 {
		return 0, 0, errorf(http.StatusBadRequest, "count %d: want 1 to 256 children", count)
	}
	life, err := lifetimeMS("timeout", req.Timeout, def)
	return count, life, err
}

// fork admits count children of memMiB each for tenant, makes them with
// freq and writes the result per child: a sandbox, or the error that
// ended the fork before it started.
func (s *Server) fork(w http.ResponseWriter, r *http.Request, tenant string, count int64, memMiB uint32, freq *kilnpb.ForkRequest, what string) error {
	admitted, err := s.admit(r.Context(), tenant, usage{Sandboxes: uint64(count), MemoryMiB: uint64(count) * uint64(memMiB)})
	if err != nil {
		return err
	}
	defer admitted()
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	stream, err := s.kiln.Fork(ctx, freq)
	if err != nil {
		return err
	}
	var out []forkResult
	for int64(len(out)) < count {
		child, err := stream.Recv()
		if err == io.EOF {
			err = status.Error(codes.Internal, "the fork ended before all its children started")
		}
		if err != nil {
			if len(out) == 0 {
				return err
			}
			code, msg := statusOf(err)
			for int64(len(out)) < count {
				out = append(out, forkResult{Error: &apiError{Code: code, Message: msg}})
			}
			break
		}
		out = append(out, forkResult{Sandbox: s.sandboxJSON(r, child)})
	}
	ids := make([]string, 0, len(out))
	for _, f := range out {
		if f.Sandbox != nil {
			ids = append(ids, f.Sandbox.SandboxID)
		}
	}
	s.log.Info("e2b: forked", "from", what, "tenant", tenant, "children", ids)
	writeJSON(w, http.StatusCreated, out)
	return nil
}

func (s *Server) sandboxMetrics(w http.ResponseWriter, r *http.Request, tenant string) error {
	q := r.URL.Query()
	unix := func(k string) (int64, error) {
		v := q.Get(k)
		if v == "" {
			return 0, nil
		}
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 0 || n > maxTimeout {
			return 0, errorf(http.StatusBadRequest, "%s %q: want Unix seconds", k, v)
		}
		return n, nil
	}
	start, err := unix("start")
	if err != nil {
		return err
	}
	end, err := unix("end")
	if err != nil {
		return err
	}
	sb, err := s.owned(r.Context(), tenant, r.PathValue("id"))
	if err != nil {
		return err
	}
	out := []sandboxMetric{}
	if sb.GetState() != kilnpb.SandboxState_SANDBOX_STATE_RUNNING {
		writeJSON(w, http.StatusOK, out) // a paused sandbox has no samples
		return nil
	}
	resp, err := s.kiln.GetSandboxMetrics(r.Context(), &kilnpb.GetSandboxMetricsRequest{Id: sb.GetId(), SinceUnixMs: start * 1000})
	if err != nil {
		return err
	}
	for _, m := range resp.GetSamples() {
		if m.GetUnixMs() < start*1000 || end > 0 && m.GetUnixMs() > end*1000+999 {
			continue
		}
		out = append(out, sandboxMetric{
			Timestamp:     time.UnixMilli(m.GetUnixMs()).UTC().Format(time.RFC3339Nano),
			TimestampUnix: m.GetUnixMs() / 1000,
			CPUCount:      m.GetCpuCount(),
			CPUUsedPct:    m.GetCpuUsedPct(),
			MemUsed:       m.GetMemUsedBytes(),
			MemTotal:      m.GetMemTotalBytes(),
			DiskUsed:      m.GetDiskUsedBytes(),
			DiskTotal:     m.GetDiskTotalBytes(),
		})
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

func (s *Server) updateNetwork(w http.ResponseWriter, r *http.Request, tenant string) error {
	var req networkConfig
	if err := decodeBody(w, r, &req); err != nil {
		return err
	}
	egress, err := egressFrom(nil, &req)
	if err != nil {
		return err
	}
	if req.AllowPublicTraffic != nil || req.MaskRequestHost != nil {
		return errorf(http.StatusBadRequest, "network.allowPublicTraffic and maskRequestHost are a create's: a running sandbox's stay")
	}
	if egress == nil {
		egress = &kilnpb.EgressPolicy{Mode: kilnpb.EgressPolicy_MODE_ALLOW_ALL}
	}
	sb, err := s.owned(r.Context(), tenant, r.PathValue("id"))
	if err != nil {
		return err
	}
	if _, err := s.kiln.UpdateNetworkPolicy(r.Context(), &kilnpb.UpdateNetworkPolicyRequest{Id: sb.GetId(), Egress: egress}); err != nil {
		return egressErr(err)
	}
	s.log.Info("e2b: updated a sandbox's network policy", "sandbox", sb.GetId(), "tenant", tenant, "mode", egress.GetMode().String())
	w.WriteHeader(http.StatusNoContent)
	return nil
}
