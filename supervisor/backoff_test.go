package supervisor

import (
	"testing"
	"time"
)

func TestBackoff(t *testing.T) {
	b := backoff{base: time.Second, max: time.Minute, reset: 10 * time.Minute}
	want := []time.Duration{1, 2, 4, 8, 16, 32, 60, 60}
	for i, w := range want {
		got := b.next(0)
		lo, hi := w*time.Second, w*time.Second*12/10
		if got < lo || got > hi {
			t.Errorf("attempt %d: delay %v, want within [%v, %v]", i, got, lo, hi)
		}
	}
	if got := b.next(10 * time.Minute); got > 1200*time.Millisecond {
		t.Errorf("after a healthy 10 minutes the delay should reset to ~1s, got %v", got)
	}
}
