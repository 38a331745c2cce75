package integration

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/agent"
	"github.com/csiagent/csiagent/internal/testhelp"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// A record file copied over another (a misdirected write, a restored
// backup, an operator's cp) is not taken for that record: the container
// record is quarantined, the volume record rebuilt; neither container nor
// volume comes back with the other's volumes or paths. (Before, c2 came
// back PREPARED with c1's volumes and mount points.)
func TestForeignRecordIsCorrupt(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	sweepOnExit(t, h)
	const typ = "foreign.test"
	h.dataPlugin(typ)
	cfg := metricsConfig(h)
	h.start(cfg)
	h.waitPlugin(typ, "ready", ready)
	h.mustPrepare("c1", h.dir("sb1"), "", volumeSpec{plugin: typ, id: "vol-a", path: "d"})
	mp2 := h.mustPrepare("c2", h.dir("sb2"), "", volumeSpec{plugin: typ, id: "vol-b", path: "d"}).Mounts[0].MountPoint
	h.mustPrepare("c3", h.dir("sb3"), "", volumeSpec{plugin: typ, id: "vol-c", path: "d"})
	h.halt()
	cp := func(from, to string) {
		t.Helper()
		b, err := os.ReadFile(globOne(t, filepath.Join(h.work, from)))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(globOne(t, filepath.Join(h.work, to)), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	cp("isolators/volume/csi/c1/volumes.state", "isolators/volume/csi/c2/volumes.state")
	cp("csi/"+typ+"/*/volumes/vol-a/volume.state", "csi/"+typ+"/*/volumes/vol-c/volume.state")
	h.launch(cfg)
	h.waitRecovered()
	byID := map[string]*agentv1.ContainerStatus{}
	for _, c := range h.containers() {
		byID[c.ContainerId] = c
	}
	for _, id := range []string{"c1", "c3"} {
		if c := byID[id]; c == nil || c.Phase != agentv1.ContainerStatus_PREPARED {
			t.Fatalf("%s after the restart: %v; want PREPARED", id, c)
		}
	}
	c2 := byID["c2"]
	if c2 == nil || c2.Phase != agentv1.ContainerStatus_PHASE_UNKNOWN || !strings.Contains(c2.LastError, "another record") {
		t.Fatalf("c2 after its record was overwritten with c1's: %v; want it quarantined, the frame named foreign", c2)
	}
	if len(c2.Mounts) != 1 || c2.Mounts[0].VolumeId != "vol-b" || c2.Mounts[0].MountPoint != mp2 {
		t.Errorf("quarantined c2 claims %v; want its own mount %s of vol-b, found in the mount table", c2.Mounts, mp2)
	}
	for _, v := range h.volumes() {
		if v.VolumeId == "vol-c" && (!slices.Equal(v.Containers, []string{"c3"}) || strings.Contains(v.TargetPath, "vol-a")) {
			t.Errorf("vol-c after its record was overwritten with vol-a's: %v; want it rebuilt, its own paths, user c3", v)
		}
	}
	globOne(t, filepath.Join(h.work, "corrupt", "csi_"+typ+"_default_volumes_vol-c_volume.state.*"))
	if got := h.scrape().value("csi_agent_records_corrupt_total", nil); got != 2 {
		t.Errorf("csi_agent_records_corrupt_total = %v; want 2", got)
	}
	h.mustCleanup("c2")
	if ok, _ := mountinfo.Mounted(mp2); ok {
		t.Errorf("quarantined c2's mount %s left after its cleanup", mp2)
	}
}

// A restart (after a reboot) on a full work dir restores the acknowledged
// containers: what starting a managed plugin writes (its process record)
// goes into space reserved when it was first written. (Before, no managed
// plugin could start on a full disk, so no container's volume was
// restored.)
func TestRestartOnFullWorkDir(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	sweepOnExit(t, h)
	if err := os.MkdirAll(h.work, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", h.work, "tmpfs", 0, "size=1m,mode=0755"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(h.work, unix.MNT_DETACH) })
	const typ = "full.loop"
	pool := h.loopPlugin(typ)
	createVolumeSize(t, pool, "vol-a", "32MiB")
	cfg := fastConfig(h)
	h.start(cfg)
	h.waitPlugin(typ, "ready", ready)
	sb := h.dir("sb1")
	mp := h.mustPrepare("c1", sb, "", volumeSpec{plugin: typ, id: "vol-a", path: "d"}).Mounts[0].MountPoint
	if err := os.WriteFile(filepath.Join(mp, "data"), []byte("kept"), 0o644); err != nil {
		t.Fatal(err)
	}
	h.halt()

	// The reboot: processes, mounts (the work dir's filesystem stays)
	// and loop devices gone.
	h.killPlugins()
	for range 5 {
		var ms []string
		for _, m := range mountsUnder(t, h.work, h.extra) {
			if m != h.work {
				ms = append(ms, m)
			}
		}
		if len(ms) == 0 {
			break
		}
		slices.Reverse(ms)
		for _, m := range ms {
			_ = unix.Unmount(m, unix.MNT_DETACH)
		}
	}
	for _, f := range loopDevicesFor(t, pool) {
		if fd, err := unix.Open("/dev/"+filepath.Base(filepath.Dir(filepath.Dir(f))), unix.O_RDONLY|unix.O_CLOEXEC, 0); err == nil {
			_ = unix.IoctlSetInt(fd, unix.LOOP_CLR_FD, 0)
			unix.Close(fd)
		}
	}
	fillUp(t, h.work)

	cfg.BootID = "after-the-reboot"
	h.launch(cfg)
	h.waitRecovered()
	c := h.container("c1")
	if c == nil || c.Phase != agentv1.ContainerStatus_PREPARED || c.LastError != "" {
		t.Fatalf("c1 after a restart on a full work dir: %v; want PREPARED", c)
	}
	if b, err := os.ReadFile(filepath.Join(mp, "data")); err != nil || string(b) != "kept" {
		t.Fatalf("c1's volume after a restart on a full work dir: %q, %v; want its mount restored", b, err)
	}
	// Space again, for the cleanup.
	if err := os.Remove(filepath.Join(h.work, "filler")); err != nil {
		t.Fatal(err)
	}
}

// fillUp fills dir's filesystem with dir/filler.
func fillUp(t *testing.T, dir string) {
	t.Helper()
	filler, err := os.Create(filepath.Join(dir, "filler"))
	if err != nil {
		t.Fatal(err)
	}
	defer filler.Close()
	for {
		if _, err := filler.Write(make([]byte, 4096)); err != nil {
			if !errors.Is(err, syscall.ENOSPC) {
				t.Fatal(err)
			}
			return
		}
	}
}

// The work dir is the agent's: a second agent on it refuses to start,
// naming the holder; removed or replaced under a running agent, nothing
// more is acknowledged (no new tree is written), with an error saying
// why. (Before, the second agent started and both wrote the same records;
// a Prepare after the work dir was moved away was acknowledged into a new
// tree that no restart would read.)
func TestWorkDirIsOwned(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	sweepOnExit(t, h)
	const typ = "owned.test"
	h.dataPlugin(typ)
	cfg := fastConfig(h)
	h.start(cfg)
	h.waitPlugin(typ, "ready", ready)
	h.mustPrepare("c1", h.dir("sb1"), "", volumeSpec{plugin: typ, id: "vol-a", path: "d"})

	second := cfg
	second.RuntimeDir = h.dir("run2")
	second.APISocket = filepath.Join(second.RuntimeDir, "agent.sock")
	if a, err := agent.New(second); err == nil || !strings.Contains(err.Error(), "pid "+strconv.Itoa(os.Getpid())) || !strings.Contains(err.Error(), "--work-dir") {
		if err == nil {
			go a.Run(context.Background()) //nolint:errcheck // only to show it started; the test fails
		}
		t.Fatalf("a second agent on the same work dir: %v; want a refusal naming pid %d", err, os.Getpid())
	}

	moved := h.work + ".moved"
	if err := os.Rename(h.work, moved); err != nil {
		t.Fatal(err)
	}
	_, err := h.prepare("c2", h.dir("sb2"), "", volumeSpec{plugin: typ, id: "vol-b", path: "d"})
	if err == nil || !strings.Contains(err.Error(), "work directory removed or replaced") {
		t.Errorf("Prepare after the work dir was moved away: %v; want a refusal saying so", err)
	}
	if _, err := os.Stat(h.work); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("the agent wrote a new work dir after the old one was moved away: %v", err)
	}
	// Back in place, a restarted agent has everything.
	if err := os.RemoveAll(h.work); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(moved, h.work); err != nil {
		t.Fatal(err)
	}
	h.restart(cfg)
	h.waitRecovered()
	if c := h.container("c1"); c == nil || c.Phase != agentv1.ContainerStatus_PREPARED {
		t.Fatalf("c1 after the work dir came back and the agent restarted: %v", c)
	}
}

// A clean stop checkpoints the work dir: every record in its own file,
// no journal left (a release without the journal reads the work dir
// whole); the next start finds every container.
func TestCleanStopLeavesNoJournal(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	sweepOnExit(t, h)
	const typ = "clean.stop"
	h.dataPlugin(typ)
	cfg := metricsConfig(h)
	h.start(cfg)
	h.waitPlugin(typ, "ready", ready)
	h.mustPrepare("c1", h.dir("sb1"), "", volumeSpec{plugin: typ, id: "vol-a", path: "d"})
	if js, _ := filepath.Glob(filepath.Join(h.work, ".journal-*")); len(js) == 0 {
		t.Fatal("no journal while the agent runs: the test would show nothing")
	}
	h.halt()
	if js, _ := filepath.Glob(filepath.Join(h.work, ".journal-*")); len(js) != 0 {
		t.Errorf("journals left by a clean stop: %v", js)
	}
	globOne(t, filepath.Join(h.work, "isolators/volume/csi/c1/volumes.state"))
	h.launch(cfg)
	h.waitRecovered()
	if c := h.container("c1"); c == nil || c.Phase != agentv1.ContainerStatus_PREPARED {
		t.Fatalf("c1 after the restart: %v; want PREPARED", c)
	}
	h.mustCleanup("c1")
}
