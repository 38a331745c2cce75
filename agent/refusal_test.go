package agent

import (
	"context"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// TestPluginRefusalIsNotStuck: a volume id the plugin refuses outright
// (NodeStageVolume fails with InvalidArgument, nothing mounted) fails the
// Prepare, and the rollback does not need the plugin to accept the id:
// nothing stays tracked, reconcile has nothing to do, the container id
// is reusable, also after a restart.
func TestPluginRefusalIsNotStuck(t *testing.T) {
	needRoot(t)
	h := newHarness(t)
	pool := h.loopPlugin("loop")
	createVolume(t, pool, "good")
	h.start(fastConfig(h))
	for _, id := range []string{"a/b", "..", "x\ny"} {
		_, err := h.prepare("c", h.dir("sb"), "", volumeSpec{plugin: "loop", id: id, path: "d"})
		if status.Code(err) != codes.InvalidArgument {
			t.Fatalf("Prepare of volume %q: %v; want InvalidArgument", id, err)
		}
		h.assertClean(pool)
	}
	resp, err := h.api().Reconcile(context.Background(), &agentv1.ReconcileRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Failed) > 0 || len(resp.CleanedUp) > 0 {
		t.Errorf("reconcile after the refusals: %v", resp)
	}
	h.restart(fastConfig(h))
	h.assertClean(pool)
	h.mustPrepare("c", h.dir("sb"), "", volumeSpec{plugin: "loop", id: "good", path: "d"})
	h.mustCleanup("c")
	h.assertClean(pool)
}
