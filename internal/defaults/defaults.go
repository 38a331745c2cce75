package defaults

import "log/slog"

// Number is what Set fills in: integers, floats and durations.
type Number interface {
	~int | ~int8 | ~int16 | ~int32 | ~int64 | ~float32 | ~float64
}

// Set sets *v to def when it is zero or less (unset).
func Set[T Number](v *T, def T) {
	if *v <= 0 {
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
