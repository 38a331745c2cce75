package pervolume_test

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/csiagent/csiagent/pervolume"
	"github.com/csiagent/csiagent/pervolume/pervolumetest"
)

func TestStaggering(t *testing.T) {
	const (
		nvol   = 200
		iv     = 10 * time.Second
		cycles = 3
	)
	tests := []struct {
		name               string
		plugins            int
		perPlugin, global  int
		dur                time.Duration
		maxDelay           time.Duration
		wantGlobalMaxInUse int
	}{
		{"2 plugins, 1 each, 2 in all", 2, 1, 2, 40 * time.Millisecond, time.Second, 2},
		{"3 plugins, 2 each, 3 in all", 3, 2, 3, 40 * time.Millisecond, time.Second, 3},
		{"1 plugin, 4 of it, 2 in all", 1, 4, 2, 40 * time.Millisecond, time.Second, 2},
		{"4 plugins, 1 in all", 4, 3, 1, 20 * time.Millisecond, 2 * time.Second, 1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			clock := pervolumetest.NewClock(t0)
			f := newJob(clock)
			f.dur = tc.dur
			for i := range nvol {
				f.add(fmt.Sprintf("plugin-%d", i%tc.plugins), fmt.Sprintf("vol-%03d", i), time.Time{})
			}
			h := start(t, clock, f, pervolume.Config[result]{Policy: policy(iv, tc.perPlugin), MaxConcurrent: tc.global})
			h.driveTo(t0.Add(cycles*iv + iv/2))

			maxAll, maxPer := f.Max()
			if maxAll != tc.wantGlobalMaxInUse {
				t.Errorf("at most %d calls in flight, want %d (the cap, reached)", maxAll, tc.wantGlobalMaxInUse)
			}
			for p, n := range maxPer {
				if n > tc.perPlugin {
					t.Errorf("%s: %d calls in flight, cap %d", p, n, tc.perPlugin)
				}
			}

			byVol := map[vkey][]time.Time{}
			for _, c := range f.Calls(true) {
				byVol[c.vkey] = append(byVol[c.vkey], c.at)
			}
			if len(byVol) != nvol {
				t.Fatalf("%d volumes reclaimed, want %d", len(byVol), nvol)
			}
			buckets := map[int]int{} // calls by second since t0, over the full cycles
			for k, ats := range byVol {
				first := slotAfter(t0, iv, k.plugin, k.id)
				if ats[0].Before(first) {
					t.Errorf("%v: ran at %v, before its first slot %v", k, ats[0].Sub(t0), first.Sub(t0))
				}
				for c := range cycles {
					from, to := first.Add(time.Duration(c)*iv), first.Add(time.Duration(c+1)*iv)
					var in []time.Time
					for _, at := range ats {
						if !at.Before(from) && at.Before(to) {
							in = append(in, at)
						}
					}
					if len(in) != 1 {
						t.Errorf("%v: %d runs in its cycle %d [%v, %v), want 1", k, len(in), c, from.Sub(t0), to.Sub(t0))
						continue
					}
					if d := in[0].Sub(from); d > tc.maxDelay {
						t.Errorf("%v: cycle %d ran %v after its slot", k, c, d)
					}
					if in[0].Before(t0.Add(cycles * iv)) {
						buckets[int(in[0].Sub(t0)/time.Second)]++
					}
				}
			}
			// 200 volumes over 10 one-second buckets: 20 each on average.
			busiest := 0
			for _, n := range buckets {
				busiest = max(busiest, n)
			}
			t.Logf("busiest second: %d runs; max in flight %d, per plugin %v", busiest, maxAll, maxPer)
			if busiest > 2*nvol/int(iv/time.Second) {
				t.Errorf("busiest second holds %d runs, want runs spread over the interval: %v", busiest, buckets)
			}
		})
	}
}

