package pervolume

import (
	"cmp"
	"context"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/csiagent/csiagent/internal/defaults"
)

// Scheduler runs one Job periodically on every volume the job lists,
// staggered and capped; R is what one call of the job reports. Build it
// with New; its methods are safe for concurrent use.
type Scheduler[R any] struct {
	name          string
	job           Job[R]
	policyFn      func(string) Policy
	maxConcurrent int
	pokeSettle    time.Duration
	clock         Clock
	log           *slog.Logger

	// wake holds one token when the loop has something to look at: a poke,
	// a call that ended, capacity that was freed.
	wake  chan struct{}
	poked atomic.Bool

	mu       sync.Mutex
	entries  map[key]*entry
	plugins  map[string]*pluginState
	inflight int       // calls in flight, periodic and RunNow
	waiters  []*waiter // RunNow calls waiting for capacity, oldest first
	gen      uint64    // rescan generation
	running  bool      // Run is running

	// The loop's state, kept for Settled (export_test.go).
	workers   int       // periodic calls started and not yet accounted for
	waiting   bool      // the loop is blocked until waitUntil or a wake
	pending   bool      // a wake token is there and the loop has not seen it
	waitUntil time.Time // when the loop's timer fires
}

type key struct{ plugin, id string }

// entry is a published volume's schedule.
type entry struct {
	key
	hash uint64
	// interval the slot was computed for; 0: not scheduled.
	interval time.Duration
	slot     time.Time // the cycle's slot, as persisted
	due      time.Time // the next call: slot, or a retry inside the cycle
	attempts int       // calls made in this cycle
	cycleEnd time.Time // no retry at or after this; set by a cycle's first call
	running  bool
	gone     bool // unpublished while its call was running
	gen      uint64
}

type pluginState struct {
	policy Policy // normalised
	known  bool   // policy has been read
	// unsupported holds the volumes whose last call said Unimplemented
	// (the volume cannot discard); they are not scheduled.
	unsupported map[string]bool
	inflight    int
	totals      Totals
}

type waiter struct {
	plugin  string
	ready   chan struct{}
	granted bool
}

// task is one periodic call the loop started.
type task struct {
	e        *entry
	attempt  int
	cycleEnd time.Time
	timeout  time.Duration
}

// New returns a Scheduler; it does nothing until Run or RunNow.
func New[R any](cfg Config[R]) *Scheduler[R] {
	if cfg.Job == nil || cfg.Name == "" {
		panic("pervolume.New: Config.Job is nil or Config.Name is empty")
	}
	s := &Scheduler[R]{
		name:          cfg.Name,
		job:           cfg.Job,
		policyFn:      cfg.Policy,
		maxConcurrent: cfg.MaxConcurrent,
		pokeSettle:    cfg.PokeSettle,
		clock:         cfg.Clock,
		log:           cfg.Logger,
		wake:          make(chan struct{}, 1),
		entries:       map[key]*entry{},
		plugins:       map[string]*pluginState{},
	}
	defaults.Set(&s.maxConcurrent, DefaultMaxConcurrent)
	if s.clock == nil {
		s.clock = RealClock()
	}
	s.log = defaults.Logger(s.log).With("job", cfg.Name)
	return s
}

// Run runs the job on schedule until ctx ends, then waits for the calls in flight
// (their contexts are cancelled) and returns. Only one Run at a time: a
// second concurrent call logs an error and returns at once.
func (s *Scheduler[R]) Run(ctx context.Context) {
	s.mu.Lock()
	if s.running {
		s.mu.Unlock()
		s.log.Error(s.name + ": Run is already running")
		return
	}
	s.running = true
	s.mu.Unlock()

	var wg sync.WaitGroup
	defer func() {
		wg.Wait()
		s.mu.Lock()
		s.running, s.waiting = false, false
		s.mu.Unlock()
	}()

	var rescanAt, rescanned time.Time
	for ctx.Err() == nil {
		now := s.clock.Now()
		if s.poked.Swap(false) {
			if due := rescanned.Add(s.pokeSettle); due.Before(rescanAt) {
				rescanAt = due
			}
		}
		if !now.Before(rescanAt) {
			rescanAt, rescanned = now.Add(s.rescan(now)), now
		}

		s.mu.Lock()
		s.pending = false
		select {
		case <-s.wake:
		default:
		}
		tasks, next := s.dispatchLocked(now)
		for _, j := range tasks {
			wg.Add(1)
			go func() {
				defer wg.Done()
				s.work(ctx, j)
			}()
		}
		if next.IsZero() || rescanAt.Before(next) {
			next = rescanAt
		}
		d := next.Sub(s.clock.Now())
		if s.poked.Load() || d <= 0 {
			s.mu.Unlock()
			continue
		}
		// The timer exists before the loop says it waits, so that a fake
		// clock sees it.
		t := s.clock.NewTimer(d)
		s.waiting, s.waitUntil = true, next
		s.mu.Unlock()

		select {
		case <-ctx.Done():
		case <-t.C():
		case <-s.wake:
		}
		t.Stop()
		s.mu.Lock()
		s.waiting = false
		s.mu.Unlock()
	}
}

