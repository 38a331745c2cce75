package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/internal/testhelp"
	"github.com/csiagent/csiagent/mount"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// The attack table through the daemon (host mode, a rootfs): what a
// container, root in its rootfs, or its runtime does to the paths of its
// volumes, and what the agent then does and reports. The mount-level table
// is mount.TestUnmountOwnAttacks.

// tmpfsAt mounts a tmpfs holding one file at dir, and unmounts it when the
// test ends (if still there).
func tmpfsAt(t *testing.T, dir, file string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := mount.Mount("tmpfs", dir, "tmpfs", []string{"size=1m"}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
	if err := os.WriteFile(filepath.Join(dir, file), []byte(file), 0o644); err != nil {
		t.Fatal(err)
	}
}

func mustUnmount(t *testing.T, dir string) {
	t.Helper()
	if err := unix.Unmount(dir, 0); err != nil {
		t.Fatal(err)
	}
}

func (h *harness) container(id string) *agentv1.ContainerStatus {
	h.t.Helper()
	cr, err := h.api().ListContainers(context.Background(), &agentv1.ListContainersRequest{})
	if err != nil {
		h.t.Fatal(err)
	}
	for _, c := range cr.Containers {
		if c.ContainerId == id {
			return c
		}
	}
	return nil
}

// TestNestedContainerPaths (finding 3): volumes at /data and /data/sub, in
// both request orders: the inner one is mounted inside the outer one, a
// write to /data/sub/file lands in the inner volume, and cleanup leaves no
// mount behind.
func TestNestedContainerPaths(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	pool := h.loopPlugin("loop")
	createVolume(t, pool, "outer")
	createVolume(t, pool, "inner")
	h.start(fastConfig(h))
	outer := volumeSpec{plugin: "loop", id: "outer", path: "/data"}
	inner := volumeSpec{plugin: "loop", id: "inner", path: "/data/sub"}
	for name, specs := range map[string][]volumeSpec{"outer first": {outer, inner}, "inner first": {inner, outer}} {
		t.Run(name, func(t *testing.T) {
			rootfs := h.dir("rootfs-" + strings.ReplaceAll(name, " ", "-"))
			resp := h.mustPrepare("nested", "", rootfs, specs...)
			hostPath := map[string]string{}
			for _, m := range resp.Mounts {
				hostPath[m.VolumeId] = m.HostPath
			}
			file := filepath.Join(rootfs, "data", "sub", "file")
			if err := os.WriteFile(file, []byte("inner"), 0o644); err != nil {
				t.Fatal(err)
			}
			if _, err := os.Stat(filepath.Join(hostPath["inner"], "file")); err != nil {
				t.Errorf("the write to /data/sub/file is not in the inner volume: %v", err)
			}
			if _, err := os.Stat(filepath.Join(hostPath["outer"], "sub", "file")); err == nil {
				t.Errorf("the write to /data/sub/file landed in the outer volume")
			}
			if err := os.Remove(file); err != nil {
				t.Fatal(err)
			}
			h.mustCleanup("nested")
			if ms := mountsUnder(t, rootfs); len(ms) > 0 {
				t.Errorf("left mounted in the rootfs: %v", ms)
			}
			h.assertClean(pool)
		})
	}
}

// TestAttackTableDaemon: each case prepares one volume at /x/run, lets the
// runtime (before) and the container (after) act, cleans up, and checks
// the mounts outside our own (theirs, the host's) and the agent's report.
func TestAttackTableDaemon(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	pool := h.loopPlugin("loop")
	createVolume(t, pool, "v")
	h.start(fastConfig(h))
	vol := volumeSpec{plugin: "loop", id: "v", path: "/x/run"}
	host := h.dir("host")
	tmpfsAt(t, filepath.Join(host, "run"), "host-file")
	tmpfsAt(t, filepath.Join(host, "run", "sub"), "host-sub-file")
	hostMounts := mountsUnder(t, host)
	type env struct{ rootfs string }
	p := func(e env, rel string) string { return filepath.Join(e.rootfs, rel) }
	cases := []struct {
		name   string
		before func(t *testing.T, e env)
		attack func(t *testing.T, e env)
		// covered: the first cleanup must fail and report it; undo
		// removes the cover, after which cleanup succeeds.
		covered bool
		undo    func(t *testing.T, e env)
		kept    []string // files (below the rootfs) that must survive
	}{
		{
			name:   "finding 2: the runtime's tmpfs at the container path survives",
			before: func(t *testing.T, e env) { tmpfsAt(t, p(e, "x/run"), "runtime-file") },
			kept:   []string{"x/run/runtime-file"},
		},
		{
			name: "finding 1: parent renamed and replaced by a link to a host dir with mounts",
			attack: func(t *testing.T, e env) {
				if err := os.Rename(p(e, "x"), p(e, "y")); err != nil {
					t.Fatal(err)
				}
				if err := os.Symlink(host, p(e, "x")); err != nil {
					t.Fatal(err)
				}
			},
		},
		{
			name: "parent renamed, the container's own tmpfs at the old path",
			attack: func(t *testing.T, e env) {
				if err := os.Rename(p(e, "x"), p(e, "y")); err != nil {
					t.Fatal(err)
				}
				tmpfsAt(t, p(e, "x/run"), "their-file")
			},
			kept: []string{"x/run/their-file"},
		},
		{
			name:    "a tmpfs the container puts over its volume: refused and reported until it goes",
			attack:  func(t *testing.T, e env) { tmpfsAt(t, p(e, "x/run"), "their-file") },
			covered: true,
			undo:    func(t *testing.T, e env) { mustUnmount(t, p(e, "x/run")) },
		},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := env{rootfs: h.dir("attack-rootfs-" + string(rune('a'+i)))}
			if tc.before != nil {
				tc.before(t, e)
			}
			h.mustPrepare("attacked", "", e.rootfs, vol)
			if tc.attack != nil {
				tc.attack(t, e)
			}
			_, err := h.api().Cleanup(context.Background(), &agentv1.CleanupRequest{ContainerId: "attacked"})
			if tc.covered {
				if err == nil || !strings.Contains(err.Error(), "covered") {
					t.Fatalf("Cleanup with the volume covered: %v, want an error saying so", err)
				}
				c := h.container("attacked")
				if c == nil || c.Phase != agentv1.ContainerStatus_CLEANING || !strings.Contains(c.LastError, "covered") {
					t.Fatalf("container status = %v, want CLEANING with the reason", c)
				}
				if vs := h.volumes(); len(vs) != 1 || !slices.Equal(vs[0].Containers, []string{"attacked"}) {
					t.Fatalf("the volume must keep its user while its mount is there: %v", vs)
				}
				tc.undo(t, e)
				h.mustCleanup("attacked")
			} else if err != nil {
				t.Fatalf("Cleanup: %v", err)
			}
			if c := h.container("attacked"); c != nil {
				t.Errorf("container still tracked: %v", c)
			}
			if got := mountsUnder(t, host); !slices.Equal(got, hostMounts) {
				t.Errorf("host mounts changed: %v -> %v", hostMounts, got)
			}
			for _, f := range append(tc.kept, "../host/run/sub/host-sub-file") {
				if _, err := os.Stat(p(e, f)); err != nil {
					t.Errorf("lost %s: %v", f, err)
				}
			}
			// Only theirs may remain in the rootfs.
			for _, m := range mountsUnder(t, e.rootfs) {
				mustUnmount(t, m)
			}
		})
	}
	if err := unix.Unmount(filepath.Join(host, "run", "sub"), 0); err != nil {
		t.Fatal(err)
	}
	if err := unix.Unmount(filepath.Join(host, "run"), 0); err != nil {
		t.Fatal(err)
	}
	h.assertClean(pool)
}

