package optrace

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestBeginWithoutTraceAllocatesNothing(t *testing.T) {
	ctx := context.Background()
	allocs := testing.AllocsPerRun(1000, func() {
		Begin(ctx, Mount, "bind")()
	})
	if allocs != 0 {
		t.Fatalf("Begin without a Trace: %v allocations per call, want 0", allocs)
	}
	var nilTrace *Trace
	nilTrace.Add("fsyncs", 1) // must not panic
}

func TestEventsInStartOrder(t *testing.T) {
	ctx, tr := With(context.Background())
	endOuter := Begin(ctx, Lock, "outer")
	endInner := Begin(ctx, Plugin, "inner")
	endInner() // closed first, started second
	endOuter()
	tr.Finish()
	ev := tr.Events()
	if len(ev) != 2 || ev[0].Name != "outer" || ev[1].Name != "inner" {
		t.Fatalf("events %+v, want outer then inner", ev)
	}
	if ev[1].Start < ev[0].Start || ev[1].Start+ev[1].Duration > ev[0].Start+ev[0].Duration {
		t.Fatalf("inner %+v not within outer %+v", ev[1], ev[0])
	}
	if u := tr.wall() - covered(ev); u < 0 || u > tr.wall() {
		t.Fatalf("untraced %v outside [0, wall %v]", u, tr.wall())
	}
}

func TestCovered(t *testing.T) {
	ms := time.Millisecond
	for _, c := range []struct {
		name   string
		events []Event
		want   time.Duration
	}{
		{"none", nil, 0},
		{"disjoint", []Event{{Start: 0, Duration: 2 * ms}, {Start: 5 * ms, Duration: 1 * ms}}, 3 * ms},
		{"nested", []Event{{Start: 0, Duration: 10 * ms}, {Start: 2 * ms, Duration: 3 * ms}}, 10 * ms},
		{"overlapping", []Event{{Start: 0, Duration: 4 * ms}, {Start: 3 * ms, Duration: 4 * ms}}, 7 * ms},
		{"touching", []Event{{Start: 0, Duration: 2 * ms}, {Start: 2 * ms, Duration: 2 * ms}}, 4 * ms},
	} {
		if got := covered(c.events); got != c.want {
			t.Errorf("%s: covered %v, want %v", c.name, got, c.want)
		}
	}
}

// Events and counters from many goroutines all land (go test -race checks
// the locking).
func TestConcurrentEvents(t *testing.T) {
	ctx, tr := With(context.Background())
	const n = 50
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			Begin(ctx, Mount, "m")()
			From(ctx).Add("fsyncs", 1)
		})
	}
	wg.Wait()
	tr.Finish()
	if got := len(tr.Events()); got != n {
		t.Fatalf("%d events, want %d", got, n)
	}
	if !strings.Contains(tr.String(), "fsyncs: 50\n") {
		t.Fatalf("counter missing from\n%s", tr)
	}
}

func TestString(t *testing.T) {
	ctx, tr := With(context.Background())
	Begin(ctx, Commit, "wait PREPARED")()
	Begin(ctx, Commit, "wait again")()
	Begin(ctx, "custom", "x")()
	tr.Add("checkpoint writes", 3)
	tr.Finish()
	s := tr.String()
	for _, want := range []string{"wait PREPARED", "commit      2 events", "custom      1 events", "untraced", "wall", "checkpoint writes: 3"} {
		if !strings.Contains(s, want) {
			t.Errorf("table lacks %q:\n%s", want, s)
		}
	}
	// The wall time is fixed by Finish.
	if w := tr.wall(); w != tr.wall() {
		t.Errorf("wall time moves after Finish")
	}
}
