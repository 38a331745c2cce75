package isolator

import (
	"context"
	"path/filepath"
	"sync"
	"sync/atomic"

	"github.com/csiagent/csiagent/mount"
)

// removal is what a finished teardown or cleanup leaves to remove after
// its answer: a volume's mount directories (tree) and the record file
// (file) and directory (dir) of a volume or container that memory has
// already forgotten. file "" keeps the record (already removed); tree ""
// has none.
//
// None of it needs to be gone before the answer. A record left by a crash
// is a container CLEANING or a volume without users in a teardown state,
// which recovery finishes (each step idempotent), as after a crash just
// before the removal; a mount tree no record claims is removed by
// recovery (removeOrphanDirs). Done in the answer, these unlinks and
// rmdirs were a third of a Cleanup's own time (each waits for its discard
// on a filesystem mounted discard).
type removal struct {
	kind, name string // "volume" or "container", and which, for the logs
	tree       string
	pool       *mount.TreePool // where tree goes, if fit (nil: removed)
	dir, file  string
	started    bool
	done       chan struct{}
}

// removals holds the removals not finished yet, by record directory.
type removals struct {
	mu      sync.Mutex
	pending map[string]*removal
	idle    chan struct{} // closed when pending empties; nil: none waits
	queue   []*removal    // to run, oldest first (without Config.Deferred)
	workers int           // goroutines running the queue
	// failed counts the removals that left mount directories or a record
	// (RemovalsFailed).
	failed atomic.Uint64
}

// maxParallelRemovals is how many removals run at once: each mostly waits
// on the disk.
const maxParallelRemovals = 4

// removeLater forgets r's record (drop, under iso.mu) at once and removes
// what r names in the background (Config.Deferred, or the queue's
// goroutines). A record written to
// r.dir meanwhile (the same container or volume again) cancels it
// (claimDir).
func (iso *Isolator) removeLater(r *removal, drop func()) {
	iso.mu.Lock()
	drop()
	iso.mu.Unlock()
	iso.cfg.OnChange()
	r.done = make(chan struct{})
	rm := &iso.removals
	rm.mu.Lock()
	if rm.pending == nil {
		rm.pending = map[string]*removal{}
	}
	for old := rm.pending[r.dir]; old != nil; old = rm.pending[r.dir] {
		if !old.started {
			rm.forgetLocked(old) // r removes what old would have
			continue
		}
		rm.mu.Unlock()
		<-old.done
		rm.mu.Lock()
	}
	rm.pending[r.dir] = r
	if run := iso.cfg.Deferred; run != nil {
		rm.mu.Unlock()
		run(func() { iso.remove(r) })
		return
	}
	// A queue and at most maxParallelRemovals goroutines, however many
	// removals a Reconcile leaves at once.
	rm.queue = append(rm.queue, r)
	if rm.workers < maxParallelRemovals {
		rm.workers++
		go iso.runRemovals()
	}
	rm.mu.Unlock()
}

// runRemovals runs the queued removals until none is left.
func (iso *Isolator) runRemovals() {
	rm := &iso.removals
	for {
		rm.mu.Lock()
		if len(rm.queue) == 0 {
			rm.workers--
			rm.mu.Unlock()
			return
		}
		r := rm.queue[0]
		rm.queue[0] = nil
		rm.queue = rm.queue[1:]
		rm.mu.Unlock()
		iso.remove(r)
	}
}

