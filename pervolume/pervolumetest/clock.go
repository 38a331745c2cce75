package pervolumetest

import (
	"context"
	"slices"
	"sync"
	"time"

	"github.com/csiagent/csiagent/pervolume"
)

// Clock is a fake pervolume.Clock: time moves only by Advance and AdvanceTo,
// which fire the timers that are due, earliest first. Its methods are safe
// for concurrent use.
type Clock struct {
	mu     sync.Mutex
	cond   sync.Cond
	now    time.Time
	timers []*timer // pending, in creation order
}

var _ pervolume.Clock = (*Clock)(nil)

// NewClock returns a Clock that reads start.
func NewClock(start time.Time) *Clock {
	c := &Clock{now: start}
	c.cond.L = &c.mu
	return c
}

type timer struct {
	c  *Clock
	at time.Time
	ch chan time.Time
}

func (t *timer) C() <-chan time.Time { return t.ch }

func (t *timer) Stop() bool {
	t.c.mu.Lock()
	defer t.c.mu.Unlock()
	i := slices.Index(t.c.timers, t)
	if i < 0 {
		return false
	}
	t.c.timers = slices.Delete(t.c.timers, i, i+1)
	t.c.cond.Broadcast()
	return true
}

// Now returns the fake time.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// NewTimer returns a timer that fires once the fake time reaches Now()+d;
// at once if d <= 0.
func (c *Clock) NewTimer(d time.Duration) pervolume.Timer {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := &timer{c: c, at: c.now.Add(d), ch: make(chan time.Time, 1)}
	if d <= 0 {
		t.ch <- c.now
		return t
	}
	c.timers = append(c.timers, t)
	c.cond.Broadcast()
	return t
}

// Advance moves the fake time forward by d.
func (c *Clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.advanceLocked(c.now.Add(d))
}

// AdvanceTo moves the fake time to t, if t is later than Now().
func (c *Clock) AdvanceTo(t time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.advanceLocked(t)
}

func (c *Clock) advanceLocked(t time.Time) {
	if t.After(c.now) {
		c.now = t
	}
	var due []*timer
	c.timers = slices.DeleteFunc(c.timers, func(x *timer) bool {
		if x.at.After(c.now) {
			return false
		}
		due = append(due, x)
		return true
	})
	slices.SortStableFunc(due, func(a, b *timer) int { return a.at.Compare(b.at) })
	for _, x := range due {
		x.ch <- c.now // never blocks: each timer fires once into a buffer of 1
	}
	c.cond.Broadcast()
}

// Timers returns the number of pending timers: made, not fired, not
// stopped.
func (c *Clock) Timers() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.timers)
}

// NextDeadline returns when the earliest pending timer fires, and false if
// none is pending.
func (c *Clock) NextDeadline() (time.Time, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.timers) == 0 {
		return time.Time{}, false
	}
	next := c.timers[0].at
	for _, t := range c.timers[1:] {
		if t.at.Before(next) {
			next = t.at
		}
	}
	return next, true
}

// BlockUntil waits until at least n timers are pending, which is how a
// test knows that n goroutines are blocked on the clock; it returns
// ctx.Err() if ctx ends first.
func (c *Clock) BlockUntil(ctx context.Context, n int) error {
	stop := context.AfterFunc(ctx, func() {
		c.mu.Lock()
		defer c.mu.Unlock()
		c.cond.Broadcast()
	})
	defer stop()
	c.mu.Lock()
	defer c.mu.Unlock()
	for len(c.timers) < n {
		if err := ctx.Err(); err != nil {
			return err
		}
		c.cond.Wait()
	}
	return nil
}
