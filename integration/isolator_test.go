package integration

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/internal/testhelp"
	"github.com/csiagent/csiagent/mount"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// TestVolumeAcrossContainers is Mesos's first isolator scenario: a
// container writes a file and exits; the volume is unpublished; a second
// container, at another path, reads the file back.
func TestVolumeAcrossContainers(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	pool := h.loopPlugin("loop")
	createVolume(t, pool, "vol1")
	h.start(fastConfig(h))
	vol := volumeSpec{plugin: "loop", id: "vol1", path: "data"}

	sb1 := h.dir("sandbox1")
	resp := h.mustPrepare("c1", sb1, "", vol)
	m := resp.Mounts[0]
	if m.MountPoint != filepath.Join(sb1, "data") || !strings.HasPrefix(m.HostPath, h.work) {
		t.Errorf("mount = %v", m)
	}
	if err := os.WriteFile(filepath.Join(sb1, "data", "hello"), []byte("from c1"), 0o644); err != nil {
		t.Fatal(err)
	}
	vs := h.volumes()
	if len(vs) != 1 || vs[0].State != agentv1.VolumeStatus_PUBLISHED || !slices.Equal(vs[0].Containers, []string{"c1"}) {
		t.Fatalf("volumes = %v", vs)
	}
	h.mustCleanup("c1")
	h.assertClean(pool)
	if _, err := os.Stat(m.HostPath); !os.IsNotExist(err) {
		t.Errorf("target path %s still exists after the last cleanup: %v", m.HostPath, err)
	}

	sb2 := h.dir("sandbox2")
	vol.path = "elsewhere/data"
	h.mustPrepare("c2", sb2, "", vol)
	got, err := os.ReadFile(filepath.Join(sb2, "elsewhere", "data", "hello"))
	if err != nil || string(got) != "from c1" {
		t.Fatalf("second container reads %q, %v", got, err)
	}
	h.mustCleanup("c2")
	h.assertClean(pool)
}

