package pervolumetest_test

import (
	"context"
	"testing"
	"time"

	"github.com/csiagent/csiagent/pervolume/pervolumetest"
)

func TestClock(t *testing.T) {
	start := time.Unix(1_900_000_000, 0)

	t.Run("timers fire in order when due", func(t *testing.T) {
		c := pervolumetest.NewClock(start)
		late, early := c.NewTimer(2*time.Second), c.NewTimer(time.Second)
		if n := c.Timers(); n != 2 {
			t.Fatalf("Timers() = %d, want 2", n)
		}
		if next, ok := c.NextDeadline(); !ok || !next.Equal(start.Add(time.Second)) {
			t.Fatalf("NextDeadline() = %v, %v", next, ok)
		}
		c.Advance(time.Second)
		select {
		case at := <-early.C():
			if !at.Equal(start.Add(time.Second)) {
				t.Errorf("fired at %v", at)
			}
		default:
			t.Fatal("early timer did not fire")
		}
		select {
		case <-late.C():
			t.Fatal("late timer fired early")
		default:
		}
		c.AdvanceTo(start.Add(5 * time.Second))
		<-late.C()
		if late.Stop() {
			t.Error("Stop of a fired timer reported true")
		}
		if !c.Now().Equal(start.Add(5 * time.Second)) {
			t.Errorf("Now() = %v", c.Now())
		}
	})

	t.Run("stop", func(t *testing.T) {
		c := pervolumetest.NewClock(start)
		tm := c.NewTimer(time.Second)
		if !tm.Stop() {
			t.Error("Stop of a pending timer reported false")
		}
		c.Advance(time.Hour)
		select {
		case <-tm.C():
			t.Error("stopped timer fired")
		default:
		}
		if _, ok := c.NextDeadline(); ok {
			t.Error("NextDeadline reports a stopped timer")
		}
	})

	t.Run("zero duration fires at once", func(t *testing.T) {
		c := pervolumetest.NewClock(start)
		<-c.NewTimer(0).C()
		if c.Timers() != 0 {
			t.Error("an immediate timer is pending")
		}
	})

	t.Run("block until", func(t *testing.T) {
		c := pervolumetest.NewClock(start)
		got := make(chan time.Time)
		go func() { got <- <-c.NewTimer(time.Minute).C() }()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := c.BlockUntil(ctx, 1); err != nil {
			t.Fatal(err)
		}
		c.Advance(time.Minute)
		if at := <-got; !at.Equal(start.Add(time.Minute)) {
			t.Errorf("fired at %v", at)
		}
		short, cancel2 := context.WithCancel(context.Background())
		cancel2()
		if err := c.BlockUntil(short, 1); err == nil {
			t.Error("BlockUntil with an ended context returned nil")
		}
	})
}