// TestFirstSchedule: what a volume's persisted Next means when the
// scheduler first sees it.
func TestFirstSchedule(t *testing.T) {
	const iv = 10 * time.Second
	const p, id = "plugin", "vol"
	slot := slotAfter(t0, iv, p, id)
	tests := []struct {
		name         string
		next, since  time.Time
		wantPersist  []time.Time // Schedule calls, in order
		wantFirstRun time.Time
	}{
		{"never scheduled, publish time unknown: next slot, persisted at once", time.Time{}, time.Time{}, []time.Time{slot, slot.Add(iv)}, slot},
		{"never scheduled, published now: next slot, persisted only after its run", time.Time{}, t0, []time.Time{slot.Add(iv)}, slot},
		{"never scheduled, published an hour ago (slots missed while down): once at once, then the next slot", time.Time{}, t0.Add(-time.Hour), []time.Time{slot}, t0},
		{"within an interval: kept", t0.Add(3 * time.Second), time.Time{}, []time.Time{slotAfter(t0.Add(3*time.Second), iv, p, id)}, t0.Add(3 * time.Second)},
		{"too far (interval shortened): moved to the next slot", t0.Add(time.Hour), time.Time{}, []time.Time{slot, slot.Add(iv)}, slot},
		{"missed while the agent was down: once at once, then the next slot", t0.Add(-time.Hour), time.Time{}, []time.Time{slot}, t0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			clock := pervolumetest.NewClock(t0)
			f := newJob(clock)
			f.add(p, id, tc.next)
			f.published(p, id, tc.since)
			h := start(t, clock, f, pervolume.Config[result]{Policy: policy(iv, 1)})
			h.driveTo(tc.wantFirstRun)
			var ats []time.Duration
			for _, c := range f.Calls(true) {
				ats = append(ats, c.at.Sub(t0))
			}
			if len(ats) != 1 || ats[0] != tc.wantFirstRun.Sub(t0) {
				t.Fatalf("calls at %v, want one at %v", ats, tc.wantFirstRun.Sub(t0))
			}
			if got := f.Schedules(vkey{p, id}); !slices.EqualFunc(got, tc.wantPersist, time.Time.Equal) {
				t.Errorf("Schedule calls %v, want %v", got, tc.wantPersist)
			}
		})
	}
}

func TestPokeAndRescan(t *testing.T) {
	const iv = 10 * time.Second
	clock := pervolumetest.NewClock(t0)
	f := newJob(clock)
	f.add("a", "v1", time.Time{})
	h := start(t, clock, f, pervolume.Config[result]{Policy: policy(iv, 1)})
	h.driveTo(t0.Add(2 * time.Second))

	// Published mid-cycle and poked: scheduled at once, in its own slot.
	f.add("a", "v2", time.Time{})
	h.s.Poke()
	h.settle()
	now := clock.Now()
	want := slotAfter(now, iv, "a", "v2")
	if got := f.Schedules(vkey{"a", "v2"}); len(got) != 1 || !got[0].Equal(want) {
		t.Fatalf("after Poke: Schedule calls %v, want [%v]", got, want)
	}

	// Published without a poke: found by the periodic rescan, within one
	// interval.
	f.add("a", "v3", time.Time{})
	h.driveTo(now.Add(iv))
	if got := f.Schedules(vkey{"a", "v3"}); len(got) == 0 {
		t.Fatal("volume published without a Poke not scheduled within an interval")
	}

	// Unpublished: no more calls.
	f.remove("a", "v1")
	h.s.Poke()
	before := len(f.Calls(false))
	h.driveTo(clock.Now().Add(3 * iv))
	for _, c := range f.Calls(false)[before:] {
		if c.id == "v1" {
			t.Fatalf("unpublished volume called at %v", c.at.Sub(t0))
		}
	}

	// Poke never blocks, with or without Run.
	s := pervolume.New(pervolume.Config[result]{Name: "test", Job: f, Clock: clock})
	for range 1000 {
		s.Poke()
		h.s.Poke()
	}
}

