package agent

import (
	"context"
	"strings"
	"testing"
	"time"

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

// TestRecoveryWithPluginDown: a cleanup is interrupted because its
// plugin is down, and the plugin never comes back: the next agent's
// recovery waits for it at most --node-rpc-timeout, is then done (READY),
// says in its status what is pending, and serves other plugins' volumes;
// the container's cleanup finishes once the plugin is back.
func TestRecoveryWithPluginDown(t *testing.T) {
	needRoot(t)
	h := newHarness(t)
	downData, upData := h.dir("data-down"), h.dir("data-up")
	h.writeConfig("down.json", testPluginConfig("down", "--data-dir="+downData))
	h.writeConfig("up.json", testPluginConfig("up", "--data-dir="+upData))
	cfg := fastConfig(h)
	cfg.RPCTimeout = time.Second
	h.start(cfg)
	h.mustPrepare("c1", h.dir("sb1"), "", volumeSpec{plugin: "down", id: "v", path: "d"})
	h.mustPrepare("c2", h.dir("sb2"), "", volumeSpec{plugin: "up", id: "w", path: "d"})
	h.writeConfig("down.json", testPluginConfig("down", "--data-dir="+downData, "--probe-fail"))
	h.waitPlugin("down", "down", func(p *agentv1.Plugin) bool { return !ready(p) })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := h.api().Cleanup(ctx, &agentv1.CleanupRequest{ContainerId: "c1"}); status.Code(err) != codes.Unavailable {
		t.Fatalf("Cleanup with the plugin down: %v; want Unavailable", err)
	}

	h.restart(cfg)
	select {
	case <-h.a.iso.Recovered():
	case <-time.After(cfg.RPCTimeout + 5*time.Second):
		t.Fatal("recovery not done within --node-rpc-timeout plus 5 s while a plugin is down")
	}
	if st := newSDNotifier(h.a).status(); !strings.Contains(st, "1 containers and 1 volumes pending (plugins down)") {
		t.Errorf("status = %q; want it to say what is pending", st)
	}
	h.mustCleanup("c2")
	h.mustPrepare("c3", h.dir("sb3"), "", volumeSpec{plugin: "up", id: "w", path: "d"})
	h.mustCleanup("c3")

	h.writeConfig("down.json", testPluginConfig("down", "--data-dir="+downData))
	h.waitPlugin("down", "ready", ready)
	h.mustCleanup("c1")
	h.assertClean()
}
