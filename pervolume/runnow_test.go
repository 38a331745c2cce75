package pervolume_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/pervolume"
	"github.com/csiagent/csiagent/pervolume/pervolumetest"
)

// onDemand is a RunNow running in the background.
type onDemand struct {
	n        int // volumes
	finished chan struct{}

	mu      sync.Mutex
	sum     pervolume.Summary
	got     map[string]error  // progress reports
	results map[string]result // the results of the successes
}

func runNow(ctx context.Context, s *pervolume.Scheduler[result], vols []pervolume.Volume) *onDemand {
	r := &onDemand{n: len(vols), finished: make(chan struct{}), got: map[string]error{}, results: map[string]result{}}
	go func() {
		defer close(r.finished)
		sum := s.RunNow(ctx, vols, func(v pervolume.Volume, res result, err error) {
			r.mu.Lock()
			defer r.mu.Unlock()
			if _, dup := r.got[v.ID]; dup {
				panic("progress called twice for " + v.ID)
			}
			r.got[v.ID] = err
			if err == nil {
				r.results[v.ID] = res
			}
		})
		r.mu.Lock()
		defer r.mu.Unlock()
		r.sum = sum
	}()
	return r
}

func (r *onDemand) reported() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.got)
}

// freed sums PreUsage-PostUsage of the successes' results where both
// are known.
func (r *onDemand) freed() int64 {
	<-r.finished
	r.mu.Lock()
	defer r.mu.Unlock()
	var n int64
	for _, res := range r.results {
		if res.PreUsage >= 0 && res.PostUsage >= 0 {
			n += res.PreUsage - res.PostUsage
		}
	}
	return n
}

// result waits for RunNow to return.
func (r *onDemand) result() (pervolume.Summary, map[string]error) {
	<-r.finished
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.sum, r.got
}

// quiet waits until each volume of r is done, waiting for capacity, or
// blocked on the clock (in a call or a backoff), when nothing else runs
// on the clock: nothing happens then until the clock moves. The pending
// timers are read before the waiters, so that a call that leaves the queue
// for the clock meanwhile is not counted twice.
func (r *onDemand) quiet(t *testing.T, clock *pervolumetest.Clock, s *pervolume.Scheduler[result]) {
	t.Helper()
	eventually(t, "RunNow to be quiet", func() bool {
		done := r.reported()
		timers := clock.Timers()
		return done+timers+s.Waiters() == r.n
	})
}

// drive moves the clock, timer by timer, until RunNow returns; RunNow is
// quiet before each step.
func (r *onDemand) drive(t *testing.T, clock *pervolumetest.Clock, s *pervolume.Scheduler[result]) {
	t.Helper()
	for {
		r.quiet(t, clock, s)
		if r.reported() == r.n {
			r.result()
			return
		}
		next, ok := clock.NextDeadline()
		if !ok {
			t.Fatal("RunNow waits for nothing on the clock")
		}
		clock.AdvanceTo(next)
	}
}

