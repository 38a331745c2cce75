package retrypolicy

import (
	"fmt"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"
)

// Request is the API's RetryPolicy message (agentv1.RetryPolicy; a nil one
// too) as Parse reads it.
type Request interface {
	GetMaxAttempts() uint32
	GetInitialBackoff() *durationpb.Duration
	GetMaxBackoff() *durationpb.Duration
	GetTimeout() *durationpb.Duration
}

// Policy is a validated RetryPolicy, its unset fields the defaults.
type Policy struct {
	// Attempts are the calls of one RPC in all, the first included.
	Attempts              int
	Initial, Max, Timeout time.Duration
}

// Parse validates p (nil, or a nil message: every default) into a
// Policy, naming the field that is out of its limits.
func Parse(p Request) (Policy, error) {
	rp := Policy{Attempts: DefaultAttempts, Initial: DefaultBackoff, Max: DefaultMaxBackoff, Timeout: DefaultTimeout}
	if p == nil {
		return rp, nil
	}
	if n := p.GetMaxAttempts(); n > 0 {
		if n > MaxAttempts {
			return rp, fmt.Errorf("retry.max_attempts %d: at most %d", n, MaxAttempts)
		}
		rp.Attempts = int(n)
	}
	dur := func(name string, d *durationpb.Duration, lo, hi time.Duration, into *time.Duration) error {
		if d == nil {
			return nil
		}
		if err := d.CheckValid(); err != nil {
			return fmt.Errorf("retry.%s: %w", name, err)
		}
		v := d.AsDuration()
		if v == 0 {
			return nil
		}
		if v < lo || v > hi {
			return fmt.Errorf("retry.%s %v: must be between %v and %v", name, v, lo, hi)
		}
		*into = v
		return nil
	}
	if err := dur("initial_backoff", p.GetInitialBackoff(), MinBackoff, MaxTimeout, &rp.Initial); err != nil {
		return rp, err
	}
	if err := dur("max_backoff", p.GetMaxBackoff(), MinBackoff, MaxTimeout, &rp.Max); err != nil {
		return rp, err
	}
	if err := dur("timeout", p.GetTimeout(), time.Millisecond, MaxTimeout, &rp.Timeout); err != nil {
		return rp, err
	}
	rp.Max = max(rp.Max, rp.Initial)
	return rp, nil
}

// Backoff is the wait after the n-th failed call (from 1): Initial
// doubling up to Max, with up to 10% jitter so that agents retrying the
// same plugin spread out.
func (p Policy) Backoff(n int) time.Duration {
	return Backoff(p.Initial, p.Max, n-1, 10)
}
