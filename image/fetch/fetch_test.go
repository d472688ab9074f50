package fetch

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

func TestRange(t *testing.T) {
	blob := []byte("0123456789abcdefghij")
	type behave func(w http.ResponseWriter, r *http.Request, call int32) bool // true: handled
	serveRange := func(w http.ResponseWriter, r *http.Request) {
		var a, b int
		fmt.Sscanf(r.Header.Get("Range"), "bytes=%d-%d", &a, &b)
		w.Header().Set("Content-Range", fmt.Sprintf("bytes %d-%d/%d", a, b, len(blob)))
		w.WriteHeader(http.StatusPartialContent)
		w.Write(blob[a : b+1])
	}
	for _, tc := range []struct {
		name      string
		off, n    int64
		first     behave // the first call's answer, nil: serve the range
		want      string // the bytes, or a substring of the error
		wantErr   bool
		wantCalls int32
	}{
		{name: "range", off: 3, n: 4, want: "3456", wantCalls: 1},
		{name: "whole blob as 200", off: 0, n: 20, first: func(w http.ResponseWriter, _ *http.Request, _ int32) bool {
			w.Write(blob)
			return true
		}, want: string(blob), wantCalls: 1},
		{name: "500 is retried", off: 1, n: 2, first: func(w http.ResponseWriter, _ *http.Request, _ int32) bool {
			http.Error(w, "busy", http.StatusInternalServerError)
			return true
		}, want: "12", wantCalls: 2},
		{name: "short body is retried", off: 0, n: 10, first: func(w http.ResponseWriter, _ *http.Request, _ int32) bool {
			w.Header().Set("Content-Length", "10")
			w.WriteHeader(http.StatusPartialContent)
			w.Write(blob[:4])
			return true
		}, want: "0123456789", wantCalls: 2},
		{name: "404 is not retried", off: 0, n: 2, first: func(w http.ResponseWriter, _ *http.Request, _ int32) bool {
			http.Error(w, "blob unknown", http.StatusNotFound)
			return true
		}, want: "HTTP 404: blob unknown", wantErr: true, wantCalls: 1},
		{name: "200 for a part is refused", off: 2, n: 2, first: func(w http.ResponseWriter, _ *http.Request, _ int32) bool {
			w.Write(blob)
			return true
		}, want: "HTTP 200", wantErr: true, wantCalls: 1},
		{name: "wrong Content-Range", off: 2, n: 2, first: func(w http.ResponseWriter, _ *http.Request, _ int32) bool {
			w.Header().Set("Content-Range", "bytes 0-1/20")
			w.WriteHeader(http.StatusPartialContent)
			w.Write(blob[:2])
			return true
		}, want: "asked for bytes 2-3", wantErr: true, wantCalls: 1},
		{name: "outside the blob", off: 18, n: 4, want: "outside", wantErr: true},
		{name: "empty", off: 0, n: 0, want: "outside", wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var calls atomic.Int32
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				c := calls.Add(1)
				if c == 1 && tc.first != nil && tc.first(w, r, c) {
					return
				}
				serveRange(w, r)
			}))
			defer srv.Close()
			var cnt Counter
			b := &Blob{Client: srv.Client(), URL: srv.URL + "/v2/x/blobs/d", Size: int64(len(blob)), Counter: &cnt}
			got, err := b.Range(context.Background(), tc.off, tc.n)
			if tc.wantErr {
				if err == nil || !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("got %q, %v; want an error naming %q", got, err, tc.want)
				}
			} else if err != nil || !bytes.Equal(got, []byte(tc.want)) {
				t.Fatalf("got %q, %v; want %q", got, err, tc.want)
			}
			if calls.Load() != tc.wantCalls || cnt.Stats().Requests != int64(tc.wantCalls) {
				t.Errorf("%d calls, %d counted; want %d", calls.Load(), cnt.Stats().Requests, tc.wantCalls)
			}
		})
	}
}

// A registry that stops mid-body fails the call at the deadline.
func TestRangeStalls(t *testing.T) {
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "100")
		w.WriteHeader(http.StatusPartialContent)
		w.Write(make([]byte, 10))
		w.(http.Flusher).Flush()
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	defer srv.Close()
	defer close(release)
	b := &Blob{Client: srv.Client(), URL: srv.URL, Size: 1000, Timeout: 300 * time.Millisecond}
	start := time.Now()
	_, err := b.Range(context.Background(), 0, 100)
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "no answer within") {
		t.Fatalf("got %v, want a deadline error", err)
	}
	if el := time.Since(start); el > 2*time.Second {
		t.Errorf("took %s with a 300ms deadline", el)
	}
}
