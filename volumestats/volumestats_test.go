package volumestats

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"
)

// fakeSource polls instantly after hold, recording when.
type fakeSource struct {
	mu             sync.Mutex
	vols           []Volume
	polls          map[string][]time.Time
	inflight, peak int
	hold           time.Duration
}

func (f *fakeSource) Volumes() []Volume {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.vols)
}

func (f *fakeSource) Poll(ctx context.Context, v Volume) Stats {
	f.mu.Lock()
	f.polls[v.ID] = append(f.polls[v.ID], time.Now())
	f.inflight++
	f.peak = max(f.peak, f.inflight)
	f.mu.Unlock()
	t := time.NewTimer(f.hold)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
	f.mu.Lock()
	f.inflight--
	f.mu.Unlock()
	return Stats{Bytes: Usage{Known: true, Total: 100, Used: int64(len(v.ID))}}
}

func (f *fakeSource) count(id string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.polls[id])
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond) // polling a condition, not standing in for an event
	}
}

// TestPollerStaggersCapsAndForgets: each volume is polled once per interval
// (never twice within one), at most MaxConcurrent at once; a volume no
// longer listed is forgotten.
func TestPollerStaggersCapsAndForgets(t *testing.T) {
	const iv = 200 * time.Millisecond
	f := &fakeSource{polls: map[string][]time.Time{}, hold: 30 * time.Millisecond}
	for _, id := range []string{"a", "b", "c", "d", "e", "f"} {
		f.vols = append(f.vols, Volume{Plugin: "p", ID: id})
	}
	p := New(Config{Source: f, Interval: iv, MaxConcurrent: 2})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); p.Run(ctx) }()
	defer func() { cancel(); <-done }()

	waitFor(t, "three polls of every volume", func() bool {
		for _, v := range f.Volumes() {
			if f.count(v.ID) < 3 {
				return false
			}
		}
		return true
	})
	f.mu.Lock()
	if f.peak > 2 {
		t.Errorf("%d polls at once, cap 2", f.peak)
	}
	for id, ts := range f.polls {
		for i := 1; i < len(ts); i++ {
			// A poll may wait for the cap, so the gap can be shorter by
			// the hold of the polls ahead of it.
			if gap := ts[i].Sub(ts[i-1]); gap < iv-3*f.hold {
				t.Errorf("volume %s polled twice within %v (interval %v)", id, gap, iv)
			}
		}
	}
	f.vols = f.vols[1:] // a is unpublished
	f.mu.Unlock()
	if s, ok := p.Get("p", "b"); !ok || s.Bytes.Used != 1 || s.At.IsZero() {
		t.Errorf("Get(b) = %+v, %v", s, ok)
	}
	waitFor(t, "a forgotten", func() bool { _, ok := p.Snapshot()[Key{"p", "a"}]; return !ok })
	if len(p.Snapshot()) != 5 {
		t.Errorf("snapshot %v", p.Snapshot())
	}
}

// TestRefresh polls on demand, before any slot.
func TestRefresh(t *testing.T) {
	f := &fakeSource{polls: map[string][]time.Time{}}
	p := New(Config{Source: f, Interval: time.Hour})
	p.Refresh(context.Background(), []Volume{{Plugin: "p", ID: "x"}})
	if s, ok := p.Get("p", "x"); !ok || !s.Bytes.Known || f.count("x") != 1 {
		t.Errorf("after Refresh: %+v %v, %d polls", s, ok, f.count("x"))
	}
}

// blockingSource holds each poll until release is closed.
type blockingSource struct {
	mu      sync.Mutex
	vols    []Volume
	started chan struct{} // one send per poll
	release chan struct{}
}

func (b *blockingSource) Volumes() []Volume {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.vols)
}

func (b *blockingSource) Poll(ctx context.Context, v Volume) Stats {
	b.started <- struct{}{}
	<-b.release
	return Stats{Bytes: Usage{Known: true, Total: 1}}
}

// A volume unpublished while its poll runs is forgotten all the same: the
// poll's result, kept when it ended, no longer stays for good (its
// volume_stats gauges outlived the volume; TestPollerStaggersCapsAndForgets
// failed on it now and then).
func TestPollerForgetsVolumeGoneDuringItsPoll(t *testing.T) {
	b := &blockingSource{vols: []Volume{{Plugin: "p", ID: "a"}}, started: make(chan struct{}, 16), release: make(chan struct{})}
	p := New(Config{Source: b, Interval: 50 * time.Millisecond, MaxConcurrent: 1})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); p.Run(ctx) }()
	defer func() { cancel(); <-done }()
	<-b.started
	b.mu.Lock()
	b.vols = nil // unpublished, its poll still running
	b.mu.Unlock()
	waitFor(t, "a no longer scheduled", func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		_, due := p.due[Key{"p", "a"}]
		return !due
	})
	close(b.release)
	waitFor(t, "a forgotten", func() bool { _, ok := p.Get("p", "a"); return !ok && !p.busyWith(Key{"p", "a"}) })
}

func (p *Poller) busyWith(k Key) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.busy[k]
}
