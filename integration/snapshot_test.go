package integration

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/csiagent/csiagent/controllerops"
	"github.com/csiagent/csiagent/mount"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// TestGroupSnapshotOfContainerKilledWhileFrozen: a runc container writes
// to two loop volumes; a snapshot of one and a group snapshot of the
// container's volumes (frozen meanwhile) are taken, listed and removed by
// name through the real CLI; then the agent is killed (SIGKILL, from its
// crash hook) while the container's filesystems are frozen for a group
// snapshot: they are still frozen then, and the next agent thaws them
// before it serves (a write in the container completes), and the create,
// run again, finishes the interrupted group snapshot.
func TestGroupSnapshotOfContainerKilledWhileFrozen(t *testing.T) {
	runc, busybox := needRunc(t)
	h := newHarness(t)
	sweepOnExit(t, h)
	const typ, container = "loop.snap", "snapc"
	pool := h.loopPlugin(typ)
	createVolume(t, pool, "vol-a")
	createVolume(t, pool, "vol-b")
	socket := filepath.Join(h.run, "agent.sock")
	h.cfg.APISocket = socket // the OCI hooks' socket
	ca := startCrashAgent(t, h, typ)
	t.Cleanup(func() { killAndWait(t, ca.pluginPid) })

	bundle := h.bundle(busybox, container, "while true; do echo tick >> /a/log; echo tick >> /b/log; sleep 0.1; done",
		volumeSpec{plugin: typ, id: "vol-a", path: "/a"}, volumeSpec{plugin: typ, id: "vol-b", path: "/b"})
	runDetached(t, runc, bundle, container, "both volumes given", func() bool {
		resp, err := ca.client.ListContainers(opCtx(t), &agentv1.ListContainersRequest{})
		return err == nil && len(resp.GetContainers()) == 1 && len(resp.GetContainers()[0].GetMounts()) == 2
	})
	cli := func(wantOK bool, args ...string) string {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
		defer cancel()
		out, err := exec.CommandContext(ctx, bins.agent, append(args, "--api-socket", socket)...).CombinedOutput()
		if (err == nil) != wantOK {
			t.Fatalf("csi-agent %s: %v (want success: %t)\n%s", strings.Join(args, " "), err, wantOK, out)
		}
		return string(out)
	}

	cli(true, "snapshot", "create", "--volume", "vol-a", "--plugin", typ, "--name", "s1")
	if out := cli(true, "snapshot", "ls"); !strings.Contains(out, "s1") || !strings.Contains(out, "true") {
		t.Errorf("snapshot ls after create:\n%s", out)
	}
	cli(true, "snapshot", "rm", "s1")
	cli(true, "volume", "create", "named-b", "--plugin", typ, "--volume-id", "vol-b")
	cli(true, "snapshot", "create", "--volume", "named-b", "--name", "s2")
	if out := cli(true, "snapshot", "ls"); !strings.Contains(out, "named-b (vol-b)") || strings.Contains(out, "s1") {
		t.Errorf("snapshot ls after a named volume's snapshot:\n%s", out)
	}
	cli(true, "snapshot", "rm", "s2")
	created := cli(true, "group-snapshot", "create", "--container", container, "--name", "g1")
	if out := cli(true, "snapshot", "ls"); !strings.Contains(out, "g1") || !strings.Contains(out, "vol-a=") || !strings.Contains(out, "vol-b=") || strings.Contains(out, "s1") {
		t.Errorf("snapshot ls after the group snapshot (create said %s):\n%s", created, out)
	}

	var targets []string
	vols, err := ca.client.ListVolumes(opCtx(t), &agentv1.ListVolumesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range vols.GetVolumes() {
		targets = append(targets, v.GetTargetPath())
	}
	if len(targets) != 2 {
		t.Fatalf("volumes: %v", vols)
	}
	// Whatever happens below, nothing stays frozen after the test.
	t.Cleanup(func() {
		for _, p := range targets {
			_ = mount.Thaw(p)
		}
	})

	ca.kill()
	ca = startCrashAgent(t, h, typ, "CSIAGENT_TEST_CRASH_ON="+controllerops.CrashFrozen)
	cli(false, "group-snapshot", "create", "--container", container, "--name", "g2")
	ca.waitCrash(t)
	record := filepath.Join(h.work, "snapshots", "frozen", "g2.json")
	if _, err := os.Stat(record); err != nil {
		t.Errorf("no freeze record while frozen: %v", err)
	}
	for _, p := range targets {
		if err := mount.Freeze(p); !errors.Is(err, mount.ErrAlreadyFrozen) {
			_ = mount.Thaw(p)
			t.Fatalf("%s not frozen when the agent died: FIFREEZE gave %v", p, err)
		}
	}

	ca = startCrashAgent(t, h, typ)
	write := exec.Command(runc, "exec", container, "sh", "-c", "echo after > /a/after && echo after > /b/after")
	if err := write.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- write.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("write in the container after the restart: %v", err)
		}
	case <-time.After(20 * time.Second):
		for _, p := range targets {
			_ = mount.Thaw(p)
		}
		<-done
		t.Fatal("a write in the container blocked for 20s after the restart: the agent did not thaw the filesystems")
	}
	if _, err := os.Stat(record); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("freeze record left after the recovery thaw: %v", err)
	}

	// The interrupted create, run again, finishes the group snapshot.
	cli(true, "group-snapshot", "create", "--container", container, "--name", "g2")
	cli(true, "group-snapshot", "delete", "--name", "g1")
	cli(true, "group-snapshot", "delete", "--name", "g2")
	if out := cli(true, "snapshot", "ls", "--output", "json"); strings.Contains(out, "g1") || strings.Contains(out, "g2") {
		t.Errorf("snapshot ls after the deletes:\n%s", out)
	}

	// The container's poststop hook gives the volumes back.
	if out, err := exec.Command(runc, "delete", "--force", container).CombinedOutput(); err != nil {
		t.Fatalf("runc delete: %v\n%s", err, out)
	}
	resp, err := ca.client.ListContainers(opCtx(t), &agentv1.ListContainersRequest{})
	if err != nil || len(resp.GetContainers()) != 0 {
		t.Errorf("containers after runc delete: %v, %v", resp, err)
	}
	cli(true, "volume", "rm", "named-b")
}
