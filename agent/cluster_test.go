package agent

import (
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/csiagent/csiagent/cluster"
)

// TestClusterMetrics: the fleet's counters as csi_agent_cluster_*
// metrics, none when the agent is in no cluster.
func TestClusterMetrics(t *testing.T) {
	none := clusterCollector{func() (cluster.Stats, bool) { return cluster.Stats{}, false }}
	if n := testutil.CollectAndCount(none); n != 0 {
		t.Errorf("in no cluster: %d metrics, want none", n)
	}
	c := clusterCollector{func() (cluster.Stats, bool) {
		return cluster.Stats{Connected: true, ClaimsHeld: 2, PendingReleases: 1, Revoked: 1, Conflicts: 5, LockWaits: 3, LocksHeld: 1}, true
	}}
	want := `
# HELP csi_agent_cluster_claim_conflicts_total Claims refused because another node held the volume.
# TYPE csi_agent_cluster_claim_conflicts_total counter
csi_agent_cluster_claim_conflicts_total 5
# HELP csi_agent_cluster_claims_held Volume claims this node holds (its claim records).
# TYPE csi_agent_cluster_claims_held gauge
csi_agent_cluster_claims_held 2
# HELP csi_agent_cluster_connected 1 while the node is registered in the fleet and its last etcd call answered, else 0.
# TYPE csi_agent_cluster_connected gauge
csi_agent_cluster_connected 1
`
	if err := testutil.CollectAndCompare(c, strings.NewReader(want), "csi_agent_cluster_connected", "csi_agent_cluster_claims_held", "csi_agent_cluster_claim_conflicts_total"); err != nil {
		t.Error(err)
	}
	if n := testutil.CollectAndCount(c); n != 7 {
		t.Errorf("%d metrics, want 7", n)
	}
}

// TestFenceCIDRs: configured networks are checked and normalised, a bad
// one is refused naming the flag; by default the host's addresses, each
// a one-address network, none of them loopback or link-local.
func TestFenceCIDRs(t *testing.T) {
	got, err := fenceCIDRs([]string{"10.0.3.7/24", "fd00::1/128"})
	if err != nil || !slices.Equal(got, []string{"10.0.3.0/24", "fd00::1/128"}) {
		t.Fatalf("configured: %v, %v", got, err)
	}
	if _, err := fenceCIDRs([]string{"10.0.3.7"}); err == nil || !strings.Contains(err.Error(), "--cluster-fence-cidrs") {
		t.Fatalf("an address without a prefix length: %v, want an error naming --cluster-fence-cidrs", err)
	}
	host, err := fenceCIDRs(nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range host {
		p := netip.MustParsePrefix(c)
		if p.Addr().IsLoopback() || p.Addr().IsLinkLocalUnicast() || p.Bits() != p.Addr().BitLen() {
			t.Errorf("host fencing network %s: want one global address", c)
		}
	}
}
