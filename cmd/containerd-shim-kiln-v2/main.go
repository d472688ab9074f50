// Command containerd-shim-kiln-v2 is Kiln's containerd runtime shim v2
// (runtime type io.containerd.kiln.v2): containerd starts it per pod, and
// each pod runs in a Kiln microVM. See package shim and docs/kubernetes.md.
package main

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/containerd/containerd/log"
	"github.com/containerd/containerd/pkg/shutdown"
	"github.com/containerd/containerd/plugin"
	cshim "github.com/containerd/containerd/runtime/v2/shim"

	"github.com/kilnvm/kiln/shim"
)

func main() {
	plugin.Register(&plugin.Registration{
		Type:     plugin.TTRPCPlugin,
		ID:       "task",
		Requires: []plugin.Type{plugin.EventPlugin, plugin.InternalPlugin},
		InitFn: func(ic *plugin.InitContext) (interface{}, error) {
			pp, err := ic.GetByID(plugin.EventPlugin, "publisher")
			if err != nil {
				return nil, err
			}
			ss, err := ic.GetByID(plugin.InternalPlugin, "shutdown")
			if err != nil {
				return nil, err
			}
			// The shim's log is containerd's: its "log" FIFO, which
			// containerd's shim package has set as logrus's output.
			logger := slog.New(slog.NewTextHandler(log.G(ic.Context).Logger.Out, nil))
			cfg, err := shim.LoadConfig()
			if err != nil {
				return nil, err
			}
			rt, err := cfg.Runtime()
			if err != nil {
				return nil, fmt.Errorf("kiln shim: %w", err)
			}
			boot := shim.SandboxBooter{Runtime: rt, Logger: logger}
			return shim.NewService(ic.Context, cfg, boot, pp.(cshim.Publisher), ss.(shutdown.Service), logger), nil
		},
	})
	cshim.RunManager(context.Background(), shim.Manager{})
}