// Poke asks for a rescan of the volumes and policies now. It never blocks.
func (s *Scheduler[R]) Poke() {
	s.poked.Store(true)
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// ResetPlugin says the plugin's config or process changed: its policy is
// read again and its volumes that answered Unimplemented are scheduled
// again from their next slot.
func (s *Scheduler[R]) ResetPlugin(plugin string) {
	s.mu.Lock()
	if ps := s.plugins[plugin]; ps != nil {
		for id := range ps.unsupported {
			s.supportedLocked(plugin, id, s.clock.Now())
		}
	}
	s.mu.Unlock()
	s.Poke()
}

// Unsupported returns, sorted, the plugin's volumes whose last call said
// Unimplemented (nil: none).
func (s *Scheduler[R]) Unsupported(plugin string) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if ps := s.plugins[plugin]; ps != nil && len(ps.unsupported) > 0 {
		return slices.Sorted(maps.Keys(ps.unsupported))
	}
	return nil
}

// Totals returns the plugin's counters.
func (s *Scheduler[R]) Totals(plugin string) Totals {
	s.mu.Lock()
	defer s.mu.Unlock()
	if ps := s.plugins[plugin]; ps != nil {
		return ps.totals
	}
	return Totals{}
}

// Next returns when the volume's next scheduled run is due (its slot, or
// a retry inside the cycle); false if it is not scheduled (unknown, its
// plugin's interval is 0, or its call runs now).
func (s *Scheduler[R]) Next(plugin, id string) (time.Time, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.entries[key{plugin, id}]
	if e == nil || e.interval == 0 || e.running {
		return time.Time{}, false
	}
	return e.due, true
}

// rescan reads the volumes and their plugins' policies, adds and removes
// entries, (re)computes the schedule of those whose interval changed and
// persists the slots the Job does not have. It returns the time until
// the next rescan.
func (s *Scheduler[R]) rescan(now time.Time) time.Duration {
	vols := s.job.Volumes()
	pols := map[string]Policy{}
	for _, v := range vols {
		if _, ok := pols[v.Plugin]; !ok {
			pols[v.Plugin] = s.readPolicy(v.Plugin)
		}
	}

	var persist []Volume
	period := MaxRescan
	s.mu.Lock()
	for p, pol := range pols {
		ps := s.pluginLocked(p)
		ps.policy, ps.known = pol, true
		if pol.Interval > 0 && pol.Interval < period {
			period = pol.Interval
		}
	}
	s.gen++
	for _, v := range vols {
		k := key{v.Plugin, v.ID}
		e := s.entries[k]
		if e == nil {
			e = &entry{key: k, hash: volumeHash(v.Plugin, v.ID)}
			s.entries[k] = e
		}
		e.gen, e.gone = s.gen, false
		if e.running {
			continue // its end reschedules it
		}
		switch iv := pols[v.Plugin].Interval; {
		case iv == 0:
			e.interval = 0
		case iv != e.interval:
			base := v.Next
			if e.interval > 0 {
				base = e.slot
			}
			e.interval = iv
			e.slot = firstRun(base, v.Since, now, iv, e.hash)
			e.due, e.attempts, e.cycleEnd = e.slot, 0, time.Time{}
		}
		// A never-scheduled volume's first run follows from Since: nothing
		// to persist until it runs (one write less per new volume).
		if e.interval > 0 && !v.Next.Equal(e.slot) &&
			!(v.Next.IsZero() && !v.Since.IsZero() && e.slot.Equal(firstRun(time.Time{}, v.Since, now, e.interval, e.hash))) {
			persist = append(persist, Volume{Plugin: v.Plugin, ID: v.ID, Next: e.slot})
		}
	}
	for _, e := range s.entries {
		if e.gen != s.gen {
			if e.running {
				e.gone = true
			} else {
				s.removeLocked(e)
			}
		}
	}
	s.grantLocked() // a plugin's cap may have grown
	s.mu.Unlock()

	for _, v := range persist {
		s.persist(v.Plugin, v.ID, v.Next)
	}
	return period
}

// dispatchLocked starts the due calls that the caps allow, oldest first,
// and returns them with the earliest future due time (zero: none). Due
// calls left waiting for capacity need no timer: freeing capacity wakes
// the loop.
func (s *Scheduler[R]) dispatchLocked(now time.Time) ([]task, time.Time) {
	var due []*entry
	var next time.Time
	for _, e := range s.entries {
		if e.running || e.interval == 0 || s.pluginLocked(e.plugin).unsupported[e.id] {
			continue
		}
		if e.due.After(now) {
			if next.IsZero() || e.due.Before(next) {
				next = e.due
			}
			continue
		}
		due = append(due, e)
	}
	slices.SortFunc(due, func(a, b *entry) int {
		return cmp.Or(a.due.Compare(b.due), cmp.Compare(a.plugin, b.plugin), cmp.Compare(a.id, b.id))
	})
	var tasks []task
	for _, e := range due {
		if s.inflight >= s.maxConcurrent {
			break
		}
		if !s.fitsLocked(e.plugin) {
			continue
		}
		s.takeLocked(e.plugin)
		if e.attempts == 0 {
			e.cycleEnd = nextSlot(now, e.interval, e.hash)
		}
		e.attempts++
		e.running = true
		s.workers++
		tasks = append(tasks, task{e: e, attempt: e.attempts, cycleEnd: e.cycleEnd, timeout: s.plugins[e.plugin].policy.Timeout})
	}
	return tasks, next
}

