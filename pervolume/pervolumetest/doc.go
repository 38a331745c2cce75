// Package pervolumetest provides a fake pervolume.Clock for tests of code that
// drives a pervolume.Scheduler.
package pervolumetest
