package vmmbackend

import (
	"context"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/image/imagetest"
)

// TestEnsureImage: the real backend pulls an image a create names when
// its folder lacks it, once for concurrent creates, and says NotFound for
// a name the registry does not know.
func TestEnsureImage(t *testing.T) {
	img, _, err := imagetest.RandomImage(7, 1)
	if err != nil {
		t.Fatal(err)
	}
	reg := imagetest.NewRegistry(t)
	ref := reg.Push(t, "app:v1", img)
	b := &Backend{Images: t.TempDir()}
	ctx := context.Background()
	reg.Reset()
	errs := make(chan error, 4)
	for range 4 {
		go func() { errs <- b.ensureImage(ctx, ref) }()
	}
	for range 4 {
		if err := <-errs; err != nil {
			t.Fatalf("ensureImage: %v", err)
		}
	}
	manifests := reg.Stats().Requests
	if err := b.ensureImage(ctx, ref); err != nil {
		t.Fatal(err)
	}
	if reg.Stats().Requests != manifests {
		t.Errorf("a stored image was pulled again")
	}
	im, _ := b.imageRoots().Images(b.Images)
	if _, err := im.Get(ref); err != nil {
		t.Errorf("not stored after the pull: %v", err)
	}
	if err := b.ensureImage(ctx, reg.Host+"/nosuch:v1"); status.Code(err) != codes.NotFound {
		t.Errorf("unknown image: %v, want NotFound", err)
	}
	if err := b.ensureImage(ctx, "Bad:Ref"); status.Code(err) != codes.InvalidArgument {
		t.Errorf("bad reference: %v, want InvalidArgument", err)
	}
}
