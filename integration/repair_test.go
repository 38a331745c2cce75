package integration

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/internal/testhelp"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"

	"github.com/csiagent/csiagent/mount"
)

// TestRepairRebindsRuncContainer: a running runc container uses a loop
// volume; its publish target is unmounted behind the agent's back (umount
// -l). The next volume stats pass republishes it and replaces the
// container's now stale bind with a clone of the new target: the
// container's mount table shows one mount at the path, with the new id
// the agent records (csi-agent containers), it still reads and writes the
// volume's data, and the repair is counted.
func TestRepairRebindsRuncContainer(t *testing.T) {
	runc, busybox := needRunc(t)
	h := newHarness(t)
	pool := h.loopPlugin("loop")
	createVolume(t, pool, "rep")
	cfg := fastConfig(h)
	cfg.VolumeStatsInterval = 200 * time.Millisecond
	cfg.MetricsAddress = "127.0.0.1:0"
	h.start(cfg)
	h.waitPlugin("loop", "ready", ready)
	vol := volumeSpec{plugin: "loop", id: "rep", path: "/data"}
	script := "echo kept-data > /data/hello && echo up > /data/ready && " +
		"while [ ! -e /data/go ]; do /bin/busybox sleep 0.05; done; cat /data/hello && echo after-repair > /data/after"
	bundle := h.bundle(busybox, "repair", script, vol)
	var out, errOut bytes.Buffer
	cmd := exec.Command(runc, "run", "--bundle", bundle, "repair")
	cmd.Stdout, cmd.Stderr = &out, &errOut
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var runErr error
	exited := make(chan struct{})
	go func() { runErr = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		_ = exec.Command(runc, "delete", "--force", "repair").Run()
		select {
		case <-exited:
		case <-time.After(waitTimeout):
			t.Error("runc did not exit")
		}
	})

	var target string
	waitFor(t, "the container to write its file", func() bool {
		for _, v := range h.volumes() {
			target = v.GetTargetPath()
		}
		_, err := os.Stat(filepath.Join(target, "ready"))
		return target != "" && err == nil
	})
	oldID := containerMountID(t, h, "repair")
	pid := runcPid(t, runc, "repair")
	if got := mountsAt(t, pid, "/data"); len(got) != 1 || got[0] != oldID {
		t.Fatalf("the container's mounts at /data before: %v; want [%d]", got, oldID)
	}

	if err := unix.Unmount(target, unix.MNT_DETACH); err != nil { // behind the agent's back
		t.Fatal(err)
	}
	var newID uint64
	waitFor(t, "the repair to re-bind the container's mount", func() bool {
		newID = containerMountID(t, h, "repair")
		return newID != 0 && newID != oldID
	})
	if ok, err := mount.IsMountPoint(target); err != nil || !ok {
		t.Errorf("the target %s is not mounted again: %v, %v", target, ok, err)
	}
	if got := mountsAt(t, pid, "/data"); len(got) != 1 || got[0] != newID {
		t.Errorf("the container's mounts at /data after the repair: %v; want only the new one [%d]", got, newID)
	}
	cli, err := exec.Command(bins.agent, "containers", "--output", "json", "--api-socket", h.cfg.APISocket).CombinedOutput()
	if err != nil || !strings.Contains(string(cli), fmt.Sprintf(`"mount_id": "%d"`, newID)) {
		t.Errorf("csi-agent containers shows no mount %d: %v\n%s", newID, err, cli)
	}
	if n := h.scrape().value("csi_agent_volume_repairs_total", map[string]string{"plugin": "loop", "result": "repaired"}); n != 1 {
		t.Errorf("csi_agent_volume_repairs_total{result=repaired} = %v; want 1", n)
	}
	want := fmt.Sprintf("re-bound container repair: /data: mount %d replaced by %d", oldID, newID)
	if vs := h.volumes(); len(vs) != 1 || !strings.Contains(vs[0].GetLastRepair(), want) {
		t.Errorf("the volume's last repair: %v; want it to say %q", vs, want)
	}

	if err := os.WriteFile(filepath.Join(target, "go"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	select {
	case <-exited:
		if runErr != nil || !strings.Contains(out.String(), "kept-data") {
			t.Fatalf("container: %v\nstdout: %s\nstderr: %s", runErr, &out, &errOut)
		}
	case <-time.After(waitTimeout):
		t.Fatal("the container did not see the file written through the republished target")
	}
	resp := h.mustPrepare("check", h.dir("sandbox"), "", volumeSpec{plugin: "loop", id: "rep", path: "d"})
	b, err := os.ReadFile(filepath.Join(resp.GetMounts()[0].GetMountPoint(), "after"))
	if err != nil || string(b) != "after-repair\n" {
		t.Errorf("what the container wrote after the repair: %q, %v", b, err)
	}
	h.mustCleanup("check")
	h.assertClean(pool)
}

// containerMountID is the mount id the agent records for container id's
// one mount (0 while it has none, or two during a re-bind).
func containerMountID(t *testing.T, h *harness, id string) uint64 {
	t.Helper()
	for _, c := range h.containers() {
		if c.GetContainerId() == id && len(c.GetMounts()) == 1 {
			return c.GetMounts()[0].GetMountId()
		}
	}
	return 0
}

// runcPid is the pid of a running runc container's process.
func runcPid(t *testing.T, runc, id string) int {
	t.Helper()
	b, err := exec.Command(runc, "state", id).Output()
	if err != nil {
		t.Fatalf("runc state %s: %v", id, err)
	}
	var st struct{ Pid int }
	if err := json.Unmarshal(b, &st); err != nil || st.Pid == 0 {
		t.Fatalf("runc state %s: %v, %s", id, err, b)
	}
	return st.Pid
}

// mountsAt lists the ids of the mounts at path in the mount namespace of
// pid, bottom first.
func mountsAt(t *testing.T, pid int, path string) []uint64 {
	t.Helper()
	f, err := os.Open(fmt.Sprintf("/proc/%d/mountinfo", pid))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var ids []uint64
	s := bufio.NewScanner(f)
	for s.Scan() {
		fields := strings.Fields(s.Text())
		if len(fields) > 4 && fields[4] == path {
			var id uint64
			fmt.Sscan(fields[0], &id)
			ids = append(ids, id)
		}
	}
	return ids
}

// TestRepairLeavesOthersMountsAlone: a container's mount point holds a
// mount the agent did not make (stacked on ours); after the target is
// unmounted behind the agent's back, a refresh republishes the volume but
// leaves that mount and the record as they are, and says so.
func TestRepairLeavesOthersMountsAlone(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	pool := h.loopPlugin("loop")
	createVolume(t, pool, "rep")
	h.start(fastConfig(h))
	h.waitPlugin("loop", "ready", ready)
	resp := h.mustPrepare("c", h.dir("sandbox"), "", volumeSpec{plugin: "loop", id: "rep", path: "d"})
	mp := resp.GetMounts()[0].GetMountPoint()
	oldID := containerMountID(t, h, "c")
	if err := unix.Mount("tmpfs", mp, "tmpfs", 0, "size=1m"); err != nil { // not ours
		t.Fatal(err)
	}
	var theirs uint64
	if f, err := os.Open(mp); err != nil {
		t.Fatal(err)
	} else {
		theirs, err = mount.ID(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
	}
	target := h.volumes()[0].GetTargetPath()
	if err := unix.Unmount(target, unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	if _, err := h.api().ListVolumes(context.Background(), &agentv1.ListVolumesRequest{RefreshStats: true}); err != nil {
		t.Fatal(err)
	}
	if ok, err := mount.IsMountPoint(target); err != nil || !ok {
		t.Errorf("the target %s is not mounted again: %v, %v", target, ok, err)
	}
	if f, err := os.Open(mp); err != nil {
		t.Error(err)
	} else if top, err := mount.ID(f); err != nil || top != theirs {
		t.Errorf("the top mount at %s is %d (%v); want the one that is not ours, %d", mp, top, err, theirs)
		f.Close()
	} else {
		f.Close()
	}
	if id := containerMountID(t, h, "c"); id != oldID {
		t.Errorf("recorded mount %d; want the old record %d kept", id, oldID)
	}
	if vs := h.volumes(); len(vs) != 1 || !strings.Contains(vs[0].GetLastRepair(), "left alone container c: d: the mount there is not the one the agent made") {
		t.Errorf("the volume's last repair: %v", vs)
	}
	if err := unix.Unmount(mp, 0); err != nil {
		t.Fatal(err)
	}
	h.mustCleanup("c")
	h.assertClean(pool)
}

// TestRepairPluginWithoutStats: a plugin that reports neither usage nor
// health (the test plugin, which the volume stats poller never polls) gets
// repairs too, from the resync passes. Its volume's publish target is
// unmounted behind the agent's back: a new container's Prepare is refused
// (Unavailable, naming the path) rather than given the agent's empty
// directory; the next resync pass republishes the volume and re-binds the
// first container; then the Prepare succeeds and both containers see the
// same data.
func TestRepairPluginWithoutStats(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	h.dataPlugin("t")
	cfg := fastConfig(h)
	cfg.ResyncInterval = 100 * time.Millisecond
	h.start(cfg)
	h.waitPlugin("t", "ready", ready)
	spec := volumeSpec{plugin: "t", id: "v", path: "d"}
	first := h.mustPrepare("c1", h.dir("sandbox1"), "", spec)
	if err := os.WriteFile(filepath.Join(first.GetMounts()[0].GetMountPoint(), "hello"), []byte("kept"), 0o644); err != nil {
		t.Fatal(err)
	}
	oldID := containerMountID(t, h, "c1")
	target := h.volumes()[0].GetTargetPath()
	if err := unix.Unmount(target, unix.MNT_DETACH); err != nil { // behind the agent's back
		t.Fatal(err)
	}
	_, err := h.prepare("c2", h.dir("sandbox2"), "", spec)
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "is not mounted") {
		// A resync pass may have repaired it first: then c2 is prepared.
		if err != nil {
			t.Fatalf("Prepare of a volume whose target is unmounted: %v; want Unavailable, saying it is not mounted", err)
		}
		h.mustCleanup("c2")
	}
	waitFor(t, "a resync pass to repair the volume", func() bool {
		v := h.volumes()
		return len(v) == 1 && v[0].GetLastRepair() != "" && containerMountID(t, h, "c1") != oldID
	})
	if ok, err := mount.IsMountPoint(target); err != nil || !ok {
		t.Fatalf("the target %s is not mounted again after the repair: %v, %v", target, ok, err)
	}
	second := h.mustPrepare("c2", h.dir("sandbox2"), "", spec)
	for _, m := range []string{first.GetMounts()[0].GetMountPoint(), second.GetMounts()[0].GetMountPoint()} {
		if b, err := os.ReadFile(filepath.Join(m, "hello")); err != nil || string(b) != "kept" {
			t.Errorf("%s/hello: %q, %v; want the volume's data", m, b, err)
		}
	}
	h.mustCleanup("c1")
	h.mustCleanup("c2")
	h.assertClean()
}
