// Package envd serves E2B's in-sandbox API (envd) for Kiln sandboxes: the
// Connect RPC services process.Process and filesystem.Filesystem, /files
// and /health, translated onto kiln.v1 calls. No E2B code runs in the
// guest: Kiln's own agent does the work. The caller (package e2b) routes a
// request to a sandbox and checks its access token first.
package envd

import (
	"log/slog"
	"net/http"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// Version is the envd version Kiln reports to SDKs: the highest whose
// features it implements (the SDK gates features on it).
const Version = "0.4.0"

// Handler serves envd for every sandbox of one kilnd.
type Handler struct {
	kiln kilnpb.KilnClient
	log  *slog.Logger
}

// New returns a Handler that reaches sandboxes through kiln.
func New(kiln kilnpb.KilnClient, log *slog.Logger) *Handler {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Handler{kiln: kiln, log: log}
}

// Serve answers one envd request for sandbox id, which the caller has
// authorized.
func (h *Handler) Serve(w http.ResponseWriter, r *http.Request, id string) {
	http.Error(w, "envd is not served yet", http.StatusNotImplemented)
}