func TestRunNow(t *testing.T) {
	st := func(c codes.Code) error { return status.Error(c, c.String()) }
	// Per volume id: its answers, in order.
	answers := map[string][]struct {
		res result
		err error
	}{
		"a1": {{res: result{PreUsage: 1000, PostUsage: 400}}},
		"a2": {{res: result{PreUsage: 500, PostUsage: 700}}}, // usage grew: -200
		"a3": {{err: st(codes.Aborted)}, {res: result{PreUsage: 300, PostUsage: 0}}},
		"a4": {{err: st(codes.InvalidArgument)}},
		"a5": {{res: result{PreUsage: -1, PostUsage: 10}}}, // unknown: not counted
		"a6": {{res: result{PreUsage: 10, PostUsage: 10}}},
		"b1": {{res: result{PreUsage: 2000, PostUsage: 1000}}},
		"b2": {{err: fmt.Errorf("volume b2: %w", pervolume.ErrNotPublished)}},
		"b3": {{res: result{PreUsage: 100, PostUsage: 150}}}, // -50
		"b4": {{res: result{PreUsage: 100, PostUsage: 0}}},
		"b5": {{err: st(codes.NotFound)}}, // and not published: dropped
		"b6": {{res: result{PreUsage: 0, PostUsage: 0}}},
	}
	const wantFreed = 600 - 200 + 300 + 1000 - 50 + 100
	wantErr := map[string]error{
		"a4": st(codes.InvalidArgument), "b2": pervolume.ErrNotPublished, "b5": pervolume.ErrNotPublished,
	}
	tests := []struct {
		name              string
		global, perPlugin int
		saturated         int // calls in flight once all have started
	}{
		{"2 in all, 1 per plugin", 2, 1, 2},
		{"3 in all, 2 per plugin", 3, 2, 3},
		{"4 in all, 1 per plugin", 4, 1, 2},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			clock := pervolumetest.NewClock(t0)
			f := newJob(clock)
			f.dur = time.Second
			f.script = func(_ *fakeJob, _, id string, n int) (result, error) {
				a := answers[id][n]
				return a.res, a.err
			}
			var vols []pervolume.Volume
			for id := range answers {
				vols = append(vols, pervolume.Volume{Plugin: id[:1], ID: id})
				if id != "b5" {
					f.add(id[:1], id, time.Time{})
				}
			}
			s := pervolume.New(pervolume.Config[result]{Name: "test", Job: f, Clock: clock, MaxConcurrent: tc.global, Policy: policy(0, tc.perPlugin)})

			r := runNow(context.Background(), s, vols)
			r.quiet(t, clock, s)
			if n := len(f.Current()); n != tc.saturated {
				t.Fatalf("%d calls in flight once all have started, want %d", n, tc.saturated)
			}
			r.drive(t, clock, s)
			sum, got := r.result()

			maxAll, maxPer := f.Max()
			if maxAll != tc.saturated {
				t.Errorf("at most %d calls in flight, want %d", maxAll, tc.saturated)
			}
			for p, n := range maxPer {
				if n > tc.perPlugin {
					t.Errorf("plugin %s: %d calls in flight, cap %d", p, n, tc.perPlugin)
				}
			}
			want := pervolume.Summary{Volumes: 9, Failures: 3}
			if sum != want {
				t.Errorf("Summary %+v, want %+v", sum, want)
			}
			// progress reports each success's final result.
			if freed := r.freed(); freed != wantFreed {
				t.Errorf("the successes' results free %d bytes, want %d", freed, wantFreed)
			}
			if len(got) != len(answers) {
				t.Errorf("progress for %d volumes, want %d", len(got), len(answers))
			}
			for id, err := range got {
				switch w := wantErr[id]; {
				case w == nil && err != nil:
					t.Errorf("%s: %v, want success", id, err)
				case w != nil && !errors.Is(err, w) && status.Code(err) != status.Code(w):
					t.Errorf("%s: %v, want %v", id, err, w)
				}
			}
			if n := len(f.Calls(false)); n != len(answers)+1 {
				t.Errorf("%d calls, want %d (one retry)", n, len(answers)+1)
			}
			// Same accounting as periodic runs: unpublished volumes are not runs.
			a, b := s.Totals("a"), s.Totals("b")
			if a.Runs+b.Runs != 10 || a.Failures+b.Failures != 1 {
				t.Errorf("Totals a %+v, b %+v", a, b)
			}
		})
	}
}

