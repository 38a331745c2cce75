package retrypolicy

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
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

// TestRetry: retried on the listed codes until success, not on others,
// and not past the context's end; onRetry hears of each retry.
func TestRetry(t *testing.T) {
	unavailable, invalid := status.Error(codes.Unavailable, "u"), status.Error(codes.InvalidArgument, "i")
	answers := func(errs ...error) func(context.Context) error {
		return func(context.Context) error {
			err := errs[0]
			errs = errs[1:]
			return err
		}
	}
	retries := 0
	onRetry := func(int, error, time.Duration) { retries++ }
	ctx := context.Background()
	if n, err := Retry(ctx, time.Millisecond, time.Millisecond, []codes.Code{codes.Unavailable}, answers(unavailable, unavailable, nil), onRetry); n != 3 || err != nil || retries != 2 {
		t.Errorf("two Unavailable then success: %d calls, %v, %d retries", n, err, retries)
	}
	if n, err := Retry(ctx, time.Millisecond, time.Millisecond, []codes.Code{codes.Unavailable}, answers(unavailable, invalid, nil), nil); n != 2 || err != invalid {
		t.Errorf("Unavailable then InvalidArgument: %d calls, %v", n, err)
	}
	cctx, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancel()
	n, err := Retry(cctx, time.Millisecond, 5*time.Millisecond, []codes.Code{codes.Unavailable}, func(context.Context) error { return unavailable }, nil)
	if err != unavailable || cctx.Err() == nil || n < 2 {
		t.Errorf("Unavailable until the deadline: %d calls, %v, context %v", n, err, cctx.Err())
	}
}