// TestBlockReadOnly (finding 4): an RO user of a block volume gets a
// device it cannot write (its own read-only publish), while an RW user of
// the same volume still writes; both go cleanly.
func TestBlockReadOnly(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	pool := h.loopPlugin("loop")
	createVolume(t, pool, "blk")
	h.start(fastConfig(h))
	h.blockReadOnly("loop", "blk")
	h.assertClean(pool)
}

// blockReadOnly prepares one RW and one RO user of a block volume
// (sandboxes), checks the RW user writes its device, the RO user cannot
// and reads what the RW user wrote, and cleans both up.
func (h *harness) blockReadOnly(plugin, id string) {
	t := h.t
	t.Helper()
	rw, ro := h.dir("sb-rw"), h.dir("sb-ro")
	h.mustPrepare("writer", rw, "", volumeSpec{plugin: plugin, id: id, path: "disk", block: true})
	h.mustPrepare("reader", ro, "", volumeSpec{plugin: plugin, id: id, path: "disk", block: true, ro: true})
	payload := bytes.Repeat([]byte("csiagent"), 512)
	for name, sb := range map[string]string{"the RW user": rw, "the RO user": ro} {
		dev, err := os.OpenFile(filepath.Join(sb, "disk"), os.O_RDWR, 0)
		if err == nil {
			_, err = dev.WriteAt(payload, 8192)
			if err == nil {
				err = dev.Sync()
			}
			dev.Close()
		}
		switch {
		case sb == rw && err != nil:
			t.Errorf("%s cannot write its block device: %v", name, err)
		case sb == ro && !errors.Is(err, unix.EROFS) && !errors.Is(err, unix.EPERM) && !errors.Is(err, unix.EACCES):
			t.Errorf("%s writes its block device: %v; want EROFS or EPERM", name, err)
		}
	}
	// The RO user reads what the RW user wrote.
	dev, err := os.Open(filepath.Join(ro, "disk"))
	if err != nil {
		t.Fatal(err)
	}
	back := make([]byte, len(payload))
	_, err = dev.ReadAt(back, 8192)
	dev.Close()
	if err != nil || !bytes.Equal(back, payload) {
		t.Errorf("the RO user reads %q..., %v", back[:8], err)
	}
	h.mustCleanup("reader")
	h.mustCleanup("writer")
}

