package isolator

import (
	"context"
	"strings"
	"testing"

	"github.com/csiagent/csiagent/internal/optrace"
)

// TestUnitTrace: a Prepare and a Cleanup with a trace in their context
// record their steps at the choke points (locks, checkpoints, plugin
// calls, mount work, durability waits) and the checkpoint counts.
func TestUnitTrace(t *testing.T) {
	w := newWorld(t)
	iso := w.run(Config{})
	req := w.request("c1", vol{"loop", "vol-1", "/data", false})

	ctx, prep := optrace.With(context.Background())
	if _, err := iso.Prepare(ctx, req); err != nil {
		t.Fatal(err)
	}
	prep.Finish()
	wantSteps(t, "prepare", prep, "lock container lock", "other checkpoint container PREPARING", "lock volume lock",
		"other plugin ready (Plugins.Node)", "other checkpoint volume: first step", "mount mkdir staging path", "plugin NodeStageVolume",
		"mount mkdir target parent", "plugin NodePublishVolume", "mount IsMountPoint", "other checkpoint volume PUBLISHED",
		"mount ResolveInRoot", "mount CloneTree", "other checkpoint container mounts", "mount MoveTree",
		"other checkpoint container PREPARED", "commit Wait: container record durable")

	ctx, clean := optrace.With(context.Background())
	if err := iso.Cleanup(ctx, "c1", false); err != nil {
		t.Fatal(err)
	}
	clean.Finish()
	wantSteps(t, "cleanup", clean, "lock container lock", "other checkpoint container CLEANING", "mount UnmountOwn",
		"lock volume lock", "mount ForeignMounts", "other checkpoint volume: first step", "plugin NodeUnpublishVolume",
		"plugin NodeUnstageVolume", "mount CheckEmptyTree", "other forget volume record", "other forget container record",
		"commit Wait: container record durable")
	for _, tr := range []*optrace.Trace{prep, clean} {
		if s := tr.String(); !strings.Contains(s, "checkpoint writes: ") || !strings.Contains(s, "fsyncs: ") {
			t.Errorf("no checkpoint counts in\n%s", s)
		}
	}
	w.checkEmpty(iso)
}

// wantSteps fails unless tr has an event of each "kind name" of want, in
// that order (other events may come between).
func wantSteps(t *testing.T, what string, tr *optrace.Trace, want ...string) {
	t.Helper()
	i := 0
	for _, e := range tr.Events() {
		if i < len(want) && string(e.Kind)+" "+e.Name == want[i] {
			i++
		}
	}
	if i < len(want) {
		t.Errorf("%s: no step %q in order in\n%s", what, want[i], tr)
	}
}
