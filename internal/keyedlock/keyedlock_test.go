package keyedlock

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"
)

// held reports whether key is held, without waiting.
func held(m *Map, key string) bool {
	unlock, ok := m.TryLock(key)
	if ok {
		unlock()
	}
	return !ok
}

func TestOneHolderPerKey(t *testing.T) {
	var m Map
	ctx := context.Background()
	unlockA, err := m.Lock(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	// Another key is free.
	unlockB, err := m.Lock(ctx, "b")
	if err != nil {
		t.Fatal(err)
	}
	unlockB()
	if _, ok := m.TryLock("a"); ok {
		t.Fatal("TryLock took a held key")
	}
	got := make(chan struct{})
	go func() {
		unlock, err := m.Lock(ctx, "a")
		if err != nil {
			t.Error(err)
			return
		}
		close(got)
		unlock()
	}()
	select {
	case <-got:
		t.Fatal("a second holder got a held key")
	default:
	}
	unlockA()
	select {
	case <-got:
	case <-time.After(10 * time.Second):
		t.Fatal("the waiter did not get the key after it was released")
	}
}

func TestWaiterGivesUpWithItsContext(t *testing.T) {
	var m Map
	unlock, _ := m.Lock(context.Background(), "k")
	ctx, cancel := context.WithCancel(context.Background())
	waited := 0
	errc := make(chan error, 1)
	go func() {
		_, err := m.LockWaiting(ctx, "k", func() { waited++; cancel() })
		errc <- err
	}()
	select {
	case err := <-errc:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("err = %v, want context.Canceled", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the waiter did not give up")
	}
	if waited != 1 {
		t.Errorf("waiting called %d times, want 1", waited)
	}
	unlock()
	// A free key is taken even with an ended context, and without calling
	// waiting.
	unlock, err := m.LockWaiting(ctx, "k", func() { t.Error("waiting called for a free key") })
	if err != nil {
		t.Fatalf("a free key with an ended context: %v", err)
	}
	unlock()
	if len(m.held) != 0 {
		t.Errorf("entries left after every release: %v", m.held)
	}
}

// TestLockAllNoDeadlock: callers locking overlapping sets in opposite
// orders all finish, and each key has one holder at a time.
func TestLockAllNoDeadlock(t *testing.T) {
	var m Map
	var inside sync.Map
	var wg sync.WaitGroup
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for i := range 8 {
		keys := []string{"a", "b", "c", "a"}
		if i%2 == 1 {
			keys = []string{"c", "b", "a"}
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 200 {
				unlock, err := m.LockAll(ctx, keys...)
				if err != nil {
					t.Error(err)
					return
				}
				for _, k := range []string{"a", "b", "c"} {
					if _, loaded := inside.LoadOrStore(k, true); loaded {
						t.Errorf("two holders of %s", k)
					}
				}
				for _, k := range []string{"a", "b", "c"} {
					inside.Delete(k)
				}
				unlock()
			}
		}()
	}
	wg.Wait()
	for _, k := range []string{"a", "b", "c"} {
		if held(&m, k) {
			t.Errorf("%s still held", k)
		}
	}
}

// TestLockAllFailsWhole: a LockAll that gives up holds none of its keys.
func TestLockAllFailsWhole(t *testing.T) {
	var m Map
	unlockB, _ := m.Lock(context.Background(), "b")
	defer unlockB()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := m.LockAll(ctx, "a", "b", "c"); !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
	if held(&m, "a") || held(&m, "c") {
		t.Error("a failed LockAll left keys held")
	}
}
