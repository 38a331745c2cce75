package defaults

import (
	"cmp"
	"log/slog"
)

// Set sets *v to def when it is unset: zero or less (numbers and
// durations), or empty (strings).
func Set[T cmp.Ordered](v *T, def T) {
	var zero T
	if *v <= zero {
		*v = def
	}
}

// Logger is l, or a logger that discards everything when l is nil.
func Logger(l *slog.Logger) *slog.Logger {
	if l == nil {
		return slog.New(slog.DiscardHandler)
	}
	return l
}