// remove does removal r unless a write to its directory cancelled it.
func (iso *Isolator) remove(r *removal) {
	rm := &iso.removals
	rm.mu.Lock()
	if rm.pending[r.dir] != r {
		rm.mu.Unlock()
		return
	}
	r.started = true
	rm.mu.Unlock()
	defer iso.finish(r)
	if r.tree != "" {
		if err := iso.mounts.RecycleTree(r.pool, r.tree); err != nil {
			left := "left, with its record, for the next start (which redoes the teardown first, each step idempotent)"
			if r.file == "" {
				left = "left, and no record names them any more (its claim is released); remove them once what is mounted there is unmounted"
			}
			iso.log.Error("removing a torn-down volume's mount directories (something was mounted or written in them after the teardown): "+left, r.kind, r.name, "path", r.tree, "error", err)
			rm.failed.Add(1)
			return
		}
	}
	if r.file == "" {
		return
	}
	if _, err := iso.commit.Remove(filepath.Join(r.dir, r.file)); err != nil {
		iso.log.Error("removing a record; the next start finishes its "+r.kind+"'s cleanup", r.kind, r.name, "error", err)
		rm.failed.Add(1)
		return
	}
	if _, err := iso.commit.Remove(r.dir); err != nil {
		iso.log.Warn("removing "+r.kind+" checkpoint directory", r.kind, r.name, "error", err)
	}
	if iso.cfg.Deferred != nil {
		// Only where the removals run where the caller says (the fake
		// world: on the calling goroutine). On the daemon's own
		// goroutines the point would fall between the next operation's
		// points in an order the scheduler picks, and the crash tests
		// that replay points by number need one order; the removals'
		// crash states are the syscalls TestCrashStates records.
		iso.cfg.CrashPoint("checkpoint " + r.kind + " removed")
	}
}

// finish ends removal r: a write waiting for its directory goes on.
func (iso *Isolator) finish(r *removal) {
	rm := &iso.removals
	rm.mu.Lock()
	defer rm.mu.Unlock()
	rm.dropLocked(r)
}

// dropLocked takes r out of the pending removals (rm.mu held) and wakes
// whoever waits for it or for none to be left.
func (rm *removals) dropLocked(r *removal) {
	rm.forgetLocked(r)
	if len(rm.pending) == 0 && rm.idle != nil {
		close(rm.idle)
		rm.idle = nil
	}
}

// forgetLocked takes r out of the pending removals (rm.mu held) and wakes
// whoever waits for it; no one waiting for none to be left (see
// dropLocked).
func (rm *removals) forgetLocked(r *removal) {
	delete(rm.pending, r.dir)
	close(r.done)
}

// claimDir, before a record is written into dir, cancels the removal of
// dir not started yet, or waits for the one running to end: the record
// then is the new one's, and whatever the removal would have removed is
// the new one's too.
func (iso *Isolator) claimDir(dir string) {
	rm := &iso.removals
	rm.mu.Lock()
	r := rm.pending[dir]
	if r == nil {
		rm.mu.Unlock()
		return
	}
	if !r.started {
		rm.dropLocked(r)
		rm.mu.Unlock()
		return
	}
	rm.mu.Unlock()
	<-r.done
}

// RemovalsFailed counts the removals since start that left a torn-down
// volume's mount directories (something was mounted or written in them),
// or a record (the next start finishes that cleanup).
func (iso *Isolator) RemovalsFailed() uint64 { return iso.removals.failed.Load() }

// RemovalsPending is the number of removals not done yet.
func (iso *Isolator) RemovalsPending() int {
	rm := &iso.removals
	rm.mu.Lock()
	defer rm.mu.Unlock()
	return len(rm.pending)
}

// SettleRemovals waits until every removal is done, or ctx ends: at a
// clean stop, so that the start image (atomicfile.WriteImage) and the
// next start find none left. When ctx ends, the removals not started are
// dropped (what they would have removed the next start finishes); those
// running go on (RemovalsPending counts them).
func (iso *Isolator) SettleRemovals(ctx context.Context) error {
	rm := &iso.removals
	rm.mu.Lock()
	if len(rm.pending) == 0 {
		rm.mu.Unlock()
		return nil
	}
	if rm.idle == nil {
		rm.idle = make(chan struct{})
	}
	idle := rm.idle
	rm.mu.Unlock()
	select {
	case <-idle:
		return nil
	case <-ctx.Done():
		rm.mu.Lock()
		defer rm.mu.Unlock()
		for _, r := range rm.pending {
			if !r.started {
				rm.dropLocked(r)
			}
		}
		return ctx.Err()
	}
}
