package pervolume_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/csiagent/csiagent/pervolume"
	"github.com/csiagent/csiagent/pervolume/pervolumetest"
)

// TestRestartMidCycle stops the scheduler half-way through a cycle with a
// call in flight, keeps the agent down while some slots pass, and starts a
// new scheduler on the persisted Next values: each volume still runs
// exactly once per cycle.
func TestRestartMidCycle(t *testing.T) {
	const (
		nvol     = 100
		iv       = 10 * time.Second
		downtime = 2 * time.Second
	)
	clock := pervolumetest.NewClock(t0)
	f := newJob(clock)
	f.dur = 50 * time.Millisecond
	for i := range nvol {
		f.add(fmt.Sprintf("p%d", i%2), fmt.Sprintf("vol-%03d", i), time.Time{})
	}
	cfg := pervolume.Config[result]{Policy: policy(iv, 1), MaxConcurrent: 2}

	h1 := start(t, clock, f, cfg)
	h1.driveTo(t0.Add(iv / 2))
	for len(f.Current()) == 0 { // stop with a call in flight
		h1.settle()
		next, _ := clock.NextDeadline()
		clock.AdvanceTo(next)
		h1.settle()
	}
	stoppedAt := clock.Now()
	h1.stop()
	if n := clock.Timers(); n != 0 {
		t.Fatalf("%d timers left pending by a stopped scheduler", n)
	}
	interrupted := 0
	for _, c := range f.Calls(false) {
		if errors.Is(c.err, context.Canceled) {
			interrupted++
		}
	}
	if interrupted == 0 {
		t.Fatal("no call was in flight at the stop")
	}

	clock.Advance(downtime)
	missed := 0
	for _, v := range f.Volumes() {
		if slot := slotAfter(t0, iv, v.Plugin, v.ID); slot.After(stoppedAt) && !slot.After(clock.Now()) {
			missed++
		}
	}
	if missed == 0 {
		t.Fatal("no slot passed while the agent was down; the test proves nothing")
	}

	h2 := start(t, clock, f, cfg)
	h2.driveTo(t0.Add(2*iv + 2*time.Second))

	byVol := map[vkey][]time.Time{}
	for _, c := range f.Calls(true) {
		byVol[c.vkey] = append(byVol[c.vkey], c.at)
	}
	for _, v := range f.Volumes() {
		k := vkey{v.Plugin, v.ID}
		first := slotAfter(t0, iv, k.plugin, k.id)
		for c := range 2 {
			from, to := first.Add(time.Duration(c)*iv), first.Add(time.Duration(c+1)*iv)
			n := 0
			for _, at := range byVol[k] {
				if !at.Before(from) && at.Before(to) {
					n++
				}
			}
			if n != 1 {
				t.Errorf("%v: %d runs in cycle %d [%v, %v) (stopped at %v, restarted at %v), want 1; runs %v",
					k, n, c, from.Sub(t0), to.Sub(t0), stoppedAt.Sub(t0), stoppedAt.Add(downtime).Sub(t0), byVol[k])
			}
		}
	}
}
