package retrypolicy

import (
	"testing"
	"time"
)

func TestBackoff(t *testing.T) {
	for _, c := range []struct {
		n    int
		want time.Duration // before jitter
	}{
		{0, time.Second}, {1, 2 * time.Second}, {3, 8 * time.Second},
		{6, time.Minute}, // capped
		{1000, time.Minute},
	} {
		for range 50 {
			got := Backoff(time.Second, time.Minute, c.n, 5)
			if got < c.want || got > c.want+c.want/5 {
				t.Fatalf("Backoff(1s, 1m, %d, 5) = %v, want %v plus at most 20%%", c.n, got, c.want)
			}
		}
	}
	// A shift that overflows is the cap, not a negative wait.
	if got := Backoff(time.Hour, 24*time.Hour, 40, 10); got < 24*time.Hour || got > 24*time.Hour+24*time.Hour/10 {
		t.Fatalf("Backoff past overflow = %v, want 24h plus at most 10%%", got)
	}
}
