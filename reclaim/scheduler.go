package reclaim

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/csiagent/csiagent/pervolume"
)

// The csi-addons services (discovery names) whose volumes the agent
// reclaims: NodeReclaimSpace on published volumes (the schedule), and
// ControllerReclaimSpace on volumes published nowhere (on demand).
const (
	NodeService       = "reclaimspace.ReclaimSpaceNode"
	ControllerService = "reclaimspace.ReclaimSpaceController"
)

// Result is what one NodeReclaimSpace call reported.
type Result struct {
	Start     time.Time
	Duration  time.Duration
	PreUsage  int64 // bytes; -1 unknown
	PostUsage int64 // bytes; -1 unknown
}

// freed returns PreUsage-PostUsage (negative when usage grew) and whether
// both were known.
func (r Result) freed() (int64, bool) {
	if r.PreUsage < 0 || r.PostUsage < 0 {
		return 0, false
	}
	return r.PreUsage - r.PostUsage, true
}

// LogValue is how the scheduler logs a successful call.
func (r Result) LogValue() slog.Value {
	return slog.GroupValue(slog.Int64("pre_usage", r.PreUsage), slog.Int64("post_usage", r.PostUsage),
		slog.Duration("duration", r.Duration))
}

// Totals are one plugin's counters since the scheduler was built.
type Totals struct {
	pervolume.Totals
	// BytesFreed sums PreUsage-PostUsage of the successful runs where both
	// were known; a negative difference (usage grew) is included.
	BytesFreed int64
}

// Summary is what RunNow did.
type Summary struct {
	pervolume.Summary
	// BytesFreed sums PreUsage-PostUsage of the volumes reclaimed
	// successfully where both were known, negative differences included.
	BytesFreed int64
}

// Scheduler is the reclaim schedule: a pervolume.Scheduler whose job is
// NodeReclaimSpace, counting the bytes freed. Its methods are safe for
// concurrent use.
type Scheduler struct {
	// Run, Poke, ResetPlugin, Unsupported and Next are the scheduler's;
	// Totals and RunNow add the bytes freed to its counts.
	*pervolume.Scheduler[Result]

	mu    sync.Mutex
	freed map[string]int64 // by plugin
}

// New returns the reclaim schedule of cfg.Job, which makes the
// NodeReclaimSpace calls; it does nothing until Run or RunNow.
func New(cfg pervolume.Config[Result]) *Scheduler {
	s := &Scheduler{freed: map[string]int64{}}
	if cfg.Job != nil {
		cfg.Job = counted{cfg.Job, s}
	}
	s.Scheduler = pervolume.New(cfg)
	return s
}

// Totals returns the plugin's counters.
func (s *Scheduler) Totals(plugin string) Totals {
	t := s.Scheduler.Totals(plugin)
	s.mu.Lock()
	defer s.mu.Unlock()
	return Totals{Totals: t, BytesFreed: s.freed[plugin]}
}

// RunNow reclaims the given volumes now, as pervolume.Scheduler.RunNow
// does, and sums the bytes freed.
func (s *Scheduler) RunNow(ctx context.Context, vols []pervolume.Volume, progress func(pervolume.Volume, Result, error)) Summary {
	var freed int64 // progress is called one call at a time
	sum := s.Scheduler.RunNow(ctx, vols, func(v pervolume.Volume, r Result, err error) {
		if n, ok := r.freed(); ok && err == nil {
			freed += n
		}
		if progress != nil {
			progress(v, r, err)
		}
	})
	return Summary{Summary: sum, BytesFreed: freed}
}

// counted is the agent's job, counting the bytes each successful call
// freed (every successful call ends a run).
type counted struct {
	pervolume.Job[Result]
	s *Scheduler
}

func (c counted) Do(ctx context.Context, plugin, id string) (Result, error) {
	r, err := c.Job.Do(ctx, plugin, id)
	if n, ok := r.freed(); ok && err == nil {
		c.s.mu.Lock()
		c.s.freed[plugin] += n
		c.s.mu.Unlock()
	}
	return r, err
}
