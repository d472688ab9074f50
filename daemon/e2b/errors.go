package e2b

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// apiError is the control plane's error body, as the SDK reads it: code
// is the HTTP status (the SDK tells not-found and already-paused apart
// by it).
type apiError struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
}

// httpError is an error with its HTTP status.
type httpError struct {
	status int
	msg    string
}

func (e *httpError) Error() string { return e.msg }

func errorf(status int, format string, args ...any) error {
	return &httpError{status: status, msg: fmt.Sprintf(format, args...)}
}

// notFound is the answer for an unknown sandbox, and for another
// tenant's: the same, so that IDs of others cannot be probed.
func notFound(id string) error {
	return errorf(http.StatusNotFound, "sandbox %q not found", id)
}

// statusOf maps an error to its HTTP status and message: kiln.v1's gRPC
// codes to the statuses the SDK knows.
func statusOf(err error) (int, string) {
	var he *httpError
	if errors.As(err, &he) {
		return he.status, he.msg
	}
	var qe *QuotaError
	if errors.As(err, &qe) {
		// The tenant's own quota: E2B's answer to a tenant at its
		// limit of sandboxes.
		return http.StatusTooManyRequests, qe.Error()
	}
	st, ok := status.FromError(err)
	if !ok {
		return http.StatusInternalServerError, err.Error()
	}
	if st.Code() == codes.ResourceExhausted {
		// A host limit: kilnd's message counts the host's sandboxes
		// and memory, every tenant's together, which is not a
		// tenant's to learn (the operator's log has it).
		return httpStatus(st.Code()), hostCapacity
	}
	return httpStatus(st.Code()), st.Message()
}

// hostCapacity is what a tenant is told of a request refused for the
// host's limits.
const hostCapacity = "capacity: the host has no room for this request now; try again later"

// httpStatus is a gRPC code's HTTP status.
func httpStatus(c codes.Code) int {
	switch c {
	case codes.OK:
		return http.StatusOK
	case codes.InvalidArgument, codes.OutOfRange:
		return http.StatusBadRequest
	case codes.NotFound:
		return http.StatusNotFound
	case codes.AlreadyExists, codes.FailedPrecondition, codes.Aborted:
		return http.StatusConflict
	case codes.PermissionDenied:
		return http.StatusForbidden
	case codes.Unauthenticated:
		return http.StatusUnauthorized
	case codes.ResourceExhausted, codes.Unavailable:
		// 429 would make the SDK retry after Retry-After; kilnd cannot
		// say when a host limit frees up, so: busy.
		return http.StatusServiceUnavailable
	case codes.DeadlineExceeded:
		return http.StatusGatewayTimeout
	case codes.Canceled:
		return http.StatusRequestTimeout
	case codes.Unimplemented:
		return http.StatusNotImplemented
	}
	return http.StatusInternalServerError
}

// writeJSON answers v with status.
func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		status, b = http.StatusInternalServerError, []byte(`{"code":500,"message":"encoding the reply failed"}`)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	w.Write(append(b, '\n'))
}

// writeError answers err as the SDK expects it.
func writeError(w http.ResponseWriter, err error) {
	code, msg := statusOf(err)
	writeJSON(w, code, apiError{Code: code, Message: msg})
}

// connectError is envd's (Connect protocol) error body.
type connectError struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

func writeConnectError(w http.ResponseWriter, status int, code, msg string) {
	writeJSON(w, status, connectError{Code: code, Message: msg})
}

// maxBody bounds a request body.
const maxBody = 1 << 20

// decodeBody decodes r's JSON body into v. An empty body leaves v as it
// is; unknown fields are ignored; bad JSON is a 400 naming the field.
func decodeBody(w http.ResponseWriter, r *http.Request, v any) error {
	body := http.MaxBytesReader(w, r.Body, maxBody)
	b, err := io.ReadAll(body)
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return errorf(http.StatusRequestEntityTooLarge, "the request body is over %d bytes", maxBody)
		}
		return errorf(http.StatusBadRequest, "reading the request body: %v", err)
	}
	return decodeJSON(b, v)
}

// decodeJSON is decodeBody over the body's bytes.
func decodeJSON(b []byte, v any) error {
	if len(strings.TrimSpace(string(b))) == 0 {
		return nil
	}
	dec := json.NewDecoder(strings.NewReader(string(b)))
	if err := dec.Decode(v); err != nil {
		var te *json.UnmarshalTypeError
		var se *json.SyntaxError
		switch {
		case errors.As(err, &te):
			field := te.Field
			if field == "" {
				field = "the body"
			}
			return errorf(http.StatusBadRequest, "bad request body: %s: want %s, not a JSON %s", field, te.Type, te.Value)
		case errors.As(err, &se):
			return errorf(http.StatusBadRequest, "bad request body: invalid JSON at byte %d: %v", se.Offset, err)
		}
		var fe *fieldError
		if errors.As(err, &fe) {
			return errorf(http.StatusBadRequest, "bad request body: %s", fe)
		}
		return errorf(http.StatusBadRequest, "bad request body: %v", err)
	}
	if dec.More() {
		return errorf(http.StatusBadRequest, "bad request body: more than one JSON value")
	}
	return nil
}

// fieldError is a decoded value's error, naming its field.
type fieldError struct {
	field string
	err   error
}

func (e *fieldError) Error() string { return e.field + ": " + e.err.Error() }