// TestNestedContainerPathsRunc (finding 3, OCI hook path): the same
// nesting in real runc containers, mounted inside their mount namespace:
// /data/sub is the inner volume's root (its lost+found) and takes the
// write; poststop leaves nothing.
func TestNestedContainerPathsRunc(t *testing.T) {
	runc, busybox := needRunc(t)
	h := newHarness(t)
	pool := h.loopPlugin("loop")
	createVolume(t, pool, "outer")
	createVolume(t, pool, "inner")
	h.start(fastConfig(h))
	h.waitPlugin("loop", "ready", ready)
	outer := volumeSpec{plugin: "loop", id: "outer", path: "/data"}
	inner := volumeSpec{plugin: "loop", id: "inner", path: "/data/sub"}
	for name, specs := range map[string][]volumeSpec{"outer-first": {outer, inner}, "inner-first": {inner, outer}} {
		t.Run(name, func(t *testing.T) {
			b := h.bundle(busybox, name, "echo "+name+" > /data/sub/file && ls /data/sub && ls /data", specs...)
			out, errOut, err := runContainer(t, runc, b, "nested-"+name)
			// /data/sub holds the inner volume's lost+found and the file;
			// /data lists the outer volume's lost+found and sub.
			if err != nil || strings.Count(out, "lost+found") != 2 || !strings.Contains(out, "file") {
				t.Fatalf("container: %v\nstdout: %s\nstderr: %s", err, out, errOut)
			}
			h.assertClean(pool)
			if ms := mountsUnder(t, b); len(ms) > 0 {
				t.Errorf("mounts on the host under the bundle: %v", ms)
			}
		})
	}
}

// TestCleanupReportsMountsNotFound: a mount the container took away is
// reported in the container's last_error next to the failure that keeps
// it CLEANING (here: its other volume covered by its own tmpfs).
func TestCleanupReportsMountsNotFound(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	pool := h.loopPlugin("loop")
	createVolume(t, pool, "a")
	createVolume(t, pool, "b")
	h.start(fastConfig(h))
	rootfs := h.dir("rootfs")
	h.mustPrepare("c", "", rootfs, volumeSpec{plugin: "loop", id: "a", path: "/x/run"}, volumeSpec{plugin: "loop", id: "b", path: "/z"})
	tmpfsAt(t, filepath.Join(rootfs, "x", "run"), "their-file")
	mustUnmount(t, filepath.Join(rootfs, "z"))
	if _, err := h.api().Cleanup(context.Background(), &agentv1.CleanupRequest{ContainerId: "c"}); err == nil {
		t.Fatal("Cleanup succeeded with a volume covered")
	}
	c := h.container("c")
	if c == nil || !strings.Contains(c.LastError, "covered") || !strings.Contains(c.LastError, filepath.Join(rootfs, "z")+" was not there") {
		t.Fatalf("container status = %v, want last_error naming the cover and the mount not found", c)
	}
	mustUnmount(t, filepath.Join(rootfs, "x", "run"))
	h.mustCleanup("c")
	h.assertClean(pool)
}

