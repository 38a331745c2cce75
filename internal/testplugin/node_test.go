package main

import (
	"bytes"
	"errors"
	"io"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestParseCode(t *testing.T) {
	for _, c := range []struct {
		in   string
		want codes.Code
		ok   bool
	}{
		{"", codes.Internal, true},
		{"\n", codes.Internal, true},
		{"Unavailable", codes.Unavailable, true},
		{"UNAVAILABLE\n", codes.Unavailable, true},
		{"unavailable", codes.Unavailable, true},
		{"InvalidArgument", codes.InvalidArgument, true},
		{"INVALID_ARGUMENT", codes.InvalidArgument, true},
		{"DEADLINE_EXCEEDED", codes.DeadlineExceeded, true},
		{"codes.ResourceExhausted", codes.ResourceExhausted, true},
		{"Canceled", codes.Canceled, true},
		{"16", codes.Unauthenticated, true},
		{"14", codes.Unavailable, true},
		{"OK", codes.Internal, false},
		{"0", codes.OK, false},
		{"17", 17, false},
		{"bogus", codes.Internal, false},
	} {
		if got, ok := parseCode(c.in); got != c.want || ok != c.ok {
			t.Errorf("parseCode(%q) = %v, %v; want %v, %v", c.in, got, ok, c.want, c.ok)
		}
	}
}

func TestMaskSecrets(t *testing.T) {
	for _, c := range []struct{ in, want []string }{
		{[]string{"tp", "--require-stage-secret", "k=v"}, []string{"tp", "--require-stage-secret", "k=***"}},
		{[]string{"tp", "-require-publish-secret", "k=a=b"}, []string{"tp", "-require-publish-secret", "k=***"}},
		{[]string{"tp", "--require-stage-secret=k=v", "--name", "k=v"}, []string{"tp", "--require-stage-secret=k=***", "--name", "k=v"}},
		{[]string{"tp", "--require-publish-secret=novalue"}, []string{"tp", "--require-publish-secret=novalue"}},
		{[]string{"tp", "--require-stage-secret"}, []string{"tp", "--require-stage-secret"}},
		{[]string{"--require-stage-secret", "k=v"}, []string{"--require-stage-secret", "k=v"}}, // argv[0] is no flag
	} {
		if got := maskSecrets(c.in); !slices.Equal(got, c.want) {
			t.Errorf("maskSecrets(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}

func TestParseSecretFlags(t *testing.T) {
	c, err := parseFlags([]string{"--require-stage-secret", "a=1", "--require-stage-secret=b=", "--require-publish-secret", "c=x=y"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if want := map[string]string{"a": "1", "b": ""}; !maps.Equal(c.requireStageSecrets, want) {
		t.Errorf("stage secrets %v, want %v", c.requireStageSecrets, want)
	}
	if want := map[string]string{"c": "x=y"}; !maps.Equal(c.requirePublishSecrets, want) {
		t.Errorf("publish secrets %v, want %v", c.requirePublishSecrets, want)
	}
	for _, args := range [][]string{
		{"--require-stage-secret", "noequals"},
		{"--require-publish-secret", "=v"},
		{"--require-stage-secret", "k=first-value", "--require-stage-secret", "k=second-value"},
	} {
		var out bytes.Buffer
		_, err := parseFlags(args, &out)
		if err == nil {
			t.Errorf("parseFlags(%q) succeeded, want an error", args)
			continue
		}
		if msg := out.String() + err.Error(); strings.Contains(msg, "-value") {
			t.Errorf("parseFlags(%q) error shows a secret value: %s", args, msg)
		}
	}
}

// nodeEnv is a plugin with --data-dir and the paths a CO would use.
type nodeEnv struct {
	p            *proc
	node         csi.NodeClient
	dir, data    string
	staging, pub string // the CO's staging directory and the targets' parent
}

// startNode starts the plugin on a fresh data directory with extra flags.
// Mounts left below the test's directory are detached before it is
// removed.
func startNode(t *testing.T, bin string, flags ...string) *nodeEnv {
	t.Helper()
	dir := t.TempDir()
	t.Cleanup(func() { unmountAllUnder(t, dir) })
	e := &nodeEnv{dir: dir, data: filepath.Join(dir, "data"), staging: filepath.Join(dir, "staging"), pub: filepath.Join(dir, "targets")}
	for _, d := range []string{e.staging, e.pub} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			t.Fatal(err)
		}
	}
	e.p = start(t, bin, "", nil, append([]string{"--data-dir", e.data}, flags...)...)
	e.p.waitServing(t)
	e.node = csi.NewNodeClient(e.p.conn)
	return e
}

// restart stops the plugin and starts it again on the same directories.
func (e *nodeEnv) restart(t *testing.T, bin string, flags ...string) {
	t.Helper()
	e.p.terminate(t)
	e.p = start(t, bin, "", nil, append([]string{"--data-dir", e.data}, flags...)...)
	e.p.waitServing(t)
	e.node = csi.NewNodeClient(e.p.conn)
}

func unmountAllUnder(t *testing.T, dir string) {
	mounts, err := mountinfo.GetMounts(mountinfo.PrefixFilter(dir))
	if err != nil {
		t.Errorf("list mounts below %s: %v", dir, err)
		return
	}
	// Deepest (longest) first.
	slices.SortFunc(mounts, func(a, b *mountinfo.Info) int { return len(b.Mountpoint) - len(a.Mountpoint) })
	for _, m := range mounts {
		_ = unix.Unmount(m.Mountpoint, unix.MNT_DETACH)
	}
}

func mountCap() *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
}

func blockCap() *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
}

func (e *nodeEnv) stage(t *testing.T, id string, c *csi.VolumeCapability, secrets map[string]string) error {
	t.Helper()
	_, err := e.node.NodeStageVolume(rpcCtx(t, rpcTimeout), &csi.NodeStageVolumeRequest{
		VolumeId: id, StagingTargetPath: e.staging, VolumeCapability: c, Secrets: secrets,
	})
	return err
}

func (e *nodeEnv) publish(t *testing.T, id, target string, c *csi.VolumeCapability, readonly bool, secrets map[string]string) error {
	t.Helper()
	_, err := e.node.NodePublishVolume(rpcCtx(t, rpcTimeout), &csi.NodePublishVolumeRequest{
		VolumeId: id, StagingTargetPath: e.staging, TargetPath: target, VolumeCapability: c, Readonly: readonly, Secrets: secrets,
	})
	return err
}

func (e *nodeEnv) unpublish(t *testing.T, id, target string) error {
	t.Helper()
	_, err := e.node.NodeUnpublishVolume(rpcCtx(t, rpcTimeout), &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target})
	return err
}

func (e *nodeEnv) unstage(t *testing.T, id string) error {
	t.Helper()
	_, err := e.node.NodeUnstageVolume(rpcCtx(t, rpcTimeout), &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: e.staging})
	return err
}

// wantCode checks err's gRPC code and, if given, that its message holds
// msg.
func wantCode(t *testing.T, what string, err error, code codes.Code, msg string) {
	t.Helper()
	if status.Code(err) != code || !strings.Contains(status.Convert(err).Message(), msg) {
		t.Errorf("%s = %v, want %v %q", what, err, code, msg)
	}
}

func isMounted(t *testing.T, path string) bool {
	t.Helper()
	ok, err := mountinfo.Mounted(path)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		t.Fatal(err)
	}
	return ok
}

