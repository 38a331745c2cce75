package reclaim

import (
	"context"
	"errors"
	"log/slog"
	"time"
)

// Defaults and bounds. A named constant says how long; see doc.go for the
// retried codes.
const (
	// DefaultMaxConcurrent is the agent-wide cap on calls in flight when
	// Config.MaxConcurrent is not positive.
	DefaultMaxConcurrent = 2
	// DefaultPluginMaxConcurrent is the per-plugin cap when
	// Policy.MaxConcurrent is not positive.
	DefaultPluginMaxConcurrent = 1
	// DefaultTimeout bounds one NodeReclaimSpace call when Policy.Timeout
	// is not positive.
	DefaultTimeout = 5 * time.Minute
	// RetryBase is the first delay before a retry (Aborted, NotFound of a
	// volume that is still published); it doubles on each retry.
	RetryBase = time.Second
	// RetryMaxAttempts bounds the calls made for one volume in one cycle,
	// the first included. Retries are also bounded by the cycle: none is
	// made at or after the volume's next slot.
	RetryMaxAttempts = 5
	// MaxRescan bounds the time between two reads of Target.Volumes() and
	// of the policies when nothing pokes the scheduler. The scheduler also
	// rescans at least once per shortest interval of a scheduled plugin.
	MaxRescan = time.Minute
)

// The csi-addons services (discovery names) whose volumes the agent
// reclaims: NodeReclaimSpace on published volumes (the schedule), and
// ControllerReclaimSpace on volumes published nowhere (on demand).
const (
	NodeService       = "reclaimspace.ReclaimSpaceNode"
	ControllerService = "reclaimspace.ReclaimSpaceController"
)

// ErrNotPublished is what Target.Reclaim wraps when the volume is no longer
// published: the scheduler forgets the volume silently.
var ErrNotPublished = errors.New("volume is not published")

// Policy is one plugin's reclaim policy.
type Policy struct {
	// Interval between two runs on one volume; 0 disables periodic reclaim
	// for the plugin (RunNow still works).
	Interval time.Duration
	// Timeout of one call (the call's context deadline); not positive:
	// DefaultTimeout.
	Timeout time.Duration
	// MaxConcurrent calls in flight for this plugin; not positive:
	// DefaultPluginMaxConcurrent.
	MaxConcurrent int
}

// Volume is a published volume as the agent knows it.
type Volume struct {
	Plugin, ID string
	// Next is the persisted next run time; zero: never scheduled.
	Next time.Time
	// Since is when the volume was published; zero: unknown. A volume
	// never scheduled runs first at its first slot after Since, which
	// therefore needs no persisting until that run.
	Since time.Time
}

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

// Target is implemented by the agent. Its methods are called from several
// goroutines at once and never with a scheduler lock held.
type Target interface {
	// Volumes returns the volumes published now.
	Volumes() []Volume
	// Reclaim makes one NodeReclaimSpace call under the volume's lock and
	// records the result (or the error) with the volume. Its error is the
	// plugin's gRPC status error, or wraps ErrNotPublished.
	Reclaim(ctx context.Context, plugin, id string) (Result, error)
	// Schedule persists the next run time with the volume.
	Schedule(plugin, id string, next time.Time) error
}

// Totals are one plugin's counters since the scheduler was built.
type Totals struct {
	// Runs counts finished runs: one per volume and cycle (or RunNow
	// volume), its retries included, whatever the outcome. Volumes that
	// turned out unpublished and runs cut short by the caller's context are
	// not counted.
	Runs int64
	// Failures counts the Runs that ended with an error.
	Failures int64
	// BytesFreed sums PreUsage-PostUsage of the successful runs where both
	// were known; a negative difference (usage grew) is included.
	BytesFreed int64
	// LastError is the error that ended the last failed run; nil if none.
	LastError error
}

// Summary is what RunNow did.
type Summary struct {
	// Volumes counts the volumes reclaimed successfully.
	Volumes int
	// BytesFreed sums PreUsage-PostUsage of those where both were known,
	// negative differences included.
	BytesFreed int64
	// Failures counts the volumes whose run failed, including volumes that
	// were not published and those left when ctx ended:
	// Volumes+Failures is the number of volumes given.
	Failures int
}

// Config configures a Scheduler.
type Config struct {
	// Target does the calls and persistence. Required.
	Target Target
	// Policy returns a plugin's policy; it is read on every rescan. Nil:
	// every plugin has the zero Policy (not scheduled).
	Policy func(plugin string) Policy
	// MaxConcurrent caps the calls in flight agent-wide, periodic and
	// RunNow together; not positive: DefaultMaxConcurrent.
	MaxConcurrent int
	// Clock tells the time and makes timers; nil: RealClock().
	Clock Clock
	// Logger; nil: logs are discarded.
	Logger *slog.Logger
}
