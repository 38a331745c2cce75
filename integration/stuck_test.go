package integration

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/internal/testhelp"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// TestPluginRefusalIsNotStuck: a volume id the plugin refuses outright
// (NodeStageVolume fails with InvalidArgument, nothing mounted) fails the
// Prepare, and the rollback does not need the plugin to accept the id:
// nothing stays tracked, reconcile has nothing to do, the container id
// is reusable, also after a restart.
func TestPluginRefusalIsNotStuck(t *testing.T) {
	testhelp.NeedRoot(t)
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
// Reconcile waits for it once; the containers' cleanups finish once the
// plugin is back.
func TestRecoveryWithPluginDown(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	downData, upData := h.dir("data-down"), h.dir("data-up")
	h.writeConfig("down.json", testPluginConfig("down", "--data-dir="+downData))
	h.writeConfig("up.json", testPluginConfig("up", "--data-dir="+upData))
	cfg := fastConfig(h)
	cfg.RPCTimeout = 2 * time.Second
	h.start(cfg)
	h.mustPrepare("c1", h.dir("sb1"), "", volumeSpec{plugin: "down", id: "v", path: "d"})
	h.mustPrepare("c4", h.dir("sb4"), "", volumeSpec{plugin: "down", id: "x", path: "d"})
	h.mustPrepare("c2", h.dir("sb2"), "", volumeSpec{plugin: "up", id: "w", path: "d"})
	h.writeConfig("down.json", testPluginConfig("down", "--data-dir="+downData, "--probe-fail"))
	h.waitPlugin("down", "down", func(p *agentv1.Plugin) bool { return !ready(p) })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := h.api().Cleanup(ctx, &agentv1.CleanupRequest{ContainerId: "c1"}); status.Code(err) != codes.Unavailable {
		t.Fatalf("Cleanup with the plugin down: %v; want Unavailable", err)
	}

	// The next agent runs as systemd would run it: it says READY=1.
	sock := filepath.Join(h.run, "notify.sock")
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: sock, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	t.Setenv("NOTIFY_SOCKET", sock)
	deadline := time.Now().Add(cfg.RPCTimeout + 5*time.Second)
	h.restart(cfg)
	if err := conn.SetReadDeadline(deadline); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4096)
	for {
		n, err := conn.Read(buf)
		if err != nil {
			t.Fatalf("no READY=1 within --node-rpc-timeout plus 5 s while a plugin is down: %v", err)
		}
		if msg := string(buf[:n]); strings.Contains(msg, "READY=1") {
			if !strings.Contains(msg, "1 containers and 1 volumes pending (plugins down)") {
				t.Errorf("READY=1 came with %q; want a status saying what is pending", msg)
			}
			break
		}
	}
	h.mustCleanup("c2")
	h.mustPrepare("c3", h.dir("sb3"), "", volumeSpec{plugin: "up", id: "w", path: "d"})
	h.mustCleanup("c3")
	// Reconcile waits for the plugin that is down once, not once per
	// container.
	start := time.Now()
	resp, err := h.api().Reconcile(context.Background(), &agentv1.ReconcileRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d > cfg.RPCTimeout*7/4 {
		t.Errorf("Reconcile took %v with one plugin down; want about one --node-rpc-timeout (%v)", d, cfg.RPCTimeout)
	}
	if len(resp.Failed) != 2 || !strings.Contains(resp.Failed["c4"], "not tried") {
		t.Errorf("Reconcile = %v; want c1 and c4 failed, c4 not tried", resp)
	}

	h.writeConfig("down.json", testPluginConfig("down", "--data-dir="+downData))
	h.waitPlugin("down", "ready", ready)
	h.mustCleanup("c1")
	h.mustCleanup("c4")
	h.assertClean()
}

// TestForceCleanup: a container whose volumes' plugin is down cannot be
// cleaned up; --force forgets it all the same, keeps a volume still
// mounted (now without users) for the plugin's return, forgets one whose
// mounts an operator removed, and leaves the container id reusable.
func TestForceCleanup(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	data := h.dir("data")
	h.writeConfig("t.json", testPluginConfig("t", "--data-dir="+data))
	cfg := fastConfig(h)
	cfg.RPCTimeout = time.Second
	h.start(cfg)
	// Ready first: a Prepare waits for a starting plugin only up to the
	// RPC timeout, 1 s here, which a start on a loaded machine exceeds.
	h.waitPlugin("t", "ready", ready)
	vol, gone := volumeSpec{plugin: "t", id: "v", path: "d"}, volumeSpec{plugin: "t", id: "u", path: "e"}
	sb := h.dir("sb")
	h.mustPrepare("c", sb, "", vol, gone)
	h.writeConfig("t.json", testPluginConfig("t", "--data-dir="+data, "--probe-fail"))
	h.waitPlugin("t", "down", func(p *agentv1.Plugin) bool { return !ready(p) })
	if _, err := h.api().Cleanup(context.Background(), &agentv1.CleanupRequest{ContainerId: "c"}); status.Code(err) != codes.Unavailable {
		t.Fatalf("Cleanup with the plugin down: %v; want Unavailable", err)
	}
	// The operator unmounts what the plugin mounted for u.
	for _, v := range h.volumes() {
		if v.VolumeId != "u" {
			continue
		}
		ms := mountsUnder(t, filepath.Dir(v.TargetPath))
		for i := len(ms) - 1; i >= 0; i-- {
			if err := unix.Unmount(ms[i], 0); err != nil {
				t.Fatal(err)
			}
		}
	}
	if _, err := h.api().Cleanup(context.Background(), &agentv1.CleanupRequest{ContainerId: "c", Force: true}); err != nil {
		t.Fatalf("Cleanup --force: %v", err)
	}
	cs, err := h.api().ListContainers(context.Background(), &agentv1.ListContainersRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(cs.Containers) > 0 {
		t.Errorf("containers after a forced cleanup: %v", cs.Containers)
	}
	if ms := mountsUnder(t, sb); len(ms) > 0 {
		t.Errorf("the container's mount is left: %v", ms)
	}
	vs := h.volumes()
	if len(vs) != 1 || len(vs[0].Containers) > 0 || vs[0].State != agentv1.VolumeStatus_PUBLISHED {
		t.Fatalf("volumes after a forced cleanup: %v; want v, published, kept without users, and u forgotten", vs)
	}
	if ms := mountsUnder(t, vs[0].TargetPath); len(ms) != 1 {
		t.Errorf("mounts at the volume's target: %v; want the plugin's one, kept", ms)
	}

	h.writeConfig("t.json", testPluginConfig("t", "--data-dir="+data))
	h.waitPlugin("t", "ready", ready)
	h.mustPrepare("c", sb, "", vol)
	h.mustCleanup("c")
	h.assertClean()
}

// TestRefusalNeedsNoTeardown: a NodeStageVolume refused with
// InvalidArgument, NotFound or FailedPrecondition did nothing, so the
// rollback sends the plugin no teardown call; one that failed with
// Internal may have acted, so the rollback unpublishes and unstages.
func TestRefusalNeedsNoTeardown(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	failFile := filepath.Join(h.extra, "fail-stage")
	h.writeConfig("t.json", testPluginConfig("t", "--data-dir="+h.dir("data"), "--fail-stage-file="+failFile))
	h.start(fastConfig(h))
	h.waitPlugin("t", "ready", ready)
	logPath := filepath.Join(h.work, "csi", "t", "default", "logs", "container-0.stderr.log")
	for _, code := range []codes.Code{codes.InvalidArgument, codes.NotFound, codes.FailedPrecondition, codes.Internal} {
		if err := os.WriteFile(failFile, []byte(code.String()), 0o644); err != nil {
			t.Fatal(err)
		}
		before, err := os.ReadFile(logPath)
		if err != nil {
			t.Fatal(err)
		}
		_, err = h.prepare("c", h.dir("sb"), "", volumeSpec{plugin: "t", id: "v", path: "d"})
		if status.Code(err) != code {
			t.Fatalf("Prepare with NodeStageVolume failing with %s: %v", code, err)
		}
		h.assertClean()
		after, err := os.ReadFile(logPath)
		if err != nil {
			t.Fatal(err)
		}
		calls := string(after[len(before):])
		teardown := strings.Contains(calls, "NodeUnpublishVolume") || strings.Contains(calls, "NodeUnstageVolume")
		if teardown != (code == codes.Internal) {
			t.Errorf("NodeStageVolume failing with %s: teardown calls sent = %v; the plugin saw:\n%s", code, teardown, calls)
		}
	}
}