// TestAttackInRunc: a container, root in its rootfs, plays the rename and
// symlink games on the path of its volume while it runs (its parent moved
// aside, a link to "/" in its place). The poststop cleanup must still end
// everything (the mount lived in the container's namespace), touch no host
// mount, and the data written through the moved path is in the volume.
func TestAttackInRunc(t *testing.T) {
	runc, busybox := needRunc(t)
	h := newHarness(t)
	pool := h.loopPlugin("loop")
	createVolume(t, pool, "v")
	h.start(fastConfig(h))
	h.waitPlugin("loop", "ready", ready)
	host := t.TempDir() // a host directory with a mount of its own
	tmpfsAt(t, filepath.Join(host, "run"), "host-file")
	hostMounts := mountsUnder(t, host)
	vol := volumeSpec{plugin: "loop", id: "v", path: "/x/run"}
	b := h.bundle(busybox, "attack", "busybox mv /x /y && busybox ln -s / /x && echo moved > /y/run/file && busybox ls /x/", vol)
	if out, errOut, err := runContainer(t, runc, b, "attack-runc"); err != nil {
		t.Fatalf("container: %v\nstdout: %s\nstderr: %s", err, out, errOut)
	}
	h.assertClean(pool)
	if ms := mountsUnder(t, b); len(ms) > 0 {
		t.Errorf("mounts on the host under the bundle: %v", ms)
	}
	if got := mountsUnder(t, host); !slices.Equal(got, hostMounts) {
		t.Errorf("host mounts changed: %v -> %v", hostMounts, got)
	}
	if _, err := os.Stat(filepath.Join(host, "run", "host-file")); err != nil {
		t.Errorf("host file: %v", err)
	}
	// The write through the moved path landed in the volume.
	rootfs := h.dir("check-rootfs")
	h.mustPrepare("check", "", rootfs, volumeSpec{plugin: "loop", id: "v", path: "/data"})
	if b, err := os.ReadFile(filepath.Join(rootfs, "data", "file")); err != nil || string(b) != "moved\n" {
		t.Errorf("volume holds %q, %v; want what the container wrote", b, err)
	}
	h.mustCleanup("check")
	h.assertClean(pool)
}

// TestContainerCannotHideItsMount (issue 24, finding 1): a running hook
// container makes, in its own mount namespace, a directory at the host
// path of its volume's publish target (the default work dir makes it
// predictable). The cleanup, which runs in that namespace, must still
// find the mount it made by the root recorded when it made it, and
// unmount it; before, it looked the publish target up there, found the
// container's directory, declared the mount gone and returned success with
// the volume still mounted in the running container (and released it to
// the next one).
func TestContainerCannotHideItsMount(t *testing.T) {
	runc, busybox := needRunc(t)
	h := newHarness(t)
	sweepOnExit(t, h)
	pool := h.loopPlugin("loop")
	createVolume(t, pool, "v")
	h.start(fastConfig(h))
	h.waitPlugin("loop", "ready", ready)
	target := filepath.Join(h.work, "csi", "loop", "default", "mounts", "v", "target")
	b := h.bundle(busybox, "hider", "busybox mkdir -p "+target+" && busybox sleep 600", volumeSpec{plugin: "loop", id: "v", path: "/data"})
	runDetached(t, runc, b, "hider", "its directory at the publish target's path", func() bool {
		_, err := os.Stat(filepath.Join(b, "rootfs", target))
		return err == nil
	})
	if vs := h.volumes(); len(vs) != 1 || vs[0].TargetPath != target {
		t.Fatalf("volumes %v; want v published at %s", vs, target)
	}
	out, err := exec.Command(runc, "state", "hider").Output()
	if err != nil {
		t.Fatal(err)
	}
	var st struct {
		Pid int `json:"pid"`
	}
	if err := json.Unmarshal(out, &st); err != nil {
		t.Fatal(err)
	}
	mounted := func() bool {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", st.Pid))
		if err != nil {
			t.Fatal(err)
		}
		return strings.Contains(string(b), " /data ")
	}
	if !mounted() {
		t.Fatal("the volume is not mounted in the container")
	}
	if _, err := h.api().Cleanup(context.Background(), &agentv1.CleanupRequest{ContainerId: "hider"}); err != nil {
		t.Fatalf("cleanup of the running container: %v", err)
	}
	if mounted() {
		t.Fatal("cleanup succeeded with the volume still mounted in the running container")
	}
	if err := exec.Command(runc, "delete", "--force", "hider").Run(); err != nil {
		t.Fatal(err)
	}
	h.assertClean(pool)
}
