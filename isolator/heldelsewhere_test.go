package isolator

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"

	statev1 "github.com/csiagent/csiagent/proto/state/v1"
)

// withAccess sets the access mode of every volume of req.
func withAccess(req *statev1.PrepareRequest, mode csi.VolumeCapability_AccessMode_Mode) *statev1.PrepareRequest {
	for _, v := range req.GetVolumes() {
		v.GetSource().GetCsiVolume().GetStaticProvisioning().GetVolumeCapability().AccessMode.Mode = mode
	}
	return req
}

// TestUnitHeldElsewhereNotTornDown: a volume whose last user leaves its
// filesystem mounted elsewhere (a bind in the user's own mount namespace,
// which the agent did not make) is not torn down: it stays PUBLISHED with
// no users and an error saying where it is still mounted, the resync
// passes keep it so, a single-writer Prepare of it is refused (it would
// get the same filesystem still written to through that mount, or, torn
// down, a second instance of it), a multi-writer one shares it with no
// second stage, and once the mount elsewhere is gone a pass tears it down.
func TestUnitHeldElsewhereNotTornDown(t *testing.T) {
	w := newWorld(t)
	iso := w.isolator(Config{})
	w.prepare(iso, withAccess(w.request("c1", vol{"loop", "vol-1", "/data", false}), csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER))
	w.prepare(iso, w.request("m1", vol{"loop", "vol-2", "/data", false})) // MULTI_NODE_MULTI_WRITER
	w.calls("loop")

	// The containers' processes bind their volumes elsewhere in their
	// own namespaces.
	const pid1, pid2 = 4242, 4343
	w.table.startProcess(pid1, 88)
	w.table.startProcess(pid2, 89)
	w.table.mu.Lock()
	w.table.mounts = append(w.table.mounts,
		w.table.newMount(88, "/elsewhere", w.table.dev("vol-1"), "/"),
		w.table.newMount(89, "/elsewhere", w.table.dev("vol-2"), "/"))
	w.table.mu.Unlock()

	w.cleanup(iso, "c1")
	w.cleanup(iso, "m1")
	if calls := w.calls("loop"); len(calls) > 0 {
		t.Errorf("volumes still mounted elsewhere torn down: %v", calls)
	}
	held := func(id string) VolumeInfo {
		t.Helper()
		for _, v := range iso.ListVolumes() {
			if v.ID == id {
				return v
			}
		}
		t.Fatalf("volume %s forgotten", id)
		return VolumeInfo{}
	}
	for _, c := range []struct {
		id  string
		pid string
	}{{"vol-1", "4242"}, {"vol-2", "4343"}} {
		v := held(c.id)
		if v.State != stPublished || len(v.Users) > 0 || !strings.Contains(v.LastError, "/elsewhere in the mount namespace of pid "+c.pid) || !strings.Contains(v.LastError, "until that mount is gone") {
			t.Errorf("volume %s: %s, users %v, last_error %q; want PUBLISHED, no users, an error naming the mount elsewhere", c.id, v.State, v.Users, v.LastError)
		}
		if ok, _ := iso.mounts.IsMountPoint(v.TargetPath); !ok {
			t.Errorf("volume %s: its target is not mounted", c.id)
		}
	}
	if p := iso.Pending(); !strings.Contains(p, "2 volumes pending") {
		t.Errorf("Pending() = %q", p)
	}

	// The passes keep them, with their errors.
	for range 2 {
		iso.resync(context.Background(), false)
	}
	if calls := w.calls("loop"); len(calls) > 0 {
		t.Errorf("a pass tore down volumes still mounted elsewhere: %v", calls)
	}
	if v := held("vol-1"); v.State != stPublished || !strings.Contains(v.LastError, "/elsewhere in the mount namespace of pid 4242") {
		t.Errorf("after the passes, vol-1: %s, last_error %q", v.State, v.LastError)
	}

	// A single writer is refused; so is one of each other single-writer
	// mode (the volume's capability being the same).
	_, err := iso.Prepare(context.Background(), withAccess(w.request("c2", vol{"loop", "vol-1", "/data", false}), csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER))
	if !errors.Is(err, ErrPrecondition) || !strings.Contains(err.Error(), "loop/vol-1") || !strings.Contains(err.Error(), "/elsewhere in the mount namespace of pid 4242") {
		t.Fatalf("single-writer Prepare of a volume still mounted elsewhere: %v; want ErrPrecondition naming the volume and the mount", err)
	}
	if calls := w.calls("loop"); len(calls) > 0 {
		t.Errorf("the refused Prepare called %v", calls)
	}
	// A multi-writer shares the same instance: no second stage.
	w.prepare(iso, w.request("m2", vol{"loop", "vol-2", "/data", false}))
	if calls := w.calls("loop"); len(calls) > 0 {
		t.Errorf("a multi-writer Prepare of a published volume called %v", calls)
	}
	if v := held("vol-2"); v.State != stPublished || !slices.Equal(v.Users, []string{"m2"}) || v.LastError != "" {
		t.Errorf("vol-2 shared: %s, users %v, last_error %q", v.State, v.Users, v.LastError)
	}

	// The mounts elsewhere go: the next pass tears vol-1 down; vol-2's
	// user leaving tears it down.
	w.table.endProcess(pid1)
	w.table.endProcess(pid2)
	iso.resync(context.Background(), false)
	if calls := w.calls("loop"); !slices.Equal(calls, []string{"NodeUnpublishVolume vol-1", "NodeUnstageVolume vol-1"}) {
		t.Errorf("the pass after the mount elsewhere went called %v", calls)
	}
	w.cleanup(iso, "m2")
	w.prepare(iso, withAccess(w.request("c2", vol{"loop", "vol-1", "/data", false}), csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER))
	w.check(iso)
	w.cleanup(iso, "c2")
	w.checkEmpty(iso)
}
