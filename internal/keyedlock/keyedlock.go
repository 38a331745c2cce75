package keyedlock

import (
	"context"
	"slices"
	"sync"
)

// Map is a set of locks named by string keys. The zero value is ready;
// a Map must not be copied after first use.
type Map struct {
	mu sync.Mutex
	// held maps a held key to a channel closed when it is released.
	held map[string]chan struct{}
}

// Lock takes key's lock, waiting while another holder has it until ctx
// ends; then it returns ctx.Err() and does not hold the lock. A free lock
// is taken even if ctx has ended. The returned function releases it.
func (m *Map) Lock(ctx context.Context, key string) (unlock func(), err error) {
	return m.LockWaiting(ctx, key, nil)
}

// LockWaiting is Lock, calling waiting (if not nil) once before it first
// waits for another holder, e.g. to tell the caller why it is slow.
func (m *Map) LockWaiting(ctx context.Context, key string, waiting func()) (unlock func(), err error) {
	for {
		unlock, busy := m.take(key)
		if unlock != nil {
			return unlock, nil
		}
		if waiting != nil {
			waiting()
			waiting = nil
		}
		select {
		case <-busy:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// TryLock takes key's lock if it is free; ok is false if another holder
// has it.
func (m *Map) TryLock(key string) (unlock func(), ok bool) {
	unlock, _ = m.take(key)
	return unlock, unlock != nil
}

// LockAll takes the locks of all keys, in sorted order so that two callers
// locking overlapping sets cannot deadlock; duplicates count once. On
// error it holds none of them. The returned function releases them all.
func (m *Map) LockAll(ctx context.Context, keys ...string) (unlock func(), err error) {
	keys = slices.Compact(slices.Sorted(slices.Values(keys)))
	held := make([]func(), 0, len(keys))
	release := func() {
		for i := len(held) - 1; i >= 0; i-- {
			held[i]()
		}
	}
	for _, k := range keys {
		u, err := m.Lock(ctx, k)
		if err != nil {
			release()
			return nil, err
		}
		held = append(held, u)
	}
	return release, nil
}

// take takes key's lock if it is free (unlock is set), else returns the
// channel closed when its holder releases it.
func (m *Map) take(key string) (unlock func(), busy <-chan struct{}) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if ch, ok := m.held[key]; ok {
		return nil, ch
	}
	if m.held == nil {
		m.held = map[string]chan struct{}{}
	}
	done := make(chan struct{})
	m.held[key] = done
	return func() {
		m.mu.Lock()
		delete(m.held, key)
		m.mu.Unlock()
		close(done)
	}, nil
}
