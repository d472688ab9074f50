package envd

import (
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"mime/multipart"
	"net/http"
	"path"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// writeChunk is the size of the WriteFile messages an upload is cut into.
const writeChunk = 256 << 10

// serveFiles is /files: GET downloads a file, POST uploads files.
func (h *Handler) serveFiles(w http.ResponseWriter, r *http.Request) {
	switch r.Method {
	case http.MethodGet, http.MethodHead:
		h.download(w, r)
	case http.MethodPost, http.MethodPut:
		h.upload(w, r)
	default:
		w.Header().Set("Allow", "GET, HEAD, POST, PUT")
		httpError(w, http.StatusMethodNotAllowed, r.Method+" /files: want GET or POST")
	}
}

// filesUser is the user a /files request acts as: the username
// parameter, else the Basic authorization's user.
func filesUser(r *http.Request) (string, error) {
	if u := r.URL.Query().Get("username"); u != "" {
		if err := checkUser(u); err != nil {
			return "", fmt.Errorf("username: %w", err)
		}
		return u, nil
	}
	return userFromAuth(r.Header)
}

// httpStatus is the HTTP status of a kiln.v1 call's error.
func httpStatus(err error) int {
	switch status.Code(err) {
	case codes.NotFound:
		return http.StatusNotFound
	case codes.InvalidArgument, codes.FailedPrecondition, codes.OutOfRange:
		return http.StatusBadRequest
	case codes.AlreadyExists:
		return http.StatusConflict
	case codes.PermissionDenied:
		return http.StatusForbidden
	case codes.Unauthenticated:
		return http.StatusUnauthorized
	case codes.ResourceExhausted:
		return http.StatusInsufficientStorage
	case codes.Unavailable:
		return http.StatusBadGateway
	case codes.DeadlineExceeded:
		return http.StatusGatewayTimeout
	}
	return http.StatusInternalServerError
}

func kilnHTTPError(w http.ResponseWriter, what string, err error) {
	msg := err.Error()
	if st, ok := status.FromError(err); ok {
		msg = st.Message()
	}
	httpError(w, httpStatus(err), what+": "+msg)
}

// download streams a file of the sandbox.
func (h *Handler) download(w http.ResponseWriter, r *http.Request) {
	ctx, id := r.Context(), sandboxOf(r.Context())
	user, err := filesUser(r)
	if err != nil {
		httpError(w, http.StatusUnauthorized, err.Error())
		return
	}
	q := r.URL.Query().Get("path")
	if q == "" {
		httpError(w, http.StatusBadRequest, "GET /files: path is missing")
		return
	}
	p, err := resolvePath(q, h.home(ctx, id, user))
	if err != nil {
		httpError(w, http.StatusBadRequest, err.Error())
		return
	}
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := h.kiln.ReadFile(rctx, &kilnpb.ReadFileRequest{SandboxId: id, Path: p})
	var first *kilnpb.FileChunk
	if err == nil {
		first, err = stream.Recv()
	}
	if err != nil && err != io.EOF {
		kilnHTTPError(w, "read "+p, err)
		return
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Disposition", mime.FormatMediaType("attachment", map[string]string{"filename": path.Base(p)}))
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(http.StatusOK)
	if err == io.EOF {
		return // an empty file
	}
	if _, err := w.Write(first.GetData()); err != nil {
		return
	}
	for {
		c, err := stream.Recv()
		if err == io.EOF {
			return
		}
		if err != nil {
			// The status is sent: only cutting the connection tells the
			// client the body is short (net/http's way to abort).
			h.log.Debug("a download broke off", "sandbox", id, "path", p, "err", err)
			panic(http.ErrAbortHandler)
		}
		if _, err := w.Write(c.GetData()); err != nil {
			return
		}
	}
}

// uploaded is one file of an upload's reply.
type uploaded struct {
	Name string `json:"name"`
	Type string `json:"type"`
	Path string `json:"path"`
}

// errTooLarge is an upload past Limits.MaxUpload.
var errTooLarge = errors.New("the upload is too large")

// capReader fails with errTooLarge past n bytes.
type capReader struct {
	r io.Reader
	n int64
}

func (c *capReader) Read(p []byte) (int, error) {
	if c.n < 0 {
		return 0, errTooLarge
	}
	if int64(len(p)) > c.n+1 {
		p = p[:c.n+1]
	}
	n, err := c.r.Read(p)
	c.n -= int64(n)
	if c.n < 0 {
		return n, errTooLarge
	}
	return n, err
}

// uploadError is a bad upload body: the client's fault.
type uploadError struct {
	code int
	err  error
}

func (e *uploadError) Error() string { return e.err.Error() }
func (e *uploadError) Unwrap() error { return e.err }

// bodyReader marks an error reading the request's body as the client's:
// too large, or a bad body.
type bodyReader struct{ r io.Reader }

func (b bodyReader) Read(p []byte) (int, error) {
	n, err := b.r.Read(p)
	var ue *uploadError
	if err != nil && err != io.EOF && !errors.As(err, &ue) {
		code := http.StatusBadRequest
		if errors.Is(err, errTooLarge) {
			code = http.StatusRequestEntityTooLarge
		}
		err = &uploadError{code, err}
	}
	return n, err
}

// upload writes the files of a request: multipart/form-data (one part
// per file; a part's filename is its destination when path is not
// given) or the body itself (application/octet-stream), either maybe
// gzip-compressed (Content-Encoding). Nothing is held whole in memory.
func (h *Handler) upload(w http.ResponseWriter, r *http.Request) {
	ctx, id := r.Context(), sandboxOf(r.Context())
	user, err := filesUser(r)
	if err != nil {
		httpError(w, http.StatusUnauthorized, err.Error())
		return
	}
	home := h.home(ctx, id, user)
	dest := ""
	if q := r.URL.Query().Get("path"); q != "" {
		if dest, err = resolvePath(q, home); err != nil {
			httpError(w, http.StatusBadRequest, err.Error())
			return
		}
	}
	var body io.Reader = r.Body
	switch enc := strings.ToLower(strings.TrimSpace(r.Header.Get("Content-Encoding"))); enc {
	case "", "identity":
	case "gzip", "x-gzip":
		gz, err := gzip.NewReader(r.Body)
		if err != nil {
			httpError(w, http.StatusBadRequest, "Content-Encoding gzip: "+err.Error())
			return
		}
		defer gz.Close()
		body = gz
	default:
		httpError(w, http.StatusUnsupportedMediaType, "Content-Encoding "+enc+": want gzip or none")
		return
	}
	body = bodyReader{&capReader{r: body, n: h.limits.MaxUpload}}

	var done []uploaded
	ct, params, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if ct == "multipart/form-data" {
		if params["boundary"] == "" {
			httpError(w, http.StatusBadRequest, "multipart/form-data without a boundary")
			return
		}
		mr := multipart.NewReader(body, params["boundary"])
		for {
			part, err := mr.NextPart()
			if err == io.EOF {
				break
			}
			if err != nil {
				httpError(w, uploadCode(err), "multipart body: "+err.Error())
				return
			}
			form, name, err := partNames(part.Header.Get("Content-Disposition"))
			if err != nil {
				httpError(w, http.StatusBadRequest, err.Error())
				return
			}
			if name == "" && form != "file" {
				continue // not a file
			}
			p := dest
			switch {
			case p != "" && len(done) > 0:
				httpError(w, http.StatusBadRequest, "path is given: one file per upload (leave path out to name each part's file by its filename)")
				return
			case p == "" && name == "":
				httpError(w, http.StatusBadRequest, "a file part has no filename and path is not given")
				return
			case p == "":
				if p, err = resolvePath(name, home); err != nil {
					httpError(w, http.StatusBadRequest, "filename: "+err.Error())
					return
				}
			}
			if !h.writeUpload(w, ctx, id, user, p, bodyReader{part}) {
				return
			}
			done = append(done, uploaded{Name: path.Base(p), Type: "file", Path: p})
		}
		if len(done) == 0 {
			httpError(w, http.StatusBadRequest, "the multipart body has no file part")
			return
		}
	} else {
		if dest == "" {
			httpError(w, http.StatusBadRequest, "POST /files: path is missing")
			return
		}
		if !h.writeUpload(w, ctx, id, user, dest, body) {
			return
		}
		done = append(done, uploaded{Name: path.Base(dest), Type: "file", Path: dest})
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	json.NewEncoder(w).Encode(done)
}

func uploadCode(err error) int {
	var ue *uploadError
	if errors.As(err, &ue) {
		return ue.code
	}
	return http.StatusBadRequest
}

// partNames reads a multipart part's Content-Disposition: its form
// name and its filename, whole (multipart.Part.FileName keeps only the
// base name, and here the filename is a path).
func partNames(disposition string) (form, filename string, err error) {
	if disposition == "" {
		return "", "", errors.New("a multipart part has no Content-Disposition")
	}
	d, params, err := mime.ParseMediaType(disposition)
	if err != nil {
		return "", "", fmt.Errorf("a multipart part's Content-Disposition: %w", err)
	}
	if d != "form-data" && d != "attachment" && d != "file" {
		return "", "", fmt.Errorf("a multipart part's Content-Disposition is %q: want form-data", d)
	}
	return params["name"], params["filename"], nil
}

// writeUpload streams r into the sandbox's file p, owned by user, its
// parents made; it answers the request itself on failure (and says
// false).
func (h *Handler) writeUpload(w http.ResponseWriter, ctx context.Context, id, user, p string, r io.Reader) bool {
	_, err := h.writeFile(ctx, id, user, p, r)
	if err == nil {
		return true
	}
	var ue *uploadError
	if errors.As(err, &ue) {
		httpError(w, ue.code, "write "+p+": "+ue.err.Error())
		return false
	}
	kilnHTTPError(w, "write "+p, err)
	return false
}

// writeFile streams r into a kiln.v1 WriteFile: the file appears whole or
// not at all (a failed read cancels the call).
func (h *Handler) writeFile(ctx context.Context, id, user, p string, r io.Reader) (*kilnpb.FileInfo, error) {
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ws, err := h.kiln.WriteFile(wctx)
	if err != nil {
		return nil, err
	}
	hdr := &kilnpb.WriteFileHeader{SandboxId: id, Path: p, MakeParents: true, User: user}
	if err := ws.Send(&kilnpb.WriteFileRequest{Kind: &kilnpb.WriteFileRequest_Header{Header: hdr}}); err != nil {
		_, err = ws.CloseAndRecv()
		return nil, err
	}
	buf := make([]byte, writeChunk)
	for {
		n, rerr := fill(r, buf)
		if n > 0 {
			if err := ws.Send(&kilnpb.WriteFileRequest{Kind: &kilnpb.WriteFileRequest_Data{Data: buf[:n]}}); err != nil {
				_, err = ws.CloseAndRecv()
				if err == nil {
					err = errors.New("kilnd ended the write early")
				}
				return nil, err
			}
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			cancel() // the file is not written
			return nil, rerr
		}
	}
	return ws.CloseAndRecv()
}

// fill reads into buf until it is full or r ends; only a clean end is
// io.EOF (a multipart part cut short is io.ErrUnexpectedEOF, an error).
func fill(r io.Reader, buf []byte) (int, error) {
	n := 0
	for n < len(buf) {
		m, err := r.Read(buf[n:])
		n += m
		if err != nil {
			return n, err
		}
	}
	return n, nil
}
