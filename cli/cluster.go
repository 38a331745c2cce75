package cli

import (
	"context"
	"fmt"
	"strings"

	"github.com/spf13/cobra"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// clusterCmd is csi-agent cluster nodes|claims.
func (e *env) clusterCmd() *cobra.Command {
	return e.group("cluster", "the fleet this host joined (serve --cluster-etcd-endpoints): nodes, claims",
		"The fleet on etcd: its nodes with their liveness, the volumes claimed by one host (or shared by readers) and the cluster-wide locks.",
		command("nodes [flags]", "list the fleet's nodes: alive (lease held) or not, registered, agent version, plugins", noArgs, e.withVolumes(func(ctx context.Context, c agentv1.AgentClient, output string, _ []string) error {
			resp, err := c.ClusterNodes(ctx, &agentv1.ClusterNodesRequest{})
			return printReply(e.stdout, output, resp, err, func() error {
				tw := newTable(e.stdout, "NODE\tALIVE\tREGISTERED\tVERSION\tPLUGINS")
				for _, n := range resp.GetNodes() {
					fmt.Fprintf(tw, "%s\t%v\t%s\t%s\t%s\n", n.GetNodeId(), n.GetAlive(), timeCell(n.GetRegistered()), orDash(n.GetAgentVersion()), orDash(strings.Join(n.GetPlugins(), ",")))
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
	)
}
