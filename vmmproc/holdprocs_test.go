package vmmproc

import (
	"strings"
	"testing"
)

func TestHoldProcsFrom(t *testing.T) {
	tests := []struct {
		in      string
		want    bool
		wantErr bool
	}{
		{"", true, false},
		{"true", true, false},
		{"1", true, false},
		{"false", false, false},
		{"0", false, false},
		{"off", false, true},
		{"yes please", false, true},
	}
	for _, tt := range tests {
		got, err := holdProcsFrom(tt.in)
		if got != tt.want || (err != nil) != tt.wantErr {
			t.Errorf("holdProcsFrom(%q) = %v, %v; want %v (error %v)", tt.in, got, err, tt.want, tt.wantErr)
		}
		if err != nil && !strings.Contains(err.Error(), HoldProcsEnv) {
			t.Errorf("holdProcsFrom(%q): error %q does not name %s", tt.in, err, HoldProcsEnv)
		}
	}
}
