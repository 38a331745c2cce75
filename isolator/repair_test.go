package isolator

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestUnitRepairOnItsOwn: the isolator repairs on its own: a published
// volume whose target was unmounted behind the agent's back in the fake
// world is found by a resync pass and, on the isolator's repair worker,
// republished and re-bound into its container, the repair reported to
// Config.OnRepair and recorded as the volume's last repair.
func TestUnitRepairOnItsOwn(t *testing.T) {
	w := newWorld(t)
	outcomes := make(chan string, 10)
	iso := w.run(Config{ResyncInterval: 10 * time.Millisecond, OnRepair: func(plugin, id string, outcome RepairOutcome) {
		outcomes <- plugin + "/" + id + " " + string(outcome)
	}})
	before := w.prepare(iso, w.request("c1", vol{"loop", "vol-1", "/data", false}))
	target := volumeOf(iso, "loop", "vol-1").TargetPath
	w.calls("loop")
	w.unmountBehindOurBack(target)
	select {
	case got := <-outcomes:
		if got != "loop/vol-1 repaired" {
			t.Fatalf("OnRepair: %s; want loop/vol-1 repaired", got)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no repair reported in 10s")
	}
	if got := w.calls("loop"); !slices.Equal(got, []string{"NodePublishVolume vol-1"}) {
		t.Errorf("the repair asked %v; want a publish", got)
	}
	if c := containerOf(iso, "c1"); len(c.Mounts) != 1 || c.Mounts[0].GetMountId() == before[0].GetMountId() {
		t.Errorf("c1's mounts after the repair: %v; want one, new", c.Mounts)
	}
	if v := volumeOf(iso, "loop", "vol-1"); !strings.Contains(v.LastRepair, "re-bound container c1") {
		t.Errorf("the volume's last repair: %q", v.LastRepair)
	}
	w.check(iso)
	w.cleanup(iso, "c1")
	w.checkEmpty(iso)
}

// TestUnitRepairOff: with Config.NoRepair, a published volume whose
// target was unmounted is left as it is, by Repair and by the resync
// passes alike: the plugin is asked nothing, the container keeps its
// mount, and each check warns, naming the volume; nothing is reported to
// Config.OnRepair. The container's cleanup still releases everything.
func TestUnitRepairOff(t *testing.T) {
	w := newWorld(t)
	var logs syncBuffer
	var reported []string
	iso := w.run(Config{NoRepair: true, ResyncInterval: time.Hour, Logger: slog.New(slog.NewTextHandler(&logs, nil)),
		OnRepair: func(plugin, id string, outcome RepairOutcome) {
			reported = append(reported, plugin+"/"+id+" "+string(outcome))
		}})
	ctx := context.Background()
	before := w.prepare(iso, w.request("c1", vol{"loop", "vol-1", "/data", false}))
	target := volumeOf(iso, "loop", "vol-1").TargetPath
	w.unmountBehindOurBack(target)
	w.calls("loop")
	if r, err := iso.Repair(ctx, "loop", "vol-1"); err != nil || r.Republished || len(r.Rebound)+len(r.Skipped) > 0 {
		t.Errorf("Repair with repair off: %+v, %v; want nothing done", r, err)
	}
	batch := iso.resync(ctx, false)
	if want := []volumeKey{{"loop", "vol-1"}}; !slices.Equal(batch, want) {
		t.Errorf("the pass found %v; want %v", batch, want)
	}
	iso.repairUnmounted(ctx, batch)
	if got := w.calls("loop"); len(got) > 0 {
		t.Errorf("with repair off, the plugin was asked %v", got)
	}
	w.table.mu.Lock()
	mounted := w.table.top(hostNS, target) != nil
	w.table.mu.Unlock()
	if mounted {
		t.Errorf("with repair off, the target %s was mounted again", target)
	}
	if c := containerOf(iso, "c1"); len(c.Mounts) != 1 || c.Mounts[0].GetMountId() != before[0].GetMountId() {
		t.Errorf("c1's mounts with repair off: %v; want its own, unchanged", c.Mounts)
	}
	if v := volumeOf(iso, "loop", "vol-1"); v.LastRepair != "" {
		t.Errorf("the volume's last repair with repair off: %q", v.LastRepair)
	}
	if len(reported) > 0 {
		t.Errorf("with repair off, OnRepair was told %v", reported)
	}
	if n := strings.Count(logs.String(), "repair is off"); n != 2 || !strings.Contains(logs.String(), "volume=vol-1") {
		t.Errorf("with repair off, %d warnings (want 2, naming vol-1); the log:\n%s", n, logs.String())
	}
	// The container's mount is still found by what was recorded when it
	// was made (its source, the target, is gone): the cleanup releases it
	// and the volume, leaving nothing.
	w.cleanup(iso, "c1")
	w.checkEmpty(iso)
}

// TestUnitRepairChecksWithoutLock: Repair checks a volume's target
// without its lock, so a check of a mounted target never waits for
// another operation on the volume (a stats poll is not held up by a
// reclaim); a target found not mounted is waited for, and a repair that
// cannot get the volume in time fails, reported to Config.OnRepair and
// saying why; once the volume is free, the repair goes through.
func TestUnitRepairChecksWithoutLock(t *testing.T) {
	w := newWorld(t)
	var reported []string
	iso := w.run(Config{ResyncInterval: time.Hour, OnRepair: func(plugin, id string, outcome RepairOutcome) {
		reported = append(reported, plugin+"/"+id+" "+string(outcome))
	}})
	w.prepare(iso, w.request("c1", vol{"loop", "vol-1", "/data", false}))
	key := volumeKey{"loop", "vol-1"}
	unlock, err := iso.volumeLocks.Lock(context.Background(), key.String())
	if err != nil {
		t.Fatal(err)
	}
	short := func() context.Context {
		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		t.Cleanup(cancel)
		return ctx
	}
	if r, err := iso.Repair(short(), "loop", "vol-1"); err != nil || r.Republished {
		t.Errorf("Repair of a mounted volume that another operation holds: %+v, %v; want nothing done, at once", r, err)
	}
	w.unmountBehindOurBack(volumeOf(iso, "loop", "vol-1").TargetPath)
	_, err = iso.Repair(short(), "loop", "vol-1")
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "repairing the volume (its target path was not mounted)") {
		t.Errorf("Repair of an unmounted volume that another operation holds: %v; want it to fail waiting, saying it was repairing", err)
	}
	if want := []string{"loop/vol-1 failed"}; !slices.Equal(reported, want) {
		t.Errorf("reported %v; want %v", reported, want)
	}
	unlock()
	reported = nil
	if r, err := iso.Repair(context.Background(), "loop", "vol-1"); err != nil || !r.Republished {
		t.Errorf("Repair once the volume is free: %+v, %v; want it republished", r, err)
	}
	if want := []string{"loop/vol-1 repaired"}; !slices.Equal(reported, want) {
		t.Errorf("reported %v; want %v", reported, want)
	}
	w.check(iso)
	w.cleanup(iso, "c1")
	w.checkEmpty(iso)
}

// syncBuffer is a bytes.Buffer safe for the isolator's goroutines to log
// to while a test reads it.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
