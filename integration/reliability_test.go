package integration

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/internal/testhelp"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// Reliability and security tests: hostile ids and messages at the API, a
// full work dir, plugins that lie, hang, die or answer garbage, and a
// simulated reboot. docs/reliability.md lists what each proves.

// attackCases counts the hostile inputs the tests below try; each test
// logs its count, docs/reliability.md sums them.
func logAttacks(t *testing.T, n int) { t.Logf("attack cases tried: %d", n) }

// dataPlugin configures a managed test plugin of type typ serving node
// volumes from a data dir, with extra flags.
func (h *harness) dataPlugin(typ string, flags ...string) {
	h.t.Helper()
	data := h.dir("data-" + typ)
	h.writeConfig(typ+".json", testPluginConfig(typ, append([]string{"--data-dir=" + data}, flags...)...))
}

// TestHostileIDs: container ids, volume ids and plugin types are used in
// paths, so whatever a client sends must never lead outside the work dir:
// container ids outside a safe charset are refused with an error naming
// container_id; volume ids are percent-encoded into one path component
// (and refused when too long); bad plugin types are config errors.
func TestHostileIDs(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	const typ = "hostile.test"
	h.dataPlugin(typ)
	// Plugin types and names that try to leave the work dir.
	for i, bad := range []string{
		`{"type":"../evil","endpoints":[{"csi_service":"NODE_SERVICE","endpoint":"/x.sock"}]}`,
		`{"type":"a/b","endpoints":[{"csi_service":"NODE_SERVICE","endpoint":"/x.sock"}]}`,
		`{"type":"ok","name":"..","endpoints":[{"csi_service":"NODE_SERVICE","endpoint":"/x.sock"}]}`,
		`{"type":"x\u0000y","endpoints":[{"csi_service":"NODE_SERVICE","endpoint":"/x.sock"}]}`,
		`{"type":"\u2215etc","endpoints":[{"csi_service":"NODE_SERVICE","endpoint":"/x.sock"}]}`,
		`{"type":"` + strings.Repeat("t", 200) + `","endpoints":[{"csi_service":"NODE_SERVICE","endpoint":"/x.sock"}]}`,
	} {
		h.writeConfig("bad-"+string(rune('a'+i))+".json", bad)
	}
	h.start(fastConfig(h))
	h.waitPlugin(typ, "ready", ready)
	attacks := 6
	plugins, err := h.api().ListPlugins(context.Background(), &agentv1.ListPluginsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(plugins.Plugins) != 1 || len(plugins.ConfigErrors) != 6 {
		t.Fatalf("plugins %v, config errors %v; want only %s and 6 errors", plugins.Plugins, plugins.ConfigErrors, typ)
	}
	base := filepath.Dir(h.work)
	baseBefore := dirNames(t, base)
	csiDir := filepath.Join(h.work, "csi")
	sb := h.dir("sandbox")

	t.Run("container ids", func(t *testing.T) {
		for _, id := range []string{
			"", ".", "..", "../x", "x/../../y", "/abs", "a/b", "a\x00b", strings.Repeat("a", 129), ".hidden",
			"\uff0e\uff0e", "a\u202eb", "caf\u00e9", "a b", "a;b", "a\nb", "%2e%2e", "a\\b", "\u2215etc",
		} {
			attacks++
			_, err := h.prepare(id, sb, "", volumeSpec{plugin: typ, id: "v", path: "d"})
			if status.Code(err) != codes.InvalidArgument || !strings.Contains(status.Convert(err).Message(), "container_id") {
				t.Errorf("Prepare container_id %q: %v; want InvalidArgument naming container_id", id, err)
			}
			if id == "" {
				continue // Cleanup of "" is the same check
			}
			attacks += 2
			if _, err := h.api().Cleanup(context.Background(), &agentv1.CleanupRequest{ContainerId: id}); status.Code(err) != codes.InvalidArgument {
				t.Errorf("Cleanup container_id %q: %v; want InvalidArgument", id, err)
			}
			if _, err := h.api().Reconcile(context.Background(), &agentv1.ReconcileRequest{LiveContainerIds: []string{id}}); status.Code(err) != codes.InvalidArgument {
				t.Errorf("Reconcile live id %q: %v; want InvalidArgument", id, err)
			}
		}
		if _, err := os.Stat(filepath.Join(h.work, "isolators")); err == nil {
			if names := dirNames(t, filepath.Join(h.work, "isolators", "volume", "csi")); len(names) > 0 {
				t.Errorf("refused container ids left records: %v", names)
			}
		}
	})

	t.Run("volume ids", func(t *testing.T) {
		for _, id := range []string{
			"../../../../etc", "/etc/passwd", "a/../../b", "../", "./.", "\x00", "a\x00/../b", "%2e%2e%2f", "%",
			"\u2215..\u2215..\u2215etc", "\uff0e\uff0e", ".hidden", "a\u202e/b", "-rf", "vol\n1",
			strings.Repeat("\u00e9", 80), // 160 bytes, 480 encoded: too long
		} {
			attacks++
			resp, err := h.prepare("c1", sb, "", volumeSpec{plugin: typ, id: id, path: "d"})
			if err != nil {
				// Refused by the agent (too long) or by the plugin
				// (which cannot name "." or ".."): either way, nothing
				// may stay.
				t.Logf("volume_id %q refused: %v", id, err)
			} else {
				vs := h.volumes()
				if len(vs) != 1 || vs[0].VolumeId != id {
					t.Fatalf("volume_id %q: tracked %v", id, vs)
				}
				for _, p := range []string{vs[0].StagingPath, vs[0].TargetPath} {
					mounts := filepath.Join(csiDir, typ, "default", "mounts")
					enc := filepath.Base(filepath.Dir(p))
					if filepath.Dir(filepath.Dir(p)) != mounts || enc == ".." || enc == "." || strings.HasPrefix(enc, ".") {
						t.Errorf("volume_id %q: path %s is not <mounts>/<one component>/...", id, p)
					}
				}
				dirs, _ := filepath.Glob(filepath.Join(csiDir, typ, "default", "volumes", "*", "volume.state"))
				if len(dirs) != 1 {
					t.Errorf("volume_id %q: checkpoints %v; want one, one level down", id, dirs)
				}
				if mp := resp.Mounts[0].MountPoint; mp != filepath.Join(sb, "d") {
					t.Errorf("volume_id %q: mounted at %s", id, mp)
				}
				h.mustCleanup("c1")
			}
			h.assertClean()
			if got := dirNames(t, base); !slices.Equal(got, baseBefore) {
				t.Fatalf("volume_id %q: entries next to the work dir changed: %v -> %v", id, baseBefore, got)
			}
		}
		if _, err := h.prepare("c1", sb, "", volumeSpec{plugin: typ, id: strings.Repeat("/", 100), path: "d"}); status.Code(err) != codes.InvalidArgument ||
			!strings.Contains(err.Error(), "volume_id is too long") {
			t.Errorf("a volume id that encodes beyond 255 bytes: %v; want InvalidArgument naming volume_id", err)
		}
		attacks++
	})

	t.Run("plugin names", func(t *testing.T) {
		for _, name := range []string{"../evil", "..", "a/b", "/etc", "x\x00", "\u2215etc", strings.Repeat("p", 300)} {
			attacks++
			_, err := h.prepare("c1", sb, "", volumeSpec{plugin: name, id: "v", path: "d"})
			if status.Code(err) != codes.NotFound {
				t.Errorf("plugin_name %q: %v; want NotFound", name, err)
			}
		}
		h.assertClean()
	})
	if got := dirNames(t, csiDir); !slices.Equal(got, []string{typ}) {
		t.Errorf("plugin directories under %s: %v; want only %s", csiDir, got, typ)
	}
	logAttacks(t, attacks)
}

// dirNames lists a directory's entries, sorted; none if it is missing.
func dirNames(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	var out []string
	for _, e := range entries {
		out = append(out, e.Name())
	}
	sort.Strings(out)
	return out
}

// TestAPIHostileMessages: malformed Prepare requests get InvalidArgument
// with the offending field named, unknown enum values included; a request
// bigger than the API's limit is refused with ResourceExhausted; and a
// client that is neither root nor in the API group (nobody) is refused
// even a call that would change nothing it may see.
func TestAPIHostileMessages(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	const typ = "msg.test"
	h.dataPlugin(typ)
	if err := os.Chmod(h.run, 0o755); err != nil {
		t.Fatal(err)
	}
	h.start(fastConfig(h))
	h.waitPlugin(typ, "ready", ready)
	sb := h.dir("sandbox")
	good := func() *agentv1.PrepareRequest {
		return &agentv1.PrepareRequest{ContainerId: "c1", Sandbox: sb, Volumes: []*agentv1.Volume{volumeSpec{plugin: typ, id: "v", path: "d"}.volume()}}
	}
	csiVol := func(r *agentv1.PrepareRequest) *agentv1.CSIVolume { return r.Volumes[0].Source.CsiVolume }
	static := func(r *agentv1.PrepareRequest) *agentv1.StaticProvisioning { return csiVol(r).StaticProvisioning }
	cases := []struct {
		name   string
		mutate func(r *agentv1.PrepareRequest)
		code   codes.Code
		want   string
	}{
		{"missing container_id", func(r *agentv1.PrepareRequest) { r.ContainerId = "" }, codes.InvalidArgument, "container_id is required"},
		{"no volumes", func(r *agentv1.PrepareRequest) { r.Volumes = nil }, codes.InvalidArgument, "no volumes"},
		{"nil volume", func(r *agentv1.PrepareRequest) { r.Volumes = []*agentv1.Volume{{}} }, codes.InvalidArgument, "volumes[0]: source.type"},
		{"relative rootfs", func(r *agentv1.PrepareRequest) { r.Rootfs = "rootfs" }, codes.InvalidArgument, "rootfs \"rootfs\" must be an absolute path"},
		{"relative sandbox", func(r *agentv1.PrepareRequest) { r.Sandbox = "../sb" }, codes.InvalidArgument, "sandbox \"../sb\" must be an absolute path"},
		{"unknown mode 7", func(r *agentv1.PrepareRequest) { r.Volumes[0].Mode = 7 }, codes.InvalidArgument, "volumes[0]: mode 7 is not RW or RO"},
		{"negative mode", func(r *agentv1.PrepareRequest) { r.Volumes[0].Mode = -1 }, codes.InvalidArgument, "volumes[0]: mode -1 is not RW or RO"},
		{"missing mode", func(r *agentv1.PrepareRequest) { r.Volumes[0].Mode = 0 }, codes.InvalidArgument, "volumes[0]: mode is required"},
		{"unknown source.type 9", func(r *agentv1.PrepareRequest) { r.Volumes[0].Source.Type = 9 }, codes.InvalidArgument, "volumes[0]: source.type 9 is not a Mesos volume source type"},
		{"HOST_PATH source", func(r *agentv1.PrepareRequest) { r.Volumes[0].Source.Type = agentv1.Volume_Source_HOST_PATH }, codes.InvalidArgument, "source.type is HOST_PATH"},
		{"missing csi_volume", func(r *agentv1.PrepareRequest) { r.Volumes[0].Source.CsiVolume = nil }, codes.InvalidArgument, "volumes[0]: source.csi_volume is missing"},
		{"missing plugin_name", func(r *agentv1.PrepareRequest) { csiVol(r).PluginName = "" }, codes.InvalidArgument, "source.csi_volume.plugin_name is required"},
		{"missing static_provisioning", func(r *agentv1.PrepareRequest) { csiVol(r).StaticProvisioning = nil }, codes.InvalidArgument, "'static_provisioning' is missing"},
		{"missing volume_id", func(r *agentv1.PrepareRequest) { static(r).VolumeId = "" }, codes.InvalidArgument, "static_provisioning.volume_id is required"},
		{"missing volume_capability", func(r *agentv1.PrepareRequest) { static(r).VolumeCapability = nil }, codes.InvalidArgument, "volume_capability with an access_mode is required"},
		{"unknown access mode 99", func(r *agentv1.PrepareRequest) { static(r).VolumeCapability.AccessMode.Mode = 99 }, codes.InvalidArgument,
			"volume_capability.access_mode.mode 99 is not a CSI access mode"},
		{"missing access type", func(r *agentv1.PrepareRequest) { static(r).VolumeCapability.AccessType = nil }, codes.InvalidArgument, "needs an access type"},
		{"missing container_path", func(r *agentv1.PrepareRequest) { r.Volumes[0].ContainerPath = "" }, codes.InvalidArgument, "volumes[0]: container_path is required"},
		{"NUL in container_path", func(r *agentv1.PrepareRequest) { r.Volumes[0].ContainerPath = "d\x00/../../etc" }, codes.InvalidArgument, "container_path contains a NUL byte"},
		{"relative container_path without sandbox", func(r *agentv1.PrepareRequest) { r.Sandbox = "" }, codes.InvalidArgument, "needs a sandbox"},
		{"unknown secret type", func(r *agentv1.PrepareRequest) {
			static(r).NodeStageSecrets = map[string]*agentv1.Secret{"k": {Type: 5}}
		}, codes.InvalidArgument, `node_stage_secrets: invalid request: secret "k": type must be VALUE or REFERENCE`},
		{"reference secret escaping the secrets dir", func(r *agentv1.PrepareRequest) {
			static(r).NodePublishSecrets = map[string]*agentv1.Secret{"k": {Type: agentv1.Secret_REFERENCE, Reference: &agentv1.Secret_Reference{Name: "../../etc/shadow", Key: "root"}}}
		}, codes.InvalidArgument, "node_publish_secrets"},
		{"3 MiB volume_context, under the limit", func(r *agentv1.PrepareRequest) {
			static(r).VolumeContext = map[string]string{"big": strings.Repeat("x", 3<<20)}
			r.Volumes[0].Mode = 7
		}, codes.InvalidArgument, "mode 7"},
		{"5 MiB volume_context, over the limit", func(r *agentv1.PrepareRequest) {
			static(r).VolumeContext = map[string]string{"big": strings.Repeat("x", 5<<20)}
		}, codes.ResourceExhausted, "larger than max"},
		{"200k volumes, over the limit", func(r *agentv1.PrepareRequest) {
			for range 200000 {
				r.Volumes = append(r.Volumes, r.Volumes[0])
			}
		}, codes.ResourceExhausted, "larger than max"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			req := good()
			tc.mutate(req)
			_, err := h.api().Prepare(context.Background(), req)
			if status.Code(err) != tc.code || !strings.Contains(status.Convert(err).Message(), tc.want) {
				t.Fatalf("err = %v; want %v containing %q", err, tc.code, tc.want)
			}
		})
	}
	h.assertClean()

	// A prepared container, which a stranger's Reconcile would clean up.
	h.mustPrepare("c1", sb, "", volumeSpec{plugin: typ, id: "v", path: "d"})
	socket := h.cfg.APISocket
	if err := os.Chmod(socket, 0o666); err != nil { // the peer-credential check must hold alone
		t.Fatal(err)
	}
	strangers := [][]string{{"reconcile", "--live", "nothing"}, {"cleanup", "--container", "c1"}, {"volumes"}, {"plugins"}}
	for _, args := range strangers {
		cmd := exec.Command(bins.agent, append(args, "--api-socket", socket)...)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}} // nobody
		out, err := cmd.CombinedOutput()
		if err == nil || !strings.Contains(string(out), "PermissionDenied: uid 65534 may not use the csi-agent API") {
			t.Errorf("csi-agent %v as nobody: %v, %q; want PermissionDenied", args, err, out)
		}
	}
	cr, err := h.api().ListContainers(context.Background(), &agentv1.ListContainersRequest{})
	if err != nil || len(cr.Containers) != 1 || cr.Containers[0].Phase != agentv1.ContainerStatus_PREPARED {
		t.Fatalf("after the strangers' calls: %v, %v; want c1 PREPARED", cr, err)
	}
	h.mustCleanup("c1")
	h.assertClean()
	logAttacks(t, len(cases)+len(strangers))
}