// TestSharedVolume: two containers share a volume; it is unpublished only
// after both are cleaned up.
func TestSharedVolume(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	pool := h.loopPlugin("loop")
	createVolume(t, pool, "shared")
	h.start(fastConfig(h))
	vol := volumeSpec{plugin: "loop", id: "shared", path: "data"}
	sb1, sb2 := h.dir("sb1"), h.dir("sb2")
	h.mustPrepare("c1", sb1, "", vol)
	h.mustPrepare("c2", sb2, "", vol)
	if err := os.WriteFile(filepath.Join(sb1, "data", "f"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(sb2, "data", "f")); err != nil {
		t.Fatalf("c2 does not see c1's write: %v", err)
	}
	vs := h.volumes()
	if len(vs) != 1 || !slices.Equal(vs[0].Containers, []string{"c1", "c2"}) {
		t.Fatalf("volumes = %v", vs)
	}
	h.mustCleanup("c1")
	vs = h.volumes()
	if len(vs) != 1 || vs[0].State != agentv1.VolumeStatus_PUBLISHED || !slices.Equal(vs[0].Containers, []string{"c2"}) {
		t.Fatalf("after c1's cleanup: %v", vs)
	}
	if _, err := os.Stat(filepath.Join(sb2, "data", "f")); err != nil {
		t.Fatalf("c2 lost the volume when c1 was cleaned up: %v", err)
	}
	h.mustCleanup("c2")
	h.assertClean(pool)
}

// TestPluginAddedLive: a plugin config written while the agent runs is
// usable without a restart; an unmanaged plugin serves volumes too.
func TestPluginAddedLive(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	h.start(fastConfig(h))
	pool := h.loopPlugin("late")
	createVolume(t, pool, "v")
	h.waitPlugin("late", "loaded", func(p *agentv1.Plugin) bool { return p != nil })
	// Prepare waits for the new plugin to become ready.
	h.mustPrepare("c1", h.dir("sb"), "", volumeSpec{plugin: "late", id: "v", path: "d"})

	upool := mkPool(t, filepath.Join(h.extra, "upool"))
	createVolume(t, upool, "u")
	sock := filepath.Join(h.run, "unmanaged.sock")
	startLoopPlugin(t, sock, upool)
	h.writeConfig("u.json", `{"type":"unmanaged","endpoints":[{"csi_service":"CONTROLLER_SERVICE","endpoint":"`+sock+`"},{"csi_service":"NODE_SERVICE","endpoint":"`+sock+`"}]}`)
	// Known once the watcher has read the file; Prepare then waits for
	// readiness itself.
	h.waitPlugin("unmanaged", "loaded", func(p *agentv1.Plugin) bool { return p != nil })
	h.mustPrepare("c2", h.dir("sb2"), "", volumeSpec{plugin: "unmanaged", id: "u", path: "d"})
	h.mustCleanup("c1")
	h.mustCleanup("c2")
	h.assertClean(pool, upool)
}

// TestAgentRestartWhileContainersRun: the agent restarts while a container
// uses its volume; the mount stays, and cleanup afterwards works. A
// container that ended while the agent was down is cleaned up by
// Reconcile.
func TestAgentRestartWhileContainersRun(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	pool := h.loopPlugin("loop")
	createVolume(t, pool, "a")
	createVolume(t, pool, "b")
	cfg := fastConfig(h)
	h.start(cfg)
	sbA, sbB := h.dir("sbA"), h.dir("sbB")
	ra := h.mustPrepare("alive", sbA, "", volumeSpec{plugin: "loop", id: "a", path: "d"})
	h.mustPrepare("gone", sbB, "", volumeSpec{plugin: "loop", id: "b", path: "d"})

	h.restart(cfg)
	if ok, err := mount.IsMountPoint(filepath.Join(sbA, "d")); !ok || err != nil {
		t.Fatalf("container mount lost across the agent restart: %v", err)
	}
	resp, err := h.api().Reconcile(context.Background(), &agentv1.ReconcileRequest{LiveContainerIds: []string{"alive"}})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(resp.CleanedUp, []string{"gone"}) || len(resp.Failed) != 0 {
		t.Fatalf("Reconcile = %v", resp)
	}
	if ms := mountsUnder(t, sbB); len(ms) != 0 {
		t.Errorf("the ended container's mount remains: %v", ms)
	}
	h.mustCleanup("alive")
	if _, err := os.Stat(ra.Mounts[0].HostPath); !os.IsNotExist(err) {
		t.Errorf("target path still exists after cleanup: %v", err)
	}
	h.assertClean(pool)
}

// TestContainerPaths follows the Mesos table: absolute paths need not
// exist with a rootfs and must exist without; relative paths are made in
// the sandbox.
func TestContainerPaths(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	pool := h.loopPlugin("loop")
	createVolume(t, pool, "v")
	h.start(fastConfig(h))
	rootfs, sandbox, existing := h.dir("rootfs"), h.dir("sandbox"), h.dir("host-existing")
	cases := []struct {
		name, path, rootfs, sandbox string
		wantMountPoint              string
		wantErr                     string
	}{
		{"absolute with rootfs, created", "/mnt/data", rootfs, "", filepath.Join(rootfs, "mnt", "data"), ""},
		{"relative with rootfs goes to the sandbox", "rel", rootfs, sandbox, filepath.Join(sandbox, "rel"), ""},
		{"relative without rootfs", "a/b", "", sandbox, filepath.Join(sandbox, "a", "b"), ""},
		{"absolute without rootfs, existing", existing, "", "", existing, ""},
		{"absolute without rootfs, missing", "/nonexistent/csiagent/x", "", "", "", "Absolute container path '/nonexistent/csiagent/x' does not exist"},
		{"relative without sandbox", "rel", "", "", "", "is relative: the request needs a sandbox"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			resp, err := h.prepare("paths", tc.sandbox, tc.rootfs, volumeSpec{plugin: "loop", id: "v", path: tc.path})
			if tc.wantErr != "" {
				if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want InvalidArgument with %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := resp.Mounts[0].MountPoint; got != tc.wantMountPoint {
				t.Errorf("mount point %s, want %s", got, tc.wantMountPoint)
			}
			if ok, _ := mount.IsMountPoint(tc.wantMountPoint); !ok {
				t.Errorf("%s is not a mount point", tc.wantMountPoint)
			}
			h.mustCleanup("paths")
		})
	}
	h.assertClean(pool)
}

// TestReadOnlyAndBlock: an RO volume refuses writes; a block volume gives
// the container a usable device node.
func TestReadOnlyAndBlock(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	pool := h.loopPlugin("loop")
	createVolume(t, pool, "ro")
	createVolume(t, pool, "blk")
	h.start(fastConfig(h))
	sb := h.dir("sb")
	h.mustPrepare("c", sb, "",
		volumeSpec{plugin: "loop", id: "ro", path: "ro", ro: true},
		volumeSpec{plugin: "loop", id: "blk", path: "dev/disk", block: true})
	err := os.WriteFile(filepath.Join(sb, "ro", "x"), nil, 0o644)
	if !errors.Is(err, syscall.EROFS) {
		t.Errorf("write to an RO volume: %v, want EROFS", err)
	}
	st, err := os.Stat(filepath.Join(sb, "dev", "disk"))
	if err != nil || st.Mode()&os.ModeDevice == 0 {
		t.Fatalf("block volume mount point: %v, %v; want a device node", st, err)
	}
	dev, err := os.OpenFile(filepath.Join(sb, "dev", "disk"), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	payload := bytes.Repeat([]byte("csiagent"), 512)
	if _, err := dev.WriteAt(payload, 4096); err != nil {
		t.Fatal(err)
	}
	back := make([]byte, len(payload))
	if _, err := dev.ReadAt(back, 4096); err != nil || !bytes.Equal(back, payload) {
		t.Errorf("read back from the block device: %v", err)
	}
	dev.Close()
	h.mustCleanup("c")
	h.assertClean(pool)
}

// TestPrepareValidation checks each refusal's code and Mesos message, and
// that a refused request disturbs no published volume.
func TestPrepareValidation(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	pool := h.loopPlugin("loop")
	createVolume(t, pool, "v")
	h.start(fastConfig(h))
	sb := h.dir("sb")
	good := volumeSpec{plugin: "loop", id: "v", path: "d"}
	h.mustPrepare("running", sb, "", good)
	cases := []struct {
		name  string
		id    string
		specs []volumeSpec
		code  codes.Code
		want  string
	}{
		{"unknown plugin", "x", []volumeSpec{{plugin: "nope", id: "v", path: "d"}}, codes.NotFound, "Unknown CSI plugin 'nope'"},
		{"read-only access used RW", "x", []volumeSpec{{plugin: "loop", id: "v", path: "d", access: csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY}},
			codes.InvalidArgument, "Cannot use the read-only volume 'v' in read-write mode"},
		{"duplicate volume", "x", []volumeSpec{good, {plugin: "loop", id: "v", path: "e"}}, codes.InvalidArgument,
			"Found duplicate CSI volume with plugin 'loop' and volume ID 'v'"},
		{"container id with a slash", "a/../etc", []volumeSpec{good}, codes.InvalidArgument, `container_id "a/../etc" has the character '/'`},
		{"container id with a leading dot", "..", []volumeSpec{good}, codes.InvalidArgument, `container_id ".." must not start with '.'`},
		{"different volume set for a known container", "running", []volumeSpec{good, {plugin: "loop", id: "w", path: "w"}},
			codes.FailedPrecondition, "container running already has a different set of volumes"},
		{"same volume, other capability", "x", []volumeSpec{{plugin: "loop", id: "v", path: "d", block: true}},
			codes.FailedPrecondition, "with a different volume_capability"},
		{"volume the plugin does not have", "x", []volumeSpec{{plugin: "loop", id: "missing", path: "d"}}, codes.NotFound, "missing"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := h.prepare(tc.id, h.dir("sb-"+strings.ReplaceAll(tc.name, " ", "-")), "", tc.specs...)
			if status.Code(err) != tc.code || !strings.Contains(status.Convert(err).Message(), tc.want) {
				t.Fatalf("err = %v; want %s containing %q", err, tc.code, tc.want)
			}
		})
	}
	t.Run("missing static_provisioning", func(t *testing.T) {
		v := good.volume()
		v.Source.CsiVolume.StaticProvisioning = nil
		_, err := h.api().Prepare(context.Background(), &agentv1.PrepareRequest{ContainerId: "x", Sandbox: sb, Volumes: []*agentv1.Volume{v}})
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "'static_provisioning' is missing") {
			t.Fatalf("err = %v", err)
		}
	})
	// The same request again succeeds with the same answer.
	again := h.mustPrepare("running", sb, "", good)
	if again.Mounts[0].MountPoint != filepath.Join(sb, "d") {
		t.Errorf("repeat = %v", again)
	}
	vs := h.volumes()
	if len(vs) != 1 || vs[0].State != agentv1.VolumeStatus_PUBLISHED || !slices.Equal(vs[0].Containers, []string{"running"}) {
		t.Fatalf("refused requests disturbed the published volume: %v", vs)
	}
	if ok, _ := mount.IsMountPoint(filepath.Join(sb, "d")); !ok {
		t.Error("the running container lost its mount")
	}
	h.mustCleanup("running")
	h.mustCleanup("never-existed") // idempotent
	h.assertClean(pool)
}

