package e2b

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"strconv"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// E2B's volumes are kilnd's (kiln.v1 CreateVolume): a tenant's carry its
// TenantLabel and their E2B name in VolumeNameLabel, unique among the
// tenant's. A sandbox mounts one by name (NewSandbox.volumeMounts),
// read-write, as E2B's volumes are: a volume is in one sandbox at a time
// (the next create that names it is a 409 until that sandbox has ended).
// Its files are reached through the sandboxes that mount it: the volume
// content API (/volumecontent/...) is not served.

// VolumeNameLabel is a kilnd volume's E2B name; VolumeMountLabel+N is the
// E2B name of a sandbox's Nth volume (kiln.v1 describes it by ID).
const (
	VolumeNameLabel  = LabelPrefix + "volume-name"
	VolumeMountLabel = LabelPrefix + "volume-"
)

// maxVolumeName bounds an E2B volume's name.
const maxVolumeName = 63

// volumeInfo is the schema's Volume; volumeAndToken its VolumeAndToken.
type volumeInfo struct {
	VolumeID string `json:"volumeID"`
	Name     string `json:"name"`
}

type volumeAndToken struct {
	volumeInfo
	Token string `json:"token"`
}

// volumeMount is the schema's SandboxVolumeMount.
type volumeMount struct {
	Name string `json:"name"`
	Path string `json:"path"`
}

// checkVolumeName refuses a name E2B's would not be: 1 to 63 letters,
// digits, '-' and '_'.
func checkVolumeName(name string) error {
	if name == "" || len(name) > maxVolumeName {
		return errorf(http.StatusBadRequest, "volume name %q: want 1 to %d characters", name, maxVolumeName)
	}
	for _, c := range name {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return errorf(http.StatusBadRequest, "volume name %q: only letters, digits, '-' and '_'", name)
		}
	}
	return nil
}

// volumeToken is volume id's token for the volume content API: an HMAC
// of its ID, as a sandbox's traffic token is.
func (t *tokens) volumeToken(id string) string {
	m := hmac.New(sha256.New, t.key)
	m.Write([]byte("kiln-e2b-volume-v1\x00"))
	m.Write([]byte(id))
	return base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

func (s *Server) volumeOut(v *kilnpb.Volume) volumeAndToken {
	return volumeAndToken{volumeInfo{VolumeID: v.GetId(), Name: v.GetLabels()[VolumeNameLabel]}, s.tokens.volumeToken(v.GetId())}
}

// tenantVolumes are the tenant's volumes, those named name when it is
// set.
func (s *Server) tenantVolumes(r *http.Request, tenant, name string) ([]*kilnpb.Volume, error) {
	want := map[string]string{TenantLabel: tenant}
	if name != "" {
		want[VolumeNameLabel] = name
	}
	resp, err := s.kiln.ListVolumes(r.Context(), &kilnpb.ListVolumesRequest{Labels: want})
	if err != nil {
		return nil, err
	}
	return resp.GetVolumes(), nil
}

// tenantVolume is the tenant's volume id: another tenant's is not found,
// as an unknown one is.
func (s *Server) tenantVolume(r *http.Request, tenant, id string) (*kilnpb.Volume, error) {
	v, err := s.kiln.GetVolume(r.Context(), &kilnpb.GetVolumeRequest{Id: id})
	if status.Code(err) == codes.NotFound || status.Code(err) == codes.InvalidArgument || err == nil && v.GetLabels()[TenantLabel] != tenant {
		return nil, errorf(http.StatusNotFound, "volume %q not found", id)
	}
	return v, err
}

// createVolume is POST /volumes.
func (s *Server) createVolume(w http.ResponseWriter, r *http.Request, tenant string) error {
	var req struct {
		Name string `json:"name"`
	}
	if err := decodeBody(w, r, &req); err != nil {
		return err
	}
	if err := checkVolumeName(req.Name); err != nil {
		return err
	}
	// One create per name at a time: the check and the create are one
	// step under the lock, so that two racing creates make one volume.
	s.volumeMu.Lock()
	defer s.volumeMu.Unlock()
	if vs, err := s.tenantVolumes(r, tenant, req.Name); err != nil {
		return err
	} else if len(vs) > 0 {
		return errorf(http.StatusConflict, "volume %q already exists (%s)", req.Name, vs[0].GetId())
	}
	v, err := s.kiln.CreateVolume(r.Context(), &kilnpb.CreateVolumeRequest{Labels: map[string]string{TenantLabel: tenant, VolumeNameLabel: req.Name}})
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, s.volumeOut(v))
	return nil
}

// listVolumes is GET /volumes.
func (s *Server) listVolumes(w http.ResponseWriter, r *http.Request, tenant string) error {
	vs, err := s.tenantVolumes(r, tenant, "")
	if err != nil {
		return err
	}
	out := []volumeInfo{}
	for _, v := range vs {
		out = append(out, s.volumeOut(v).volumeInfo)
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

// getVolume is GET /volumes/{id}.
func (s *Server) getVolume(w http.ResponseWriter, r *http.Request, tenant string) error {
	v, err := s.tenantVolume(r, tenant, r.PathValue("id"))
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, s.volumeOut(v))
	return nil
}

// deleteVolume is DELETE /volumes/{id}: a 409 while a sandbox that has
// not ended (a paused one included) mounts it.
func (s *Server) deleteVolume(w http.ResponseWriter, r *http.Request, tenant string) error {
	v, err := s.tenantVolume(r, tenant, r.PathValue("id"))
	if err != nil {
		return err
	}
	if _, err := s.kiln.DeleteVolume(r.Context(), &kilnpb.DeleteVolumeRequest{Id: v.GetId()}); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// volumeContentHandler answers the volume content API (its calls carry
// a volume's token, not an API key): not served, and says so.
func (s *Server) volumeContentHandler(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusNotImplemented, apiError{Code: http.StatusNotImplemented,
		Message: "the volume content API is not served by Kiln: read and write a volume's files in a sandbox that mounts it"})
}

// volumeMounts resolves a create's volumeMounts (by the tenant's volume
// names) to kiln.v1's, and the labels that keep their names.
func (s *Server) volumeMounts(r *http.Request, tenant string, raw []json.RawMessage, labels map[string]string) ([]*kilnpb.VolumeMount, error) {
	var out []*kilnpb.VolumeMount
	for i, b := range raw {
		var m volumeMount
		if err := json.Unmarshal(b, &m); err != nil {
			return nil, errorf(http.StatusBadRequest, "volumeMounts[%d]: %v", i, err)
		}
		if err := checkVolumeName(m.Name); err != nil {
			return nil, errorf(http.StatusBadRequest, "volumeMounts[%d]: %s", i, err.Error())
		}
		vs, err := s.tenantVolumes(r, tenant, m.Name)
		if err != nil {
			return nil, err
		}
		if len(vs) == 0 {
			return nil, errorf(http.StatusNotFound, "volumeMounts[%d]: volume %q not found", i, m.Name)
		}
		out = append(out, &kilnpb.VolumeMount{Volume: vs[0].GetId(), Path: m.Path})
		labels[VolumeMountLabel+strconv.Itoa(i)] = m.Name
	}
	return out, nil
}

// volumeMountsOut is a sandbox's volumes as E2B describes them.
func volumeMountsOut(sb *kilnpb.Sandbox) []volumeMount {
	var out []volumeMount
	for i, v := range sb.GetVolumes() {
		out = append(out, volumeMount{Name: sb.GetLabels()[VolumeMountLabel+strconv.Itoa(i)], Path: v.GetPath()})
	}
	return out
}