// startUnmanagedTestPlugin runs the test plugin on socket, as an
// unmanaged plugin the test owns.
func startUnmanagedTestPlugin(t *testing.T, socket string, flags ...string) {
	t.Helper()
	cmd := exec.Command(bins.test, append([]string{"--name=unmanaged"}, flags...)...)
	cmd.Env = append(os.Environ(), "CSI_ENDPOINT=unix://"+socket)
	cmd.Stderr = testWriter{t}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
}

// TestWorkDirFull: with the work dir on a tiny filesystem that fills up,
// an operation whose checkpoint cannot be written fails with a clear
// error (ResourceExhausted, "no space left on device"), the previous
// checkpoints stay byte for byte, mounts stay, no temp file is left, and
// the agent keeps serving; a cleanup, which needs no new space, works;
// once there is space, everything works again.
func TestWorkDirFull(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	if err := os.MkdirAll(h.work, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", h.work, "tmpfs", 0, "size=256k,mode=0755"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(h.work, unix.MNT_DETACH) })
	const typ = "full.test"
	socket := filepath.Join(h.run, "tp.sock")
	startUnmanagedTestPlugin(t, socket, "--data-dir="+h.dir("data"))
	h.writeConfig(typ+".json", `{"type":"`+typ+`","endpoints":[{"csi_service":"NODE_SERVICE","endpoint":"unix://`+socket+`"}]}`)
	h.start(fastConfig(h))
	h.waitPlugin(typ, "ready", ready)
	sb1, sb2 := h.dir("sb1"), h.dir("sb2")
	volA := volumeSpec{plugin: typ, id: "vol-a", path: "d"}
	mp := h.mustPrepare("c1", sb1, "", volA).Mounts[0].MountPoint
	checkpoints := map[string][]byte{}
	for _, pattern := range []string{"isolators/volume/csi/*/volumes.state", "csi/*/*/volumes/*/volume.state"} {
		files, _ := filepath.Glob(filepath.Join(h.work, pattern))
		for _, f := range files {
			b, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			checkpoints[f] = b
		}
	}
	if len(checkpoints) != 2 {
		t.Fatalf("checkpoints %v; want c1's and vol-a's", checkpoints)
	}

	// Fill the work dir (again before each call: a round that finds the
	// disk full commits to the record files and frees the journal).
	filler, err := os.Create(filepath.Join(h.work, "filler"))
	if err != nil {
		t.Fatal(err)
	}
	defer filler.Close()
	fill := func() {
		t.Helper()
		for {
			if _, err := filler.Write(make([]byte, 4096)); err != nil {
				if !errors.Is(err, syscall.ENOSPC) {
					t.Fatal(err)
				}
				return
			}
		}
	}

	full := func(what string, err error) {
		t.Helper()
		if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "no space left on device") || !strings.Contains(err.Error(), "checkpointing") {
			t.Errorf("%s with the work dir full: %v; want ResourceExhausted saying the checkpoint could not be written", what, err)
		}
	}
	fill()
	_, err = h.prepare("c2", sb2, "", volumeSpec{plugin: typ, id: "vol-b", path: "d"})
	full("Prepare of a new volume", err)
	fill()
	_, err = h.prepare("c3", h.dir("sb3"), "", volA)
	full("Prepare sharing vol-a", err)
	fill()

	// Nothing changed, nothing half-written, the agent serves.
	for f, want := range checkpoints {
		if got, err := os.ReadFile(f); err != nil || !bytes.Equal(got, want) {
			t.Errorf("%s changed while the work dir was full: %v\n%s\nwant\n%s", f, err, got, want)
		}
		if tmps, _ := filepath.Glob(filepath.Join(filepath.Dir(f), ".*.tmp-*")); len(tmps) > 0 {
			t.Errorf("temp files left: %v", tmps)
		}
	}
	if ok, err := mountinfo.Mounted(mp); err != nil || !ok {
		t.Errorf("c1's mount %s is gone (%v)", mp, err)
	}
	vs := h.volumes()
	if len(vs) != 1 || vs[0].VolumeId != "vol-a" || vs[0].State != agentv1.VolumeStatus_PUBLISHED || !slices.Equal(vs[0].Containers, []string{"c1"}) {
		t.Errorf("volumes while full: %v; want vol-a PUBLISHED with [c1]", vs)
	}
	cr, err := h.api().ListContainers(context.Background(), &agentv1.ListContainersRequest{})
	if err != nil || len(cr.Containers) != 1 || cr.Containers[0].Phase != agentv1.ContainerStatus_PREPARED {
		t.Errorf("containers while full: %v, %v; want c1 PREPARED", cr, err)
	}

	// A cleanup needs no space (its records are written into slots
	// reserved when they were made, then removed): it works on the full
	// disk.
	h.mustCleanup("c1")
	if ok, err := mountinfo.Mounted(mp); err != nil || ok {
		t.Errorf("c1's mount %s: mounted %v (%v) after its cleanup", mp, ok, err)
	}

	// Space again: everything works.
	if err := os.Remove(filepath.Join(h.work, "filler")); err != nil {
		t.Fatal(err)
	}
	h.mustPrepare("c2", sb2, "", volumeSpec{plugin: typ, id: "vol-b", path: "d"})
	h.mustCleanup("c2")
	// assertClean, but the tmpfs work dir is itself a mount.
	if ms := slices.DeleteFunc(mountsUnder(t, h.work, h.extra), func(m string) bool { return m == h.work }); len(ms) > 0 {
		t.Errorf("leaked mounts: %v", ms)
	}
	if vs := h.volumes(); len(vs) > 0 {
		t.Errorf("volumes still tracked: %v", vs)
	}
}

