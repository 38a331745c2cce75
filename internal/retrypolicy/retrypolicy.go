package retrypolicy

import "time"

// Defaults and limits of a RetryPolicy's fields.
const (
	// DefaultAttempts is the calls of one RPC in all, the first included.
	DefaultAttempts = 5
	// MaxAttempts caps max_attempts.
	MaxAttempts = 100
	// DefaultBackoff is the wait after the first failed call; it doubles
	// after each.
	DefaultBackoff = 500 * time.Millisecond
	// MinBackoff is the least initial_backoff and max_backoff.
	MinBackoff = 10 * time.Millisecond
	// DefaultMaxBackoff is the longest wait between calls.
	DefaultMaxBackoff = 30 * time.Second
	// DefaultTimeout bounds a whole operation.
	DefaultTimeout = 10 * time.Minute
	// MaxTimeout caps timeout.
	MaxTimeout = 24 * time.Hour
)