func TestRunNowRetryBackoff(t *testing.T) {
	clock := pervolumetest.NewClock(t0)
	f := newJob(clock)
	f.add("p", "v", time.Time{})
	f.script = fails(1, status.Error(codes.Aborted, "busy"))
	s := pervolume.New(pervolume.Config[result]{Name: "test", Job: f, Clock: clock})
	r := runNow(context.Background(), s, []pervolume.Volume{{Plugin: "p", ID: "v"}})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := clock.BlockUntil(ctx, 1); err != nil {
		t.Fatal("RunNow does not wait on the clock before its retry")
	}
	if n := len(f.Calls(false)); n != 1 {
		t.Fatalf("%d calls before the backoff ended, want 1", n)
	}
	clock.Advance(pervolume.RetryBase)
	if sum, _ := r.result(); sum != (pervolume.Summary{Volumes: 1}) || r.freed() != 100 {
		t.Errorf("Summary %+v, %d bytes freed", sum, r.freed())
	}
	calls := f.Calls(false)
	if len(calls) != 2 || !calls[1].at.Equal(t0.Add(pervolume.RetryBase)) {
		t.Errorf("calls %v, want at 0s and 1s", calls)
	}
}

// TestRunNowSharesCaps: RunNow waits for the capacity periodic runs hold,
// and gets it before the periodic runs that are due.
func TestRunNowSharesCaps(t *testing.T) {
	clock := pervolumetest.NewClock(t0)
	f := newJob(clock)
	f.dur = time.Minute
	for i := range 5 {
		f.add("p", fmt.Sprint(i), t0.Add(-time.Hour)) // all missed: due now
	}
	h := start(t, clock, f, pervolume.Config[result]{Policy: policy(time.Hour, 4), MaxConcurrent: 1})
	h.settle()
	first := f.Current()
	if len(first) != 1 {
		t.Fatalf("calls in flight %v, want 1", first)
	}

	r := runNow(context.Background(), h.s, []pervolume.Volume{{Plugin: "q", ID: "x"}})
	eventually(t, "RunNow to wait for capacity", func() bool { return h.s.Waiters() == 1 })
	if cur := f.Current(); len(cur) != 1 || cur[0] != first[0] {
		t.Fatalf("calls in flight %v, want only %v", cur, first)
	}

	clock.Advance(time.Minute) // the periodic call ends
	eventually(t, "RunNow's call, waiting on the clock", func() bool {
		cur := f.Current()
		// In flight is not enough: the call must have set its timer
		// before the clock moves, or the advance passes it by.
		return len(cur) == 1 && cur[0] == (vkey{"q", "x"}) && f.parkedCalls() == 1
	})
	clock.Advance(time.Minute)
	if sum, _ := r.result(); sum.Volumes != 1 {
		t.Errorf("Summary %+v", sum)
	}
	if maxAll, _ := f.Max(); maxAll != 1 {
		t.Errorf("%d calls in flight at once, cap 1", maxAll)
	}
}

func TestRunNowContextEnds(t *testing.T) {
	clock := pervolumetest.NewClock(t0)
	f := newJob(clock)
	f.dur = time.Minute
	var vols []pervolume.Volume
	for i := range 3 {
		f.add("p", fmt.Sprint(i), time.Time{})
		vols = append(vols, pervolume.Volume{Plugin: "p", ID: fmt.Sprint(i)})
	}
	s := pervolume.New(pervolume.Config[result]{Name: "test", Job: f, Clock: clock})
	ctx, cancel := context.WithCancel(context.Background())
	r := runNow(ctx, s, vols)
	eventually(t, "one call and two waiters", func() bool { return f.parkedCalls() == 1 && s.Waiters() == 2 })
	cancel()
	sum, got := r.result()
	if sum != (pervolume.Summary{Failures: 3}) {
		t.Errorf("Summary %+v, want 3 failures", sum)
	}
	for id, err := range got {
		if !errors.Is(err, context.Canceled) {
			t.Errorf("%s: %v, want context.Canceled", id, err)
		}
	}
	if tot := s.Totals("p"); tot != (pervolume.Totals{}) {
		t.Errorf("Totals %+v: cancelled runs are not runs", tot)
	}
	if s.Waiters() != 0 {
		t.Error("waiters left behind")
	}
}
