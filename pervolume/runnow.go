package pervolume

import (
	"context"
	"sync"
	"time"
)

// RunNow runs the job on the given volumes now, through the same caps and the
// same recovery as the periodic runs (Unimplemented marks the volume
// Unsupported, a success clears the mark), and blocks until every volume is
// done or ctx ends. progress, if not nil, is called once per volume (one
// call at a time) with the final result or error; an error wraps
// ErrNotPublished when the volume is not published. RunNow does not move
// the volumes' periodic slots. It works whether Run is running or not.
func (s *Scheduler[R]) RunNow(ctx context.Context, vols []Volume, progress func(Volume, R, error)) Summary {
	var (
		mu  sync.Mutex
		sum Summary
		wg  sync.WaitGroup
	)
	for _, v := range vols {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := s.runOnce(ctx, v)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				sum.Failures++
			} else {
				sum.Volumes++
			}
			if progress != nil {
				progress(v, res, err)
			}
		}()
	}
	wg.Wait()
	return sum
}

// runOnce is one on-demand run of a volume, retries included. Retries are
// bounded by RetryMaxAttempts and, when the plugin is scheduled, by one
// interval.
func (s *Scheduler[R]) runOnce(ctx context.Context, v Volume) (R, error) {
	var zero R
	pol := s.policy(v.Plugin)
	var end time.Time
	if pol.Interval > 0 {
		end = s.clock.Now().Add(pol.Interval)
	}
	for attempt := 1; ; attempt++ {
		if err := ctx.Err(); err != nil {
			return zero, err
		}
		if err := s.acquire(ctx, v.Plugin); err != nil {
			return zero, err
		}
		res, err := s.call(ctx, v.Plugin, v.ID, pol.Timeout)
		s.release(v.Plugin)
		verdict, at, err := s.outcome(ctx, v.Plugin, v.ID, res, err, attempt, end)
		switch verdict {
		case done:
			return res, nil
		case retry:
			if err := s.sleepUntil(ctx, at); err != nil {
				return zero, err
			}
		default:
			return zero, err
		}
	}
}

// sleepUntil waits on the clock until t or until ctx ends.
func (s *Scheduler[R]) sleepUntil(ctx context.Context, t time.Time) error {
	timer := s.clock.NewTimer(t.Sub(s.clock.Now()))
	defer timer.Stop()
	select {
	case <-timer.C():
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
