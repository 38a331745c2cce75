package cli

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// clusterCmd is csi-agent cluster nodes|claims.
func (e *env) clusterCmd() *cobra.Command {
	return e.group("cluster", "the fleet this host joined (serve --cluster-etcd-endpoints): nodes, claims, release",
		"The fleet on etcd: its nodes with their liveness, the volumes claimed by one host (or shared by readers) and the cluster-wide locks; release hands a dead node's claims to the other hosts.",
		command("nodes [flags]", "list the fleet's nodes: alive (lease held) or not, registered, agent version, plugins", noArgs, e.withVolumes(func(ctx context.Context, c agentv1.AgentClient, output string, _ []string) error {
			resp, err := c.ClusterNodes(ctx, &agentv1.ClusterNodesRequest{})
			return printReply(e.stdout, output, resp, err, func() error {
				tw := newTable(e.stdout, "NODE\tALIVE\tREGISTERED\tVERSION\tPLUGINS\tFENCE CIDRS")
				for _, n := range resp.GetNodes() {
					fmt.Fprintf(tw, "%s\t%v\t%s\t%s\t%s\t%s\n", n.GetNodeId(), n.GetAlive(), timeCell(n.GetRegistered()), orDash(n.GetAgentVersion()),
						orDash(strings.Join(n.GetPlugins(), ",")), orDash(strings.Join(n.GetFenceCidrs(), ",")))
				}
				return tw.Flush()
			})
		})),
		command("claims [flags]", "list the fleet's claims (plugin, volume, mode, holding nodes) and locks", noArgs, e.withVolumes(func(ctx context.Context, c agentv1.AgentClient, output string, _ []string) error {
			resp, err := c.ClusterClaims(ctx, &agentv1.ClusterClaimsRequest{})
			return printReply(e.stdout, output, resp, err, func() error {
				tw := newTable(e.stdout, "PLUGIN\tVOLUME\tMODE\tHOLDERS")
				for _, cl := range resp.GetClaims() {
					var hs []string
					for _, h := range cl.GetHolders() {
						hs = append(hs, h.GetNodeId()+map[bool]string{true: "", false: " (down)"}[h.GetAlive()])
					}
					fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", cl.GetPluginName(), cl.GetVolumeId(), cl.GetMode(), strings.Join(hs, ","))
				}
				for _, l := range resp.GetLocks() {
					fmt.Fprintf(tw, "lock %s\t%s\t-\t%s (waiting: %s)\n", l.GetKind(), l.GetId(), l.GetHolder(), orDash(strings.Join(l.GetWaiters(), ",")))
				}
				return tw.Flush()
			})
		})),
		command("release --node NODE [flags]", "hand a dead node's claims to the other hosts: once its lease is gone, after fencing it (--fence-plugin) or on your word that it is down (--node-is-down)", noArgs, e.clusterReleaseCmd),
	)
}

// releaseTimeout bounds cluster release (fencing included).
const releaseTimeout = 5 * time.Minute

func (e *env) clusterReleaseCmd(fs *pflag.FlagSet) runFunc {
	node := fs.String("node", "", "the dead node whose claims to release (required; csi-agent cluster nodes lists the nodes)")
	volume := fs.String("volume", "", "release only its claims on volumes of this id (default: all of them)")
	down := fs.Bool("node-is-down", false, "your assertion that the node is powered off or cut off its storage: no fencing. If it is in fact running, its containers and another host may write the same volume at once")
	plugin := fs.String("fence-plugin", "", "fence the node first with this plugin's csi-addons FenceClusterNetwork, on the networks it registered (serve --cluster-fence-cidrs)")
	secretsFile := fs.String("secrets-file", "", "with --fence-plugin: JSON file with an object of strings passed as the fencing call's secrets (never stored or logged)")
	params := paramFlag(fs, "with --fence-plugin: plugin parameter of the fencing call (e.g. clusterID=...)")
	timeout := fs.Duration("timeout", releaseTimeout, "how long to wait for the agent, fencing included")
	return e.withAgent(fs, func(ctx context.Context, c agentv1.AgentClient, output string, _ []string) error {
		switch {
		case *node == "":
			return usageError("--node is required: the dead node whose claims to release")
		case !*down && *plugin == "":
			return usageError("--fence-plugin PLUGIN or --node-is-down is required: a node's claims go to other hosts only once it cannot write to the volumes")
		case *plugin == "" && (*secretsFile != "" || len(params) > 0):
			return usageError("--secrets-file and --param are for --fence-plugin")
		}
		req := &agentv1.ClusterReleaseRequest{NodeId: *node, VolumeId: *volume, NodeIsDown: *down}
		if *plugin != "" {
			req.Fence = &agentv1.FenceRequest{PluginName: *plugin, Parameters: params.params()}
			if *secretsFile != "" {
				s, err := readSecrets(*secretsFile)
				if err != nil {
					return err
				}
				req.Fence.Secrets = s
			}
		}
		ctx, cancel := context.WithTimeout(ctx, *timeout)
		defer cancel()
		resp, err := c.ClusterRelease(ctx, req)
		return printReply(e.stdout, output, resp, err, func() error {
			if cs := resp.GetFencedCidrs(); len(cs) > 0 {
				fmt.Fprintf(e.stdout, "fenced %s: %s\n", *node, strings.Join(cs, ","))
			}
			if len(resp.GetReleased()) == 0 {
				fmt.Fprintf(e.stdout, "node %s held no claims to release\n", *node)
			}
			for _, cl := range resp.GetReleased() {
				fmt.Fprintf(e.stdout, "released %s %s (%s) from %s\n", cl.GetPluginName(), cl.GetVolumeId(), cl.GetMode(), *node)
			}
			return nil
		})
	})
}