// TestSymlinkEscape: a rootfs whose paths lead outside through symlinks
// gets its mounts inside the rootfs, never on the host.
func TestSymlinkEscape(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	pool := h.loopPlugin("loop")
	createVolume(t, pool, "v")
	h.start(fastConfig(h))
	rootfs := h.dir("rootfs")
	outside := h.dir("outside")
	for name, target := range map[string]string{
		"data":   "/etc",                  // absolute symlink to a host directory
		"dotdot": "../../../../../../tmp", // climbs above the rootfs
		"parent": outside,                 // symlinked parent directory
	} {
		if err := os.Symlink(target, filepath.Join(rootfs, name)); err != nil {
			t.Fatal(err)
		}
	}
	hostEtc := mountsUnder(t, "/etc")
	for _, path := range []string{"/data", "/dotdot/x", "/parent/y"} {
		t.Run(path, func(t *testing.T) {
			resp, err := h.prepare("esc", "", rootfs, volumeSpec{plugin: "loop", id: "v", path: path})
			if err == nil {
				mp := resp.Mounts[0].MountPoint
				if !strings.HasPrefix(mp, rootfs+"/") {
					t.Errorf("mounted at %s, outside the rootfs %s", mp, rootfs)
				}
				h.mustCleanup("esc")
			}
			if got := mountsUnder(t, "/etc"); !slices.Equal(got, hostEtc) {
				t.Errorf("host /etc mounts changed: %v -> %v", hostEtc, got)
			}
			if ms := mountsUnder(t, outside, "/tmp/x"); len(ms) > 0 {
				t.Errorf("mounted outside the rootfs: %v", ms)
			}
		})
	}
	h.assertClean(pool)
}

