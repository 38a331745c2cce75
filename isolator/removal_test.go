package isolator

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// deferredQueue is a Config.Deferred that keeps the work until the test
// runs it.
type deferredQueue struct{ fs []func() }

func (q *deferredQueue) later(f func()) { q.fs = append(q.fs, f) }

func (q *deferredQueue) runAll() {
	fs := q.fs
	q.fs = nil
	for _, f := range fs {
		f()
	}
}

// recordFiles lists the container and volume record files under the
// world's work dir.
func recordFiles(t *testing.T, w *world) []string {
	t.Helper()
	var out []string
	for _, pattern := range []string{
		filepath.Join(w.work, "isolators", "volume", "csi", "*", containerStateFile),
		filepath.Join(w.work, "csi", "*", "*", "volumes", "*", volumeStateFile),
	} {
		m, err := filepath.Glob(pattern)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, m...)
	}
	return out
}

// TestRemovalAfterTheAnswer: a Cleanup answers with its container and its
// volume forgotten; their records and the volume's mount directories are
// removed after it (Config.Deferred), and counted until then.
func TestRemovalAfterTheAnswer(t *testing.T) {
	w := newWorld(t)
	q := &deferredQueue{}
	iso := w.isolator(Config{Deferred: q.later})
	w.prepare(iso, w.request("c1", vol{"loop", "vol-1", "/data", false}))
	before := recordFiles(t, w)
	if len(before) != 2 {
		t.Fatalf("records after the Prepare: %v; want the container's and the volume's", before)
	}
	w.cleanup(iso, "c1")
	if c, v := iso.ListContainers(), iso.ListVolumes(); len(c)+len(v) > 0 {
		t.Errorf("after the Cleanup's answer: containers %v, volumes %v; want none", c, v)
	}
	if got := recordFiles(t, w); len(got) != 2 {
		t.Errorf("records at the answer: %v; want both, removed after it", got)
	}
	if n := iso.RemovalsPending(); n != 2 {
		t.Errorf("RemovalsPending() = %d at the answer; want 2", n)
	}
	q.runAll()
	if n := iso.RemovalsPending(); n != 0 {
		t.Errorf("RemovalsPending() = %d once they ran; want 0", n)
	}
	if err := iso.SettleRemovals(context.Background()); err != nil {
		t.Fatal(err)
	}
	w.checkEmpty(iso)
}

// TestRemovalCancelledByTheSameContainerAgain: a container prepared again
// (same id, same volume) before its earlier Cleanup's removals ran keeps
// its records and mounts: the new records' writes cancel the removals.
func TestRemovalCancelledByTheSameContainerAgain(t *testing.T) {
	w := newWorld(t)
	q := &deferredQueue{}
	iso := w.isolator(Config{Deferred: q.later})
	req := w.request("c1", vol{"loop", "vol-1", "/data", false})
	w.prepare(iso, req)
	w.cleanup(iso, "c1")
	w.prepare(iso, req)
	q.runAll()
	if n := iso.RemovalsPending(); n != 0 {
		t.Errorf("RemovalsPending() = %d; want 0", n)
	}
	if got := recordFiles(t, w); len(got) != 2 {
		t.Fatalf("records of the container prepared again: %v; want its own and its volume's", got)
	}
	w.check(iso)
	if _, err := os.Stat(filepath.Join(w.work, "isolators", "volume", "csi", "c1", containerStateFile)); err != nil {
		t.Fatal(err)
	}
	// And a new isolator on the same work dir finds it prepared.
	iso2 := w.run(Config{})
	if c := containerOf(iso2, "c1"); c == nil {
		t.Fatal("c1 lost across a restart")
	}
	w.check(iso2)
	w.cleanup(iso2, "c1")
	w.checkEmpty(iso2)
}

