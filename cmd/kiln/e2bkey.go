package main

import (
	"flag"
	"fmt"
	"io"

	"github.com/kilnvm/kiln/daemon/e2b/apikey"
)

// defaultE2BKeysFile is where kiln e2b key new appends by default: the
// keys file of the README's kilnd --e2b-api-keys example.
const defaultE2BKeysFile = "/etc/kiln/e2b-keys"

// cmdE2B is kiln e2b: key new TENANT makes an API key in E2B's format (both
// E2B SDKs take it), appends "KEY TENANT" to kilnd's keys file and prints
// the key.
func cmdE2B(args []string, stdout, stderr io.Writer) int {
	if len(args) < 2 || args[0] != "key" || args[1] != "new" {
		fmt.Fprintln(stderr, "usage: kiln e2b key new [--keys FILE] TENANT")
		return exitUsage
	}
	fs := flag.NewFlagSet("kiln e2b key new", flag.ContinueOnError)
	fs.SetOutput(stderr)
	keys := fs.String("keys", defaultE2BKeysFile, "kilnd's E2B keys `FILE` (its --e2b-api-keys) to append the key to; made 0600 when missing")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: kiln e2b key new [--keys FILE] TENANT")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args[2:]); err != nil {
		return exitUsage
	}
	if fs.NArg() != 1 {
		fs.Usage()
		return exitUsage
	}
	tenant := fs.Arg(0)
	if err := apikey.CheckTenant(tenant); err != nil {
		fmt.Fprintf(stderr, "kiln e2b key new: %v\n", err)
		return exitUsage
	}
	key := apikey.New()
	if err := apikey.Append(*keys, key, tenant); err != nil {
		fmt.Fprintf(stderr, "kiln e2b key new: %v\n", err)
		return exitInternal
	}
	fmt.Fprintln(stdout, key)
	return exitOK
}
