package optrace

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"
)

// Kind classifies an event.
type Kind string

// The kinds of events.
const (
	// Lock is a wait for a lock: a volume's, a container's, or another
	// mutex the operation waits on.
	Lock Kind = "lock"
	// Commit is a wait for durability (a commit round's fsyncs).
	Commit Kind = "commit"
	// Plugin is a CSI call to a plugin, retries included.
	Plugin Kind = "plugin"
	// Mount is mount work: binds, moves, unmounts, mount table scans,
	// mount point directories.
	Mount Kind = "mount"
	// Claim is a cluster claim or release.
	Claim Kind = "claim"
	// Other is any other step worth its line.
	Other Kind = "other"
)

// Event is one timed step of an operation.
type Event struct {
	Kind Kind
	Name string
	// Start is the offset from the Trace's start; Duration how long the
	// step took.
	Start, Duration time.Duration
}

// counter is a named count of the operation (Add).
type counter struct {
	name string
	n    uint64
}

// Trace records one operation's events. Its methods are safe for
// concurrent use; a nil *Trace records nothing.
type Trace struct {
	start time.Time

	mu       sync.Mutex
	end      time.Time // zero until Finish
	events   []Event
	counters []counter
}

type key struct{}

// With returns a context that carries a new Trace, started now, and the
// Trace.
func With(ctx context.Context) (context.Context, *Trace) {
	t := &Trace{start: time.Now()}
	return context.WithValue(ctx, key{}, t), t
}

// From returns ctx's Trace, nil when it carries none.
func From(ctx context.Context) *Trace {
	t, _ := ctx.Value(key{}).(*Trace)
	return t
}

// noop is the end of an event not recorded: one func value for all, so
// that Begin without a Trace allocates nothing.
var noop = func() {}

// Begin opens an event of ctx's Trace and returns the func that closes it
// (to defer, or call when the step is done). Without a Trace in ctx it
// does nothing and allocates nothing.
func Begin(ctx context.Context, kind Kind, name string) (end func()) {
	return From(ctx).Begin(kind, name)
}

// Begin opens an event and returns the func that closes it; on a nil
// Trace, a func that does nothing.
func (t *Trace) Begin(kind Kind, name string) (end func()) {
	if t == nil {
		return noop
	}
	s := time.Now()
	return func() {
		d := time.Since(s)
		t.mu.Lock()
		t.events = append(t.events, Event{Kind: kind, Name: name, Start: s.Sub(t.start), Duration: d})
		t.mu.Unlock()
	}
}

// Add adds n to the counter name (created at 0 on first use); counters
// are listed after the summary, in the order they were first added. A nil
// Trace ignores it.
func (t *Trace) Add(name string, n uint64) {
	if t == nil {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for i := range t.counters {
		if t.counters[i].name == name {
			t.counters[i].n += n
			return
		}
	}
	t.counters = append(t.counters, counter{name, n})
}

// Finish ends the operation's wall time (the first call counts). A Trace
// rendered before Finish takes its wall time up to the rendering.
func (t *Trace) Finish() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.end.IsZero() {
		t.end = time.Now()
	}
}

// Events returns the events closed so far, in start order.
func (t *Trace) Events() []Event {
	t.mu.Lock()
	defer t.mu.Unlock()
	return sortedEvents(t.events)
}

func sortedEvents(events []Event) []Event {
	out := slices.Clone(events)
	slices.SortStableFunc(out, func(a, b Event) int { return cmp.Compare(a.Start, b.Start) })
	return out
}

// wall is the operation's wall time: from With to Finish, or to now. The
// caller holds mu.
func (t *Trace) wall() time.Duration {
	if t.end.IsZero() {
		return time.Since(t.start)
	}
	return t.end.Sub(t.start)
}

// covered is the length of the union of the intervals of events, sorted
// by start.
func covered(events []Event) time.Duration {
	var total, curStart, curEnd time.Duration
	open := false
	for _, e := range events {
		s, end := e.Start, e.Start+e.Duration
		switch {
		case !open:
			curStart, curEnd, open = s, end, true
		case s > curEnd:
			total += curEnd - curStart
			curStart, curEnd = s, end
		case end > curEnd:
			curEnd = end
		}
	}
	if open {
		total += curEnd - curStart
	}
	return total
}

// kindOrder is the order of the summary's lines.
var kindOrder = []Kind{Lock, Commit, Plugin, Mount, Claim, Other}

// String renders the trace as a table: a line per event in time order
// (offset, duration, kind, name, in ms), then per kind the number of events
// and their total duration (nested or concurrent events of a kind both
// count), the untraced remainder (the wall time minus the union of the
// events' intervals, which overlapping events cover once), the wall time,
// and the counters.
func (t *Trace) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	events := sortedEvents(t.events)
	wall := t.wall()
	var b strings.Builder
	fmt.Fprintf(&b, "%10s %10s  %-6s  %s\n", "offset ms", "dur ms", "kind", "step")
	for _, e := range events {
		fmt.Fprintf(&b, "%10.3f %10.3f  %-6s  %s\n", msOf(e.Start), msOf(e.Duration), e.Kind, e.Name)
	}
	b.WriteString("summary:\n")
	totals := map[Kind]time.Duration{}
	counts := map[Kind]int{}
	kinds := slices.Clone(kindOrder)
	for _, e := range events {
		if !slices.Contains(kinds, e.Kind) {
			kinds = append(kinds, e.Kind)
		}
		totals[e.Kind] += e.Duration
		counts[e.Kind]++
	}
	for _, k := range kinds {
		if counts[k] > 0 {
			fmt.Fprintf(&b, "  %-9s %3d events %10.3f ms\n", k, counts[k], msOf(totals[k]))
		}
	}
	fmt.Fprintf(&b, "  %-9s            %10.3f ms (wall minus the union of the events)\n", "untraced", msOf(wall-covered(events)))
	fmt.Fprintf(&b, "  %-9s            %10.3f ms\n", "wall", msOf(wall))
	for _, c := range t.counters {
		fmt.Fprintf(&b, "  %s: %d\n", c.name, c.n)
	}
	return b.String()
}

func msOf(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
