package pervolume_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/pervolume"
	"github.com/csiagent/csiagent/pervolume/pervolumetest"
)

var ok = result{PreUsage: 1000, PostUsage: 900}

// fails answers err for the first n calls of a volume (n < 0: always),
// then success.
func fails(n int, err error) func(*fakeJob, string, string, int) (result, error) {
	return func(_ *fakeJob, _, _ string, i int) (result, error) {
		if n < 0 || i < n {
			return result{}, err
		}
		return ok, nil
	}
}

// gone unpublishes the volume and answers err.
func gone(err error) func(*fakeJob, string, string, int) (result, error) {
	return func(f *fakeJob, p, id string, _ int) (result, error) {
		f.remove(p, id)
		return result{}, err
	}
}

func secs(ss ...float64) []time.Duration {
	out := make([]time.Duration, len(ss))
	for i, s := range ss {
		out[i] = time.Duration(s * float64(time.Second))
	}
	return out
}

// TestErrorRecovery runs one volume for three cycles against scripted
// answers and checks when it was called, what was persisted and counted.
func TestErrorRecovery(t *testing.T) {
	const p, id = "plugin", "vol"
	st := func(c codes.Code) error { return status.Error(c, c.String()) }
	tests := []struct {
		name   string
		iv     time.Duration
		script func(*fakeJob, string, string, int) (result, error)
		// calls, relative to the first slot
		want []time.Duration
		// finished cycles (each persists the next slot), failed ones
		cycles, failures int64
		wantCode         codes.Code
		unsupported      bool
	}{
		{"success", 10 * time.Second, nil, secs(0, 10, 20), 3, 0, codes.OK, false},
		{"aborted twice then success: backoff 1s, 2s", 10 * time.Second, fails(2, st(codes.Aborted)),
			secs(0, 1, 3, 10, 20), 3, 0, codes.OK, false},
		{"aborted always: retries bounded by the interval", 10 * time.Second, fails(-1, st(codes.Aborted)),
			secs(0, 1, 3, 7, 10, 11, 13, 17, 20, 21, 23, 27), 3, 3, codes.Aborted, false},
		{"aborted always: retries bounded by attempts", time.Minute, fails(-1, st(codes.Aborted)),
			secs(0, 1, 3, 7, 15, 60, 61, 63, 67, 75, 120, 121, 123, 127, 135), 3, 3, codes.Aborted, false},
		{"not found, volume gone: dropped silently", 10 * time.Second, gone(st(codes.NotFound)),
			secs(0), 0, 0, codes.OK, false},
		{"not found, still published: bounded retries, then next cycle", 10 * time.Second, fails(-1, st(codes.NotFound)),
			secs(0, 1, 3, 7, 10, 11, 13, 17, 20, 21, 23, 27), 3, 3, codes.NotFound, false},
		{"not found once, still published", 10 * time.Second, fails(1, st(codes.NotFound)),
			secs(0, 1, 10, 20), 3, 0, codes.OK, false},
		{"invalid argument: no retry", 10 * time.Second, fails(-1, st(codes.InvalidArgument)),
			secs(0, 10, 20), 3, 3, codes.InvalidArgument, false},
		{"unauthenticated: no retry", 10 * time.Second, fails(-1, st(codes.Unauthenticated)),
			secs(0, 10, 20), 3, 3, codes.Unauthenticated, false},
		{"unknown: next cycle", 10 * time.Second, fails(1, st(codes.Unknown)),
			secs(0, 10, 20), 3, 1, codes.Unknown, false},
		{"deadline exceeded: next cycle", 10 * time.Second, fails(-1, st(codes.DeadlineExceeded)),
			secs(0, 10, 20), 3, 3, codes.DeadlineExceeded, false},
		{"unavailable: next cycle", 10 * time.Second, fails(-1, st(codes.Unavailable)),
			secs(0, 10, 20), 3, 3, codes.Unavailable, false},
		{"plain error: next cycle", 10 * time.Second, fails(-1, errors.New("boom")),
			secs(0, 10, 20), 3, 3, codes.Unknown, false},
		{"not published: dropped silently", 10 * time.Second, gone(fmt.Errorf("reclaim: %w", pervolume.ErrNotPublished)),
			secs(0), 0, 0, codes.OK, false},
		{"unimplemented: volume unsupported, no more calls", 10 * time.Second, fails(-1, st(codes.Unimplemented)),
			secs(0), 1, 1, codes.Unimplemented, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			clock := pervolumetest.NewClock(t0)
			f := newJob(clock)
			f.script = tc.script
			f.add(p, id, time.Time{})
			slot := slotAfter(t0, tc.iv, p, id)
			h := start(t, clock, f, pervolume.Config[result]{Policy: policy(tc.iv, 1)})
			h.driveTo(slot.Add(3*tc.iv - time.Second)) // three cycles, all their retries

			var got []time.Duration
			for _, c := range f.Calls(false) {
				got = append(got, c.at.Sub(slot))
				if c.timeout <= 0 || c.timeout > time.Minute {
					t.Errorf("call at %v: %v left before its deadline, want (0, 1m]: the policy's timeout", c.at.Sub(slot), c.timeout)
				}
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("calls at %v, want %v", got, tc.want)
			}

			wantSched := []time.Time{slot} // first seen
			for c := range tc.cycles {
				wantSched = append(wantSched, slot.Add(time.Duration(c+1)*tc.iv))
			}
			if got := f.Schedules(vkey{p, id}); !slices.EqualFunc(got, wantSched, time.Time.Equal) {
				t.Errorf("Schedule calls %v, want %v", got, wantSched)
			}

			tot := h.s.Totals(p)
			if tot.Runs != tc.cycles || tot.Failures != tc.failures {
				t.Errorf("Totals: %d runs, %d failures; want %d, %d", tot.Runs, tot.Failures, tc.cycles, tc.failures)
			}
			if tc.wantCode == codes.OK && tot.LastError != nil {
				t.Errorf("Totals.LastError = %v, want nil", tot.LastError)
			}
			if tc.wantCode != codes.OK && status.Code(tot.LastError) != tc.wantCode {
				t.Errorf("Totals.LastError = %v, want code %v", tot.LastError, tc.wantCode)
			}
			var want []string
			if tc.unsupported {
				want = []string{id}
			}
			if got := h.s.Unsupported(p); !slices.Equal(got, want) {
				t.Errorf("Unsupported = %v, want %v", got, want)
			}
		})
	}
}

