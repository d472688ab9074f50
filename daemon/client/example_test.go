package client_test

import (
	"bytes"
	"context"
	"fmt"
	"log"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/daemon/client"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// Example starts a sandbox from a template, runs a command in it, copies a
// file in and out, checkpoints it, forks two children from the checkpoint
// and destroys them all. It needs a running kilnd (and a template named
// "python"), so it is compiled but not run by go test.
func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	// unix:/run/kiln/kilnd.sock unless KILN_HOST says otherwise; a TCP
	// host (tcp://127.0.0.1:7070) also needs client.WithToken(...).
	host := os.Getenv("KILN_HOST")
	if host == "" {
		host = client.DefaultHost
	}
	c, err := client.Dial(ctx, host)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	sb, err := c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{
		Source:        &kilnpb.CreateSandboxRequest_Template{Template: "python"},
		Resources:     &kilnpb.Resources{Cpus: 1, MemoryMib: 512},
		Labels:        map[string]string{"job": "example"},
		LifetimeMs:    (10 * time.Minute).Milliseconds(),
		IdleTimeoutMs: (time.Minute).Milliseconds(),
	})
	if status.Code(err) == codes.NotFound {
		log.Fatal("no template named python: create one with kiln template create")
	}
	if err != nil {
		log.Fatal(err)
	}
	defer c.DestroySandbox(context.Background(), sb.GetId())

	// Files in: any io.Reader.
	if _, err := c.WriteFile(ctx, sb.GetId(), "/work/main.py", strings.NewReader("print(6*7)\n"),
		client.WriteFileOptions{MakeParents: true}); err != nil {
		log.Fatal(err)
	}

	// A command, its output streamed into any io.Writer.
	var out bytes.Buffer
	res, err := c.Exec(ctx, sb.GetId(), client.ExecOptions{
		Argv:    []string{"python3", "main.py"},
		Cwd:     "/work",
		Stdout:  &out,
		Stderr:  os.Stderr,
		Timeout: 30 * time.Second,
	})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("exit %d: %s", res.ExitCode, out.String())

	// Files out: any io.Writer.
	if _, err := c.ReadFile(ctx, sb.GetId(), "/work/main.py", os.Stdout); err != nil {
		log.Fatal(err)
	}

	// Checkpoint, then fork children from it as they become ready.
	ck, err := c.Checkpoint(ctx, sb.GetId(), client.CheckpointOptions{})
	if err != nil {
		log.Fatal(err)
	}
	fork := &kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_CheckpointId{CheckpointId: ck.GetId()}, Count: 2}
	for child, err := range c.Fork(ctx, fork) {
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println("child", child.GetId())
		defer c.DestroySandbox(context.Background(), child.GetId())
	}
}

// ExampleClient_WatchEvents prints every sandbox's state changes until
// ctx ends.
func ExampleClient_WatchEvents() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c, err := client.Dial(ctx, client.DefaultHost)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	w, err := c.WatchEvents(ctx)
	if err != nil {
		log.Fatal(err)
	}
	defer w.Close()
	for ev, err := range w.All() {
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println(ev.GetKind(), ev.GetSandboxId(), ev.GetReason())
	}
}