// TestMisbehavingPlugins: a plugin that reports a publish it did not make,
// hangs, answers with an oversized or a malformed message, or dies in the
// middle of the call. Each fails the Prepare with a clear code (or, for
// the death, is retried against the restarted plugin until it succeeds)
// and leaves nothing mounted, staged or tracked.
func TestMisbehavingPlugins(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	sweepOnExit(t, h)
	const typ = "bad.test"
	misbehave := filepath.Join(h.extra, "misbehave")
	h.dataPlugin(typ, "--publish-misbehave-file="+misbehave)
	cfg := fastConfig(h)
	const rpcTimeout = 4 * time.Second
	cfg.RPCTimeout = rpcTimeout
	h.start(cfg)
	h.waitPlugin(typ, "ready", ready)
	spec := volumeSpec{plugin: typ, id: "vol-m", path: "d"}
	cases := []struct {
		how  string
		code codes.Code
		want string
	}{
		{"lie", codes.Internal, "reported NodePublishVolume success but nothing is mounted"},
		{"hang", codes.DeadlineExceeded, "NodePublishVolume of volume vol-m"},
		{"oversized", codes.ResourceExhausted, "larger than max"},
		{"malformed", codes.Internal, "unmarshal"},
		{"die", codes.OK, ""},
	}
	for _, tc := range cases {
		t.Run(tc.how, func(t *testing.T) {
			before := h.waitPlugin(typ, "ready", ready).Instances[0]
			writeAtomic(t, misbehave, tc.how)
			t.Cleanup(func() { os.Remove(misbehave) })
			start := time.Now()
			resp, err := h.prepare("c1", h.dir("sb-"+tc.how), "", spec)
			took := time.Since(start)
			if status.Code(err) != tc.code || !strings.Contains(status.Convert(err).Message(), tc.want) {
				t.Fatalf("Prepare: %v; want %v containing %q", err, tc.code, tc.want)
			}
			if took > rpcTimeout+waitTimeout/3 {
				t.Errorf("Prepare took %v; the RPC timeout is %v", took, rpcTimeout)
			}
			t.Logf("Prepare answered in %v: %v", took.Round(time.Millisecond), err)
			if tc.how == "die" {
				after := h.waitPlugin(typ, "ready again", ready).Instances[0]
				if after.Pid == before.Pid || after.Restarts <= before.Restarts {
					t.Errorf("the plugin did not die and restart: pid %d -> %d, restarts %d -> %d", before.Pid, after.Pid, before.Restarts, after.Restarts)
				}
				mp := resp.Mounts[0].MountPoint
				if err := os.WriteFile(filepath.Join(mp, "f"), []byte("x"), 0o644); err != nil {
					t.Errorf("the volume is not usable: %v", err)
				}
				h.mustCleanup("c1")
			}
			h.assertClean()
		})
	}
	os.Remove(misbehave)
	// Nothing is poisoned: the same volume prepares normally.
	h.mustPrepare("c1", h.dir("sb-ok"), "", spec)
	h.mustCleanup("c1")
	h.assertClean()
}

