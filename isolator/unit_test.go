package isolator

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/csiagent/csiagent/internal/retrypolicy"
	"github.com/csiagent/csiagent/proto/reclaimspace"
	statev1 "github.com/csiagent/csiagent/proto/state/v1"
)

// The TestUnit tests run the isolator on the fakes of fake_test.go: no
// root, no mounts, no plugin processes; they run as any user, under -race.

// world is one host in the model: a work dir, directories for
// containers' rootfs, the mount table and the plugins.
type world struct {
	t       *testing.T
	dir     string
	work    string
	table   *fakeTable
	plugins *nodePlugins
	bootID  string
	boots   int
	// isolators are the isolators made on the world, the last running.
	isolators []*Isolator
}

func newWorld(t *testing.T) *world {
	t.Helper()
	dir := t.TempDir()
	table := newFakeTable()
	return &world{t: t, dir: dir, work: filepath.Join(dir, "work"), table: table, plugins: newNodePlugins(table), bootID: "boot-1", boots: 1}
}

// newTestIsolator is New, for a test: once the test ends, the commit
// rounds still running end before its temporary directories are removed
// (a round may still make the work dir's journal).
// The removals an answer leaves (Config.Deferred) run on the calling
// goroutine unless cfg says otherwise: a crash point stops all of the
// isolator's work, and a test sees the work dir as the answer left it.
func newTestIsolator(t *testing.T, cfg Config) (*Isolator, error) {
	t.Helper()
	if cfg.Deferred == nil {
		cfg.Deferred = func(f func()) { f() }
	}
	iso, err := New(cfg)
	if err == nil {
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_ = iso.commit.Sync(ctx) // a test's failing fsyncs may keep failing
		})
	}
	return iso, err
}

// isolator starts an Isolator on the world (no Run); cfg's zero fields
// get the world's.
func (w *world) isolator(cfg Config) *Isolator {
	w.t.Helper()
	// The rounds of an earlier isolator (one that "crashed") end before
	// the next one starts, as a crashed process's end with it: they
	// would rename new records under its feet. What is visible is the
	// same either way (see atomicfile.ReadRecord).
	for _, old := range w.isolators {
		if err := old.commit.Sync(context.Background()); err != nil {
			w.t.Fatal(err)
		}
	}
	cfg.WorkDir, cfg.Plugins, cfg.BootID = w.work, w.plugins, w.bootID
	cfg.Mounts = &fakeMounter{t: w.table, ns: hostNS}
	iso, err := newTestIsolator(w.t, cfg)
	if err != nil {
		w.t.Fatal(err)
	}
	w.isolators = append(w.isolators, iso)
	return iso
}

// run starts an Isolator and its Run loop, and waits for its recovery;
// the loop ends with the test.
func (w *world) run(cfg Config) *Isolator {
	w.t.Helper()
	iso := w.isolator(cfg)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		iso.Run(ctx)
		close(done)
	}()
	w.t.Cleanup(func() {
		cancel()
		<-done
	})
	<-iso.Recovered()
	return iso
}

// reboot empties the mount tables and changes the boot id.
func (w *world) reboot() {
	w.boots++
	w.bootID = fmt.Sprintf("boot-%d", w.boots)
	w.table.boot()
}

// vol is one volume of a request.
type vol struct {
	plugin, id, path string
	ro               bool
}

// request is a Prepare of container id with vols, in a rootfs of its own
// (absolute paths) or its sandbox (relative ones).
func (w *world) request(id string, vols ...vol) *statev1.PrepareRequest {
	w.t.Helper()
	rootfs, sandbox := filepath.Join(w.dir, "rootfs-"+id), filepath.Join(w.dir, "sandbox-"+id)
	for _, d := range []string{rootfs, sandbox} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			w.t.Fatal(err)
		}
	}
	req := &statev1.PrepareRequest{ContainerId: id, Rootfs: rootfs, Sandbox: sandbox}
	for _, v := range vols {
		mode, access := statev1.Volume_RW, csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER
		if v.ro {
			mode = statev1.Volume_RO
		}
		req.Volumes = append(req.Volumes, &statev1.Volume{
			ContainerPath: v.path, Mode: mode,
			Source: &statev1.Volume_Source{Type: statev1.Volume_Source_CSI_VOLUME, CsiVolume: &statev1.CSIVolume{
				PluginName: v.plugin,
				StaticProvisioning: &statev1.StaticProvisioning{VolumeId: v.id, VolumeCapability: &csi.VolumeCapability{
					AccessMode: &csi.VolumeCapability_AccessMode{Mode: access},
					AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
				}},
			}},
		})
	}
	return req
}

// node is the fake node service of a plugin.
func (w *world) node(plugin string) *fakeNode { return w.plugins.nodes[plugin] }

// problems checks what must hold whenever no operation runs and every
// plugin is up, and returns what does not:
//   - every container is PREPARED, and each of its mounts is in the
//     mount table at its mount point (in its namespace), on top, by its
//     recorded id, showing its volume's filesystem;
//   - each volume's users are the containers whose requests name it; it
//     is PUBLISHED iff it has users, and a volume without users is
//     forgotten; its target (and staging, with STAGE_UNSTAGE) is mounted;
//   - nothing is mounted that no record claims;
//   - the node service was asked nothing a real plugin would refuse;
//   - a fresh Isolator loading the work dir finds the same containers
//     and volumes (the checkpoints on disk say what memory says).
func (w *world) problems(iso *Isolator) []string {
	w.t.Helper()
	var out []string
	bad := func(format string, args ...any) { out = append(out, fmt.Sprintf(format, args...)) }
	containers, volumes := iso.ListContainers(), iso.ListVolumes()
	claimed := map[uint64]bool{}
	named := map[volumeKey][]string{}
	w.table.mu.Lock()
	for _, c := range containers {
		if c.Phase != statev1.ContainerCheckpoint_PREPARED {
			bad("container %s is %s (%s)", c.ID, c.Phase, c.LastError)
		}
		ns := uint64(hostNS)
		iso.mu.Lock()
		req := iso.containers[c.ID].cp.GetRequest()
		if req.GetPid() != 0 {
			ns = iso.containers[c.ID].cp.GetMountNamespace()
		}
		iso.mu.Unlock()
		for _, v := range req.GetVolumes() {
			k := volumeKey{v.GetSource().GetCsiVolume().GetPluginName(), v.GetSource().GetCsiVolume().GetStaticProvisioning().GetVolumeId()}
			named[k] = append(named[k], c.ID)
		}
		if req.GetPid() != 0 && w.table.procs[int(req.GetPid())] != ns {
			// The container's process ended: its mounts went with its
			// namespace; the record waits for a Cleanup or Reconcile.
			continue
		}
		for _, m := range c.Mounts {
			claimed[m.GetMountId()] = true
			top := w.table.top(ns, m.GetMountPoint())
			switch {
			case top == nil:
				bad("container %s: nothing mounted at %s", c.ID, m.GetMountPoint())
			case top.id != m.GetMountId():
				bad("container %s: mount %d on top at %s, recorded %d", c.ID, top.id, m.GetMountPoint(), m.GetMountId())
			case top.dev != w.table.devs[m.GetVolumeId()]:
				bad("container %s: %s shows filesystem %d, not volume %s's", c.ID, m.GetMountPoint(), top.dev, m.GetVolumeId())
			case top.readonly != m.GetReadonly():
				bad("container %s: %s read-only %v, recorded %v", c.ID, m.GetMountPoint(), top.readonly, m.GetReadonly())
			}
		}
	}
	paths := map[string]bool{}
	for _, v := range volumes {
		k := volumeKey{v.Plugin, v.ID}
		want := slices.Sorted(slices.Values(named[k]))
		if !slices.Equal(v.Users, want) {
			bad("volume %s: users %v, container records name %v", k, v.Users, want)
		}
		if len(v.Users) == 0 || v.State != statev1.VolumeCheckpoint_PUBLISHED || v.LastError != "" {
			bad("volume %s: %s with users %v (%s)", k, v.State, v.Users, v.LastError)
		}
		if w.node(k.plugin).attach && w.table.attached[k.id] == "" {
			bad("volume %s: published but not attached", k)
		}
		mounted := []string{v.TargetPath}
		if w.node(k.plugin).stageUnstage {
			mounted = append(mounted, v.StagingPath)
		}
		for _, p := range mounted {
			paths[p] = true
			if top := w.table.top(hostNS, p); top == nil || top.dev != w.table.devs[k.id] {
				bad("volume %s: %s is not mounted", k, p)
			}
		}
		delete(named, k)
	}
	for k, ids := range named {
		bad("volume %s: named by %v but not tracked", k, ids)
	}
	for id := range w.table.attached {
		if !slices.ContainsFunc(volumes, func(v VolumeInfo) bool { return v.Plugin == "attach" && v.ID == id }) {
			bad("volume attach/%s is attached but not tracked", id)
		}
	}
	for _, m := range w.table.mounts {
		if m.path != "/" && !claimed[m.id] && !(m.ns == hostNS && paths[m.path]) {
			bad("mount %d at %s (namespace %d) claimed by no record", m.id, m.path, m.ns)
		}
	}
	w.table.mu.Unlock()
	for _, p := range []string{"loop", "plain", "attach"} {
		for _, v := range w.node(p).takeViolations() {
			bad("plugin %s: %s", p, v)
		}
	}
	fresh := w.isolator(Config{})
	if got := fresh.ListContainers(); !sameContainers(got, containers) {
		bad("the checkpoints on disk hold containers %v, memory %v", got, containers)
	}
	if got := fresh.ListVolumes(); !sameVolumes(got, volumes) {
		bad("the checkpoints on disk hold volumes %v, memory %v", got, volumes)
	}
	return out
}

func sameMounts(a, b []*statev1.ContainerMount) bool {
	return slices.EqualFunc(a, b, func(x, y *statev1.ContainerMount) bool { return proto.Equal(x, y) })
}

