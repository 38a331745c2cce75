package integration

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/csiagent/csiagent/internal/loopdev"
	"github.com/csiagent/csiagent/internal/testhelp"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// volumeCLI runs csi-agent volume args against the agent's API socket
// and returns its combined output.
func volumeCLI(socket string, args ...string) (string, error) {
	full := append([]string{"volume", args[0], "--api-socket", socket}, args[1:]...)
	out, err := exec.Command(bins.agent, full...).CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

// createdImage is the image of the volume the agent created for named
// volume name (csi-agent-NAME-HASH, in its definition).
func createdImage(t *testing.T, c agentv1.AgentClient, name string) string {
	t.Helper()
	v, err := c.GetNamedVolume(context.Background(), &agentv1.GetNamedVolumeRequest{Name: name})
	if err != nil || v.GetOptions()["volume_id"] == "" {
		t.Fatalf("named volume %s: %v, %v", name, v, err)
	}
	return v.GetOptions()["volume_id"] + ".img"
}

// poolImages lists the images in a csi-loop-plugin pool.
func poolImages(t *testing.T, pool string) []string {
	t.Helper()
	m, err := filepath.Glob(filepath.Join(pool, "*.img"))
	if err != nil {
		t.Fatal(err)
	}
	for i := range m {
		m[i] = filepath.Base(m[i])
	}
	return m
}

// TestProvisionCrashAtEveryPoint (issue 28): csi-agent volume create
// --size creates the backend volume (CreateVolume named
// csi-agent-NAME-HASH).
// The agent is killed at each point of the creation (its intent
// recorded, CreateVolume answered, the answer recorded); the next agent
// shows the volume CREATING (not mountable) until the create is run
// again, which finds the volume the plugin made: one image in the pool,
// every time. volume rm --delete deletes it.
func TestProvisionCrashAtEveryPoint(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	sweepOnExit(t, h)
	typ := "loop.prov"
	pool := h.loopPlugin(typ)
	socket := filepath.Join(h.run, "agent.sock")
	create := func() (string, error) {
		return volumeCLI(socket, "create", "web", "--plugin", typ, "--size", "32MiB", "--fs-type", "ext4")
	}
	var pluginPid int
	start := func(env ...string) *crashAgent {
		ca := startCrashAgent(t, h, typ, env...)
		if pluginPid == 0 {
			pluginPid = ca.pluginPid
			t.Cleanup(func() { killAndWait(t, pluginPid) })
		}
		return ca
	}
	trace := filepath.Join(h.extra, "trace")
	ca := start("CSIAGENT_TEST_CRASH_TRACE=" + trace)
	if out, err := create(); err != nil {
		t.Fatalf("volume create: %v\n%s", err, out)
	}
	if out, err := volumeCLI(socket, "rm", "web", "--delete"); err != nil || !strings.Contains(out, "backend volume deleted") {
		t.Fatalf("volume rm --delete: %v\n%s", err, out)
	}
	ca.kill()
	points := traceLines(t, trace)
	if want := []string{"named volume creating", "rpc CreateVolume", "named volume created"}; !slices.Equal(points, want) {
		t.Fatalf("crash points of a creation: %q, want %q", points, want)
	}
	for n := range points {
		ca := start("CSIAGENT_TEST_CRASH_AT=" + strconv.Itoa(n+1))
		if out, err := create(); err == nil {
			t.Fatalf("point %d (%s): the create succeeded, the agent should have died\n%s", n+1, points[n], out)
		}
		ca.waitCrash(t)
		ca = start()
		v, err := ca.client.GetNamedVolume(context.Background(), &agentv1.GetNamedVolumeRequest{Name: "web"})
		if err != nil {
			t.Fatalf("point %d (%s): the intent is lost: %v", n+1, points[n], err)
		}
		if created := n == len(points)-1; (v.GetState() == "CREATING") == created {
			t.Errorf("point %d (%s): state %s after the restart", n+1, points[n], v.GetState())
		}
		if out, err := create(); err != nil {
			t.Fatalf("point %d (%s): the repeated create: %v\n%s", n+1, points[n], err, out)
		}
		if imgs := poolImages(t, pool); !slices.Equal(imgs, []string{createdImage(t, ca.client, "web")}) {
			t.Fatalf("point %d (%s): pool holds %v, want the one volume", n+1, points[n], imgs)
		}
		if out, err := volumeCLI(socket, "rm", "web", "--delete"); err != nil {
			t.Fatalf("volume rm --delete: %v\n%s", err, out)
		}
		if imgs := poolImages(t, pool); len(imgs) > 0 {
			t.Fatalf("point %d: after rm --delete the pool holds %v", n+1, imgs)
		}
		ca.kill()
	}
}

// TestProvisionAttachWithRunc (issue 28): a volume created with csi-agent
// volume create --size is attached (ControllerPublishVolume: a loop device
// of csi-loop-plugin's own, named in the publish_context the agent
// records and shows), staged from that device and published for a real
// runc container that writes it; the last user's cleanup detaches it; a
// second container reads the data back; a snapshot of it, restored into a
// new volume by the snapshot's name, has the data; rm --delete deletes
// the images.
func TestProvisionAttachWithRunc(t *testing.T) {
	runc, busybox := needRunc(t)
	h := newHarness(t)
	pool := h.loopPlugin("loop")
	cfg := fastConfig(h)
	h.start(cfg)
	h.waitPlugin("loop", "ready", ready)
	if out, err := volumeCLI(h.cfg.APISocket, "create", "web", "--plugin", "loop", "--size", "64MiB", "--fs-type", "ext4", "--allow-annotations"); err != nil {
		t.Fatalf("volume create: %v\n%s", err, out)
	}
	img := filepath.Join(pool, createdImage(t, h.api(), "web"))
	if _, err := os.Stat(img); err != nil {
		t.Fatalf("the created volume's image: %v (pool: %v)", err, poolImages(t, pool))
	}

	writer := h.mountsBundle(busybox, "writer", "echo written > /data/f && sleep 600", "web:/data")
	var attached *agentv1.VolumeStatus
	runDetached(t, runc, writer, "writer", "the volume attached and published", func() bool {
		for _, v := range h.volumes() {
			if filepath.Join(pool, v.GetVolumeId()+".img") == img && v.GetState() == agentv1.VolumeStatus_PUBLISHED && v.GetAttached() {
				attached = v
				return true
			}
		}
		return false
	})
	devs, err := loopdev.FindAll(img)
	if err != nil || len(devs) != 1 || attached.GetPublishContext()["device"] != devs[0].Path {
		t.Fatalf("attached as %v; the image's loop devices %+v (%v): want the one the publish_context names", attached.GetPublishContext(), devs, err)
	}
	if out, err := exec.Command(runc, "kill", "writer", "KILL").CombinedOutput(); err != nil {
		t.Fatalf("runc kill: %v\n%s", err, out)
	}
	waitFor(t, "the writer stopped", func() bool {
		out, _ := exec.Command(runc, "state", "writer").Output()
		return strings.Contains(string(out), `"stopped"`)
	})
	if out, err := exec.Command(runc, "delete", "writer").CombinedOutput(); err != nil {
		t.Fatalf("runc delete (its poststop hook cleans up): %v\n%s", err, out)
	}
	if vs := h.volumes(); len(vs) > 0 {
		t.Errorf("after the last user's cleanup the agent still has %v", vs)
	}
	if devs, err := loopdev.FindAll(img); err != nil || len(devs) != 0 {
		t.Errorf("after the last user's cleanup: loop devices %+v, %v; want detached", devs, err)
	}

	read := func(id, name string) {
		t.Helper()
		reader := h.mountsBundle(busybox, id, "cat /data/f", name+":/data")
		out, errOut, err := runContainer(t, runc, reader, id)
		if err != nil || !strings.Contains(out, "written") {
			t.Fatalf("%s reading %s: %v\nstdout: %s\nstderr: %s", id, name, err, out, errOut)
		}
	}
	read("reader", "web")

	// A snapshot of the named volume, restored into a new one by the
	// snapshot's name (the catalogue knows its id).
	agentCLI := func(args ...string) {
		t.Helper()
		out, err := exec.Command(bins.agent, append(args, "--api-socket", h.cfg.APISocket)...).CombinedOutput()
		if err != nil {
			t.Fatalf("csi-agent %q: %v\n%s", args, err, out)
		}
	}
	agentCLI("snapshot", "create", "--volume", "web", "--name", "nightly")
	if out, err := volumeCLI(h.cfg.APISocket, "create", "restored", "--plugin", "loop", "--size", "64MiB", "--fs-type", "ext4", "--from-snapshot", "nightly", "--allow-annotations"); err != nil {
		t.Fatalf("volume create --from-snapshot: %v\n%s", err, out)
	}
	read("restorer", "restored")
	for _, name := range []string{"restored", "web"} {
		if out, err := volumeCLI(h.cfg.APISocket, "rm", name, "--delete"); err != nil {
			t.Fatalf("volume rm %s --delete: %v\n%s", name, err, out)
		}
	}
	agentCLI("snapshot", "rm", "nightly")
	if imgs := poolImages(t, pool); len(imgs) > 0 {
		t.Errorf("after rm --delete the pool holds %v", imgs)
	}
	h.assertClean(pool)
}

// TestDockerProvisionedVolume (issue 28): docker volume create --opt
// size=1GiB creates the backend volume; docker run -v writes it; docker
// volume rm deletes it (delete_on_remove=true). One created without
// delete_on_remove is kept by docker volume rm.
func TestDockerProvisionedVolume(t *testing.T) {
	e := newEnv(t)
	for _, tc := range []struct {
		name   string
		delete bool
	}{{"made", true}, {"kept", false}} {
		args := []string{"volume", "create", "-d", e.driver, "--opt", "plugin=loop.test", "--opt", "size=1GiB", "--opt", "fs_type=ext4"}
		if tc.delete {
			args = append(args, "--opt", "delete_on_remove=true")
		}
		if out := docker(t, append(args, tc.name)...); out != tc.name {
			t.Fatalf("docker volume create said %q", out)
		}
		id := e.inspect(tc.name).GetOptions()["volume_id"]
		img := filepath.Join(e.pool, id+".img")
		if st, err := os.Stat(img); err != nil || st.Size() != 1<<30 {
			t.Fatalf("the created image: %v, %v; want 1 GiB", st, err)
		}
		if out := docker(t, "run", "--rm", "--network", "none", "-v", tc.name+":/data", "csiagent-test-busybox", "sh", "-c", "echo hi > /data/f && cat /data/f"); out != "hi" {
			t.Errorf("the container wrote and read %q", out)
		}
		docker(t, "volume", "rm", tc.name)
		if _, err := os.Stat(img); tc.delete != os.IsNotExist(err) {
			t.Errorf("%s (delete_on_remove=%v) after docker volume rm: %v", tc.name, tc.delete, err)
		}
	}
	kept, err := filepath.Glob(filepath.Join(e.pool, "csi-agent-kept-*.img"))
	if err != nil || len(kept) != 1 {
		t.Fatalf("the kept volume: %v, %v", kept, err)
	}
	if out, err := exec.Command(bins.loop, "delete-volume", "--pool", e.pool, "--name", strings.TrimSuffix(filepath.Base(kept[0]), ".img")).CombinedOutput(); err != nil {
		t.Fatalf("deleting the kept volume: %v\n%s", err, out)
	}
}
