// Package defaults fills in the fields a configuration leaves unset, so
// that every package's constructor says "zero (or less) means the
// default" the same way: Set for numbers, durations and strings, Logger
// for an
// optional *slog.Logger.
//
// Not for: validation (a negative value that is an error, not "unset",
// must be refused before), nor for fields whose zero value is meaningful
// (an Interval of 0 that turns something off).
package defaults
