package pervolume

import (
	"context"
	"errors"
	"fmt"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// verdict is what to do after a call.
type verdict int

const (
	done      verdict = iota // success: the run is over
	failed                   // the run is over; try again next cycle
	retry                    // call again at the returned time, in this cycle
	dropped                  // the volume is not published: forget it silently
	cancelled                // the caller's ctx ended: nothing is recorded
)

// outcome applies the recovery table (doc.go) to one call's result,
// counts finished runs in the plugin's Totals and marks the volume
// Unsupported. attempt counts the calls made for this run, this one
// included; no retry is made at or after cycleEnd (zero: no such bound).
// It is the one place where both the periodic runs and RunNow decide.
//
//	nil                            success
//	ctx ended                      cancelled, not counted
//	wraps ErrNotPublished          dropped, not counted
//	NotFound, volume gone          dropped, not counted (checked in Volumes())
//	NotFound, still published      retry with backoff (bounded), then failure
//	Aborted                        retry with backoff (bounded), then failure
//	Unimplemented                  failure; volume Unsupported
//	InvalidArgument, Unauthenticated,
//	Unknown, DeadlineExceeded, ... failure, no retry: next cycle
func (s *Scheduler[R]) outcome(ctx context.Context, plugin, id string, res R, err error, attempt int, cycleEnd time.Time) (verdict, time.Time, error) {
	log := s.log.With("plugin", plugin, "volume", id)
	if err == nil {
		s.mu.Lock()
		ps := s.pluginLocked(plugin)
		ps.totals.Runs++
		wasUnsupported := ps.unsupported[id]
		if wasUnsupported {
			s.supportedLocked(plugin, id, s.clock.Now())
		}
		s.mu.Unlock()
		if wasUnsupported {
			s.Poke()
		}
		log.Debug(s.name+": done", "attempt", attempt, "result", res)
		return done, time.Time{}, nil
	}
	if ctx.Err() != nil {
		return cancelled, time.Time{}, err
	}
	if errors.Is(err, ErrNotPublished) {
		log.Debug(s.name+": volume no longer published", "error", err)
		return dropped, time.Time{}, err
	}

	code := status.Code(err)
	switch code {
	case codes.Unimplemented:
		s.mu.Lock()
		ps := s.pluginLocked(plugin)
		if ps.unsupported == nil {
			ps.unsupported = map[string]bool{}
		}
		ps.unsupported[id] = true
		s.mu.Unlock()
		log.Info(s.name+": the plugin cannot do this on the volume (Unimplemented); it is not scheduled until the plugin's config or process changes", "error", err)
	case codes.NotFound:
		if !s.published(plugin, id) {
			log.Debug(s.name+": volume no longer published", "error", err)
			return dropped, time.Time{}, fmt.Errorf("%w: %w", ErrNotPublished, err)
		}
		fallthrough
	case codes.Aborted:
		if at, ok := retryAt(s.clock.Now(), attempt, cycleEnd); ok {
			log.Debug(s.name+": will retry", "code", code, "attempt", attempt, "at", at, "error", err)
			return retry, at, err
		}
	}

	s.mu.Lock()
	t := &s.pluginLocked(plugin).totals
	t.Runs++
	t.Failures++
	t.LastError = err
	s.mu.Unlock()
	log.Warn(s.name+": failed", "code", code, "attempts", attempt, "error", err)
	return failed, time.Time{}, err
}

// retryAt returns when to make call attempt+1: RetryBase doubled per call
// made, while fewer than RetryMaxAttempts calls were made and before
// cycleEnd.
func retryAt(now time.Time, attempt int, cycleEnd time.Time) (time.Time, bool) {
	if attempt >= RetryMaxAttempts {
		return time.Time{}, false
	}
	at := now.Add(RetryBase << (attempt - 1))
	if !cycleEnd.IsZero() && !at.Before(cycleEnd) {
		return time.Time{}, false
	}
	return at, true
}

// published reports whether Job.Volumes() lists the volume.
func (s *Scheduler[R]) published(plugin, id string) bool {
	for _, v := range s.job.Volumes() {
		if v.Plugin == plugin && v.ID == id {
			return true
		}
	}
	return false
}