func mustExist(t *testing.T, path string, want bool) {
	t.Helper()
	_, err := os.Lstat(path)
	if got := err == nil; got != want || err != nil && !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("%s exists: %v (%v), want %v", path, got, err, want)
	}
}

// testSecrets: stage and publish succeed only with the required secrets,
// and no secret value reaches the plugin's output.
func testSecrets(t *testing.T, bin string) {
	const stageValue, publishValue, extraValue = "st4ge-pa55", "pub1ish-t0ken", "3xtra-va1ue"
	e := startNode(t, bin, "--require-stage-secret", "user=admin", "--require-stage-secret=password="+stageValue,
		"--require-publish-secret", "token="+publishValue)
	target := filepath.Join(e.pub, "t")
	const id = "v1"
	for _, c := range []struct {
		name    string
		secrets map[string]string
		missing string
	}{
		{"none", nil, "password"},
		{"one missing", map[string]string{"password": stageValue}, "user"},
		{"wrong value", map[string]string{"user": "admin", "password": "wrong"}, "password"},
		{"value under another key", map[string]string{"user": "admin", "pass": stageValue}, "password"},
	} {
		wantCode(t, "NodeStageVolume, secrets "+c.name, e.stage(t, id, mountCap(), c.secrets), codes.Unauthenticated, "missing or wrong secret "+c.missing)
	}
	if isMounted(t, e.staging) {
		t.Fatal("staged without the secrets")
	}
	// Extra secrets are fine.
	if err := e.stage(t, id, mountCap(), map[string]string{"user": "admin", "password": stageValue, "extra": extraValue}); err != nil {
		t.Fatalf("NodeStageVolume with the secrets: %v", err)
	}
	wantCode(t, "NodePublishVolume without secrets", e.publish(t, id, target, mountCap(), false, nil), codes.Unauthenticated, "missing or wrong secret token")
	wantCode(t, "NodePublishVolume with the stage secrets", e.publish(t, id, target, mountCap(), false,
		map[string]string{"user": "admin", "password": stageValue}), codes.Unauthenticated, "missing or wrong secret token")
	mustExist(t, target, false)
	if err := e.publish(t, id, target, mountCap(), false, map[string]string{"token": publishValue}); err != nil {
		t.Fatalf("NodePublishVolume with the secret: %v", err)
	}
	if !isMounted(t, target) {
		t.Error("target not mounted")
	}
	e.p.terminate(t)

	out := e.p.stdout.String() + e.p.stderr.String()
	for _, v := range []string{stageValue, publishValue, extraValue} {
		if strings.Contains(out, v) {
			t.Errorf("the plugin's output holds secret value %q:\n%s", v, out)
		}
	}
	for _, want := range []string{
		`NodeStageVolume: secrets with keys ["extra" "password" "user"]`,
		`NodePublishVolume: secrets with keys ["token"]`,
		`"--require-stage-secret=password=***"`,
		`"token=***"`,
	} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %s:\n%s", want, out)
		}
	}
}

