// Command autoload is the guest program of Kiln's module autoloading test
// (sandbox's TestKVMModuleAutoload). In a root without ip, nft or kmod it
// asks the kernel, through the system calls those tools make, for what
// needs modules nobody has loaded: a veth pair (rtnl-link-veth), a bridge
// with the pair's one end enslaved (rtnl-link-bridge), an nftables table
// with a NAT chain (net-pf-16-proto-12, nfnetlink-subsys-10,
// nft-chain-2-nat) and an overlay mount (fs-overlay). It prints "ok WHAT"
// for each that works and "FAIL WHAT: ERROR" for each that does not, and
// exits 1 when one failed. It is built with CGO_ENABLED=0 so that it runs
// in any root.
package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

func main() {
	dir := "/tmp/autoload-overlay"
	if len(os.Args) > 1 {
		dir = os.Args[1]
	}
	failed := false
	for _, c := range []struct {
		what string
		run  func() error
	}{
		{"veth", veth},
		{"bridge", bridge},
		{"nftables", nft},
		{"overlay", func() error { return overlay(dir) }},
	} {
		if err := c.run(); err != nil {
			fmt.Printf("FAIL %s: %v\n", c.what, err)
			failed = true
			continue
		}
		fmt.Printf("ok %s\n", c.what)
	}
	if failed {
		os.Exit(1)
	}
}

// veth makes the pair kv0, kv1.
func veth() error {
	if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "kv0"}, PeerName: "kv1"}); err != nil {
		return fmt.Errorf("adding veth pair kv0/kv1: %w", err)
	}
	if _, err := netlink.LinkByName("kv1"); err != nil {
		return fmt.Errorf("the peer kv1: %w", err)
	}
	return nil
}

// bridge makes the bridge kbr0, up, with kv0 in it.
func bridge() error {
	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "kbr0"}}
	if err := netlink.LinkAdd(br); err != nil {
		return fmt.Errorf("adding bridge kbr0: %w", err)
	}
	if err := netlink.LinkSetUp(br); err != nil {
		return fmt.Errorf("setting kbr0 up: %w", err)
	}
	kv0, err := netlink.LinkByName("kv0")
	if err != nil {
		return fmt.Errorf("kv0: %w", err)
	}
	if err := netlink.LinkSetMaster(kv0, br); err != nil {
		return fmt.Errorf("enslaving kv0 to kbr0: %w", err)
	}
	return nil
}

// nft adds the table ip kiln with a NAT chain at postrouting, and finds
// the chain listed.
func nft() error {
	c, err := nftables.New()
	if err != nil {
		return fmt.Errorf("nftables: %w", err)
	}
	t := c.AddTable(&nftables.Table{Family: nftables.TableFamilyIPv4, Name: "kiln"})
	c.AddChain(&nftables.Chain{Name: "post", Table: t, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPostrouting, Priority: nftables.ChainPriorityNATSource})
	if err := c.Flush(); err != nil {
		return fmt.Errorf("adding table ip kiln with a nat chain: %w", err)
	}
	chains, err := c.ListChainsOfTableFamily(nftables.TableFamilyIPv4)
	if err != nil {
		return fmt.Errorf("listing chains: %w", err)
	}
	for _, ch := range chains {
		if ch.Table.Name == "kiln" && ch.Name == "post" {
			return nil
		}
	}
	return errors.New("chain ip kiln post not listed after it was added")
}

// overlay mounts an overlay of lower and upper folders under dir, writes
// through it, finds the write in the upper folder and unmounts it.
func overlay(dir string) error {
	p := func(name string) string { return filepath.Join(dir, name) }
	for _, d := range []string{"lower", "upper", "work", "merged"} {
		if err := os.MkdirAll(p(d), 0o755); err != nil {
			return err
		}
	}
	if err := os.WriteFile(p("lower/a"), []byte("lower"), 0o644); err != nil {
		return err
	}
	opts := fmt.Sprintf("lowerdir=%s,upperdir=%s,workdir=%s", p("lower"), p("upper"), p("work"))
	if err := unix.Mount("overlay", p("merged"), "overlay", 0, opts); err != nil {
		return fmt.Errorf("mounting an overlay (%s) on %s: %w", opts, p("merged"), err)
	}
	defer unix.Unmount(p("merged"), 0)
	if b, err := os.ReadFile(p("merged/a")); err != nil || string(b) != "lower" {
		return fmt.Errorf("reading the lower file through the overlay: %q, %v", b, err)
	}
	if err := os.WriteFile(p("merged/b"), []byte("upper"), 0o644); err != nil {
		return fmt.Errorf("writing through the overlay: %w", err)
	}
	if _, err := os.Stat(p("upper/b")); err != nil {
		return fmt.Errorf("the write is not in the upper folder: %w", err)
	}
	return nil
}
