package main

import (
	"fmt"
	"path/filepath"

	"github.com/google/nftables"
	"github.com/vishvananda/netns"
)

// hasNftTable says whether the named network namespace ns has an nftables
// table called name (of any family).
func hasNftTable(ns, name string) error {
	h, err := netns.GetFromPath(filepath.Join("/run/netns", ns))
	if err != nil {
		return fmt.Errorf("netns %s: %w", ns, err)
	}
	defer h.Close()
	c, err := nftables.New(nftables.WithNetNSFd(int(h)))
	if err != nil {
		return fmt.Errorf("nftables in %s: %w", ns, err)
	}
	tables, err := c.ListTables()
	if err != nil {
		return fmt.Errorf("nftables tables in %s: %w", ns, err)
	}
	var names []string
	for _, t := range tables {
		if t.Name == name {
			return nil
		}
		names = append(names, t.Name)
	}
	return fmt.Errorf("netns %s has no nftables table %q (has %v)", ns, name, names)
}