// testFailFiles: stage and publish fail with the code in the file while it
// exists, after validating the request.
func testFailFiles(t *testing.T, bin string) {
	flags := t.TempDir()
	stageFail, publishFail := filepath.Join(flags, "stage"), filepath.Join(flags, "publish")
	e := startNode(t, bin, "--fail-stage-file", stageFail, "--fail-publish-file", publishFail)
	target := filepath.Join(e.pub, "t")
	const id = "v1"
	write := func(path, content string) {
		t.Helper()
		// Atomically, as doc.go asks.
		if err := os.WriteFile(path+".tmp", []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(path+".tmp", path); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range []struct {
		content string
		code    codes.Code
		msg     string
	}{
		{"Unavailable", codes.Unavailable, "NodeStageVolume fails with Unavailable while " + stageFail},
		{"INVALID_ARGUMENT\n", codes.InvalidArgument, ""},
		{"DeadlineExceeded", codes.DeadlineExceeded, ""},
		{"8", codes.ResourceExhausted, ""},
		{"", codes.Internal, ""},
		{"nonsense", codes.Internal, `holds "nonsense", which is not a gRPC error code`},
	} {
		write(stageFail, c.content)
		wantCode(t, "NodeStageVolume, file holds "+c.content, e.stage(t, id, mountCap(), nil), c.code, c.msg)
	}
	// The request is checked first.
	wantCode(t, "NodeStageVolume without a capability", e.stage(t, id, nil, nil), codes.InvalidArgument, "volume_capability is required")
	if isMounted(t, e.staging) {
		t.Fatal("staged while the fail file exists")
	}
	// Publish is not affected by the stage file.
	if err := e.publish(t, id, target, mountCap(), false, nil); status.Code(err) != codes.FailedPrecondition {
		t.Errorf("NodePublishVolume before staging = %v, want FailedPrecondition (not the stage file's code)", err)
	}
	if err := os.Remove(stageFail); err != nil {
		t.Fatal(err)
	}
	if err := e.stage(t, id, mountCap(), nil); err != nil {
		t.Fatalf("NodeStageVolume once the file is gone: %v", err)
	}

	for _, c := range []struct {
		content string
		code    codes.Code
	}{{"Aborted", codes.Aborted}, {"NOT_FOUND", codes.NotFound}, {"codes.FailedPrecondition", codes.FailedPrecondition}, {"", codes.Internal}} {
		write(publishFail, c.content)
		wantCode(t, "NodePublishVolume, file holds "+c.content, e.publish(t, id, target, mountCap(), false, nil), c.code, "NodePublishVolume fails with")
	}
	mustExist(t, target, false)
	if err := os.Remove(publishFail); err != nil {
		t.Fatal(err)
	}
	if err := e.publish(t, id, target, mountCap(), false, nil); err != nil || !isMounted(t, target) {
		t.Fatalf("NodePublishVolume once the file is gone: %v (mounted %v)", err, isMounted(t, target))
	}
	// Unpublish and unstage are not affected.
	write(publishFail, "Unavailable")
	write(stageFail, "Unavailable")
	if err := e.unpublish(t, id, target); err != nil {
		t.Errorf("NodeUnpublishVolume: %v", err)
	}
	if err := e.unstage(t, id); err != nil {
		t.Errorf("NodeUnstageVolume: %v", err)
	}
	if !strings.Contains(e.p.stderr.String(), "testplugin: rpc /csi.v1.Node/NodeStageVolume: Unavailable\n") {
		t.Errorf("stderr does not log the failed calls' codes:\n%s", e.p.stderr.String())
	}
}

// testLiePublish: publish succeeds, mounts nothing, creates nothing; this
// needs no root (nothing is mounted) and no staging.
func testLiePublish(t *testing.T, bin string) {
	e := startNode(t, bin, "--lie-publish")
	missing := filepath.Join(e.pub, "missing")
	existing := filepath.Join(e.pub, "existing")
	if err := os.Mkdir(existing, 0o750); err != nil {
		t.Fatal(err)
	}
	for _, target := range []string{missing, existing} {
		if err := e.publish(t, "v1", target, mountCap(), false, nil); err != nil {
			t.Fatalf("NodePublishVolume on %s: %v", target, err)
		}
		if isMounted(t, target) {
			t.Errorf("%s is mounted", target)
		}
	}
	mustExist(t, missing, false)
	wantCode(t, "NodePublishVolume without a target", e.publish(t, "v1", "", mountCap(), false, nil), codes.InvalidArgument, "target_path is required")
	if err := e.unpublish(t, "v1", existing); err != nil {
		t.Errorf("NodeUnpublishVolume: %v", err)
	}
	mustExist(t, existing, true) // the CO's
	if !strings.Contains(e.p.stderr.String(), "without mounting anything on "+missing+" (--lie-publish)") {
		t.Errorf("stderr does not say it lied:\n%s", e.p.stderr.String())
	}
}

// testTargets: who creates and removes what; only own mounts are touched.
func testTargets(t *testing.T, bin string) {
	e := startNode(t, bin)
	const id = "vol/1"
	volDir := filepath.Join(e.data, "vol%2F1")

	wantCode(t, "NodePublishVolume before staging", e.publish(t, id, filepath.Join(e.pub, "t"), mountCap(), false, nil), codes.FailedPrecondition, "not staged")
	wantCode(t, "NodeStageVolume, relative path", func() error {
		_, err := e.node.NodeStageVolume(rpcCtx(t, rpcTimeout), &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: "rel", VolumeCapability: mountCap()})
		return err
	}(), codes.InvalidArgument, "not absolute")
	wantCode(t, "NodeStageVolume, no access type", e.stage(t, id, &csi.VolumeCapability{}, nil), codes.InvalidArgument, "neither mount nor block")
	{
		orig := e.staging
		e.staging = filepath.Join(e.dir, "no-such-staging")
		wantCode(t, "NodeStageVolume, staging missing", e.stage(t, id, mountCap(), nil), codes.FailedPrecondition, "the CO creates it")
		mustExist(t, e.staging, false)
		e.staging = orig
	}
	if err := e.stage(t, id, mountCap(), nil); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(e.staging, "data"), []byte("kept"), 0o644); err != nil {
		t.Fatal(err)
	}

	// The CO created the target (target_path_exists): it stays.
	coTarget := filepath.Join(e.pub, "co")
	if err := os.Mkdir(coTarget, 0o750); err != nil {
		t.Fatal(err)
	}
	// The plugin creates the target: unpublish removes it, also after a
	// plugin restart.
	pluginTarget := filepath.Join(e.pub, "plugin")
	for _, target := range []string{coTarget, pluginTarget} {
		if err := e.publish(t, id, target, mountCap(), false, nil); err != nil {
			t.Fatalf("NodePublishVolume on %s: %v", target, err)
		}
		if b, err := os.ReadFile(filepath.Join(target, "data")); err != nil || string(b) != "kept" {
			t.Errorf("%s shows %q, %v; want the volume", target, b, err)
		}
	}
	wantCode(t, "NodePublishVolume again read-only", e.publish(t, id, coTarget, mountCap(), true, nil), codes.AlreadyExists, "readonly false")

	wantCode(t, "NodePublishVolume, parent missing", e.publish(t, id, filepath.Join(e.dir, "no-parent", "t"), mountCap(), false, nil),
		codes.FailedPrecondition, "parent directory")
	mustExist(t, filepath.Join(e.dir, "no-parent"), false)
	file := filepath.Join(e.pub, "file")
	if err := os.WriteFile(file, nil, 0o640); err != nil {
		t.Fatal(err)
	}
	wantCode(t, "NodePublishVolume, mount access on a file", e.publish(t, id, file, mountCap(), false, nil), codes.FailedPrecondition, "not a directory")
	link := filepath.Join(e.pub, "link")
	if err := os.Symlink(coTarget, link); err != nil {
		t.Fatal(err)
	}
	wantCode(t, "NodePublishVolume on a symlink", e.publish(t, id, link, mountCap(), false, nil), codes.FailedPrecondition, "not a directory")

	// Another mount at a target is left alone.
	foreign := filepath.Join(e.pub, "foreign")
	other := filepath.Join(e.dir, "other")
	for _, d := range []string{foreign, other} {
		if err := os.Mkdir(d, 0o750); err != nil {
			t.Fatal(err)
		}
	}
	if err := unix.Mount(other, foreign, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	wantCode(t, "NodePublishVolume on another mount", e.publish(t, id, foreign, mountCap(), false, nil), codes.AlreadyExists, "another mount")
	wantCode(t, "NodeUnpublishVolume of another mount", e.unpublish(t, id, foreign), codes.FailedPrecondition, "not this volume")
	if !isMounted(t, foreign) {
		t.Error("unpublish unmounted a mount that is not its own")
	}

	e.restart(t, bin)
	for range 2 {
		for _, target := range []string{coTarget, pluginTarget} {
			if err := e.unpublish(t, id, target); err != nil {
				t.Errorf("NodeUnpublishVolume %s: %v", target, err)
			}
			if isMounted(t, target) {
				t.Errorf("%s still mounted", target)
			}
		}
		if err := e.unstage(t, id); err != nil {
			t.Errorf("NodeUnstageVolume: %v", err)
		}
	}
	mustExist(t, coTarget, true)
	mustExist(t, pluginTarget, false)
	mustExist(t, e.staging, true)
	if isMounted(t, e.staging) {
		t.Error("staging still mounted")
	}
	if b, err := os.ReadFile(filepath.Join(volDir, "data")); err != nil || string(b) != "kept" {
		t.Errorf("volume data after unstage: %q, %v", b, err)
	}
	if entries, err := os.ReadDir(filepath.Join(e.data, targetsDir)); err != nil || len(entries) != 0 {
		t.Errorf("target records after unpublish: %v, %v; want none", entries, err)
	}
	// A CO-made target unpublished by a plugin that never published it.
	if err := e.unpublish(t, id, filepath.Join(e.pub, "never")); err != nil {
		t.Errorf("NodeUnpublishVolume of a missing target: %v", err)
	}
	wantCode(t, "NodeUnstageVolume of another mount", func() error {
		if err := unix.Mount(other, e.staging, "", unix.MS_BIND, ""); err != nil {
			t.Fatal(err)
		}
		return e.unstage(t, id)
	}(), codes.FailedPrecondition, "not this volume")
	if !isMounted(t, e.staging) {
		t.Error("unstage unmounted a mount that is not its own")
	}
}

// testBlock: block volumes are a backing file bind-mounted on a file.
func testBlock(t *testing.T, bin string) {
	e := startNode(t, bin)
	const id = "blk-1"
	backing := filepath.Join(e.data, id+".blk")
	if err := e.stage(t, id, blockCap(), nil); err != nil {
		t.Fatal(err)
	}
	coTarget := filepath.Join(e.pub, "co")
	if err := os.WriteFile(coTarget, nil, 0o640); err != nil {
		t.Fatal(err)
	}
	pluginTarget, roTarget := filepath.Join(e.pub, "plugin"), filepath.Join(e.pub, "ro")
	for range 2 {
		for _, target := range []string{coTarget, pluginTarget} {
			if err := e.publish(t, id, target, blockCap(), false, nil); err != nil {
				t.Fatalf("NodePublishVolume on %s: %v", target, err)
			}
		}
		if err := e.publish(t, id, roTarget, blockCap(), true, nil); err != nil {
			t.Fatalf("NodePublishVolume read-only: %v", err)
		}
	}
	for _, target := range []string{coTarget, pluginTarget, roTarget} {
		mounts, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(target))
		if err != nil {
			t.Fatal(err)
		}
		if len(mounts) != 1 {
			t.Errorf("%s mounted %d times, want once", target, len(mounts))
		}
		st, err := os.Stat(target)
		if err != nil || !st.Mode().IsRegular() || st.Size() != blockSize {
			t.Errorf("%s: %v, %v; want a %d-byte regular file", target, st, err, blockSize)
		}
	}
	var st unix.Stat_t
	if err := unix.Stat(backing, &st); err != nil {
		t.Fatal(err)
	}
	if st.Blocks*512 >= blockSize {
		t.Errorf("backing file uses %d bytes, want it sparse", st.Blocks*512)
	}
	f, err := os.OpenFile(coTarget, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte("block data"), 4096); err != nil {
		t.Fatal(err)
	}
	f.Close()
	buf := make([]byte, 10)
	if g, err := os.Open(backing); err != nil {
		t.Fatal(err)
	} else if _, err := g.ReadAt(buf, 4096); err != nil || string(buf) != "block data" {
		t.Errorf("backing file holds %q, %v; want what was written through the target", buf, err)
	} else {
		g.Close()
	}
	if _, err := os.OpenFile(roTarget, os.O_WRONLY, 0); !errors.Is(err, unix.EROFS) {
		t.Errorf("open the read-only target for writing: %v, want EROFS", err)
	}

	dirTarget := filepath.Join(e.pub, "dir")
	if err := os.Mkdir(dirTarget, 0o750); err != nil {
		t.Fatal(err)
	}
	wantCode(t, "NodePublishVolume, block on a directory", e.publish(t, id, dirTarget, blockCap(), false, nil), codes.FailedPrecondition, "not a regular file")

	for range 2 {
		for _, target := range []string{coTarget, pluginTarget, roTarget} {
			if err := e.unpublish(t, id, target); err != nil {
				t.Errorf("NodeUnpublishVolume %s: %v", target, err)
			}
		}
		if err := e.unstage(t, id); err != nil {
			t.Errorf("NodeUnstageVolume: %v", err)
		}
	}
	mustExist(t, coTarget, true)
	mustExist(t, pluginTarget, false)
	mustExist(t, roTarget, false)
	if b, err := os.ReadFile(backing); err != nil || len(b) != blockSize || string(b[4096:4106]) != "block data" {
		t.Errorf("backing file after unstage: %d bytes, %v; want it kept with its data", len(b), err)
	}
}