func sameContainers(a, b []ContainerInfo) bool {
	return slices.EqualFunc(a, b, func(x, y ContainerInfo) bool {
		return x.ID == y.ID && x.Phase == y.Phase && x.Rootfs == y.Rootfs && x.LastError == y.LastError && sameMounts(x.Mounts, y.Mounts)
	})
}

func sameVolumes(a, b []VolumeInfo) bool {
	return slices.EqualFunc(a, b, func(x, y VolumeInfo) bool {
		lx, ly := x.LastReclaim, y.LastReclaim
		x.LastReclaim, y.LastReclaim = nil, nil
		return reflect.DeepEqual(x, y) && proto.Equal(lx, ly)
	})
}

// check fails the test on any of w.problems.
func (w *world) check(iso *Isolator) {
	w.t.Helper()
	for _, p := range w.problems(iso) {
		w.t.Error(p)
	}
}

// checkEmpty checks that nothing is left: no container, no volume, no
// mount, no checkpoint, no directory under the plugins' mount roots.
func (w *world) checkEmpty(iso *Isolator) {
	w.t.Helper()
	w.check(iso)
	if c, v := iso.ListContainers(), iso.ListVolumes(); len(c)+len(v) > 0 {
		w.t.Errorf("left: containers %v, volumes %v", c, v)
	}
	w.table.mu.Lock()
	for _, m := range w.table.mounts {
		if m.path != "/" {
			w.t.Errorf("left mounted: %+v", *m)
		}
	}
	w.table.mu.Unlock()
	var left []string
	err := filepath.WalkDir(w.work, func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(w.work, p)
		if e.IsDir() && e.Name() == spareTrees {
			return fs.SkipDir // spare volume directories, empty (treePool)
		}
		if e.Name() == volumeStateFile || e.Name() == containerStateFile || strings.Count(rel, "/") >= 3 && strings.Contains(rel, "/mounts/") {
			left = append(left, rel)
		}
		return nil
	})
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		w.t.Fatal(err)
	}
	if len(left) > 0 {
		w.t.Errorf("left in the work dir: %v", left)
	}
}

// calls returns what plugin's node service was asked since the last call,
// without paths: "RPC volume" each.
func (w *world) calls(plugin string) []string {
	var out []string
	for _, c := range w.node(plugin).takeCalls() {
		f := strings.Fields(c)
		out = append(out, f[0]+" "+f[1])
	}
	return out
}

func containerOf(iso *Isolator, id string) *ContainerInfo {
	for _, c := range iso.ListContainers() {
		if c.ID == id {
			return &c
		}
	}
	return nil
}

func volumeOf(iso *Isolator, plugin, id string) *VolumeInfo {
	for _, v := range iso.ListVolumes() {
		if v.Plugin == plugin && v.ID == id {
			return &v
		}
	}
	return nil
}