// TestRebootSimulation: a reboot is simulated by a new boot id and an
// empty mount table (every mount below the test unmounted, plugins
// killed). The next agent republishes volumes in use and restores the
// containers' mounts, with their data; a volume whose only user's record
// is gone is cleaned up without a single RPC for mounts that no longer
// exist; Reconcile then cleans up the containers that did not come back.
func TestRebootSimulation(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	sweepOnExit(t, h)
	const typ = "reboot.test"
	h.dataPlugin(typ)
	cfg := fastConfig(h)
	h.start(cfg)
	h.waitPlugin(typ, "ready", ready)
	sb := map[string]string{"c1": h.dir("sb1"), "c2": h.dir("sb2"), "c3": h.dir("sb3")}
	vol := map[string]string{"c1": "vol-a", "c2": "vol-b", "c3": "vol-c"}
	for _, c := range []string{"c1", "c2", "c3"} {
		mp := h.mustPrepare(c, sb[c], "", volumeSpec{plugin: typ, id: vol[c], path: "d"}).Mounts[0].MountPoint
		if err := os.WriteFile(filepath.Join(mp, "marker"), []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	h.halt()

	// The "reboot": processes gone, mounts gone, one container record
	// lost with its container.
	h.killPlugins()
	for range 5 {
		ms := mountsUnder(t, h.work, h.extra)
		if len(ms) == 0 {
			break
		}
		slices.Reverse(ms)
		for _, m := range ms {
			_ = unix.Unmount(m, unix.MNT_DETACH)
		}
	}
	if ms := mountsUnder(t, h.work, h.extra); len(ms) > 0 {
		t.Fatalf("mounts survive the simulated reboot: %v", ms)
	}
	if err := os.RemoveAll(filepath.Join(h.work, "isolators", "volume", "csi", "c3")); err != nil {
		t.Fatal(err)
	}

	cfg.BootID = "simulated-reboot-boot-id"
	h.start(cfg)
	h.waitPlugin(typ, "ready", ready)
	h.waitRecovered()
	vs := h.volumes()
	var got []string
	for _, v := range vs {
		got = append(got, v.VolumeId+":"+v.State.String()+":"+strings.Join(v.Containers, ","))
	}
	if want := []string{"vol-a:PUBLISHED:c1", "vol-b:PUBLISHED:c2"}; !slices.Equal(got, want) {
		t.Fatalf("volumes after the reboot: %v; want %v", got, want)
	}
	for _, c := range []string{"c1", "c2"} {
		mp := filepath.Join(sb[c], "d")
		if ok, err := mountinfo.Mounted(mp); err != nil || !ok {
			t.Fatalf("container %s's mount %s not restored (%v)", c, mp, err)
		}
		if b, err := os.ReadFile(filepath.Join(mp, "marker")); err != nil || string(b) != c {
			t.Fatalf("container %s's data after the reboot: %q, %v", c, b, err)
		}
	}
	if b, err := os.ReadFile(globOne(t, filepath.Join(h.work, "csi", typ, "default", "volumes", "vol-a", "volume.state"))); err != nil || !bytes.Contains(b, []byte(cfg.BootID)) {
		t.Errorf("vol-a's checkpoint does not carry the new boot id: %s, %v", b, err)
	}
	if _, err := os.Stat(filepath.Join(h.work, "csi", typ, "default", "mounts", "vol-c")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the unused volume's directories were not cleaned up: %v", err)
	}
	resp, err := h.api().Reconcile(context.Background(), &agentv1.ReconcileRequest{LiveContainerIds: []string{"c1"}})
	if err != nil || !slices.Equal(resp.CleanedUp, []string{"c2"}) || len(resp.Failed) > 0 {
		t.Fatalf("Reconcile [c1]: %v, %v; want c2 cleaned up", resp, err)
	}
	h.mustCleanup("c1")
	h.assertClean()
	// The data of every volume survived.
	for _, c := range []string{"c1", "c2", "c3"} {
		mp := h.mustPrepare("check", h.dir("check-"+c), "", volumeSpec{plugin: typ, id: vol[c], path: "d"}).Mounts[0].MountPoint
		if b, err := os.ReadFile(filepath.Join(mp, "marker")); err != nil || string(b) != c {
			t.Errorf("%s's data: %q, %v", vol[c], b, err)
		}
		h.mustCleanup("check")
	}
	h.assertClean()
}
