package reclaim_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/pervolume"
	"github.com/csiagent/csiagent/pervolume/pervolumetest"
	"github.com/csiagent/csiagent/reclaim"
)

// fakeJob answers each volume's one call from a table; it persists
// nothing.
type fakeJob struct {
	answers map[string]answer // by volume id
}

type answer struct {
	res reclaim.Result
	err error
}

func (f fakeJob) Volumes() []pervolume.Volume {
	var out []pervolume.Volume
	for id := range f.answers {
		out = append(out, pervolume.Volume{Plugin: "p", ID: id})
	}
	return out
}

func (f fakeJob) Do(_ context.Context, _, id string) (reclaim.Result, error) {
	a := f.answers[id]
	return a.res, a.err
}

func (fakeJob) Schedule(string, string, time.Time) error { return nil }

// TestBytesFreed: the successes' PreUsage-PostUsage is summed, negative
// differences included and unknown usages skipped, in RunNow's Summary and
// in Totals; failures free nothing.
func TestBytesFreed(t *testing.T) {
	job := fakeJob{answers: map[string]answer{
		"a": {res: reclaim.Result{PreUsage: 1000, PostUsage: 400}},
		"b": {res: reclaim.Result{PreUsage: 500, PostUsage: 700}}, // usage grew: -200
		"c": {res: reclaim.Result{PreUsage: -1, PostUsage: 10}},   // unknown: not counted
		"d": {res: reclaim.Result{PreUsage: 10, PostUsage: 10}},
		"e": {res: reclaim.Result{PreUsage: 100, PostUsage: 0}, err: status.Error(codes.InvalidArgument, "bad")},
		"f": {err: status.Error(codes.Internal, "failed")},
	}}
	const wantFreed = 600 - 200
	s := reclaim.New(pervolume.Config[reclaim.Result]{Name: "reclaim", Job: job, Clock: pervolumetest.NewClock(time.Unix(0, 0))})
	reported := map[string]error{}
	sum := s.RunNow(context.Background(), job.Volumes(), func(v pervolume.Volume, _ reclaim.Result, err error) {
		reported[v.ID] = err
	})
	want := reclaim.Summary{Summary: pervolume.Summary{Volumes: 4, Failures: 2}, BytesFreed: wantFreed}
	if sum != want {
		t.Errorf("Summary %+v, want %+v", sum, want)
	}
	if len(reported) != len(job.answers) {
		t.Errorf("progress for %d volumes, want %d", len(reported), len(job.answers))
	}
	for id, a := range job.answers {
		if !errors.Is(reported[id], a.err) {
			t.Errorf("%s: progress reported %v, want %v", id, reported[id], a.err)
		}
	}
	tot := s.Totals("p")
	if tot.Runs != 6 || tot.Failures != 2 || tot.BytesFreed != wantFreed || tot.LastError == nil {
		t.Errorf("Totals %+v, want 6 runs, 2 failures, %d bytes freed and the last error", tot, wantFreed)
	}
	if tot := s.Totals("other"); tot != (reclaim.Totals{}) {
		t.Errorf("Totals of a plugin never run %+v, want zero", tot)
	}
}
