package sandbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/kilnvm/kiln/guest/client"
)

// ConfigureNetwork gives the guest's network card (the sandbox's, on its
// tap) the host's settings through the agent: cfg's addresses, gateway,
// MTU and nameservers, and the card's MAC (the sandbox's own when cfg has
// none, so that a restored or forked guest takes its new one). The host
// calls it after every start, restore and fork of a sandbox with a card.
func (s *Sandbox) ConfigureNetwork(ctx context.Context, cfg client.NetworkConfig) error {
	mac := s.MAC()
	if mac == nil {
		return errors.New("sandbox: configure network: the sandbox has no network card")
	}
	if cfg.MAC == "" {
		cfg.MAC = mac.String()
	}
	if _, err := s.client.ConfigureNetwork(ctx, cfg); err != nil {
		return fmt.Errorf("sandbox: %w", err)
	}
	return nil
}
