package retrypolicy

import (
	"math/rand/v2"
	"time"
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