// TestUnitPrepare: one container, one volume: staged, published, bound
// into the container at its path (by the recorded mount id), PREPARED on
// disk; cleaned up, nothing is left.
func TestUnitPrepare(t *testing.T) {
	w := newWorld(t)
	iso := w.run(Config{})
	ctx := context.Background()
	req := w.request("c1", vol{"loop", "vol-1", "/data", false})
	resp, err := iso.Prepare(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	ms := resp
	if len(ms) != 1 || ms[0].GetMountPoint() != filepath.Join(req.GetRootfs(), "data") || ms[0].GetContainerPath() != "/data" || ms[0].GetMountId() == 0 {
		t.Fatalf("mounts %v; want one at %s/data with its id", ms, req.GetRootfs())
	}
	v := volumeOf(iso, "loop", "vol-1")
	if got := w.calls("loop"); !slices.Equal(got, []string{"NodeStageVolume vol-1", "NodePublishVolume vol-1"}) {
		t.Errorf("node calls %v", got)
	}
	if v.State != statev1.VolumeCheckpoint_PUBLISHED || !slices.Equal(v.Users, []string{"c1"}) {
		t.Errorf("volume %v", v)
	}
	if ms[0].GetHostPath() != v.TargetPath {
		t.Errorf("bound from %s, the volume is published at %s", ms[0].GetHostPath(), v.TargetPath)
	}
	if c := containerOf(iso, "c1"); c.Phase != statev1.ContainerCheckpoint_PREPARED {
		t.Errorf("c1 is %v", c.Phase)
	}
	w.check(iso)

	w.cleanup(iso, "c1")
	if got := w.calls("loop"); !slices.Equal(got, []string{"NodeUnpublishVolume vol-1", "NodeUnstageVolume vol-1"}) {
		t.Errorf("node calls on cleanup %v", got)
	}
	w.checkEmpty(iso)
}

// TestUnitPrepareWithoutStage: a plugin without STAGE_UNSTAGE_VOLUME is
// only published (no staging path given, nothing mounted there), in a
// sandbox-relative path, read-only.
func TestUnitPrepareWithoutStage(t *testing.T) {
	w := newWorld(t)
	iso := w.run(Config{})
	ctx := context.Background()
	req := w.request("c1", vol{"plain", "vol-1", "data/in", true})
	resp, err := iso.Prepare(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if got := w.calls("plain"); !slices.Equal(got, []string{"NodePublishVolume vol-1"}) {
		t.Errorf("node calls %v", got)
	}
	m := resp[0]
	if m.GetMountPoint() != filepath.Join(req.GetSandbox(), "data/in") || !m.GetReadonly() {
		t.Errorf("mount %v; want read-only at %s/data/in", m, req.GetSandbox())
	}
	v := volumeOf(iso, "plain", "vol-1")
	if ok, _ := iso.mounts.IsMountPoint(v.StagingPath); ok {
		t.Errorf("staging path %s mounted for a plugin without STAGE_UNSTAGE", v.StagingPath)
	}
	w.check(iso)
	w.cleanup(iso, "c1")
	if got := w.calls("plain"); !slices.Equal(got, []string{"NodeUnpublishVolume vol-1"}) {
		t.Errorf("node calls on cleanup %v", got)
	}
	w.checkEmpty(iso)
}

// TestUnitRepeatedPrepare: the same request again answers the same
// mounts and asks the plugin nothing; another request for the same id is
// refused and changes nothing.
func TestUnitRepeatedPrepare(t *testing.T) {
	w := newWorld(t)
	iso := w.run(Config{})
	ctx := context.Background()
	req := w.request("c1", vol{"loop", "vol-1", "/data", false}, vol{"plain", "vol-2", "/data/sub", false})
	first, err := iso.Prepare(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	w.calls("loop")
	w.calls("plain")
	// The same set of volumes, listed in another order.
	again := proto.Clone(req).(*statev1.PrepareRequest)
	slices.Reverse(again.Volumes)
	second, err := iso.Prepare(ctx, again)
	if err != nil {
		t.Fatal(err)
	}
	if !sameMounts(first, second) {
		t.Errorf("repeated Prepare answered %v, first %v", second, first)
	}
	if got := append(w.calls("loop"), w.calls("plain")...); len(got) > 0 {
		t.Errorf("repeated Prepare asked the plugins %v", got)
	}
	other := w.request("c1", vol{"loop", "vol-1", "/elsewhere", false})
	if _, err := iso.Prepare(ctx, other); !errors.Is(err, ErrPrecondition) {
		t.Errorf("Prepare of c1 with other volumes: %v; want ErrPrecondition", err)
	}
	if c := containerOf(iso, "c1"); c.Phase != statev1.ContainerCheckpoint_PREPARED || !sameMounts(c.Mounts, first) {
		t.Errorf("after the refused Prepare c1 is %v", c)
	}
	w.check(iso)
	// The nested mount: /data/sub is on the volume at /data.
	ms := first
	if len(ms) != 2 || ms[1].GetParentMountId() != ms[0].GetMountId() {
		t.Errorf("mounts %v: want /data/sub on the mount at /data", ms)
	}
	w.cleanup(iso, "c1")
	w.checkEmpty(iso)
}

// TestUnitSharedVolume: two containers share a volume: both are its
// users; the first one's cleanup unbinds only its mount and keeps the
// volume published for the other; a repeated cleanup and one of an
// unknown id are done at once; the last one's cleanup unpublishes and
// unstages.
func TestUnitSharedVolume(t *testing.T) {
	w := newWorld(t)
	iso := w.run(Config{})
	ctx := context.Background()
	r1 := w.prepare(iso, w.request("c1", vol{"loop", "vol-1", "/data", false}))
	r2 := w.prepare(iso, w.request("c2", vol{"loop", "vol-1", "/shared", false}))
	if got := w.calls("loop"); !slices.Equal(got, []string{"NodeStageVolume vol-1", "NodePublishVolume vol-1"}) {
		t.Errorf("node calls for two users %v; want one stage and one publish", got)
	}
	if v := volumeOf(iso, "loop", "vol-1"); !slices.Equal(v.Users, []string{"c1", "c2"}) {
		t.Errorf("users %v", v.Users)
	}
	w.check(iso)

	w.cleanup(iso, "c1")
	if got := w.calls("loop"); len(got) > 0 {
		t.Errorf("cleanup of a user that is not the last asked %v", got)
	}
	if ok, _ := iso.mounts.IsMountPoint(r1[0].GetMountPoint()); ok {
		t.Error("c1's mount is still there")
	}
	if ok, _ := iso.mounts.IsMountPoint(r2[0].GetMountPoint()); !ok {
		t.Error("c2's mount went with c1's cleanup")
	}
	if v := volumeOf(iso, "loop", "vol-1"); !slices.Equal(v.Users, []string{"c2"}) || v.State != statev1.VolumeCheckpoint_PUBLISHED {
		t.Errorf("after c1's cleanup: %v", v)
	}
	w.check(iso)
	for _, id := range []string{"c1", "never-prepared"} {
		if err := iso.Cleanup(ctx, id, false); err != nil {
			t.Errorf("Cleanup(%s) of a clean container: %v", id, err)
		}
	}
	if got := w.calls("loop"); len(got) > 0 {
		t.Errorf("cleanups of clean containers asked %v", got)
	}
	w.cleanup(iso, "c2")
	if got := w.calls("loop"); !slices.Equal(got, []string{"NodeUnpublishVolume vol-1", "NodeUnstageVolume vol-1"}) {
		t.Errorf("last user's cleanup asked %v", got)
	}
	w.checkEmpty(iso)
}

// TestUnitFailedPrepareIsRolledBack: a publish the plugin refuses fails
// the Prepare and undoes all of it, the other volume's staging and
// publishing included; a volume another container uses stays published.
func TestUnitFailedPrepareIsRolledBack(t *testing.T) {
	w := newWorld(t)
	iso := w.run(Config{})
	ctx := context.Background()
	w.prepare(iso, w.request("c0", vol{"loop", "vol-0", "/data", false}))
	w.node("plain").setFail(func(rpc, id string) error {
		if rpc == "NodePublishVolume" {
			return status.Error(codes.Internal, "refused")
		}
		return nil
	})
	req := w.request("c1", vol{"loop", "vol-0", "/a", false}, vol{"loop", "vol-1", "/b", false}, vol{"plain", "vol-2", "/c", false})
	if _, err := iso.Prepare(ctx, req); err == nil {
		t.Fatal("Prepare succeeded with a publish refused")
	}
	if c := containerOf(iso, "c1"); c != nil {
		t.Errorf("c1 left %v", c)
	}
	w.check(iso)
	if v := iso.ListVolumes(); len(v) != 1 || v[0].ID != "vol-0" {
		t.Errorf("volumes after the rollback: %v; want vol-0 only", v)
	}
	for _, p := range []string{"a", "b", "c"} {
		if ok, _ := iso.mounts.IsMountPoint(filepath.Join(req.GetRootfs(), p)); ok {
			t.Errorf("/%s still mounted in c1's rootfs", p)
		}
	}
	w.cleanup(iso, "c0")
	w.checkEmpty(iso)
}

// TestUnitManyContainers: containers prepared and cleaned up all at once,
// many on few volumes (each request two of three volumes, on both
// plugins), some twice, with resync passes running all along; then each
// volume's users are exactly the prepared containers naming it, and
// cleaning all up leaves nothing.
func TestUnitManyContainers(t *testing.T) {
	w := newWorld(t)
	// Resync passes run all the time, between and during operations.
	iso := w.run(Config{ResyncInterval: time.Millisecond})
	ctx := context.Background()
	vols := []vol{{"loop", "vol-a", "/a", false}, {"loop", "vol-b", "/b", false}, {"plain", "vol-c", "/c", false}}
	const n = 24
	reqs := make([]*statev1.PrepareRequest, n)
	for i := range n {
		reqs[i] = w.request(fmt.Sprintf("c%d", i), vols[i%3], vols[(i+1)%3])
	}
	errs := make(chan error, 3*n)
	round := func(f func(i int) error) {
		for i := range n {
			go func() { errs <- f(i) }()
		}
		for range n {
			if err := <-errs; err != nil {
				t.Error(err)
			}
		}
	}
	// Every container prepared, every third cleaned up at once with its
	// prepare (either order), then prepared again with a cleanup of
	// another container running.
	round(func(i int) error {
		_, err := iso.Prepare(ctx, reqs[i])
		if i%3 == 0 {
			if err := iso.Cleanup(ctx, reqs[i].GetContainerId(), false); err != nil {
				return err
			}
		}
		return err
	})
	w.check(iso)
	round(func(i int) error {
		if i%3 == 0 {
			_, err := iso.Prepare(ctx, reqs[i])
			return err
		}
		if i%3 == 1 {
			return iso.Cleanup(ctx, reqs[i].GetContainerId(), false)
		}
		return nil
	})
	w.check(iso)
	var prepared []string
	for i := range n {
		if i%3 != 1 {
			prepared = append(prepared, reqs[i].GetContainerId())
		}
	}
	sort.Strings(prepared)
	var got []string
	for _, c := range iso.ListContainers() {
		got = append(got, c.ID)
	}
	if !slices.Equal(got, prepared) {
		t.Errorf("containers %v; want %v", got, prepared)
	}
	round(func(i int) error { return iso.Cleanup(ctx, reqs[i].GetContainerId(), false) })
	w.checkEmpty(iso)
}

// TestUnitRecoveryWithPluginDown: a restart finds an interrupted cleanup
// whose plugin is down: recovery waits for the plugin once (the RPC
// timeout), not once per container or volume, keeps the state, and says
// what is pending; once the plugin is back, the cleanup finishes.
func TestUnitRecoveryWithPluginDown(t *testing.T) {
	w := newWorld(t)
	iso := w.isolator(Config{})
	ctx := context.Background()
	for _, id := range []string{"c1", "c2"} {
		w.prepare(iso, w.request(id, vol{"loop", "vol-" + id, "/data", false}))
	}
	// Both cleanups stop at their first checkpoint (CLEANING).
	crashing := w.isolator(Config{CrashPoint: func(point string) {
		if point == "checkpoint container CLEANING" {
			panic(errCrash)
		}
	}})
	for _, id := range []string{"c1", "c2"} {
		if !crashed(func() { crashing.Cleanup(ctx, id, false) }) { //nolint:errcheck // it crashes
			t.Fatalf("cleanup of %s did not reach its first checkpoint", id)
		}
	}
	w.plugins.setDown("loop", true)
	const timeout = 500 * time.Millisecond
	start := time.Now()
	iso = w.run(Config{RPCTimeout: timeout})
	if took := time.Since(start); took > 2*timeout {
		t.Errorf("recovery with the plugin down took %v; the RPC timeout is %v", took, timeout)
	}
	for _, id := range []string{"c1", "c2"} {
		if c := containerOf(iso, id); c.Phase != statev1.ContainerCheckpoint_CLEANING {
			t.Errorf("%s after recovery with its plugin down: %v", id, c)
		}
	}
	if p := iso.Pending(); !strings.Contains(p, "2 containers") || !strings.Contains(p, "loop") {
		t.Errorf("Pending() = %q; want the 2 containers and plugin loop", p)
	}
	w.plugins.setDown("loop", false)
	resp := iso.Reconcile(ctx, nil, "")
	if len(resp.Failed) > 0 || len(resp.CleanedUp) != 2 {
		t.Errorf("Reconcile once the plugin is back: %v", resp)
	}
	if p := iso.Pending(); p != "" {
		t.Errorf("Pending() = %q after the cleanups", p)
	}
	w.checkEmpty(iso)
}

// errCrash stops an isolator at a crash point (see crashed).
var errCrash = errors.New("crash")

// crashed runs f and reports whether it stopped at a crash point (its
// CrashPoint panicked with errCrash). Deferred functions run on the way
// out, as the kernel closes a dead process's descriptors (a detached
// clone is dropped); nothing else of the isolator runs again.
func crashed(f func()) (yes bool) {
	defer func() {
		if r := recover(); r != nil {
			if r != errCrash {
				panic(r)
			}
			yes = true
		}
	}()
	f()
	return false
}

// crashStep is one step of the crash tests' script.
type crashStep struct {
	id      string
	prepare bool
}

// crashScript: c1 and c2 share vol-1 (a plugin with STAGE_UNSTAGE), c3
// has vol-2 (one without) in its sandbox, c4 runs in its own mount
// namespace (pid 4242) with vol-1, c5 has vol-3 of a plugin that attaches
// (ControllerPublishVolume); all are prepared, then cleaned up in another
// order. Each Prepare names one volume, so that each runs on the
// calling goroutine only and a crash stops all of the isolator's work.
var crashScript = []crashStep{
	{"c1", true}, {"c2", true}, {"c3", true}, {"c4", true}, {"c5", true},
	{"c1", false}, {"c4", false}, {"c5", false}, {"c3", false}, {"c2", false},
}

const crashPid = 4242

// crashWorld is a world with crashScript's requests and c4's process.
func crashWorld(t *testing.T) (*world, map[string]*statev1.PrepareRequest) {
	w := newWorld(t)
	w.table.startProcess(crashPid, 77)
	reqs := map[string]*statev1.PrepareRequest{
		"c1": w.request("c1", vol{"loop", "vol-1", "/data", false}),
		"c2": w.request("c2", vol{"loop", "vol-1", "/data", false}),
		"c3": w.request("c3", vol{"plain", "vol-2", "data", false}),
		"c4": w.request("c4", vol{"loop", "vol-1", "/mnt/data", true}),
		"c5": w.request("c5", vol{"attach", "vol-3", "/data", false}),
	}
	reqs["c4"].Pid = crashPid
	return w, reqs
}

func (s crashStep) do(ctx context.Context, iso *Isolator, reqs map[string]*statev1.PrepareRequest) error {
	if s.prepare {
		_, err := iso.Prepare(ctx, reqs[s.id])
		return err
	}
	return iso.Cleanup(ctx, s.id, false)
}

// crashPoint is a point CrashPoint was called at: its name and the step
// of the script it came in.
type crashPoint struct {
	step int
	name string
}

// TestUnitCrashAtEveryPoint stops the isolator at every crash point
// (every checkpoint write, node call, bind and unbind) of crashScript,
// found by running the script once, and starts a new one on what is left
// (the same mounts; or, rebooted, none and a new boot id). After its
// recovery: the containers whose Prepare returned are PREPARED with their
// mounts (restored after a reboot), one whose Prepare was interrupted is
// PREPARED if its PREPARED checkpoint was written and gone otherwise, one
// whose Cleanup started is gone, and world.problems finds nothing (users,
// published iff used, no stray mount, the checkpoints on disk). Then an
// interrupted Prepare, asked again, succeeds, and a Reconcile with no
// live container leaves nothing behind.
func TestUnitCrashAtEveryPoint(t *testing.T) {
	ctx := context.Background()
	var points []crashPoint
	{
		w, reqs := crashWorld(t)
		step := 0
		iso := w.isolator(Config{CrashPoint: func(p string) { points = append(points, crashPoint{step, p}) }})
		for step = range crashScript {
			if err := crashScript[step].do(ctx, iso, reqs); err != nil {
				t.Fatalf("step %d %v: %v", step, crashScript[step], err)
			}
		}
		w.checkEmpty(iso)
	}
	names := map[string]bool{}
	for _, p := range points {
		names[p.name] = true
	}
	for _, want := range []string{"checkpoint container PREPARING", "checkpoint volume NODE_STAGE", "rpc NodeStageVolume", "rpc NodePublishVolume",
		"checkpoint volume PUBLISHED", "bind", "checkpoint container PREPARED", "checkpoint container CLEANING", "unbind",
		"checkpoint volume NODE_UNPUBLISH", "rpc NodeUnpublishVolume", "rpc NodeUnstageVolume", "checkpoint volume removed", "checkpoint container removed",
		"checkpoint volume CONTROLLER_PUBLISH", "rpc ControllerPublishVolume", "rpc ControllerUnpublishVolume"} {
		if !names[want] {
			t.Errorf("the script never reaches crash point %q (points: %v)", want, points)
		}
	}
	t.Logf("%d crash points", len(points))
	for i, p := range points {
		for _, reboot := range []bool{false, true} {
			name := fmt.Sprintf("%02d/%s/%s/%s", i, crashScript[p.step].id, map[bool]string{true: "prepare", false: "cleanup"}[crashScript[p.step].prepare], p.name)
			if reboot {
				name += "/reboot"
			}
			t.Run(name, func(t *testing.T) {
				t.Parallel() // each in a world of its own
				crashAt(t, points, i, reboot)
			})
		}
	}
}

// crashAt runs crashScript until crash point i, then recovers and checks
// (see TestUnitCrashAtEveryPoint).
func crashAt(t *testing.T, points []crashPoint, i int, reboot bool) {
	ctx := context.Background()
	w, reqs := crashWorld(t)
	n := 0
	iso := w.isolator(Config{CrashPoint: func(string) {
		if n++; n == i+1 {
			panic(errCrash)
		}
	}})
	at := points[i].step
	for k := 0; k <= at; k++ {
		var err error
		if crashed(func() { err = crashScript[k].do(ctx, iso, reqs) }) {
			if k != at {
				t.Fatalf("crashed in step %d, recorded in step %d", k, at)
			}
			break
		}
		if err != nil || k == at {
			t.Fatalf("step %d %v: %v, before the crash", k, crashScript[k], err)
		}
	}
	// What the script had done: prepared containers, cleaned up ones.
	prepared := map[string]bool{}
	for _, s := range crashScript[:at] {
		prepared[s.id] = s.prepare
	}
	s := crashScript[at]
	prepared[s.id] = false
	if s.prepare {
		for _, p := range points[:i+1] {
			if p.step == at && p.name == "checkpoint container PREPARED" {
				prepared[s.id] = true
			}
		}
	}
	if reboot {
		w.reboot()
	}
	iso = w.run(Config{})
	for _, id := range []string{"c1", "c2", "c3", "c4", "c5"} {
		// A container prepared into a process's mount namespace is gone
		// after a reboot (the namespace went): cleaned up at recovery.
		want := prepared[id] && !(reboot && reqs[id].GetPid() != 0)
		if c := containerOf(iso, id); want != (c != nil) {
			t.Errorf("%s: prepared %v, after recovery %v", id, prepared[id], c)
		}
	}
	w.check(iso)
	if p := iso.Pending(); p != "" {
		t.Errorf("Pending() after recovery: %s", p)
	}
	if s.prepare && !(reboot && reqs[s.id].GetPid() != 0) {
		// The caller, never answered, asks again.
		if err := s.do(ctx, iso, reqs); err != nil {
			t.Errorf("Prepare of %s again after the crash: %v", s.id, err)
		}
		w.check(iso)
	}
	// The containers end: a reconcile with none live cleans them up (one
	// still running would be refused).
	w.table.endAll()
	if resp := iso.Reconcile(ctx, nil, ""); len(resp.Failed) > 0 {
		t.Errorf("Reconcile after recovery: %v", resp.Failed)
	}
	w.checkEmpty(iso)
}

// TestUnitMountIDsOfAnotherBoot: after a reboot the kernel hands out the
// same mount ids again. c1 (vol-1, shared with c2, and vol-x, its own)
// had its cleanup interrupted before the reboot, and at recovery vol-x's
// directory holds a stray file, so its teardown fails and c1 stays
// CLEANING with the mounts it recorded; c2's mount, restored by
// recovery, gets the id c1 recorded for its vol-1 mount. Once the file is
// gone, c1's cleanup must neither touch c2's mount nor refuse for ever:
// recovery forgot the other boot's ids.
func TestUnitMountIDsOfAnotherBoot(t *testing.T) {
	w := newWorld(t)
	iso := w.isolator(Config{})
	ctx := context.Background()
	r1 := w.request("c1", vol{"loop", "vol-1", "/data", false}, vol{"loop", "vol-x", "/x", false})
	r2 := w.request("c2", vol{"loop", "vol-1", "/data", false})
	resp1, err := iso.Prepare(ctx, r1)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := iso.Prepare(ctx, r2); err != nil {
		t.Fatal(err)
	}
	stray := filepath.Join(volumeOf(iso, "loop", "vol-x").TargetPath, "stray")
	crashing := w.isolator(Config{CrashPoint: func(point string) {
		if point == "checkpoint container CLEANING" {
			panic(errCrash)
		}
	}})
	if !crashed(func() { crashing.Cleanup(ctx, "c1", false) }) { //nolint:errcheck // it crashes
		t.Fatal("c1's cleanup did not reach its first checkpoint")
	}
	w.reboot()
	if err := os.WriteFile(stray, []byte("data"), 0o600); err != nil {
		t.Fatal(err)
	}
	// Recovery publishes vol-1 again (staging, target), then restores
	// c2's mount: with the id c1 recorded.
	var old uint64
	for _, m := range resp1 {
		if m.GetVolumeId() == "vol-1" {
			old = m.GetMountId()
		}
	}
	w.table.mu.Lock()
	w.table.nextID = old - 3
	w.table.mu.Unlock()
	iso = w.run(Config{})
	if c := containerOf(iso, "c1"); c.Phase != statev1.ContainerCheckpoint_CLEANING {
		t.Fatalf("c1 after recovery with vol-x's directory not empty: %v", c)
	}
	c2 := containerOf(iso, "c2")
	if id := c2.Mounts[0].GetMountId(); id != old {
		t.Fatalf("c2's mount got id %d after the reboot, want c1's old %d", id, old)
	}
	if err := os.Remove(stray); err != nil {
		t.Fatal(err)
	}
	if err := iso.Cleanup(ctx, "c1", false); err != nil {
		t.Fatalf("c1's cleanup after the reboot: %v", err)
	}
	w.check(iso)
	if c := containerOf(iso, "c2"); !sameMounts(c.Mounts, c2.Mounts) {
		t.Errorf("c2 after c1's cleanup: %v", c)
	}
	w.cleanup(iso, "c2")
	w.checkEmpty(iso)
}

// loseRecordAndReboot removes a container's record, as a power cut
// before its first durable write can, then reboots.
func (w *world) loseRecordAndReboot(iso *Isolator, id string) {
	w.t.Helper()
	w.lose(iso, filepath.Join(iso.containersRoot(), id))
	w.reboot()
}

// lose removes a record file or directory from the work dir as a power
// cut can: from the record files and from the journal (a checkpoint
// first leaves the files alone holding every record).
func (w *world) lose(iso *Isolator, path string) {
	w.t.Helper()
	if err := iso.commit.Checkpoint(context.Background()); err != nil {
		w.t.Fatal(err)
	}
	if err := os.RemoveAll(path); err != nil {
		w.t.Fatal(err)
	}
}

// TestUnitLostContainerRecord: a container record lost with a power cut
// (removed here, then a reboot): recovery drops the user no record backs,
// and the volume, left without users, is torn down through the plugin and
// forgotten; the other volume is published again for its user.
func TestUnitLostContainerRecord(t *testing.T) {
	w := newWorld(t)
	iso := w.isolator(Config{})
	for _, id := range []string{"c1", "c2"} {
		w.prepare(iso, w.request(id, vol{"loop", "vol-" + id, "/data", false}))
	}
	w.loseRecordAndReboot(iso, "c1")
	w.calls("loop")
	iso = w.run(Config{})
	if v := volumeOf(iso, "loop", "vol-c1"); v != nil {
		t.Errorf("the volume of the lost record is kept: %v", v)
	}
	// vol-c1, without users, is torn down through the plugin even though
	// the reboot unmounted it (the plugin may hold node state that
	// outlives a reboot); vol-c2 is published again.
	got := w.calls("loop")
	want := []string{"NodeUnpublishVolume vol-c1", "NodeUnstageVolume vol-c1", "NodeStageVolume vol-c2", "NodePublishVolume vol-c2"}
	if !slices.Equal(slices.Sorted(slices.Values(got)), slices.Sorted(slices.Values(want))) ||
		slices.Index(got, "NodeUnpublishVolume vol-c1") > slices.Index(got, "NodeUnstageVolume vol-c1") ||
		slices.Index(got, "NodeStageVolume vol-c2") > slices.Index(got, "NodePublishVolume vol-c2") {
		t.Errorf("recovery asked %v; want %v, each volume's calls in that order", got, want)
	}
	w.check(iso)
	w.cleanup(iso, "c2")
	w.checkEmpty(iso)
}

// TestUnitRebootWithPluginDown: after a reboot a volume that recovery
// could not tear down (its plugin down) is not taken for published: its
// mounts went with the reboot. A Prepare while the plugin is still down
// fails; once it is back, a Prepare stages and publishes the volume again
// and the container sees it (before: the Prepare succeeded with the plugin
// down, binding the agent's empty target directory into the container).
func TestUnitRebootWithPluginDown(t *testing.T) {
	w := newWorld(t)
	iso := w.isolator(Config{})
	w.prepare(iso, w.request("c1", vol{"loop", "vol-1", "/data", false}))
	w.loseRecordAndReboot(iso, "c1")
	w.calls("loop")
	w.plugins.setDown("loop", true)
	iso = w.run(Config{RPCTimeout: 200 * time.Millisecond, ResyncInterval: time.Hour})
	v := volumeOf(iso, "loop", "vol-1")
	if v == nil || v.State == statev1.VolumeCheckpoint_PUBLISHED || v.LastError == "" {
		t.Fatalf("after recovery with the plugin down: %v; want the volume kept, not PUBLISHED, with the error", v)
	}
	if _, err := iso.Prepare(context.Background(), w.request("c2", vol{"loop", "vol-1", "/data", false})); !errors.Is(err, ErrUnavailable) {
		t.Errorf("Prepare with the plugin down: %v; want Unavailable", err)
	}
	// The failed prepare's rollback waits for the plugin too (c2 stays
	// CLEANING until its cleanup is retried).
	w.plugins.setDown("loop", false)
	w.cleanup(iso, "c2")
	w.calls("loop")
	w.prepare(iso, w.request("c3", vol{"loop", "vol-1", "/data", false}))
	if got, want := w.calls("loop"), []string{"NodeStageVolume vol-1", "NodePublishVolume vol-1"}; !slices.Equal(got, want) {
		t.Errorf("Prepare once the plugin is back asked %v; want %v", got, want)
	}
	w.check(iso)
	w.cleanup(iso, "c3")
	w.checkEmpty(iso)
}

// TestUnitRebootWithPluginDownRestoresMountsLater: a prepared container's
// mount that recovery could not restore after a reboot (its volume's
// plugin down) is restored by the first pass after the plugin is back,
// not only by the next restart.
func TestUnitRebootWithPluginDownRestoresMountsLater(t *testing.T) {
	w := newWorld(t)
	w.prepare(w.isolator(Config{}), w.request("c1", vol{"loop", "vol-1", "/data", false}))
	w.reboot()
	w.plugins.setDown("loop", true)
	iso := w.run(Config{RPCTimeout: 200 * time.Millisecond, ResyncInterval: time.Hour})
	if len(w.problems(iso)) == 0 {
		t.Fatal("recovery restored c1's mount with its plugin down")
	}
	w.plugins.setDown("loop", false)
	iso.resync(context.Background(), false)
	w.check(iso)
	w.cleanup(iso, "c1")
	w.checkEmpty(iso)
}

// TestUnitLaterPassesDoNotWait: a resync pass retrying a mount recovery
// could not restore does not wait for a volume another operation holds
// (it retries at the next pass), and a mount restored once is not
// restored again by the passes: a container that removes it (or turns its
// mount point into a symlink, which the host's check follows) gets no
// mount stacked per pass.
func TestUnitLaterPassesDoNotWait(t *testing.T) {
	w := newWorld(t)
	w.prepare(w.isolator(Config{}), w.request("c1", vol{"loop", "vol-1", "/data", false}, vol{"plain", "vol-2", "/more", false}))
	w.reboot()
	w.plugins.setDown("plain", true)
	iso := w.run(Config{RPCTimeout: 200 * time.Millisecond, ResyncInterval: time.Hour})
	c := containerOf(iso, "c1")
	data, more := c.Mounts[0].GetMountPoint(), c.Mounts[1].GetMountPoint()
	if ok, _ := iso.mounts.IsMountPoint(data); !ok {
		t.Fatalf("recovery did not restore %s (its plugin is up)", data)
	}
	w.plugins.setDown("plain", false)
	unlock, ok := iso.volumeLocks.TryLock(volumeKey{"plain", "vol-2"}.String())
	if !ok {
		t.Fatal("vol-2 is locked")
	}
	done := make(chan struct{})
	go func() {
		iso.resync(context.Background(), false)
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("a resync pass waits for a volume another operation holds")
	}
	unlock()
	w.unmountBehindOurBack(data)
	for range 3 {
		iso.resync(context.Background(), false)
	}
	if ok, _ := iso.mounts.IsMountPoint(data); ok {
		t.Errorf("the passes restored %s again, which recovery had restored once", data)
	}
	if ok, _ := iso.mounts.IsMountPoint(more); !ok {
		t.Errorf("%s, which recovery could not restore, is not restored by a later pass", more)
	}
}

// TestUnitCleanupCutByReboot: the last user's cleanup was cut by a power
// cut; after the reboot recovery finishes it and tears its volume down
// through the plugin, like a volume whose user's record was lost.
func TestUnitCleanupCutByReboot(t *testing.T) {
	w := newWorld(t)
	w.prepare(w.isolator(Config{}), w.request("c1", vol{"loop", "vol-1", "/data", false}))
	crashing := w.isolator(Config{CrashPoint: func(point string) {
		if point == "checkpoint container CLEANING" {
			panic(errCrash)
		}
	}})
	if !crashed(func() { _ = crashing.Cleanup(context.Background(), "c1", false) }) {
		t.Fatal("the cleanup did not reach its crash point")
	}
	w.reboot()
	w.calls("loop")
	iso := w.run(Config{})
	if got, want := w.calls("loop"), []string{"NodeUnpublishVolume vol-1", "NodeUnstageVolume vol-1"}; !slices.Equal(got, want) {
		t.Errorf("recovery asked %v; want %v", got, want)
	}
	w.checkEmpty(iso)
}

// TestUnitPluginNoLongerConfigured: after a reboot, volumes whose plugin
// is not configured (its file removed, or not valid when the agent
// started) are kept, with or without users, and named as pending: the
// agent cannot tell a plugin removed for good from one whose config is
// being rewritten, and forgetting would leave the plugin's node state
// behind for ever. Once the config is back, the volume without users is
// torn down through the plugin and the other published again.
func TestUnitPluginNoLongerConfigured(t *testing.T) {
	w := newWorld(t)
	iso := w.isolator(Config{})
	w.prepare(iso, w.request("c1", vol{"loop", "vol-1", "/data", false}))
	w.prepare(iso, w.request("c2", vol{"loop", "vol-2", "/data", false}))
	w.loseRecordAndReboot(iso, "c1")
	loop := w.plugins.nodes["loop"]
	delete(w.plugins.nodes, "loop")
	iso = w.run(Config{})
	for _, id := range []string{"vol-1", "vol-2"} {
		if v := volumeOf(iso, "loop", id); v == nil || v.State == statev1.VolumeCheckpoint_PUBLISHED {
			t.Errorf("%s with its plugin not configured: %v; want it kept, not PUBLISHED", id, v)
		}
	}
	if p := iso.Pending(); !strings.Contains(p, "2 volumes") || !strings.Contains(p, "loop") {
		t.Errorf("Pending() = %q; want both volumes and their plugin named", p)
	}
	w.plugins.nodes["loop"] = loop
	w.calls("loop")
	iso = w.run(Config{})
	got := w.calls("loop")
	for _, call := range []string{"NodeUnpublishVolume vol-1", "NodeUnstageVolume vol-1", "NodeStageVolume vol-2", "NodePublishVolume vol-2"} {
		if !slices.Contains(got, call) {
			t.Errorf("once the plugin is configured again, recovery asked %v; want %s among them", got, call)
		}
	}
	w.check(iso)
	w.cleanup(iso, "c2")
	w.checkEmpty(iso)
}

// TestUnitLostVolumeRecordRebuiltOnceConfigured: a volume record lost with
// a power cut is rebuilt from the container record that names it; when its
// plugin is not configured at recovery (a config being rewritten), the
// rebuild waits for a later pass with the config back, and the container
// gets its mount. (Before, the rebuild ran once, while loading, before any
// config was read, and was never retried: the volume stayed untracked.)
func TestUnitLostVolumeRecordRebuiltOnceConfigured(t *testing.T) {
	w := newWorld(t)
	iso := w.isolator(Config{})
	w.prepare(iso, w.request("c1", vol{"loop", "vol-1", "/data", false}))
	w.lose(iso, filepath.Join(iso.cfg.WorkDir, "csi", "loop", "default", "volumes", "vol-1"))
	w.reboot()
	loop := w.plugins.nodes["loop"]
	delete(w.plugins.nodes, "loop")
	iso = w.isolator(Config{})
	ctx := context.Background()
	iso.resync(ctx, true)
	if v := volumeOf(iso, "loop", "vol-1"); v != nil {
		t.Fatalf("vol-1 rebuilt with its plugin not configured: %v", v)
	}
	w.plugins.nodes["loop"] = loop
	iso.resync(ctx, false)
	if v := volumeOf(iso, "loop", "vol-1"); v == nil || !slices.Equal(v.Users, []string{"c1"}) {
		t.Fatalf("vol-1 after a pass with its plugin configured again: %v; want it rebuilt, used by c1", v)
	}
	iso.resync(ctx, false) // converges the rebuilt volume
	w.check(iso)
	w.cleanup(iso, "c1")
	w.checkEmpty(iso)
}

// TestUnitContainerInItsOwnNamespace: a container with a pid gets its
// mount in its own mount namespace (not the host's), resolved in its
// rootfs; once its process has ended, the mount has gone with the
// namespace and its cleanup releases the volume.
func TestUnitContainerInItsOwnNamespace(t *testing.T) {
	w := newWorld(t)
	iso := w.run(Config{})
	ctx := context.Background()
	w.table.startProcess(crashPid, 77)
	req := w.request("c1", vol{"loop", "vol-1", "/data", false})
	req.Pid = crashPid
	resp, err := iso.Prepare(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	m := resp[0]
	if m.GetMountNamespace() != 77 || m.GetMountPoint() != filepath.Join(req.GetRootfs(), "data") {
		t.Errorf("mount %v; want it in namespace 77 at %s/data", m, req.GetRootfs())
	}
	if ok, _ := iso.mounts.IsMountPoint(m.GetMountPoint()); ok {
		t.Errorf("%s mounted in the host's namespace", m.GetMountPoint())
	}
	w.check(iso)
	w.table.endProcess(crashPid)
	if err := iso.Cleanup(ctx, "c1", false); err != nil {
		t.Fatalf("cleanup of a container whose process ended: %v", err)
	}
	if got := w.calls("loop"); !slices.Equal(got, []string{"NodeStageVolume vol-1", "NodePublishVolume vol-1", "NodeUnpublishVolume vol-1", "NodeUnstageVolume vol-1"}) {
		t.Errorf("node calls %v", got)
	}
	w.checkEmpty(iso)
}

// TestUnitFailedCallLeavesTransitionalState: a plugin that breaks at a
// node call (answering Internal to it and to every call after) fails the
// Prepare or Cleanup and its rollback: the container stays CLEANING and
// the volume in the transitional state of the call that failed, both
// with the error, and Pending says so. A restart (or a reboot) with the
// plugin healed finishes the work: nothing is left.
func TestUnitFailedCallLeavesTransitionalState(t *testing.T) {
	for _, tc := range []struct {
		plugin, rpc string
		prepare     bool
		state       statev1.VolumeCheckpoint_State // after the failure
	}{
		// A failed prepare's rollback fails at its first call, unpublish.
		{"loop", "NodeStageVolume", true, statev1.VolumeCheckpoint_NODE_UNPUBLISH},
		{"loop", "NodePublishVolume", true, statev1.VolumeCheckpoint_NODE_UNPUBLISH},
		{"plain", "NodePublishVolume", true, statev1.VolumeCheckpoint_NODE_UNPUBLISH},
		{"loop", "NodeUnpublishVolume", false, statev1.VolumeCheckpoint_NODE_UNPUBLISH},
		{"loop", "NodeUnstageVolume", false, statev1.VolumeCheckpoint_NODE_UNSTAGE},
		{"plain", "NodeUnpublishVolume", false, statev1.VolumeCheckpoint_NODE_UNPUBLISH},
		{"attach", "ControllerPublishVolume", true, statev1.VolumeCheckpoint_NODE_UNPUBLISH},
		{"attach", "NodeStageVolume", true, statev1.VolumeCheckpoint_NODE_UNPUBLISH},
		{"attach", "ControllerUnpublishVolume", false, statev1.VolumeCheckpoint_CONTROLLER_UNPUBLISH},
	} {
		for _, reboot := range []bool{false, true} {
			name := fmt.Sprintf("%s/%s/reboot=%v", tc.plugin, tc.rpc, reboot)
			t.Run(name, func(t *testing.T) {
				w := newWorld(t)
				iso := w.isolator(Config{})
				ctx := context.Background()
				req := w.request("c1", vol{tc.plugin, "vol-1", "/data", false})
				if !tc.prepare {
					if _, err := iso.Prepare(ctx, req); err != nil {
						t.Fatal(err)
					}
				}
				broken := false
				w.node(tc.plugin).setFail(func(rpc, _ string) error {
					if broken = broken || rpc == tc.rpc; broken {
						return status.Error(codes.Internal, "broken")
					}
					return nil
				})
				var err error
				if tc.prepare {
					_, err = iso.Prepare(ctx, req)
				} else {
					err = iso.Cleanup(ctx, "c1", false)
				}
				if err == nil {
					t.Fatalf("the operation succeeded with %s broken", tc.rpc)
				}
				c, v := containerOf(iso, "c1"), volumeOf(iso, tc.plugin, "vol-1")
				if c.Phase != statev1.ContainerCheckpoint_CLEANING || c.LastError == "" {
					t.Errorf("container after the failure: %v", c)
				}
				if v.State != tc.state || !strings.Contains(v.LastError, "broken") {
					t.Errorf("volume after the failure: %v; want %v with the error", v, tc.state)
				}
				if p := iso.Pending(); !strings.Contains(p, "1 containers and 1 volumes pending") {
					t.Errorf("Pending() = %q", p)
				}
				w.node(tc.plugin).setFail(nil)
				if reboot {
					w.reboot()
				}
				iso = w.run(Config{})
				w.checkEmpty(iso)
			})
		}
	}
}

// unmountBehindOurBack removes the top mount at path in the host's
// namespace, as an operator's umount would.
func (w *world) unmountBehindOurBack(path string) {
	w.t.Helper()
	w.table.mu.Lock()
	defer w.table.mu.Unlock()
	m := w.table.top(hostNS, path)
	if m == nil {
		w.t.Fatalf("nothing mounted at %s", path)
	}
	w.table.unmount(m)
}

// TestUnitRepeatedPrepareRestoresMount: a prepared container's mount
// unmounted behind the agent's back is restored by a repeated Prepare,
// which answers the new mount (its new id), recorded for the cleanup.
func TestUnitRepeatedPrepareRestoresMount(t *testing.T) {
	w := newWorld(t)
	iso := w.run(Config{})
	ctx := context.Background()
	req := w.request("c1", vol{"loop", "vol-1", "/data", false})
	first, err := iso.Prepare(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	w.unmountBehindOurBack(first[0].GetMountPoint())
	again, err := iso.Prepare(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if id := again[0].GetMountId(); id == first[0].GetMountId() {
		t.Errorf("the restored mount answered with the old id %d", id)
	}
	w.check(iso)
	w.cleanup(iso, "c1")
	w.checkEmpty(iso)
}

// TestUnitPrepareRefusesUnmountedTarget: a published volume whose target
// was unmounted behind the agent's back is not handed to a new container
// (it would get the agent's empty directory, and write there): the
// Prepare fails Unavailable, saying why, and works once the volume is
// repaired.
func TestUnitPrepareRefusesUnmountedTarget(t *testing.T) {
	w := newWorld(t)
	iso := w.run(Config{})
	ctx := context.Background()
	w.prepare(iso, w.request("c1", vol{"loop", "vol-1", "/data", false}))
	w.unmountBehindOurBack(volumeOf(iso, "loop", "vol-1").TargetPath)
	_, err := iso.Prepare(ctx, w.request("c2", vol{"loop", "vol-1", "/data", false}))
	if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "not mounted") {
		t.Fatalf("Prepare of a volume whose target is unmounted: %v; want Unavailable, saying it is not mounted", err)
	}
	if c := containerOf(iso, "c2"); c != nil {
		t.Errorf("c2 after its failed Prepare: %v; want it rolled back", c)
	}
	if _, err := iso.Repair(ctx, "loop", "vol-1"); err != nil {
		t.Fatal(err)
	}
	w.prepare(iso, w.request("c2", vol{"loop", "vol-1", "/data", false}))
	w.check(iso)
	w.cleanup(iso, "c1")
	w.cleanup(iso, "c2")
	w.checkEmpty(iso)
}

// TestUnitResyncReportsUnmountedTargets: a resync pass returns each
// published volume whose target path is not a mount, and only those, for
// the repair worker to repair (the pass itself does not wait for that);
// once a repair finds the plugin down, the plugin's other volumes wait
// for the next pass.
func TestUnitResyncReportsUnmountedTargets(t *testing.T) {
	w := newWorld(t)
	var reported []string
	iso := w.run(Config{ResyncInterval: time.Hour, RPCTimeout: 50 * time.Millisecond, OnRepair: func(plugin, id string, outcome RepairOutcome) {
		reported = append(reported, plugin+"/"+id+" "+string(outcome))
	}})
	w.prepare(iso, w.request("c1", vol{"loop", "vol-1", "/data", false}, vol{"loop", "vol-2", "/more", false}, vol{"loop", "vol-3", "/else", false}))
	w.unmountBehindOurBack(volumeOf(iso, "loop", "vol-1").TargetPath)
	ctx := context.Background()
	w.calls("loop")
	batch := iso.resync(ctx, false)
	if got := w.calls("loop"); len(reported) > 0 || len(got) > 0 {
		t.Errorf("the pass itself repaired (%v, asking %v): it must not wait for a repair", reported, got)
	}
	if want := []volumeKey{{"loop", "vol-1"}}; !slices.Equal(batch, want) {
		t.Errorf("the pass found %v; want %v", batch, want)
	}
	iso.repairUnmounted(ctx, batch)
	if want := []string{"loop/vol-1 repaired"}; !slices.Equal(reported, want) {
		t.Errorf("reported %v; want %v", reported, want)
	}
	w.unmountBehindOurBack(volumeOf(iso, "loop", "vol-2").TargetPath)
	w.unmountBehindOurBack(volumeOf(iso, "loop", "vol-3").TargetPath)
	reported = nil
	w.plugins.setDown("loop", true)
	iso.repairUnmounted(ctx, iso.resync(ctx, false))
	if len(reported) != 1 || !strings.HasSuffix(reported[0], " failed") {
		t.Errorf("with the plugin down, the pass reported %v; want one volume failed, then the plugin skipped", reported)
	}
	w.plugins.setDown("loop", false)
	iso.repairUnmounted(ctx, iso.resync(ctx, false))
	w.check(iso)
}

// TestUnitRepair: a published volume's target unmounted behind the
// agent's back is published again and each user's mount replaced (the
// new one put beneath the old, the old one unmounted by id); a mount a
// container put over its own volume path is left alone, reported.
func TestUnitRepair(t *testing.T) {
	w := newWorld(t)
	iso := w.run(Config{})
	ctx := context.Background()
	r1 := w.prepare(iso, w.request("c1", vol{"loop", "vol-1", "/data", false}))
	r2 := w.prepare(iso, w.request("c2", vol{"loop", "vol-1", "/data", false}))
	// c2 covers its volume path with a tmpfs of its own.
	w.table.mu.Lock()
	cover := w.table.newMount(hostNS, r2[0].GetMountPoint(), 99, "/")
	w.table.mounts = append(w.table.mounts, cover)
	w.table.mu.Unlock()
	v := volumeOf(iso, "loop", "vol-1")
	w.unmountBehindOurBack(v.TargetPath)
	w.calls("loop")
	rep, err := iso.Repair(ctx, "loop", "vol-1")
	if err != nil {
		t.Fatal(err)
	}
	if !rep.Republished || len(rep.Rebound) != 1 || !strings.HasPrefix(rep.Rebound[0], "container c1:") || len(rep.Skipped) != 1 || !strings.HasPrefix(rep.Skipped[0], "container c2:") {
		t.Errorf("repair: %+v; want republished, c1 re-bound, c2 left alone", rep)
	}
	if got := w.calls("loop"); !slices.Equal(got, []string{"NodePublishVolume vol-1"}) {
		t.Errorf("repair asked %v; want a publish (the staging path is still mounted)", got)
	}
	c1 := containerOf(iso, "c1")
	if len(c1.Mounts) != 1 || c1.Mounts[0].GetMountId() == r1[0].GetMountId() {
		t.Errorf("c1's mounts after the repair: %v; want one, new", c1.Mounts)
	}
	if v := volumeOf(iso, "loop", "vol-1"); !strings.Contains(v.LastRepair, "re-bound") {
		t.Errorf("the volume's last repair: %q", v.LastRepair)
	}
	// c2's cover goes; then everything is as it should be.
	w.table.mu.Lock()
	w.table.unmount(cover)
	w.table.mu.Unlock()
	w.check(iso)
	for _, id := range []string{"c1", "c2"} {
		if err := iso.Cleanup(ctx, id, false); err != nil {
			t.Fatal(err)
		}
	}
	w.checkEmpty(iso)
}

// TestUnitCleanupAfterRootfsRemoved: after a reboot, the runtime removed
// a container's rootfs before the agent cleaned the container up. Nothing
// can be mounted in a directory that is gone: the cleanup succeeds and
// the volume is released (it was refused for ever, the volume published
// with that user until someone recreated the directory).
func TestUnitCleanupAfterRootfsRemoved(t *testing.T) {
	w := newWorld(t)
	iso := w.isolator(Config{})
	ctx := context.Background()
	req := w.request("c1", vol{"loop", "vol-1", "/data", false})
	if _, err := iso.Prepare(ctx, req); err != nil {
		t.Fatal(err)
	}
	w.reboot()
	if err := os.RemoveAll(req.GetRootfs()); err != nil {
		t.Fatal(err)
	}
	iso = w.run(Config{})
	if resp := iso.Reconcile(ctx, nil, ""); len(resp.Failed) > 0 {
		t.Errorf("Reconcile of a container whose rootfs is gone: %v", resp.Failed)
	}
	w.checkEmpty(iso)
}

// prepare prepares req, failing the test on an error.
func (w *world) prepare(iso *Isolator, req *statev1.PrepareRequest) []*statev1.ContainerMount {
	w.t.Helper()
	mounts, err := iso.Prepare(context.Background(), req)
	if err != nil {
		w.t.Fatal(err)
	}
	return mounts
}

// cleanup cleans container id up, failing the test on an error.
func (w *world) cleanup(iso *Isolator, id string) {
	w.t.Helper()
	if err := iso.Cleanup(context.Background(), id, false); err != nil {
		w.t.Fatal(err)
	}
}

// TestUnitRepairWaitsForRecovery: after a reboot, before recovery, a
// volume still recorded as published (its mounts gone with the reboot) is
// not repaired: recovery republishes what has users and tears down what
// has none. A published volume without users is never republished.
func TestUnitRepairWaitsForRecovery(t *testing.T) {
	w := newWorld(t)
	iso := w.isolator(Config{})
	w.prepare(iso, w.request("c1", vol{"loop", "vol-1", "/data", false}))
	w.reboot()
	w.calls("loop")
	iso = w.isolator(Config{})
	if r, err := iso.Repair(context.Background(), "loop", "vol-1"); err != nil || r.Republished {
		t.Errorf("Repair before recovery: %+v, %v; want nothing done", r, err)
	}
	if got := w.calls("loop"); len(got) > 0 {
		t.Errorf("Repair before recovery asked the plugin %v", got)
	}
	iso = w.run(Config{})
	w.check(iso)
	w.cleanup(iso, "c1")
	w.checkEmpty(iso)
}

// TestUnitTargetPathExists: target_path_exists as Mesos defines it. Set,
// the plugin expects its target to exist and the agent makes it before
// NodePublishVolume; unset (CSI), the agent makes only its parent and the
// plugin the target. Before, the meaning was the other way round: a
// plugin that expects the target got none and failed.
func TestUnitTargetPathExists(t *testing.T) {
	for _, exists := range []bool{false, true} {
		t.Run(fmt.Sprint("target_path_exists=", exists), func(t *testing.T) {
			w := newWorld(t)
			w.node("loop").targetExists = exists
			iso := w.isolator(Config{})
			w.prepare(iso, w.request("c1", vol{"loop", "vol-1", "/data", false}))
			target := volumeOf(iso, "loop", "vol-1").TargetPath
			existed := slices.Contains(w.node("loop").existed, target)
			if existed != exists {
				t.Errorf("the target existed at NodePublishVolume: %v; want %v", existed, exists)
			}
			w.check(iso)
			w.cleanup(iso, "c1")
			w.checkEmpty(iso)
		})
	}
}

// TestUnitStaticReadonly: Mesos's static_provisioning.readonly. With mode
// RO the volume is published read-only (NodePublishVolume readonly=true);
// with mode RW it is refused naming the field; a user asking for the
// volume with another readonly is refused while it is published.
func TestUnitStaticReadonly(t *testing.T) {
	w := newWorld(t)
	iso := w.isolator(Config{})
	withReadonly := func(req *statev1.PrepareRequest) *statev1.PrepareRequest {
		for _, v := range req.GetVolumes() {
			v.GetSource().GetCsiVolume().GetStaticProvisioning().Readonly = true
		}
		return req
	}
	_, err := iso.Prepare(context.Background(), withReadonly(w.request("rw", vol{"loop", "vol-1", "/data", false})))
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "static_provisioning.readonly is true") || !strings.Contains(err.Error(), "mode is RW") {
		t.Fatalf("readonly with mode RW: %v; want ErrInvalid naming the field", err)
	}
	w.prepare(iso, withReadonly(w.request("ro", vol{"loop", "vol-1", "/data", true})))
	v := volumeOf(iso, "loop", "vol-1")
	if v == nil || !v.Readonly {
		t.Fatalf("volume %+v: want it published read-only", v)
	}
	w.table.mu.Lock()
	top := w.table.top(hostNS, v.TargetPath)
	w.table.mu.Unlock()
	if top == nil || !top.readonly {
		t.Errorf("the plugin published the target %+v, want read-only", top)
	}
	_, err = iso.Prepare(context.Background(), w.request("ro2", vol{"loop", "vol-1", "/data", true}))
	if !errors.Is(err, ErrPrecondition) || !strings.Contains(err.Error(), "readonly") {
		t.Errorf("a user without readonly: %v; want ErrPrecondition", err)
	}
	w.check(iso)
	w.cleanup(iso, "ro")
	w.checkEmpty(iso)
}

// TestUnitCleanupWithPluginConfigGone: the cleanup of a container whose
// volume's plugin is no longer configured fails with ErrPrecondition (not
// "not found": the container is there) naming the plugin and both ways
// out; with the config back, it succeeds.
func TestUnitCleanupWithPluginConfigGone(t *testing.T) {
	w := newWorld(t)
	iso := w.isolator(Config{})
	w.prepare(iso, w.request("c1", vol{"loop", "vol-1", "/data", false}))
	if v := volumeOf(iso, "loop", "vol-1"); v.Pending != "" {
		t.Errorf("volume of a configured plugin shown pending: %q", v.Pending)
	}
	loop := w.plugins.nodes["loop"]
	delete(w.plugins.nodes, "loop")
	// Shown pending while the config is gone.
	if v := volumeOf(iso, "loop", "vol-1"); !strings.Contains(v.Pending, "until its plugin's config is back") {
		t.Errorf("volume of a plugin without config: pending %q", v.Pending)
	}
	err := iso.Cleanup(context.Background(), "c1", false)
	if !errors.Is(err, ErrPrecondition) || !strings.Contains(err.Error(), "loop") || !strings.Contains(err.Error(), "restore the plugin's config") || !strings.Contains(err.Error(), "cleanup --force") {
		t.Fatalf("cleanup with the plugin's config gone: %v; want ErrPrecondition naming the plugin and the ways out", err)
	}
	// The mounts the failed cleanup removed are not looked for again
	// (they would be "unmounted by someone else").
	if c := containerOf(iso, "c1"); c == nil || len(c.Mounts) > 0 {
		t.Errorf("container after the failed cleanup: %+v; want it without the mounts the cleanup removed", c)
	}
	w.plugins.nodes["loop"] = loop
	w.cleanup(iso, "c1")
	w.checkEmpty(iso)
}

// scriptedReclaimer answers ControllerReclaimSpace with its script's codes,
// then success, recording the requests.
type scriptedReclaimer struct {
	script []codes.Code
	reqs   []*reclaimspace.ControllerReclaimSpaceRequest
}

func (s *scriptedReclaimer) ControllerReclaimSpace(_ context.Context, req *reclaimspace.ControllerReclaimSpaceRequest, _ ...grpc.CallOption) (*reclaimspace.ControllerReclaimSpaceResponse, error) {
	s.reqs = append(s.reqs, req)
	if len(s.script) > 0 {
		c := s.script[0]
		s.script = s.script[1:]
		return nil, status.Error(c, "scripted")
	}
	return &reclaimspace.ControllerReclaimSpaceResponse{PreUsage: &reclaimspace.StorageConsumption{UsageBytes: 300}, PostUsage: &reclaimspace.StorageConsumption{UsageBytes: 100}}, nil
}

// TestUnitReclaimOfflineRetryTable: an offline reclaim sends the secrets
// and parameters, retries Aborted and NotFound (csi-addons' error table)
// and the transport's codes with backoff up to the policy's attempts, and
// stops at once on the others. Before: one attempt, no secrets, no
// parameters.
func TestUnitReclaimOfflineRetryTable(t *testing.T) {
	w := newWorld(t)
	iso := w.isolator(Config{})
	policy := retrypolicy.Policy{Attempts: 4, Initial: time.Millisecond, Max: time.Millisecond}
	secrets, params := map[string]string{"key": "s3cr3t"}, map[string]string{"pool": "a"}
	for _, c := range []struct {
		script []codes.Code
		calls  int
		want   codes.Code
	}{
		{[]codes.Code{codes.Aborted, codes.NotFound, codes.Unavailable}, 4, codes.OK},
		{[]codes.Code{codes.Aborted, codes.Aborted, codes.Aborted, codes.Aborted, codes.Aborted}, 4, codes.Aborted},
		{[]codes.Code{codes.InvalidArgument}, 1, codes.InvalidArgument},
		{[]codes.Code{codes.Unauthenticated}, 1, codes.Unauthenticated},
	} {
		r := &scriptedReclaimer{script: c.script}
		res, err := iso.ReclaimOffline(context.Background(), r, "loop", "vol-9", secrets, params, policy)
		if status.Code(err) != c.want || len(r.reqs) != c.calls {
			t.Errorf("script %v: %v after %d calls; want %v after %d", c.script, err, len(r.reqs), c.want, c.calls)
		}
		if c.want == codes.OK && res.GetBytesReclaimed() != 200 {
			t.Errorf("script %v: result %v", c.script, res)
		}
		for _, req := range r.reqs {
			if !maps.Equal(req.GetSecrets(), secrets) || !maps.Equal(req.GetParameters(), params) {
				t.Errorf("request %v: want the secrets and parameters", req)
			}
		}
	}
}

// TestUnitPluginErrorFirstLine: a plugin error that carries a tool's
// whole output reaches the caller as its first line, with a note that the
// rest is in the agent's log; a one-line message stays as it is.
func TestUnitPluginErrorFirstLine(t *testing.T) {
	usage := "mkfs.xfs: exit status 1: Filesystem must be larger than 300MB.\nUsage: mkfs.xfs\n/* blocksize */\t\t[-b size=num]\n"
	err := &rpcError{plugin: "loop", rpc: "NodeStageVolume", volume: "v", err: status.Error(codes.Internal, usage)}
	if got, want := err.Error(), "plugin loop: NodeStageVolume of volume v: mkfs.xfs: exit status 1: Filesystem must be larger than 300MB. (2 more lines in the agent's log)"; got != want {
		t.Errorf("Error() = %q, want %q", got, want)
	}
	one := &rpcError{plugin: "loop", rpc: "NodeStageVolume", volume: "v", err: status.Error(codes.Internal, "no space left")}
	if got := one.Error(); got != "plugin loop: NodeStageVolume of volume v: no space left" {
		t.Errorf("Error() = %q", got)
	}
}

// Reconcile with one manager's live list cleans up only that manager's
// dead containers: a runc user's list never reaches a Podman container,
// whose id it cannot contain (issue 26: a running Podman container's
// volume was released), and the manager survives a restart in the record.
func TestUnitReconcileScopedByManager(t *testing.T) {
	w := newWorld(t)
	iso := w.isolator(Config{})
	ctx := context.Background()
	for _, c := range []struct{ id, manager string }{{"runc-live", ""}, {"runc-dead", ""}, {"podman-live", "libpod"}, {"crio-dead", "cri-o"}} {
		req := w.request(c.id, vol{"loop", "vol-" + c.id, "/data", false})
		req.Manager = c.manager
		w.prepare(iso, req)
	}
	iso = w.run(Config{})
	if got := containerOf(iso, "podman-live").Manager; got != "libpod" {
		t.Fatalf("manager after a restart: %q", got)
	}
	resp := iso.Reconcile(ctx, []string{"runc-live"}, "")
	if len(resp.Failed) > 0 || len(resp.CleanedUp) != 1 || resp.CleanedUp[0] != "runc-dead" {
		t.Errorf("Reconcile of the unmanaged containers: %+v; want runc-dead only", resp)
	}
	resp = iso.Reconcile(ctx, nil, "cri-o")
	if len(resp.Failed) > 0 || len(resp.CleanedUp) != 1 || resp.CleanedUp[0] != "crio-dead" {
		t.Errorf("Reconcile of cri-o's containers: %+v; want crio-dead only", resp)
	}
	for _, id := range []string{"runc-live", "podman-live"} {
		if c := containerOf(iso, id); c.Phase != statev1.ContainerCheckpoint_PREPARED {
			t.Errorf("%s after the reconciles: %+v", id, c)
		}
	}
}

// TestUnitGoneContainerCleanedUp: a container prepared into a process's
// mount namespace whose processes have all ended without a Cleanup (the
// agent was down at poststop, the runtime crashed) is cleaned up by the
// next resync pass, as poststop would have (before, it stayed PREPARED and
// its volume published for good); while a process is in the namespace, a
// Reconcile that leaves it out of its live list is refused for it (before,
// it was cleaned up under its running processes).
func TestUnitGoneContainerCleanedUp(t *testing.T) {
	w := newWorld(t)
	iso := w.run(Config{})
	ctx := context.Background()
	w.table.startProcess(crashPid, 77)
	req := w.request("c1", vol{"loop", "vol-1", "/data", false})
	req.Pid = crashPid
	w.prepare(iso, req)

	resp := iso.Reconcile(ctx, nil, "")
	if why := resp.Failed["c1"]; len(resp.CleanedUp) != 0 || !strings.Contains(why, fmt.Sprintf("it still runs: pid %d is in its mount namespace", crashPid)) {
		t.Errorf("Reconcile without c1 while its process runs: %+v; want it refused, naming the pid", resp)
	}
	iso.resync(ctx, false)
	if c := containerOf(iso, "c1"); c == nil || c.Phase != statev1.ContainerCheckpoint_PREPARED {
		t.Fatalf("a resync while its process runs: %+v; want it kept", c)
	}
	w.check(iso)

	w.table.endProcess(crashPid)
	iso.resync(ctx, false)
	if c := containerOf(iso, "c1"); c != nil {
		t.Errorf("after its process ended, a resync left %+v", c)
	}
	w.checkEmpty(iso)
}

// After a reboot a container prepared into a process's namespace is gone,
// even when a new namespace got the same inode number (the kernel reuses
// them): recovery cleans it up rather than take it for running.
func TestUnitGoneAfterRebootDespiteInodeReuse(t *testing.T) {
	w := newWorld(t)
	iso := w.run(Config{})
	w.table.startProcess(crashPid, 77)
	req := w.request("c1", vol{"loop", "vol-1", "/data", false})
	req.Pid = crashPid
	w.prepare(iso, req)
	w.reboot()
	w.table.startProcess(crashPid+1, 77) // another container, the same inode
	iso = w.run(Config{})
	if c := containerOf(iso, "c1"); c != nil {
		t.Errorf("after a reboot, c1 (its namespace's inode taken by another) is %+v; want it cleaned up", c)
	}
}

// TestUnitWhileOffNode: f runs under the volume's lock only while the
// volume is not on the node: a backend volume is not deleted under a
// container that uses it (a Prepare of another name for it, or by its id,
// between a removal's check and its DeleteVolume).
func TestUnitWhileOffNode(t *testing.T) {
	w := newWorld(t)
	iso := w.run(Config{})
	ran := 0
	f := func() error { ran++; return nil }
	if err := iso.WhileOffNode(context.Background(), "loop", "vol-1", f); err != nil || ran != 1 {
		t.Fatalf("a volume never on the node: %v, ran %d", err, ran)
	}
	w.prepare(iso, w.request("c1", vol{"loop", "vol-1", "/data", false}))
	if err := iso.WhileOffNode(context.Background(), "loop", "vol-1", f); !errors.Is(err, ErrPrecondition) || ran != 1 {
		t.Fatalf("a volume a container uses: %v, ran %d; want ErrPrecondition, not run", err, ran)
	}
	w.cleanup(iso, "c1")
	if err := iso.WhileOffNode(context.Background(), "loop", "vol-1", f); err != nil || ran != 2 {
		t.Fatalf("after its last cleanup: %v, ran %d", err, ran)
	}
}

// TestUnitTeardownRetriesInternal: NodeUnpublishVolume and
// NodeUnstageVolume failing Internal or Unknown are called again, up to
// teardownCalls in all (third-party plugins built on Kubernetes' mount
// utilities fail so while the host's mount table changes under them);
// one that keeps failing fails the cleanup with the plugin's message.
func TestUnitTeardownRetriesInternal(t *testing.T) {
	w := newWorld(t)
	iso := w.run(Config{})
	w.prepare(iso, w.request("c1", vol{"loop", "vol-1", "/data", false}))
	failures := map[string]int{}
	var mu sync.Mutex
	w.node("loop").setFail(func(rpc, _ string) error {
		mu.Lock()
		defer mu.Unlock()
		if (rpc == "NodeUnpublishVolume" || rpc == "NodeUnstageVolume") && failures[rpc] < teardownCalls-1 {
			failures[rpc]++
			return status.Error(map[string]codes.Code{"NodeUnpublishVolume": codes.Unknown, "NodeUnstageVolume": codes.Internal}[rpc],
				"check target path: could not get consistent content of /proc/mounts after 3 attempts")
		}
		return nil
	})
	w.cleanup(iso, "c1")

	w.node("loop").setFail(nil)
	w.prepare(iso, w.request("c2", vol{"loop", "vol-2", "/data", false}))
	w.node("loop").setFail(func(rpc, _ string) error {
		if rpc == "NodeUnpublishVolume" {
			return status.Error(codes.Internal, "broken for good")
		}
		return nil
	})
	err := iso.Cleanup(context.Background(), "c2", false)
	if err == nil || !strings.Contains(err.Error(), "broken for good") || status.Code(errors.Unwrap(err)) == codes.Aborted {
		t.Fatalf("a cleanup whose unpublish keeps failing Internal: %v; want its error", err)
	}
	w.node("loop").setFail(nil)
	w.cleanup(iso, "c2")
}
