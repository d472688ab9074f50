package vmmbackend

import (
	"context"
	"maps"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/sandbox"
)

// TestMaxVolumes: the daemon mounts at most as many volumes as every
// sandbox has slots.
func TestMaxVolumes(t *testing.T) {
	if daemon.MaxVolumes != sandbox.VolumeSlots {
		t.Fatalf("daemon.MaxVolumes %d, sandbox.VolumeSlots %d", daemon.MaxVolumes, sandbox.VolumeSlots)
	}
}

// TestVolumeDisks: a restore names the images of the slots its
// checkpoint holds filled, and no other.
func TestVolumeDisks(t *testing.T) {
	vols := []daemon.VolumeAttach{{Slot: 0, Path: "/v/a.img"}, {Slot: 2, Path: "/v/c.img", ReadOnly: true}}
	tests := []struct {
		name   string
		filled map[int]string
		want   map[string]string
	}{
		{"boot or empty slots", nil, nil},
		{"one filled", map[int]string{2: "/old/c.img"}, map[string]string{"vol2": "/v/c.img"}},
		{"both filled", map[int]string{0: "/v/a.img", 2: "/v/c.img"}, map[string]string{"vol0": "/v/a.img", "vol2": "/v/c.img"}},
		{"another slot filled", map[int]string{1: "/v/b.img"}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := volumeDisks(vols, tt.filled); !maps.Equal(got, tt.want) {
				t.Errorf("volumeDisks = %v, want %v", got, tt.want)
			}
		})
	}
}

// TestCreateRefusesTooManyVolumes: more volumes than slots is refused
// before anything starts.
func TestCreateRefusesTooManyVolumes(t *testing.T) {
	b := &Backend{}
	b.Process.Command = []string{"/nonexistent/kiln-vmm"}
	_, err := b.Create(context.Background(), daemon.CreateSpec{Image: "x", Volumes: make([]daemon.VolumeAttach, daemon.MaxVolumes+1)})
	if status.Code(err) != codes.InvalidArgument {
		t.Fatalf("Create: %v, want InvalidArgument", err)
	}
}
