package integration

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"google.golang.org/protobuf/encoding/protojson"

	"github.com/csiagent/csiagent/cli"
	"github.com/csiagent/csiagent/internal/testhelp"
	"github.com/csiagent/csiagent/mount"
)

// TestAPIGroupLeastPrivilege runs the real CLI as a member of the API
// group (uid 5000, not root) against a real agent with loop volumes: every
// way the audit turned a member into root is refused, naming the field and
// the rule (a host path, a rootfs outside --api-group-roots or escaping it
// by a symlink, another user, a pid not the member's, Reconcile, cleaning
// up root's container); preparing under an allowed prefix, with the
// member's own user and own pid, works, and its cleanup too. Every
// container mount is nosuid,nodev, except a block volume's device node
// (nosuid only), which still opens.
func TestAPIGroupLeastPrivilege(t *testing.T) {
	testhelp.NeedRoot(t)
	const apiGroup, memberUID = 4321, 5000
	h := newHarness(t)
	if err := os.Chmod(h.run, 0o755); err != nil {
		t.Fatal(err)
	}
	pool := h.loopPlugin("loop")
	for _, v := range []string{"m1", "m2", "rootvol", "rootblk"} {
		createVolume(t, pool, v)
	}
	roots := h.dir("roots")
	cfg := fastConfig(h)
	cfg.APIGroup = apiGroup
	cfg.APIGroupRoots = []string{roots}
	h.start(cfg)
	h.waitPlugin("loop", "ready", ready)
	socket := h.cfg.APISocket
	member := &syscall.Credential{Uid: memberUID, Gid: apiGroup}
	me := strconv.Itoa(memberUID) + ":" + strconv.Itoa(apiGroup)

	// Files the member's CLI reads (bundles) must be reachable by it.
	public, err := os.MkdirTemp("", "csiag")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(public) })
	if err := os.Chmod(public, 0o755); err != nil {
		t.Fatal(err)
	}
	rootfs := func(name string) string {
		d := filepath.Join(roots, name, "rootfs")
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		return d
	}
	outside, hostDir := h.dir("outside"), h.dir("host/bin")
	if err := os.Symlink(outside, filepath.Join(roots, "escape")); err != nil {
		t.Fatal(err)
	}
	volumesJSON := func(specs ...volumeSpec) []byte {
		var list []json.RawMessage
		for _, s := range specs {
			b, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(s.volume())
			if err != nil {
				t.Fatal(err)
			}
			list = append(list, b)
		}
		b, _ := json.Marshal(list)
		return b
	}
	// run runs the CLI as cred (nil: root) with stdin.
	run := func(cred *syscall.Credential, stdin []byte, args ...string) (string, error) {
		cmd := exec.Command(bins.agent, args...)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
		cmd.Stdin = bytes.NewReader(stdin)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	prepare := func(cred *syscall.Credential, id string, spec volumeSpec, flags ...string) (string, error) {
		return run(cred, volumesJSON(spec), append([]string{"prepare", "--api-socket", socket, "--container", id, "--volumes", "-"}, flags...)...)
	}
	// hook runs oci-hook create-runtime as the member, with a state the
	// member wrote: its pid and a bundle whose rootfs is rootfsDir.
	hook := func(id string, pid int, rootfsDir string, spec volumeSpec) (string, error) {
		bundle := filepath.Join(public, id)
		if err := os.Mkdir(bundle, 0o755); err != nil {
			t.Fatal(err)
		}
		config, _ := json.Marshal(map[string]any{"root": map[string]any{"path": rootfsDir}})
		if err := os.WriteFile(filepath.Join(bundle, "config.json"), config, 0o644); err != nil {
			t.Fatal(err)
		}
		state, _ := json.Marshal(map[string]any{
			"id": id, "status": "creating", "pid": pid, "bundle": bundle,
			"annotations": map[string]string{cli.VolumesAnnotation: string(volumesJSON(spec))},
		})
		return run(member, state, "oci-hook", "create-runtime", "--api-socket", socket)
	}
	mountOptions := func(path string) string {
		t.Helper()
		m, ok, err := mount.Lookup(path)
		if err != nil || !ok {
			t.Fatalf("%s is not a mount point: %v", path, err)
		}
		return m.Options
	}
	hasOpts := func(opts string, want ...string) bool {
		for _, o := range want {
			if !mount.HasOption(opts, o) {
				return false
			}
		}
		return true
	}

	// Root's containers: a filesystem volume outside the prefixes, and a
	// block volume.
	rootDir := h.dir("root-rootfs")
	h.mustPrepare("root-c", "", rootDir,
		volumeSpec{plugin: "loop", id: "rootvol", path: "/data"},
		volumeSpec{plugin: "loop", id: "rootblk", path: "/dev/vol", block: true})
	if opts := mountOptions(filepath.Join(rootDir, "data")); !hasOpts(opts, "nosuid", "nodev") {
		t.Errorf("root's filesystem volume mount: options %q, want nosuid,nodev", opts)
	}
	blk := filepath.Join(rootDir, "dev", "vol")
	if opts := mountOptions(blk); !hasOpts(opts, "nosuid") || mount.HasOption(opts, "nodev") {
		t.Errorf("root's block volume mount: options %q, want nosuid without nodev", opts)
	}
	if f, err := os.Open(blk); err != nil {
		t.Errorf("root's block volume does not open: %v", err)
	} else {
		if _, err := f.Read(make([]byte, 512)); err != nil {
			t.Errorf("reading root's block volume: %v", err)
		}
		f.Close()
	}

	vol := volumeSpec{plugin: "loop", id: "m1", path: "/data"}
	sleeper := exec.Command("sleep", "300")
	sleeper.SysProcAttr = &syscall.SysProcAttr{Credential: member}
	if err := sleeper.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sleeper.Process.Kill(); sleeper.Wait() })

	refusals := []struct {
		name string
		call func() (string, error)
		want string
	}{
		// Host directories of the test's own: a regression must not touch
		// the real host's.
		{"a host path: absolute container_path without a rootfs", func() (string, error) {
			return prepare(member, "m-host", volumeSpec{plugin: "loop", id: "m1", path: hostDir}, "--sandbox", rootfs("s1"))
		}, `volumes[0].container_path "` + hostDir + `" is absolute and the request has no rootfs`},
		{"rootfs outside the prefixes", func() (string, error) { return prepare(member, "m-etc", vol, "--rootfs", outside) },
			`rootfs "` + outside + `" is not under any --api-group-roots prefix`},
		{"rootfs escaping by a symlink", func() (string, error) {
			return prepare(member, "m-link", vol, "--rootfs", filepath.Join(roots, "escape"))
		}, "which is not under any --api-group-roots prefix"},
		{"the prefix itself", func() (string, error) { return prepare(member, "m-top", vol, "--rootfs", roots) },
			"is not under any --api-group-roots prefix"},
		{"--user root", func() (string, error) {
			return prepare(member, "m-user", vol, "--rootfs", rootfs("u"), "--user", "0:0")
		},
			`user "0:0" is uid 0`},
		{"oci-hook with pid 1 (the host's namespace)", func() (string, error) { return hook("m-pid1", 1, rootfs("p1"), vol) },
			"pid 1 is not the caller's process"},
		{"reconcile", func() (string, error) { return run(member, nil, "reconcile", "--live", "", "--api-socket", socket) },
			"only root may call it"},
		{"cleanup of root's container", func() (string, error) { return run(member, nil, "cleanup", "--api-socket", socket, "root-c") },
			`its rootfs "` + rootDir + `" is not under any --api-group-roots prefix`},
	}
	for _, r := range refusals {
		out, err := r.call()
		if err == nil || !strings.Contains(out, "PermissionDenied") || !strings.Contains(out, r.want) {
			t.Errorf("%s: %v, output %q; want PermissionDenied containing %q", r.name, err, out, r.want)
		}
	}
	if ms := mountsUnder(t, outside, hostDir); len(ms) > 0 {
		t.Errorf("refused prepares left mounts: %v", ms)
	}
	if ents, _ := os.ReadDir(outside); len(ents) > 0 {
		t.Errorf("a refused prepare created %v in the directory outside", ents)
	}
	ids := map[string]bool{}
	for _, c := range h.containers() {
		ids[c.GetContainerId()] = true
	}
	if len(ids) != 1 || !ids["root-c"] {
		t.Errorf("containers after the refusals: %v, want root's only", ids)
	}

	// Allowed: the member's own user under a prefix; the member's own
	// process through the hook.
	r1 := rootfs("c1")
	if out, err := prepare(member, "m-ok", vol, "--rootfs", r1, "--user", me); err != nil {
		t.Fatalf("member prepare under the prefix: %v\n%s", err, out)
	}
	data := filepath.Join(r1, "data")
	if opts := mountOptions(data); !hasOpts(opts, "nosuid", "nodev") {
		t.Errorf("member's volume mount: options %q, want nosuid,nodev", opts)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(data, &st); err != nil || st.Uid != memberUID {
		t.Errorf("member's fresh volume root: uid %d, %v; want %d", st.Uid, err, memberUID)
	}
	r2 := rootfs("c2")
	if out, err := hook("m-hook", sleeper.Process.Pid, r2, volumeSpec{plugin: "loop", id: "m2", path: "/data"}); err != nil {
		t.Fatalf("member's hook with its own pid: %v\n%s", err, out)
	}
	if opts := mountOptions(filepath.Join(r2, "data")); !hasOpts(opts, "nosuid", "nodev") {
		t.Errorf("member's hook volume mount: options %q, want nosuid,nodev", opts)
	}
	for _, id := range []string{"m-ok", "m-hook"} {
		if out, err := run(member, nil, "cleanup", "--api-socket", socket, id); err != nil {
			t.Errorf("member cleanup of its own %s: %v\n%s", id, err, out)
		}
	}
	h.mustCleanup("root-c")
	h.assertClean(pool)
}
