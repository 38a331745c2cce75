package pervolume_test

import (
	"context"
	"fmt"
	"hash/fnv"
	"maps"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/csiagent/csiagent/pervolume"
	"github.com/csiagent/csiagent/pervolume/pervolumetest"
)

// t0 is a multiple of every interval the tests use.
var t0 = time.Unix(1_900_000_000, 0)

type vkey struct{ plugin, id string }

// call is one Do call the fake saw.
type call struct {
	vkey
	at       time.Time     // fake time it started
	timeout  time.Duration // real time left before its deadline when it started; 0: none
	err      error         // what it returned
	returned bool
}

type scheduled struct {
	vkey
	next time.Time
}

// result is what the fake job's calls report: usage before and after, as a
// reclaim would.
type result struct{ PreUsage, PostUsage int64 }

// fakeJob is a pervolume.Job over a map of volumes. Each call parks on
// the fake clock for dur (if dur > 0), or until its ctx ends (if hang),
// then answers script's result (success, 1000 → 900 bytes, if script is
// nil). It tracks the calls in flight.
type fakeJob struct {
	clock  *pervolumetest.Clock
	dur    time.Duration
	hang   bool
	script func(f *fakeJob, plugin, id string, n int) (result, error) // n counts the volume's calls from 0

	mu           sync.Mutex
	vols         []vkey
	next         map[vkey]time.Time
	since        map[vkey]time.Time
	calls        []call
	count        map[vkey]int
	inflight     int
	perPlugin    map[string]int
	maxInflight  int
	maxPerPlugin map[string]int
	current      map[int]vkey // calls in flight, by index in calls
	parked       map[pervolume.Timer]time.Time
	schedules    []scheduled
}

var _ pervolume.Job[result] = (*fakeJob)(nil)

func newJob(clock *pervolumetest.Clock) *fakeJob {
	return &fakeJob{
		clock:        clock,
		next:         map[vkey]time.Time{},
		since:        map[vkey]time.Time{},
		count:        map[vkey]int{},
		perPlugin:    map[string]int{},
		maxPerPlugin: map[string]int{},
		current:      map[int]vkey{},
		parked:       map[pervolume.Timer]time.Time{},
	}
}

func (f *fakeJob) add(plugin, id string, next time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	k := vkey{plugin, id}
	if !slices.Contains(f.vols, k) {
		f.vols = append(f.vols, k)
	}
	f.next[k] = next
}

// published sets when a volume was published (pervolume.Volume.Since).
func (f *fakeJob) published(plugin, id string, since time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.since[vkey{plugin, id}] = since
}

func (f *fakeJob) remove(plugin, id string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.vols = slices.DeleteFunc(f.vols, func(k vkey) bool { return k == vkey{plugin, id} })
}

func (f *fakeJob) Volumes() []pervolume.Volume {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]pervolume.Volume, 0, len(f.vols))
	for _, k := range f.vols {
		out = append(out, pervolume.Volume{Plugin: k.plugin, ID: k.id, Next: f.next[k], Since: f.since[k]})
	}
	return out
}

func (f *fakeJob) Schedule(plugin, id string, next time.Time) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	k := vkey{plugin, id}
	f.next[k] = next
	f.schedules = append(f.schedules, scheduled{k, next})
	return nil
}

func (f *fakeJob) Do(ctx context.Context, plugin, id string) (result, error) {
	k := vkey{plugin, id}
	f.mu.Lock()
	n := f.count[k]
	f.count[k]++
	f.inflight++
	f.perPlugin[plugin]++
	f.maxInflight = max(f.maxInflight, f.inflight)
	f.maxPerPlugin[plugin] = max(f.maxPerPlugin[plugin], f.perPlugin[plugin])
	c := call{vkey: k, at: f.clock.Now()}
	if d, ok := ctx.Deadline(); ok {
		c.timeout = time.Until(d)
	}
	i := len(f.calls)
	f.calls = append(f.calls, c)
	f.current[i] = k
	f.mu.Unlock()

	res, err := f.do(ctx, plugin, id, n)

	f.mu.Lock()
	defer f.mu.Unlock()
	f.inflight--
	f.perPlugin[plugin]--
	delete(f.current, i)
	f.calls[i].err, f.calls[i].returned = err, true
	return res, err
}