// TestCrashBeforeTheRemoval: the agent dies after a Cleanup's answer,
// before its removals: the next start finishes the cleanup from the
// records left (a container CLEANING, a volume without users) and
// leaves nothing.
func TestCrashBeforeTheRemoval(t *testing.T) {
	for _, reboot := range []bool{false, true} {
		t.Run(map[bool]string{false: "restart", true: "reboot"}[reboot], func(t *testing.T) {
			w := newWorld(t)
			q := &deferredQueue{}
			iso := w.isolator(Config{Deferred: q.later})
			w.prepare(iso, w.request("c1", vol{"loop", "vol-1", "/data", false}))
			w.prepare(iso, w.request("c2", vol{"plain", "vol-2", "data", false}))
			w.cleanup(iso, "c1")
			w.cleanup(iso, "c2")
			if got := recordFiles(t, w); len(got) != 4 {
				t.Fatalf("records at the answers: %v; want 4", got)
			}
			// Dies: q never runs.
			if reboot {
				w.reboot()
			}
			w.checkEmpty(w.run(Config{}))
		})
	}
}

// TestSettleRemovalsCutShort: removals not started when the settle's
// deadline passes (a clean stop on a slow disk) are dropped, not run
// later behind the stop's checkpoint; the next start finishes them.
func TestSettleRemovalsCutShort(t *testing.T) {
	w := newWorld(t)
	q := &deferredQueue{}
	iso := w.isolator(Config{Deferred: q.later})
	w.prepare(iso, w.request("c1", vol{"loop", "vol-1", "/data", false}))
	w.cleanup(iso, "c1")
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := iso.SettleRemovals(ctx); err == nil {
		t.Fatal("SettleRemovals with its context ended: nil; want its error")
	}
	if n := iso.RemovalsPending(); n != 0 {
		t.Errorf("RemovalsPending() = %d after the settle was cut short; want 0 (dropped)", n)
	}
	q.runAll()
	if got := recordFiles(t, w); len(got) != 2 {
		t.Fatalf("records after the dropped removals' work ran: %v; want both kept", got)
	}
	w.checkEmpty(w.run(Config{}))
}

// TestRemovalsQueued: without Config.Deferred (the daemon), the removals
// of many cleanups wait in a queue run by at most maxParallelRemovals
// goroutines; every record goes.
func TestRemovalsQueued(t *testing.T) {
	w := newWorld(t)
	iso := w.isolator(Config{})
	iso.cfg.Deferred = nil
	const n = 3 * maxParallelRemovals
	for i := range n {
		w.prepare(iso, w.request(fmt.Sprintf("c%d", i), vol{"plain", fmt.Sprintf("vol-%d", i), "data", false}))
	}
	for i := range n {
		w.cleanup(iso, fmt.Sprintf("c%d", i))
		rm := &iso.removals
		rm.mu.Lock()
		workers := rm.workers
		rm.mu.Unlock()
		if workers > maxParallelRemovals {
			t.Fatalf("%d goroutines run the removals; want at most %d", workers, maxParallelRemovals)
		}
	}
	if err := iso.SettleRemovals(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := recordFiles(t, w); len(got) > 0 {
		t.Errorf("records after the removals settled: %v", got)
	}
	rm := &iso.removals
	rm.mu.Lock()
	defer rm.mu.Unlock()
	// (Its goroutines end right after the last removal, which may be
	// just after the settle.)
	if len(rm.queue) != 0 {
		t.Errorf("after the removals settled: %d queued; want none", len(rm.queue))
	}
}

// TestRemovalFailureCounted: a torn-down volume's mount directories that
// something wrote into before their removal ran are left, with an error
// logged, and counted (RemovalsFailed: csi_agent_removals_failed_total),
// the only trace of them once no record names them.
func TestRemovalFailureCounted(t *testing.T) {
	w := newWorld(t)
	q := &deferredQueue{}
	iso := w.isolator(Config{Deferred: q.later})
	w.prepare(iso, w.request("c1", vol{"loop", "vol-1", "/data", false}))
	var staging string
	filepath.WalkDir(w.work, func(p string, d os.DirEntry, err error) error {
		if err == nil && d.IsDir() && d.Name() == "staging" {
			staging = p
		}
		return err
	})
	if staging == "" {
		t.Fatal("no staging directory under the work dir")
	}
	w.cleanup(iso, "c1")
	if err := os.WriteFile(filepath.Join(staging, "late"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	q.runAll()
	if n := iso.RemovalsFailed(); n != 1 {
		t.Errorf("RemovalsFailed() = %d after a removal found data in the volume's directories; want 1", n)
	}
	if _, err := os.Stat(filepath.Join(staging, "late")); err != nil {
		t.Errorf("the data written after the teardown: %v; want it left", err)
	}
	os.Remove(filepath.Join(staging, "late"))
}
