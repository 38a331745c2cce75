package supervisor

import (
	"time"

	"github.com/csiagent/csiagent/internal/retrypolicy"
)

// Restart backoff defaults: 1 s doubling to 1 min, forgotten after 10
// healthy minutes.
const (
	DefaultBackoffBase  = time.Second
	DefaultBackoffMax   = time.Minute
	DefaultBackoffReset = 10 * time.Minute
)

// backoff computes restart delays: exponential with jitter, reset after a
// long enough healthy run.
type backoff struct {
	base, max, reset time.Duration
	attempt          int
}

// next returns the delay before the next start, given how long the last
// run was healthy (ready).
func (b *backoff) next(healthy time.Duration) time.Duration {
	if healthy >= b.reset {
		b.attempt = 0
	}
	// Jitter of up to +20% spreads plugins that failed together.
	d := retrypolicy.Backoff(b.base, b.max, b.attempt, 5)
	b.attempt++
	return d
}
