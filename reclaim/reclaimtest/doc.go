// Package reclaimtest provides a fake reclaim.Clock for tests of code that
// drives a reclaim.Scheduler.
package reclaimtest
