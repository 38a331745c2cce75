package pervolume

import (
	"context"
	"errors"
	"log/slog"
	"time"
)

// Defaults and bounds. A named constant says how long; see doc.go for the
// retried codes.
const (
	// DefaultMaxConcurrent is the scheduler-wide cap on calls in flight
	// when Config.MaxConcurrent is not positive.
	DefaultMaxConcurrent = 2
	// DefaultPluginMaxConcurrent is the per-plugin cap when
	// Policy.MaxConcurrent is not positive.
	DefaultPluginMaxConcurrent = 1
	// DefaultTimeout bounds one call when Policy.Timeout is not positive.
	DefaultTimeout = 5 * time.Minute
	// RetryBase is the first delay before a retry (Aborted, NotFound of a
	// volume that is still published); it doubles on each retry.
	RetryBase = time.Second
	// RetryMaxAttempts bounds the calls made for one volume in one cycle,
	// the first included. Retries are also bounded by the cycle: none is
	// made at or after the volume's next slot.
	RetryMaxAttempts = 5
	// MaxRescan bounds the time between two reads of Job.Volumes() and of
	// the policies when nothing pokes the scheduler. The scheduler also
	// rescans at least once per shortest interval of a scheduled plugin.
	MaxRescan = time.Minute
)

// ErrNotPublished is what Job.Do wraps when the volume is no longer
// published: the scheduler forgets the volume silently.
var ErrNotPublished = errors.New("volume is not published")

// Policy is one plugin's schedule.
type Policy struct {
	// Interval between two runs on one volume; 0 leaves the plugin's
	// volumes unscheduled (RunNow still works).
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

// Job is the work a Scheduler runs on each volume, implemented by the
// agent. Its methods are called from several goroutines at once and never
// with a scheduler lock held. R is what one call reports; it is logged
// with a successful run (implement slog.LogValuer to choose how).
type Job[R any] interface {
	// Volumes returns the volumes the job runs on now.
	Volumes() []Volume
	// Do makes one call under the volume's lock and records the result
	// (or the error) with the volume. Its error is the plugin's gRPC
	// status error, or wraps ErrNotPublished.
	Do(ctx context.Context, plugin, id string) (R, error)
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
	// LastError is the error that ended the last failed run; nil if none.
	LastError error
}

// Summary is what RunNow did.
type Summary struct {
	// Volumes counts the volumes whose run succeeded.
	Volumes int
	// Failures counts the volumes whose run failed, including volumes that
	// were not published and those left when ctx ended:
	// Volumes+Failures is the number of volumes given.
	Failures int
}

// Config configures a Scheduler.
type Config[R any] struct {
	// Name names the job in logs: every record has the attribute
	// job=Name, and messages start with "Name: ". Required.
	Name string
	// Job does the calls and persistence. Required.
	Job Job[R]
	// Policy returns a plugin's policy; it is read on every rescan. Nil:
	// every plugin has the zero Policy (not scheduled).
	Policy func(plugin string) Policy
	// MaxConcurrent caps this scheduler's calls in flight, periodic and
	// RunNow together; not positive: DefaultMaxConcurrent.
	MaxConcurrent int
	// PokeSettle is the least time between a rescan and the next one a
	// Poke asks for (pokes meanwhile share one): a host preparing and
	// cleaning up containers back to back pokes after every call, and
	// each rescan reads every volume. Zero: a poke rescans at once.
	PokeSettle time.Duration
	// Clock tells the time and makes timers; nil: RealClock().
	Clock Clock
	// Logger; nil: logs are discarded.
	Logger *slog.Logger
}
