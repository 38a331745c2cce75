package agent

import (
	"context"
	"time"

	"google.golang.org/grpc"

	"github.com/csiagent/csiagent/apiserver"
	"github.com/csiagent/csiagent/isolator"
	"github.com/csiagent/csiagent/pluginconfig"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	"github.com/csiagent/csiagent/proto/reclaimspace"
	"github.com/csiagent/csiagent/reclaim"
	"github.com/csiagent/csiagent/supervisor"
)

// Reclaim defaults (agent-wide; a plugin's config may override them).
const (
	DefaultReclaimInterval      = 7 * 24 * time.Hour
	DefaultReclaimTimeout       = 10 * time.Minute
	DefaultReclaimMaxConcurrent = 2
	// DefaultReclaimPluginMax is the default per-plugin cap.
	DefaultReclaimPluginMax = 1
)

// policy is a schedule's policy for plugin typ: the overrides of its
// config (picked by which) on the agent's defaults; the zero policy (not
// scheduled) for a plugin no config defines.
func (a *Agent) policy(typ string, defaults reclaim.Policy, which func(*pluginconfig.Settings) *pluginconfig.ReclaimPolicy) reclaim.Policy {
	p := a.set.Get(typ)
	if p == nil {
		return reclaim.Policy{}
	}
	if s := p.Config().Info.Settings; s != nil {
		return overridden(defaults, which(s))
	}
	return defaults
}

// reclaimPolicy is a plugin's reclaim schedule (csiagent.reclaim_space).
func (a *Agent) reclaimPolicy(typ string) reclaim.Policy {
	return a.policy(typ, a.cfg.ReclaimDefaults, func(s *pluginconfig.Settings) *pluginconfig.ReclaimPolicy { return s.ReclaimSpace })
}

// keyRotationPolicy is a plugin's key rotation schedule
// (csiagent.key_rotation). The interval is 0 (not scheduled) unless set:
// rotating a key is the storage owner's decision, and a plugin that needs
// secrets for it gets none from a schedule.
func (a *Agent) keyRotationPolicy(typ string) reclaim.Policy {
	return a.policy(typ, a.cfg.KeyRotationDefaults, func(s *pluginconfig.Settings) *pluginconfig.ReclaimPolicy { return s.KeyRotation })
}

// overridden is a schedule's policy with a plugin config's overrides (nil:
// none).
func overridden(p reclaim.Policy, o *pluginconfig.ReclaimPolicy) reclaim.Policy {
	if o == nil {
		return p
	}
	if o.Interval != nil {
		p.Interval = time.Duration(*o.Interval)
	}
	if o.Timeout != nil {
		p.Timeout = time.Duration(*o.Timeout)
	}
	if o.MaxConcurrent != nil {
		p.MaxConcurrent = *o.MaxConcurrent
	}
	return p
}

// reclaimTarget lets the scheduler reclaim the isolator's volumes.
type reclaimTarget struct{ a *Agent }

var _ reclaim.Target = reclaimTarget{}

// Volumes lists published volumes of plugins that offer the node reclaim
// service (as discovered when they became ready).
func (t reclaimTarget) Volumes() []reclaim.Volume {
	return t.a.publishedOffering(reclaim.NodeService, func(pv isolator.PublishedVolume) time.Time { return pv.NextReclaim })
}

// publishedOffering lists the published volumes of plugins that offer
// service, each with its next run (picked by next).
func (a *Agent) publishedOffering(service string, next func(isolator.PublishedVolume) time.Time) []reclaim.Volume {
	var out []reclaim.Volume
	offers := map[string]bool{}
	for _, pv := range a.iso.Published() {
		ok, seen := offers[pv.Plugin]
		if !seen {
			ok = a.set.Offers(pv.Plugin, service)
			offers[pv.Plugin] = ok
		}
		if ok {
			out = append(out, reclaim.Volume{Plugin: pv.Plugin, ID: pv.ID, Next: next(pv), Since: pv.Since})
		}
	}
	return out
}

func (t reclaimTarget) Reclaim(ctx context.Context, plugin, id string) (reclaim.Result, error) {
	res, err := t.a.iso.ReclaimSpace(ctx, liveReclaim{t.a.set.Node(plugin)}, plugin, id)
	if res == nil { // err wraps reclaim.ErrNotPublished if the volume is gone
		return reclaim.Result{}, err
	}
	return reclaim.Result{
		Start: res.GetStart().AsTime(), Duration: res.GetDuration().AsDuration(),
		PreUsage: res.GetPreUsage(), PostUsage: res.GetPostUsage(),
	}, err
}

func (t reclaimTarget) Schedule(plugin, id string, next time.Time) error {
	return t.a.iso.ScheduleReclaim(context.Background(), plugin, id, next)
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

// controllerConn waits for the plugin's controller service to be ready
// and returns the connection that serves service there; errors are status
// errors.
func (a *Agent) controllerConn(ctx context.Context, typ, service string) (*grpc.ClientConn, error) {
	_, conn, err := a.ready(ctx, typ, pluginconfig.ControllerService)
	if err != nil {
		return nil, apiserver.Status(err)
	}
	return a.set.ConnFor(typ, pluginconfig.ControllerService, service, conn), nil
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
