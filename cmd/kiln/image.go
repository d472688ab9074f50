package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/kilnvm/kiln/image"
	"github.com/kilnvm/kiln/sandbox"
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
  gc [--max-size SIZE]      remove blobs no image needs; with --max-size, then
                            evict lazily fetched chunks, least recently used
                            first, until the store is at most SIZE (e.g. 20GiB)
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
	var importName, push, maxSize *string
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
	case "gc":
		nargs = 0
		maxSize = fs.String("max-size", "", "cap the store at `SIZE` (bytes, or with KiB, MiB, GiB, TiB); default: no cap")
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
		d, err := sandbox.DefaultImagesDir()
		if err != nil {
			fmt.Fprintf(stderr, "kiln image: %v (or give --dir)\n", err)
			return exitUsage
		}
		*dir = d
	}
	opts := image.Options{Logger: newLogger(stderr, false)}
	if maxSize != nil && *maxSize != "" {
		n, err := parseSize(*maxSize)
		if err != nil {
			fmt.Fprintf(stderr, "kiln image gc: --max-size: %v\n", err)
			return exitUsage
		}
		opts.Store.MaxBytes = n
	}
	im, err := image.Open(*dir, opts)
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
	case "gc":
		res, err := im.GC(ctx)
		if err != nil {
			return fail(err)
		}
		fmt.Fprintf(stdout, "freed %d blobs, %.1f MiB; %d blobs, %.1f MiB left\n", len(res.Removed), float64(res.FreedBytes)/(1<<20),
			res.Blobs, float64(res.TotalBytes)/(1<<20))
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

// parseSize parses a size in bytes, optionally with a binary unit (KiB,
// MiB, GiB, TiB; K, M, G, T and KB... mean the same).
func parseSize(s string) (int64, error) {
	num := strings.TrimRightFunc(s, func(r rune) bool { return r < '0' || r > '9' })
	unit := strings.ToUpper(strings.TrimSpace(s[len(num):]))
	shift := map[string]uint{"": 0, "B": 0, "K": 10, "KB": 10, "KIB": 10, "M": 20, "MB": 20, "MIB": 20,
		"G": 30, "GB": 30, "GIB": 30, "T": 40, "TB": 40, "TIB": 40}
	sh, ok := shift[unit]
	n, err := strconv.ParseInt(num, 10, 64)
	if !ok || err != nil || n <= 0 || n > (1<<62)>>sh {
		return 0, fmt.Errorf("%q: want a positive size such as 500MiB or 20GiB", s)
	}
	return n << sh, nil
}
