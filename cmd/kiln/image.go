package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"path/filepath"
	"text/tabwriter"

	"github.com/kilnvm/kiln/guestkernel"
	"github.com/kilnvm/kiln/image"
)

// exitPullFailed: a pull or import that failed for another reason than bad
// input (the network, the registry, the disk).
const exitPullFailed = 1

const imageUsage = `usage: kiln image <command> [--dir DIR] [flags]

  pull [--insecure] REF     fetch REF (linux/amd64) from its registry
  import [--name REF] PATH  add a docker save tarball or an OCI layout (dir or tar)
  convert [--push DEST] [--name NAME] [--insecure] REF
                            rebuild REF's layers as estargz (deterministic), name
                            it NAME (default DEST, else REF's tag + "-esgz"), push it
  ls                        list images
  rm NAME...                remove images and the blobs no other image uses
  inspect NAME              print an image's manifest digests and config as JSON
`

func cmdImage(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, imageUsage)
		return exitUsage
	}
	sub, args := args[0], args[1:]
	fs := flag.NewFlagSet("kiln image "+sub, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, imageUsage)
		fs.PrintDefaults()
	}
	dir := fs.String("dir", "", "images `DIR` (default: <kernel cache>/images)")
	var insecure *bool
	var importName, push *string
	nargs := 1
	switch sub {
	case "pull":
		insecure = fs.Bool("insecure", false, "allow plain HTTP to the registry (loopback registries always are)")
	case "convert":
		insecure = fs.Bool("insecure", false, "allow plain HTTP to the registries (loopback registries always are)")
		importName = fs.String("name", "", "name the result `NAME` (default: DEST, else REF's tag + \"-esgz\")")
		push = fs.String("push", "", "push the result to `DEST`")
	case "import":
		importName = fs.String("name", "", "name the image `REF` (default: the name in the file, else its digest)")
	case "ls":
		nargs = 0
	case "rm":
		nargs = -1
	case "inspect":
	case "help", "-h", "--help":
		fmt.Fprint(stdout, imageUsage)
		return exitOK
	default:
		fmt.Fprintf(stderr, "kiln image: unknown command %q\n", sub)
		fmt.Fprint(stderr, imageUsage)
		return exitUsage
	}
	if err := fs.Parse(args); err != nil {
		return exitUsage
	}
	rest := fs.Args()
	switch {
	case nargs >= 0 && len(rest) != nargs:
		fmt.Fprintf(stderr, "kiln image %s: want %d argument(s), got %d\n", sub, nargs, len(rest))
		return exitUsage
	case nargs < 0 && len(rest) == 0:
		fmt.Fprintf(stderr, "kiln image %s: no image named\n", sub)
		return exitUsage
	}
	if *dir == "" {
		cache, err := guestkernel.CacheDir()
		if err != nil {
			fmt.Fprintf(stderr, "kiln image: %v (or give --dir)\n", err)
			return exitUsage
		}
		*dir = filepath.Join(cache, "images")
	}
	im, err := image.Open(*dir, image.Options{Logger: newLogger(stderr, false)})
	if err != nil {
		fmt.Fprintf(stderr, "kiln image: %v\n", err)
		return exitPullFailed
	}
	fail := func(err error) int {
		fmt.Fprintf(stderr, "kiln image %s: %v\n", sub, err)
		if errors.Is(err, image.ErrInvalid) || errors.Is(err, image.ErrNotFound) {
			return exitUsage
		}
		return exitPullFailed
	}
	switch sub {
	case "pull":
		rec, err := im.Pull(ctx, rest[0], image.PullOptions{Insecure: *insecure, Progress: image.NewProgress(stderr)})
		if err != nil {
			return fail(err)
		}
		fmt.Fprintf(stdout, "%s %s\n", rec.Name, rec.Manifest)
	case "import":
		rec, err := im.Import(ctx, rest[0], image.ImportOptions{Name: *importName, Progress: image.NewProgress(stderr)})
		if err != nil {
			return fail(err)
		}
		fmt.Fprintf(stdout, "%s %s\n", rec.Name, rec.Manifest)
	case "convert":
		rec, err := im.Convert(ctx, rest[0], image.ConvertOptions{
			Name: *importName, Push: *push, Insecure: *insecure, Progress: image.NewProgress(stderr),
		})
		if err != nil {
			return fail(err)
		}
		fmt.Fprintf(stdout, "%s %s\n", rec.Name, rec.Manifest)
	case "ls":
		imgs, err := im.List()
		if err != nil {
			return fail(err)
		}
		tw := tabwriter.NewWriter(stdout, 0, 8, 2, ' ', 0)
		fmt.Fprintln(tw, "NAME\tMANIFEST\tSIZE\tCREATED")
		for _, img := range imgs {
			created := "-"
			if !img.Created.IsZero() {
				created = img.Created.Format("2006-01-02 15:04")
			}
			fmt.Fprintf(tw, "%s\t%s\t%.1f MiB\t%s\n", img.Name, img.Manifest.Encoded()[:12], float64(img.Size)/(1<<20), created)
		}
		tw.Flush()
	case "rm":
		code := exitOK
		for _, n := range rest {
			if _, err := im.Remove(n); err != nil {
				code = fail(err)
				continue
			}
			fmt.Fprintf(stdout, "removed %s\n", n)
		}
		res, err := im.GC(ctx)
		if err != nil {
			return fail(err)
		}
		if len(res.Removed) > 0 {
			fmt.Fprintf(stdout, "freed %d blobs, %.1f MiB\n", len(res.Removed), float64(res.FreedBytes)/(1<<20))
		}
		return code
	case "inspect":
		d, err := im.Inspect(rest[0])
		if err != nil {
			return fail(err)
		}
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(d); err != nil {
			return fail(err)
		}
	}
	return exitOK
}
