package cli

import (
	"context"
	"fmt"
	"strings"

	"github.com/spf13/pflag"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// fenceCmd is csi-agent fence: FenceClusterNetwork, or with --list
// ListClusterFence.
func (e *env) fenceCmd(fs *pflag.FlagSet) runFunc { return e.fenceOpCmd(fs, true) }

// unfenceCmd is csi-agent unfence: UnfenceClusterNetwork.
func (e *env) unfenceCmd(fs *pflag.FlagSet) runFunc { return e.fenceOpCmd(fs, false) }

func (e *env) fenceOpCmd(fs *pflag.FlagSet, fence bool) runFunc {
	verb := "unfence"
	if fence {
		verb = "fence"
	}
	cidrs := fs.StringSlice("cidr", nil, "a network to "+verb+", e.g. 10.90.1.0/24 (repeatable, or a comma list)")
	var list *bool
	if fence {
		list = fs.Bool("list", false, "list the fenced networks instead (no --cidr)")
	}
	params := paramFlag(fs, "plugin parameter (e.g. clusterID=...)")
	return e.withController(fs, func(ctx context.Context, client agentv1.ControllerClient, c *ctrlCall) error {
		req := &agentv1.FenceRequest{PluginName: c.plugin, Cidrs: *cidrs, Parameters: params.params(), Secrets: c.secrets, Retry: c.retry}
		call, done := client.UnfenceNetwork, "unfenced"
		switch {
		case list != nil && *list:
			call, done = client.ListFences, ""
		case fence:
			call, done = client.FenceNetwork, "fenced"
		}
		return runOp(ctx, c, call, req, func(res *agentv1.FenceReply) error {
			if done == "" {
				for _, x := range res.GetCidrs() {
					fmt.Fprintln(c.e.stdout, x)
				}
				return nil
			}
			fmt.Fprintf(c.e.stdout, "%s: %s\n", strings.Join(*cidrs, ", "), done)
			return nil
		})
	})
}
