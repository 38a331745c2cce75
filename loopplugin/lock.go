package loopplugin

import (
	"context"
	"fmt"
	"sync"
)

// volumeLocks serializes operations per volume id; different ids never
// wait for each other. Entries exist only while held or awaited.
type volumeLocks struct {
	mu sync.Mutex
	m  map[string]*volumeLock
}

type volumeLock struct {
	held chan struct{} // one token: full while someone holds the lock
	refs int           // holders and waiters
}

func newVolumeLocks() *volumeLocks {
	return &volumeLocks{m: map[string]*volumeLock{}}
}

func (l *volumeLocks) ref(id string) *volumeLock {
	l.mu.Lock()
	defer l.mu.Unlock()
	e, ok := l.m[id]
	if !ok {
		e = &volumeLock{held: make(chan struct{}, 1)}
		l.m[id] = e
	}
	e.refs++
	return e
}

func (l *volumeLocks) unref(id string, e *volumeLock) {
	l.mu.Lock()
	defer l.mu.Unlock()
	e.refs--
	if e.refs == 0 {
		delete(l.m, id)
	}
}

// lock waits for the volume's lock until ctx ends, in which case it returns
// ctx's error (wrapped) and does not hold the lock. The returned function
// releases it.
func (l *volumeLocks) lock(ctx context.Context, id string) (unlock func(), err error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("waiting for another operation on volume %s: %w", id, err)
	}
	e := l.ref(id)
	select {
	case e.held <- struct{}{}:
		return func() { <-e.held; l.unref(id, e) }, nil
	case <-ctx.Done():
		l.unref(id, e)
		return nil, fmt.Errorf("waiting for another operation on volume %s: %w", id, ctx.Err())
	}
}

// tryLock takes the volume's lock if it is free, or fails at once with
// ErrBusy.
func (l *volumeLocks) tryLock(id string) (unlock func(), err error) {
	e := l.ref(id)
	select {
	case e.held <- struct{}{}:
		return func() { <-e.held; l.unref(id, e) }, nil
	default:
		l.unref(id, e)
		return nil, fmt.Errorf("%w: another operation on volume %s is in flight", ErrBusy, id)
	}
}
