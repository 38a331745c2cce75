package pervolume

import (
	"hash/fnv"
	"testing"
	"time"
)

func TestVolumeHash(t *testing.T) {
	h := fnv.New64a()
	h.Write([]byte("plugin\x00vol"))
	if got, want := volumeHash("plugin", "vol"), h.Sum64(); got != want {
		t.Errorf("volumeHash = %#x, want FNV-64a of plugin+NUL+id %#x", got, want)
	}
	if volumeHash("a", "bc") == volumeHash("ab", "c") {
		t.Error("the separator does not separate")
	}
}

func TestNextSlot(t *testing.T) {
	const iv = 10 * time.Second
	at := func(ns int64) time.Time { return time.Unix(0, ns) }
	tests := []struct {
		name  string
		after time.Time
		hash  uint64
		want  time.Time
	}{
		{"offset 0, on a slot: the next one", at(20e9), 0, at(30e9)},
		{"offset 0, between slots", at(21e9), 0, at(30e9)},
		{"offset 3s, before this interval's slot", at(21e9), 3e9, at(23e9)},
		{"offset 3s, on the slot", at(23e9), 3e9, at(33e9)},
		{"offset 3s, just after the slot", at(23e9 + 1), 3e9, at(33e9)},
		{"hash larger than the interval", at(21e9), 5*uint64(iv) + 3e9, at(23e9)},
		{"before the epoch", at(-1e9), 3e9, at(3e9)},
		{"before the epoch, further", at(-15e9), 3e9, at(-7e9)},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := nextSlot(tc.after, iv, tc.hash); !got.Equal(tc.want) {
				t.Errorf("nextSlot(%v) = %v, want %v", tc.after.UnixNano(), got.UnixNano(), tc.want.UnixNano())
			}
		})
	}
}

func TestFirstRun(t *testing.T) {
	const iv = 10 * time.Second
	now := time.Unix(1_900_000_005, 0)
	h := uint64(3e9) // slots at ...3 s
	slot := time.Unix(1_900_000_013, 0)
	tests := []struct {
		name             string
		persisted, since time.Time
		want             time.Time
	}{
		{"never scheduled, publish time unknown: next slot", time.Time{}, time.Time{}, slot},
		{"never scheduled, published just now: next slot", time.Time{}, now, slot},
		{"never scheduled, published an hour ago (slots missed while down): its first slot after publishing, runs at once", time.Time{}, now.Add(-time.Hour), time.Unix(1_899_996_413, 0)},
		{"never scheduled, publish time in the future (clock stepped back): next slot", time.Time{}, now.Add(time.Hour), slot},
		{"future within an interval: kept", now.Add(7 * time.Second), now.Add(-time.Hour), now.Add(7 * time.Second)},
		{"exactly one interval away: kept", now.Add(iv), time.Time{}, now.Add(iv)},
		{"more than an interval away (interval shortened): next slot", now.Add(time.Hour), time.Time{}, slot},
		{"missed while down: kept, runs at once", now.Add(-time.Hour), time.Time{}, now.Add(-time.Hour)},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := firstRun(tc.persisted, tc.since, now, iv, h); !got.Equal(tc.want) {
				t.Errorf("firstRun = %v, want %v", got, tc.want)
			}
		})
	}
}

func TestRetryAt(t *testing.T) {
	now := time.Unix(1_900_000_000, 0)
	tests := []struct {
		name     string
		attempt  int
		cycleEnd time.Time
		want     time.Duration // -1: no retry
	}{
		{"first retry after 1s", 1, time.Time{}, time.Second},
		{"doubling", 3, time.Time{}, 4 * time.Second},
		{"last allowed", RetryMaxAttempts - 1, time.Time{}, RetryBase << (RetryMaxAttempts - 2)},
		{"attempts used up", RetryMaxAttempts, time.Time{}, -1},
		{"before the next slot", 2, now.Add(3 * time.Second), 2 * time.Second},
		{"at the next slot: none", 2, now.Add(2 * time.Second), -1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			at, ok := retryAt(now, tc.attempt, tc.cycleEnd)
			switch {
			case tc.want < 0 && ok:
				t.Errorf("retry at %v, want none", at.Sub(now))
			case tc.want >= 0 && (!ok || at.Sub(now) != tc.want):
				t.Errorf("retryAt = %v, %v; want %v", at.Sub(now), ok, tc.want)
			}
		})
	}
}
