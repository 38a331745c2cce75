package pervolume

import (
	"context"
	"slices"
)

// Capacity: at most maxConcurrent calls in flight agent-wide and
// Policy.MaxConcurrent per plugin, periodic and RunNow calls alike.
// Waiting RunNow calls are served first, oldest first: after every change
// no waiter fits, so the loop's non-blocking take never jumps the queue.

func (s *Scheduler[R]) fitsLocked(plugin string) bool {
	if s.inflight >= s.maxConcurrent {
		return false
	}
	ps := s.pluginLocked(plugin)
	return ps.inflight < ps.policy.MaxConcurrent
}

func (s *Scheduler[R]) takeLocked(plugin string) {
	s.inflight++
	s.pluginLocked(plugin).inflight++
}

// release frees one call's capacity and wakes whoever can use it.
func (s *Scheduler[R]) release(plugin string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.inflight--
	s.pluginLocked(plugin).inflight--
	s.grantLocked()
	s.signalLocked()
}

// grantLocked gives capacity to the waiters that fit, oldest first.
func (s *Scheduler[R]) grantLocked() {
	kept := s.waiters[:0]
	for _, w := range s.waiters {
		if s.fitsLocked(w.plugin) {
			s.takeLocked(w.plugin)
			w.granted = true
			close(w.ready)
			continue
		}
		kept = append(kept, w)
	}
	clear(s.waiters[len(kept):])
	s.waiters = kept
}

// acquire blocks until the plugin's call may start, or ctx ends.
func (s *Scheduler[R]) acquire(ctx context.Context, plugin string) error {
	w := &waiter{plugin: plugin, ready: make(chan struct{})}
	s.mu.Lock()
	s.waiters = append(s.waiters, w)
	s.grantLocked()
	s.mu.Unlock()
	select {
	case <-w.ready:
		return nil
	case <-ctx.Done():
	}
	s.mu.Lock()
	if w.granted {
		s.mu.Unlock()
		s.release(plugin)
		return ctx.Err()
	}
	if i := slices.Index(s.waiters, w); i >= 0 {
		s.waiters = slices.Delete(s.waiters, i, i+1)
	}
	s.mu.Unlock()
	return ctx.Err()
}
