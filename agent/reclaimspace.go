package agent

import (
	"context"
	"time"

	"google.golang.org/grpc"

	"github.com/csiagent/csiagent/isolator"
	"github.com/csiagent/csiagent/pervolume"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	"github.com/csiagent/csiagent/proto/reclaimspace"
	"github.com/csiagent/csiagent/reclaim"
	"github.com/csiagent/csiagent/supervisor"
)

// reclaimJob is the reclaim schedule's job: NodeReclaimSpace on the
// isolator's published volumes.
type reclaimJob struct{ a *Agent }

var _ pervolume.Job[reclaim.Result] = reclaimJob{}

// Volumes lists published volumes of plugins that offer the node reclaim
// service (as discovered when they became ready).
func (j reclaimJob) Volumes() []pervolume.Volume {
	return j.a.publishedOffering(reclaim.NodeService, func(pv isolator.PublishedVolume) time.Time { return pv.NextReclaim })
}

// Do reclaims the volume's space once.
func (j reclaimJob) Do(ctx context.Context, plugin, id string) (reclaim.Result, error) {
	res, err := j.a.iso.ReclaimSpace(ctx, liveReclaim{j.a.set.Node(plugin)}, plugin, id)
	if res == nil { // err wraps isolator.ErrNotPublished if the volume is gone
		return reclaim.Result{}, notPublished(err)
	}
	return reclaim.Result{
		Start: res.GetStart().AsTime(), Duration: res.GetDuration().AsDuration(),
		PreUsage: res.GetPreUsage(), PostUsage: res.GetPostUsage(),
	}, err
}

func (j reclaimJob) Schedule(plugin, id string, next time.Time) error {
	return j.a.iso.ScheduleReclaim(context.Background(), plugin, id, next)
}

// liveReclaim calls NodeReclaimSpace on the plugin's current connection.
type liveReclaim struct{ node supervisor.LiveNode }

func (l liveReclaim) NodeReclaimSpace(ctx context.Context, in *reclaimspace.NodeReclaimSpaceRequest, opts ...grpc.CallOption) (*reclaimspace.NodeReclaimSpaceResponse, error) {
	c, err := l.node.Conn(ctx, reclaim.NodeService)
	if err != nil {
		return nil, err
	}
	return reclaimspace.NewReclaimSpaceNodeClient(c).NodeReclaimSpace(ctx, in, opts...)
}

// reclaimTotals reports a plugin's reclaim schedule and totals.
func (a *Agent) reclaimTotals(typ string) *agentv1.ReclaimTotals {
	if a.reclaimer == nil {
		return nil
	}
	t := a.reclaimer.Totals(typ)
	out := &agentv1.ReclaimTotals{Scheduled: true, Runs: t.Runs, Failures: t.Failures, BytesReclaimed: t.BytesFreed,
		UnsupportedVolumes: a.reclaimer.Unsupported(typ)}
	if t.LastError != nil {
		out.LastError = t.LastError.Error()
	}
	switch {
	case a.reclaimPolicy(typ).Interval == 0:
		out.Scheduled, out.Reason = false, "disabled (interval 0)"
	case !a.set.Offers(typ, reclaim.NodeService):
		out.Scheduled, out.Reason = false, "the plugin does not offer "+reclaim.NodeService
	}
	return out
}
