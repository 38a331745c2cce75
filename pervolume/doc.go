// Package pervolume runs a job periodically on every published volume of
// every plugin, staggered so that a host's volumes do not all run at once,
// and capped so that the job never overloads the host. It also runs the
// job on demand (RunNow) through the same caps and recovery. The agent
// builds one Scheduler per job: reclaiming space (package reclaim) and
// rotating encryption keys, each with its own name, caps and result type.
//
// The package makes no RPC, takes no lock and writes no file: the agent
// implements Job (the call under the volume's lock, recording results
// with the volume, persisting the next run time) and tells the scheduler
// when things change (Poke, ResetPlugin). Job and Config.Policy are called
// from several goroutines at once, never with a scheduler lock held. Every
// log record carries job=Config.Name and its message starts with the name
// ("reclaim: failed", "key-rotation: failed").
//
// # Schedule
//
// A volume runs once per Policy.Interval of its plugin, at a fixed offset
// inside the interval: its slots are the Unix epoch + k*Interval + offset,
// with offset = FNV-64a(plugin + "\x00" + id) mod Interval. After a run
// the scheduler persists (Job.Schedule) the volume's first slot after the
// run's end: normally the next one; a run that overran its cycle skips to
// the following slot rather than running twice in a row. A volume's
// persisted Volume.Next, read when the scheduler first sees the volume,
// means:
//
//   - zero (never scheduled): its first slot after Volume.Since (when it
//     was published), persisted only by that run (it follows from Since);
//     with Since unknown, its next slot after now, persisted at once;
//   - in the future, at most one interval away: kept;
//   - more than one interval away (the interval was shortened): its next
//     slot after now, persisted;
//   - in the past (missed while the agent was down, or cut short by a
//     stop): run once as soon as the caps allow, then the next slot.
//
// So across agent restarts no cycle is run twice and none is skipped. A
// run cut short because Run's context ended is not a run: nothing is
// persisted, and the next Run makes it. An Interval of 0 leaves the
// plugin unscheduled; a changed Interval moves its volumes by the rules
// above.
//
// Run reads Job.Volumes() and the policies when poked, and otherwise at
// least once per shortest interval of a scheduled plugin and once per
// MaxRescan. It sleeps on the Clock until the earliest due time, a Poke, or
// a call's end; it never polls.
//
// # Caps
//
// At most Config.MaxConcurrent calls of the scheduler are in flight and
// Policy.MaxConcurrent per plugin, periodic and RunNow calls counted
// together; RunNow calls waiting for capacity go first. Two schedulers do
// not share caps. Each call has the plugin's Policy.Timeout as its context
// deadline. A retry's backoff holds no capacity.
//
// # Errors
//
// Recovery follows the error table of csi-addons' ReclaimSpace
// specification, for every job (key rotation uses it too). Every retry is
// a new Job.Do call:
//
//	Aborted                    retry after 1s, 2s, 4s, ... (RetryBase doubling),
//	                           at most RetryMaxAttempts calls and never at or
//	                           after the volume's next slot; then a failure
//	NotFound                   if Job.Volumes() no longer lists the volume:
//	                           forgotten silently; otherwise as Aborted
//	InvalidArgument,
//	Unauthenticated            failure, no retry (the Job recorded the error
//	                           with the volume); next cycle
//	Unknown, DeadlineExceeded,
//	any other error            failure; next cycle
//	Unimplemented              failure; the volume is Unsupported (the plugin
//	                           cannot do the job on it, e.g. its filesystem
//	                           cannot discard): it is not scheduled until
//	                           ResetPlugin (or a successful call, e.g. by
//	                           RunNow); the plugin's other volumes go on
//	wraps ErrNotPublished      forgotten silently
//
// Totals counts runs (a volume's cycle, its retries included), failed runs
// and the last error; what a successful run reports (R) is the job's to
// count (RunNow's progress, or the Job itself).
//
// # When not to call
//
// Do not call RunNow to catch up after a restart: Run runs the missed
// cycles by itself. Do not call ResetPlugin on a failed call: it is for a
// plugin whose process or config changed. Poke is cheap and never blocks;
// call it whenever volumes are published or unpublished or a policy
// changes, rather than waiting for the next rescan.
package pervolume