// work makes one periodic call and applies its outcome to the entry.
func (s *Scheduler[R]) work(ctx context.Context, j task) {
	e := j.e
	res, err := s.call(ctx, e.plugin, e.id, j.timeout)
	s.release(e.plugin)
	v, retryAt, _ := s.outcome(ctx, e.plugin, e.id, res, err, j.attempt, j.cycleEnd)

	now := s.clock.Now()
	var persist time.Time
	s.mu.Lock()
	switch v {
	case cancelled:
		// Run is ending; the persisted slot stays, so a restarted agent
		// runs this cycle.
	case retry:
		e.due = retryAt
	case dropped:
		s.removeLocked(e)
	default: // the cycle is over
		e.attempts, e.cycleEnd = 0, time.Time{}
		iv := s.pluginLocked(e.plugin).policy.Interval
		switch {
		case e.gone:
			s.removeLocked(e)
		case iv == 0:
			e.interval = 0
		default:
			e.interval = iv
			e.slot = nextSlot(now, iv, e.hash)
			e.due = e.slot
			persist = e.slot
		}
	}
	s.mu.Unlock()

	if !persist.IsZero() {
		s.persist(e.plugin, e.id, persist)
	}

	s.mu.Lock()
	e.running = false
	s.workers--
	s.signalLocked()
	s.mu.Unlock()
}

// call makes one Job.Do call with the plugin's timeout. The caller holds
// capacity for it.
func (s *Scheduler[R]) call(ctx context.Context, plugin, id string, timeout time.Duration) (R, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	return s.job.Do(ctx, plugin, id)
}

func (s *Scheduler[R]) persist(plugin, id string, next time.Time) {
	if err := s.job.Schedule(plugin, id, next); err != nil {
		s.log.Warn(s.name+": cannot persist the next run; will try again on the next rescan",
			"plugin", plugin, "volume", id, "next", next, "error", err)
	}
}

// removeLocked forgets an unpublished volume and its Unsupported mark.
func (s *Scheduler[R]) removeLocked(e *entry) {
	if s.entries[e.key] == e {
		delete(s.entries, e.key)
		delete(s.pluginLocked(e.plugin).unsupported, e.id)
	}
}

// signalLocked wakes the loop.
func (s *Scheduler[R]) signalLocked() {
	s.pending = true
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// pluginLocked returns the plugin's state, made with the default policy if
// new.
func (s *Scheduler[R]) pluginLocked(plugin string) *pluginState {
	ps := s.plugins[plugin]
	if ps == nil {
		ps = &pluginState{policy: normalise(Policy{})}
		s.plugins[plugin] = ps
	}
	return ps
}

// supportedLocked clears a volume's Unsupported mark. If its run was
// skipped meanwhile it goes to its next slot: it was not missed by a
// stopped agent, and running skipped volumes all at once is what
// staggering avoids. The next rescan persists the new slot.
func (s *Scheduler[R]) supportedLocked(plugin, id string, now time.Time) {
	delete(s.pluginLocked(plugin).unsupported, id)
	e := s.entries[key{plugin, id}]
	if e == nil || e.running || e.interval == 0 || e.due.After(now) {
		return
	}
	e.slot = nextSlot(now, e.interval, e.hash)
	e.due, e.attempts, e.cycleEnd = e.slot, 0, time.Time{}
}

// policy returns the plugin's policy, read once if no rescan has yet.
func (s *Scheduler[R]) policy(plugin string) Policy {
	s.mu.Lock()
	if ps := s.pluginLocked(plugin); ps.known {
		p := ps.policy // read under the lock: another RunNow may be setting it
		s.mu.Unlock()
		return p
	}
	s.mu.Unlock()
	p := s.readPolicy(plugin)
	s.mu.Lock()
	ps := s.pluginLocked(plugin)
	ps.policy, ps.known = p, true
	s.grantLocked()
	s.mu.Unlock()
	return p
}

func (s *Scheduler[R]) readPolicy(plugin string) Policy {
	if s.policyFn == nil {
		return normalise(Policy{})
	}
	return normalise(s.policyFn(plugin))
}

func normalise(p Policy) Policy {
	if p.Interval < 0 {
		p.Interval = 0
	}
	defaults.Set(&p.Timeout, DefaultTimeout)
	defaults.Set(&p.MaxConcurrent, DefaultPluginMaxConcurrent)
	return p
}
