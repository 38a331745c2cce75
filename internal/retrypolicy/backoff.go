package retrypolicy

import (
	"context"
	"math/rand/v2"
	"slices"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Backoff is the wait before retry n (0: the first): base doubled n
// times, at most max, plus a random jitter of up to 1/spread of it, so
// that callers that failed together do not retry together.
func Backoff(base, max time.Duration, n, spread int) time.Duration {
	d := base << min(n, 30)
	if d > max || d <= 0 {
		d = max
	}
	return d + rand.N(d/time.Duration(spread)+1)
}

// Retry calls call until it succeeds, fails with a code (its gRPC status)
// not in retry, or ctx ends, waiting Backoff(base, max, n, 2) before retry
// n; onRetry, when set, is told of each failed call about to be retried
// and the wait. It returns the number of calls and the last error.
func Retry(ctx context.Context, base, max time.Duration, retry []codes.Code, call func(context.Context) error, onRetry func(attempt int, err error, wait time.Duration)) (int, error) {
	for attempt := 1; ; attempt++ {
		err := call(ctx)
		if err == nil || !slices.Contains(retry, status.Code(err)) || ctx.Err() != nil {
			return attempt, err
		}
		d := Backoff(base, max, attempt-1, 2)
		if onRetry != nil {
			onRetry(attempt, err, d)
		}
		t := time.NewTimer(d)
		select {
		case <-ctx.Done():
			t.Stop()
			return attempt, err
		case <-t.C:
		}
	}
}