func (f *fakeJob) do(ctx context.Context, plugin, id string, n int) (result, error) {
	if f.hang {
		<-ctx.Done()
		return result{}, ctx.Err()
	}
	if f.dur > 0 {
		f.mu.Lock()
		t := f.clock.NewTimer(f.dur)
		f.parked[t] = f.clock.Now().Add(f.dur)
		f.mu.Unlock()
		var err error
		select {
		case <-t.C():
		case <-ctx.Done():
			t.Stop()
			err = ctx.Err()
		}
		f.mu.Lock()
		delete(f.parked, t)
		f.mu.Unlock()
		if err != nil {
			return result{}, err
		}
	}
	if f.script == nil {
		return result{PreUsage: 1000, PostUsage: 900}, nil
	}
	return f.script(f, plugin, id, n)
}

// parkedCalls counts the calls blocked on the clock that it has not
// released yet.
func (f *fakeJob) parkedCalls() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	now := f.clock.Now()
	n := 0
	for _, at := range f.parked {
		if at.After(now) {
			n++
		}
	}
	return n
}

// Calls returns the calls so far; ok: only those that succeeded.
func (f *fakeJob) Calls(ok bool) []call {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []call
	for _, c := range f.calls {
		if !ok || (c.returned && c.err == nil) {
			out = append(out, c)
		}
	}
	return out
}

func (f *fakeJob) Schedules(k vkey) []time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []time.Time
	for _, s := range f.schedules {
		if s.vkey == k {
			out = append(out, s.next)
		}
	}
	return out
}

func (f *fakeJob) Current() []vkey {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []vkey
	for _, k := range f.current {
		out = append(out, k)
	}
	return out
}

func (f *fakeJob) Max() (int, map[string]int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.maxInflight, maps.Clone(f.maxPerPlugin)
}

// slotAfter is the test's own reading of the staggering rule: the first of
// epoch + k*iv + FNV-64a(plugin NUL id) mod iv strictly after t.
func slotAfter(t time.Time, iv time.Duration, plugin, id string) time.Time {
	h := fnv.New64a()
	fmt.Fprintf(h, "%s\x00%s", plugin, id)
	off := time.Duration(h.Sum64() % uint64(iv))
	s := time.Unix(0, t.UnixNano()/int64(iv)*int64(iv)).Add(off)
	for s.After(t) {
		s = s.Add(-iv)
	}
	for !s.After(t) {
		s = s.Add(iv)
	}
	return s
}

// eventually waits, in real time, for cond; it fails the test after 5 s.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		runtime.Gosched()
	}
}

// harness runs a Scheduler on a fake clock and a fake Job.
type harness struct {
	t     *testing.T
	clock *pervolumetest.Clock
	f     *fakeJob
	s     *pervolume.Scheduler[result]
	stop  func()
}

// start builds a Scheduler (cfg's Name, Job and Clock are set here) and runs it
// until stop or the end of the test.
func start(t *testing.T, clock *pervolumetest.Clock, f *fakeJob, cfg pervolume.Config[result]) *harness {
	t.Helper()
	cfg.Name, cfg.Job, cfg.Clock = "test", f, clock
	h := &harness{t: t, clock: clock, f: f, s: pervolume.New(cfg)}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		h.s.Run(ctx)
	}()
	h.stop = func() {
		cancel()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Fatal("Run did not return after its context ended")
		}
	}
	t.Cleanup(h.stop)
	return h
}

// settle waits until nothing happens before the clock moves.
func (h *harness) settle() {
	h.t.Helper()
	eventually(h.t, "the scheduler to settle", func() bool { return h.s.Settled(h.f.parkedCalls) })
}

// driveTo moves the clock to until, timer by timer, letting the scheduler
// settle at each step.
func (h *harness) driveTo(until time.Time) {
	h.t.Helper()
	for {
		h.settle()
		next, ok := h.clock.NextDeadline()
		if !ok {
			h.t.Fatal("no timer pending while the scheduler runs")
		}
		if next.After(until) {
			h.clock.AdvanceTo(until)
			h.settle()
			return
		}
		h.clock.AdvanceTo(next)
	}
}

func policy(iv time.Duration, perPlugin int) func(string) pervolume.Policy {
	return func(string) pervolume.Policy {
		return pervolume.Policy{Interval: iv, Timeout: time.Minute, MaxConcurrent: perPlugin}
	}
}