// TestUnimplementedStopsThatVolumeOnly: Unimplemented (the spec: this
// volume's filesystem or device cannot discard) stops that volume, not the
// plugin's other volumes nor other plugins', until ResetPlugin; then it
// runs again from its next slot.
func TestUnimplementedStopsThatVolumeOnly(t *testing.T) {
	const iv = 10 * time.Second
	clock := pervolumetest.NewClock(t0)
	f := newJob(clock)
	implemented := false
	f.script = func(f *fakeJob, p, id string, _ int) (result, error) {
		f.mu.Lock()
		defer f.mu.Unlock()
		if p == "old" && id == "a" && !implemented {
			return result{}, status.Error(codes.Unimplemented, "the device cannot discard")
		}
		return ok, nil
	}
	for _, k := range []vkey{{"old", "a"}, {"old", "b"}, {"other", "c"}} {
		f.add(k.plugin, k.id, time.Time{})
	}
	h := start(t, clock, f, pervolume.Config[result]{Policy: policy(iv, 1)})
	h.driveTo(t0.Add(3 * iv))

	count := func(calls []call, k vkey) (n int) {
		for _, c := range calls {
			if c.vkey == k {
				n++
			}
		}
		return n
	}
	calls := f.Calls(false)
	if n := count(calls, vkey{"old", "a"}); n != 1 {
		t.Errorf("%d calls to the volume that answered Unimplemented, want 1", n)
	}
	for _, k := range []vkey{{"old", "b"}, {"other", "c"}} {
		if n := count(calls, k); n != 3 {
			t.Errorf("%d calls to %v, want 3 (one per cycle)", n, k)
		}
	}
	if got := h.s.Unsupported("old"); !slices.Equal(got, []string{"a"}) || h.s.Unsupported("other") != nil {
		t.Fatalf("Unsupported: old %v, other %v; want [a] and none", got, h.s.Unsupported("other"))
	}

	// The plugin is upgraded.
	f.mu.Lock()
	implemented = true
	f.mu.Unlock()
	resetAt := clock.Now()
	h.s.ResetPlugin("old")
	if got := h.s.Unsupported("old"); got != nil {
		t.Errorf("Unsupported after ResetPlugin: %v", got)
	}
	h.settle()
	if n := len(f.Calls(false)); n != len(calls) {
		t.Errorf("ResetPlugin ran %d calls at once; want the volume at its next slot", n-len(calls))
	}
	h.driveTo(resetAt.Add(2 * iv))
	var got []time.Time
	for _, c := range f.Calls(true) {
		if c.vkey == (vkey{"old", "a"}) {
			got = append(got, c.at)
		}
	}
	first := slotAfter(resetAt, iv, "old", "a")
	if want := []time.Time{first, first.Add(iv)}; !slices.EqualFunc(got, want, time.Time.Equal) {
		t.Errorf("old/a after reset ran at %v, want %v", got, want)
	}
}

// TestUnsupportedCleared: Unsupported means the last call said
// Unimplemented, whichever path made it.
func TestUnsupportedCleared(t *testing.T) {
	clock := pervolumetest.NewClock(t0)
	f := newJob(clock)
	f.add("p", "v", time.Time{})
	f.script = fails(1, status.Error(codes.Unimplemented, "no"))
	s := pervolume.New(pervolume.Config[result]{Name: "test", Job: f, Clock: clock})
	vols := []pervolume.Volume{{Plugin: "p", ID: "v"}}
	if sum := s.RunNow(context.Background(), vols, nil); sum.Failures != 1 || !slices.Equal(s.Unsupported("p"), []string{"v"}) {
		t.Fatalf("after Unimplemented: %+v, Unsupported %v", sum, s.Unsupported("p"))
	}
	if sum := s.RunNow(context.Background(), vols, nil); sum.Volumes != 1 || s.Unsupported("p") != nil {
		t.Fatalf("after a success: %+v, Unsupported %v", sum, s.Unsupported("p"))
	}
}
