// Package reclaim is the agent's csi-addons ReclaimSpace schedule:
// NodeReclaimSpace periodically on every published volume of every plugin
// that offers NodeService, and on demand (RunNow). It is a
// pervolume.Scheduler (staggered slots, caps, recovery, persisted next
// runs; see package pervolume) whose job is NodeReclaimSpace and whose
// result is Result: usage before and after the call. Scheduler adds to the
// pervolume counts the bytes freed.
//
// The package makes no RPC, takes no lock and writes no file: the agent
// implements the job (pervolume.Job[Result]: the call under the volume's
// lock, recording the result with the volume, persisting the next run
// time) and tells the scheduler when things change (Poke, ResetPlugin).
//
// # Schedule and caps
//
// A volume runs once per Policy.Interval of its plugin, at a fixed offset
// inside the interval, so that a host's volumes do not all trim at once;
// across agent restarts no cycle is run twice and none is skipped. At most
// Config.MaxConcurrent reclaims are in flight (the agent's
// --reclaim-max-concurrent) and Policy.MaxConcurrent per plugin,
// periodic and RunNow calls counted together. Key rotation is another
// pervolume.Scheduler with its own caps: reclaims and key rotations do not
// wait for each other's capacity.
//
// # Errors
//
// Recovery follows the error table of csi-addons' ReclaimSpace
// specification (package pervolume applies it). Every retry is a new call:
//
//	Aborted                    retry after 1s, 2s, 4s, ... (pervolume.RetryBase
//	                           doubling), at most pervolume.RetryMaxAttempts
//	                           calls and never at or after the volume's next
//	                           slot; then a failure
//	NotFound                   if the volume is no longer published:
//	                           forgotten silently; otherwise as Aborted
//	InvalidArgument,
//	Unauthenticated            failure, no retry (the agent recorded the error
//	                           with the volume); next cycle
//	Unknown, DeadlineExceeded,
//	any other error            failure; next cycle
//	Unimplemented              failure; the volume is Unsupported (its
//	                           filesystem or device cannot discard): it is not
//	                           scheduled until ResetPlugin (or a successful
//	                           call, e.g. by RunNow); the plugin's other
//	                           volumes go on
//	wraps pervolume.ErrNotPublished
//	                           forgotten silently
//
// Totals counts runs (a volume's cycle, its retries included), failed runs,
// bytes freed (PreUsage-PostUsage of successful runs, negative differences
// included, unknown usages skipped) and the last error; RunNow's Summary
// counts the same way. The agent names the job "reclaim": its logs carry
// job=reclaim, and a failed run logs "reclaim: failed".
//
// # When not to call
//
// Do not call RunNow to catch up after a restart: Run runs the missed
// cycles by itself. Do not call ResetPlugin on a failed call: it is for a
// plugin whose process or config changed. Poke is cheap and never blocks;
// call it whenever volumes are published or unpublished or a policy
// changes, rather than waiting for the next rescan. This package does not
// do ControllerReclaimSpace (inactive volumes): the agent calls it on
// demand only (ControllerService).
package reclaim
