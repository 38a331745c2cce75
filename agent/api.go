package agent

import (
	"context"
	"time"

	"github.com/csiagent/csiagent/apiserver"
	"github.com/csiagent/csiagent/pervolume"
	"github.com/csiagent/csiagent/pluginconfig"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	"github.com/csiagent/csiagent/reclaim"
	"github.com/csiagent/csiagent/volumestats"
)

// apiPlugins is the agent's plugin set as the Agent API (package
// apiserver) sees it.
type apiPlugins struct{ controllerPlugins }

var _ apiserver.Plugins = apiPlugins{}

// Statuses lists the plugins' status with their reclaim schedules.
func (p apiPlugins) Statuses() ([]*agentv1.Plugin, []*pluginconfig.FileError) {
	return p.a.snapshot()
}

func (p apiPlugins) Changed() <-chan struct{} { return p.a.set.Changed() }

// apiSchedules is the reclaim and key rotation schedules as the Agent API
// sees them.
type apiSchedules struct{ a *Agent }

var _ apiserver.Schedules = apiSchedules{}

func (s apiSchedules) NextReclaim(plugin, id string) (time.Time, bool) {
	return s.a.reclaimer.Next(plugin, id)
}

func (s apiSchedules) NextKeyRotation(plugin, id string) (time.Time, bool) {
	return s.a.keyRotator.Next(plugin, id)
}

func (s apiSchedules) Reclaimable() []pervolume.Volume { return reclaimJob(s).Volumes() }

func (s apiSchedules) ReclaimNow(ctx context.Context, vols []pervolume.Volume, progress func(pervolume.Volume, reclaim.Result, error)) reclaim.Summary {
	return s.a.reclaimer.RunNow(ctx, vols, progress)
}

// apiStats is the volume stats poller as the Agent API sees it.
type apiStats struct{ a *Agent }

var _ apiserver.Stats = apiStats{}

// Refresh polls every volume the poller polls now.
func (s apiStats) Refresh(ctx context.Context) { s.a.stats.Refresh(ctx, statsSource(s).Volumes()) }

func (s apiStats) Get(plugin, id string) (volumestats.Stats, bool) { return s.a.stats.Get(plugin, id) }