// TestSecrets: VALUE and REFERENCE secrets reach the plugin (which refuses
// to stage without them) and appear in no log.
func TestSecrets(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	data := h.dir("plugin-data")
	h.writeConfig("s.json", testPluginConfig("secretive", "--data-dir="+data,
		"--require-stage-secret=password=hunter2-value", "--require-stage-secret=token=tok-from-file"))
	secrets := h.dir("secrets")
	if err := os.WriteFile(filepath.Join(secrets, "backend"), []byte(`{"token": "tok-from-file"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	var logs bytes.Buffer
	cfg := fastConfig(h)
	cfg.SecretsDir = secrets
	cfg.Logger = slogTo(&logs)
	h.start(cfg)
	spec := volumeSpec{plugin: "secretive", id: "s1", path: "d", stageSecrets: map[string]*agentv1.Secret{
		"password": {Type: agentv1.Secret_VALUE, Value: &agentv1.Secret_Value{Data: []byte("hunter2-value")}},
		"token":    {Type: agentv1.Secret_REFERENCE, Reference: &agentv1.Secret_Reference{Name: "backend", Key: "token"}},
	}}
	h.mustPrepare("c", h.dir("sb"), "", spec)
	h.mustCleanup("c")

	wrong := spec
	wrong.stageSecrets = map[string]*agentv1.Secret{
		"password": {Type: agentv1.Secret_VALUE, Value: &agentv1.Secret_Value{Data: []byte("wrong-value")}},
		"token":    {Type: agentv1.Secret_REFERENCE, Reference: &agentv1.Secret_Reference{Name: "backend", Key: "token"}},
	}
	if _, err := h.prepare("c2", h.dir("sb2"), "", wrong); status.Code(err) != codes.Unauthenticated {
		t.Errorf("wrong secret: %v, want the plugin's Unauthenticated", err)
	}
	missing := spec
	missing.stageSecrets = map[string]*agentv1.Secret{
		"token": {Type: agentv1.Secret_REFERENCE, Reference: &agentv1.Secret_Reference{Name: "nope", Key: "token"}},
	}
	if _, err := h.prepare("c3", h.dir("sb3"), "", missing); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), `secret "token": reference "nope"`) {
		t.Errorf("missing reference: %v", err)
	}
	h.stop()
	for _, secret := range []string{"hunter2-value", "tok-from-file", "wrong-value", "aHVudGVyMi12YWx1ZQ"} {
		if strings.Contains(logs.String(), secret) {
			t.Errorf("secret %q reached the agent's log", secret)
		}
	}
	if !strings.Contains(logs.String(), "password") {
		t.Error("the log should name the secrets passed (without their values)")
	}
}
