package pervolume_test

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/pervolume"
	"github.com/csiagent/csiagent/pervolume/pervolumetest"
)

// rotation is a result without usages, as a key rotation reports: only
// what the job knows.
type rotation struct{ Duration time.Duration }

func (r rotation) LogValue() slog.Value {
	return slog.GroupValue(slog.Duration("duration", r.Duration))
}

// rotations answers each volume from a table.
type rotations map[string]error

func (r rotations) Volumes() []pervolume.Volume { return nil }

func (r rotations) Do(_ context.Context, _, id string) (rotation, error) {
	return rotation{Duration: time.Second}, r[id]
}

func (rotations) Schedule(string, string, time.Time) error { return nil }

// TestJobNameInLogs: two schedulers log under their own names, and a
// success logs the job's own result (its LogValue).
func TestJobNameInLogs(t *testing.T) {
	var buf bytes.Buffer
	log := slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	clock := pervolumetest.NewClock(t0)
	rot := pervolume.New(pervolume.Config[rotation]{Name: "key-rotation", Job: rotations{"bad": status.Error(codes.Internal, "no key")}, Clock: clock, Logger: log})
	other := newJob(clock)
	other.script = fails(-1, status.Error(codes.Internal, "no space"))
	rec := pervolume.New(pervolume.Config[result]{Name: "reclaim", Job: other, Clock: clock, Logger: log})

	sum := rot.RunNow(context.Background(), []pervolume.Volume{{Plugin: "p", ID: "ok"}, {Plugin: "p", ID: "bad"}}, nil)
	if sum != (pervolume.Summary{Volumes: 1, Failures: 1}) {
		t.Errorf("Summary %+v", sum)
	}
	rec.RunNow(context.Background(), []pervolume.Volume{{Plugin: "p", ID: "full"}}, nil)

	type record struct {
		Msg, Job, Volume string
		Result           map[string]any
	}
	var got []record
	for line := range strings.Lines(buf.String()) {
		var r record
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			t.Fatalf("%q: %v", line, err)
		}
		got = append(got, r)
	}
	want := map[string]record{
		"ok":   {Msg: "key-rotation: done", Job: "key-rotation", Volume: "ok"},
		"bad":  {Msg: "key-rotation: failed", Job: "key-rotation", Volume: "bad"},
		"full": {Msg: "reclaim: failed", Job: "reclaim", Volume: "full"},
	}
	for _, r := range got {
		w, ok := want[r.Volume]
		if !ok || r.Msg != w.Msg || r.Job != w.Job {
			t.Errorf("logged %+v, want %+v", r, w)
			continue
		}
		delete(want, r.Volume)
		if r.Msg == "key-rotation: done" && (len(r.Result) != 1 || r.Result["duration"] == nil) {
			t.Errorf("a rotation's result logged as %v, want its duration only", r.Result)
		}
	}
	for _, w := range want {
		t.Errorf("not logged: %+v", w)
	}
}
