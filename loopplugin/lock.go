package loopplugin

import (
	"context"
	"fmt"
	"strings"

	"github.com/csiagent/csiagent/internal/keyedlock"
)

// volumeLocks serializes operations per volume id (and the keys below);
// different ids never wait for each other. It is a keyedlock.Map that
// speaks the plugin's errors: a wait cut short names the volume, a busy
// tryLock is ErrBusy (Aborted).
type volumeLocks struct {
	m keyedlock.Map
}

func newVolumeLocks() *volumeLocks {
	return &volumeLocks{}
}

// lock waits for the volume's lock until ctx ends, in which case it returns
// ctx's error (wrapped) and does not hold the lock. The returned function
// releases it.
func (l *volumeLocks) lock(ctx context.Context, id string) (unlock func(), err error) {
	return l.lockAll(ctx, id)
}

// tryLock takes the volume's lock if it is free, or fails at once with
// ErrBusy.
func (l *volumeLocks) tryLock(id string) (unlock func(), err error) {
	unlock, ok := l.m.TryLock(id)
	if !ok {
		return nil, fmt.Errorf("%w: another operation on volume %s is in flight", ErrBusy, id)
	}
	return unlock, nil
}

// lockAll waits for the locks of all ids, taken in sorted order so that two
// callers locking overlapping sets cannot deadlock. Duplicates count once.
// The returned function releases them all.
func (l *volumeLocks) lockAll(ctx context.Context, ids ...string) (unlock func(), err error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("waiting for another operation on volume %s: %w", strings.Join(ids, ", "), err)
	}
	unlock, err = l.m.LockAll(ctx, ids...)
	if err != nil {
		return nil, fmt.Errorf("waiting for another operation on volume %s: %w", strings.Join(ids, ", "), err)
	}
	return unlock, nil
}

// lockedVolume checks a call's volume id and then its other arguments
// (argErrs: what their checks returned, reported in that order, so a
// request's first error is the one returned), takes the volume's lock
// (waiting until ctx ends, or, with try, failing at once with ErrBusy
// when it is held) and reads the volume. The caller releases the lock
// with unlock.
func (p *Plugin) lockedVolume(ctx context.Context, id string, try bool, argErrs ...error) (vol Volume, unlock func(), err error) {
	if err := requireVolumeID(id); err != nil {
		return Volume{}, nil, err
	}
	for _, err := range argErrs {
		if err != nil {
			return Volume{}, nil, err
		}
	}
	if try {
		unlock, err = p.locks.tryLock(id)
	} else {
		unlock, err = p.locks.lock(ctx, id)
	}
	if err != nil {
		return Volume{}, nil, err
	}
	if vol, err = p.pool.Get(id); err != nil {
		unlock()
		return Volume{}, nil, err
	}
	return vol, unlock, nil
}

// lockedAttached is lockedVolume that also finds the loop devices the
// volume's image is attached to.
func (p *Plugin) lockedAttached(ctx context.Context, id string, try bool, argErrs ...error) (Volume, devices, func(), error) {
	vol, unlock, err := p.lockedVolume(ctx, id, try, argErrs...)
	if err != nil {
		return Volume{}, nil, nil, err
	}
	ds, err := devicesOf(vol)
	if err != nil {
		unlock()
		return Volume{}, nil, nil, err
	}
	return vol, ds, unlock, nil
}

// Lock keys other than volume ids start with a NUL byte, which no volume id
// contains. Lock order: volume locks (sorted) first, then the groups lock;
// snapshot and group snapshot locks are only ever tried (tryLock), never
// waited for, so they cannot take part in a deadlock.
const groupsLockKey = "\x00groups"

func snapshotLockKey(id string) string      { return "\x00snapshot/" + id }
func groupSnapshotLockKey(id string) string { return "\x00group-snapshot/" + id }
