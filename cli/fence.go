package cli

import (
	"context"
	"flag"
	"fmt"
	"strings"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// cidrsFlag collects repeated --cidr flags (each may hold a comma list).
type cidrsFlag []string

func (c *cidrsFlag) String() string { return strings.Join(*c, ",") }

func (c *cidrsFlag) Set(v string) error {
	for _, x := range strings.Split(v, ",") {
		if x = strings.TrimSpace(x); x != "" {
			*c = append(*c, x)
		}
	}
	return nil
}

// runFence is 'csi-agent fence': FenceClusterNetwork, or with --list
// ListClusterFence.
func runFence(ctx context.Context, e *env, args []string) int {
	return runFenceOp(ctx, e, "fence", true, args)
}

// runUnfence is 'csi-agent unfence': UnfenceClusterNetwork.
func runUnfence(ctx context.Context, e *env, args []string) int {
	return runFenceOp(ctx, e, "unfence", false, args)
}

func runFenceOp(ctx context.Context, e *env, name string, fenceCmd bool, args []string) int {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	var cidrs cidrsFlag
	fs.Var(&cidrs, "cidr", "a network to "+name+", e.g. 10.90.1.0/24 (repeat, or a comma list)")
	var list *bool
	if fenceCmd {
		list = fs.Bool("list", false, "list the fenced networks instead (no --cidr)")
	}
	params := paramFlag(fs, "plugin parameter (e.g. clusterID=...)")
	return withController(ctx, e, fs, args, func(ctx context.Context, client agentv1.ControllerClient, c *ctrlCall) error {
		req := &agentv1.FenceRequest{PluginName: c.plugin, Cidrs: cidrs, Parameters: params.params(), Secrets: c.secrets, Retry: c.retry}
		call, done := client.UnfenceNetwork, "unfenced"
		switch {
		case list != nil && *list:
			call, done = client.ListFences, ""
		case fenceCmd:
			call, done = client.FenceNetwork, "fenced"
		}
		stream, err := call(ctx, req)
		res, err := follow(c, stream, err)
		if err != nil {
			return err
		}
		if c.output == "json" {
			return printJSON(c.e.stdout, res)
		}
		if done == "" {
			for _, x := range res.GetCidrs() {
				fmt.Fprintln(c.e.stdout, x)
			}
			return nil
		}
		fmt.Fprintf(c.e.stdout, "%s: %s\n", strings.Join(cidrs, ", "), done)
		return nil
	})
}
