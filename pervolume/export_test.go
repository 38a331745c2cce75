package pervolume

// Settled reports whether Run's loop is blocked on a timer that has not
// fired yet, with no wake-up pending, and each periodic call it started is
// parked: blocked in the Job on the clock (parked counts those). Then
// nothing happens until the clock moves.
func (s *Scheduler[R]) Settled(parked func() int) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.waiting && !s.pending && !s.poked.Load() &&
		s.waitUntil.After(s.clock.Now()) && s.workers == parked()
}

// Waiters returns the number of RunNow calls waiting for capacity.
func (s *Scheduler[R]) Waiters() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.waiters)
}