// TestPokeSettle: with PokeSettle, pokes right after a rescan share one
// rescan, PokeSettle after it; a poke after a quiet spell rescans at once.
// (Before it, every poke rescanned every volume: a host preparing
// containers back to back rescanned after each.)
func TestPokeSettle(t *testing.T) {
	const iv, settleFor = 10 * time.Second, 100 * time.Millisecond
	clock := pervolumetest.NewClock(t0)
	f := newJob(clock)
	f.add("a", "v1", time.Time{})
	var rescans atomic.Int64
	pol := policy(iv, 1)
	h := start(t, clock, f, pervolume.Config[result]{PokeSettle: settleFor, Policy: func(p string) pervolume.Policy {
		rescans.Add(1)
		return pol(p)
	}})
	h.settle()
	r0 := rescans.Load()
	for range 5 {
		h.s.Poke()
	}
	h.settle()
	if n := rescans.Load() - r0; n != 0 {
		t.Fatalf("%d rescans for pokes right after a rescan; want none before PokeSettle", n)
	}
	h.driveTo(clock.Now().Add(settleFor))
	if n := rescans.Load() - r0; n != 1 {
		t.Fatalf("%d rescans PokeSettle after 5 pokes; want 1", n)
	}
	// A quiet spell, then a poke: at once.
	h.driveTo(clock.Now().Add(time.Second))
	r1 := rescans.Load()
	h.s.Poke()
	h.settle()
	if n := rescans.Load() - r1; n != 1 {
		t.Fatalf("%d rescans for a poke after a quiet spell; want 1, at once", n)
	}
}

func TestIntervalZero(t *testing.T) {
	const iv = 10 * time.Second
	clock := pervolumetest.NewClock(t0)
	f := newJob(clock)
	f.add("off", "v", time.Time{})
	f.published("off", "v", t0) // a known publish time must not make interval 0 divide by zero
	f.add("on", "v", time.Time{})
	ivOff := time.Duration(0)
	pol := func(p string) pervolume.Policy {
		if p == "off" {
			return pervolume.Policy{Interval: ivOff}
		}
		return pervolume.Policy{Interval: iv}
	}
	h := start(t, clock, f, pervolume.Config[result]{Policy: pol})
	h.driveTo(t0.Add(3 * iv))
	for _, c := range f.Calls(false) {
		if c.plugin == "off" {
			t.Fatalf("plugin with interval 0 called at %v", c.at.Sub(t0))
		}
	}
	if got := f.Schedules(vkey{"off", "v"}); len(got) != 0 {
		t.Fatalf("plugin with interval 0 scheduled: %v", got)
	}

	// Enabled: scheduled from its next slot.
	h.settle()
	f.mu.Lock()
	ivOff = iv
	f.mu.Unlock()
	h.s.Poke()
	h.settle()
	want := slotAfter(clock.Now(), iv, "off", "v")
	if got := f.Schedules(vkey{"off", "v"}); len(got) != 1 || !got[0].Equal(want) {
		t.Fatalf("once enabled: Schedule calls %v, want [%v]", got, want)
	}
}

func TestShutdownWithCallsInFlight(t *testing.T) {
	clock := pervolumetest.NewClock(t0)
	f := newJob(clock)
	f.hang = true
	missed := t0.Add(-time.Minute)
	for i := range 4 {
		f.add("p", fmt.Sprint(i), missed)
	}
	h := start(t, clock, f, pervolume.Config[result]{Policy: policy(time.Hour, 2), MaxConcurrent: 2})
	eventually(t, "two calls in flight", func() bool { return len(f.Current()) == 2 })

	h.stop()
	calls := f.Calls(false)
	if len(calls) != 2 {
		t.Fatalf("%d calls, want 2", len(calls))
	}
	for _, c := range calls {
		if !c.returned || c.err != context.Canceled {
			t.Errorf("call %v: returned %v, err %v; want it cancelled and returned before Run", c.vkey, c.returned, c.err)
		}
	}
	if tot := h.s.Totals("p"); tot.Runs != 0 || tot.Failures != 0 {
		t.Errorf("Totals %+v: a shutdown is not a run", tot)
	}
	for i := range 4 {
		if got := f.Schedules(vkey{"p", fmt.Sprint(i)}); len(got) != 0 {
			t.Errorf("volume %d rescheduled to %v: its missed cycle must still run after a restart", i, got)
		}
	}
}

func TestRunTwice(t *testing.T) {
	clock := pervolumetest.NewClock(t0)
	f := newJob(clock)
	h := start(t, clock, f, pervolume.Config[result]{})
	h.settle()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan struct{})
	go func() {
		defer close(done)
		h.s.Run(ctx) // returns at once: Run is already running
	}()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("a second Run did not return")
	}
}
