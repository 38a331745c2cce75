package loopplugin

import (
	"context"
	"fmt"
	"slices"
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

// lockAll waits for the locks of all ids, taken in sorted order so that two
// callers locking overlapping sets cannot deadlock. Duplicates count once.
// The returned function releases them all.
func (l *volumeLocks) lockAll(ctx context.Context, ids ...string) (unlock func(), err error) {
	ids = slices.Compact(slices.Sorted(slices.Values(ids)))
	var held []func()
	release := func() {
		for i := len(held) - 1; i >= 0; i-- {
			held[i]()
		}
	}
	for _, id := range ids {
		u, err := l.lock(ctx, id)
		if err != nil {
			release()
			return nil, err
		}
		held = append(held, u)
	}
	return release, nil
}

// Lock keys other than volume ids start with a NUL byte, which no volume id
// contains. Lock order: volume locks (sorted) first, then the groups lock;
// snapshot and group snapshot locks are only ever tried (tryLock), never
// waited for, so they cannot take part in a deadlock.
const groupsLockKey = "\x00groups"

func snapshotLockKey(id string) string      { return "\x00snapshot/" + id }
func groupSnapshotLockKey(id string) string { return "\x00group-snapshot/" + id }
