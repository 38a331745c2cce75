package dockerplugin

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"time"

	"github.com/docker/go-plugins-helpers/volume"

	"github.com/csiagent/csiagent/internal/atomicfile"
	"github.com/csiagent/csiagent/isolator"
	"github.com/csiagent/csiagent/namedvol"
	statev1 "github.com/csiagent/csiagent/proto/state/v1"
)

// fakeBackend records prepared containers; prepare, when set, runs
// instead of succeeding.
type fakeBackend struct {
	mu         sync.Mutex
	containers map[string]*statev1.PrepareRequest
	cleanups   int
	prepare    func(ctx context.Context) error
	// volumes is what ListVolumes reports.
	volumes []isolator.VolumeInfo
	// backend is the plugin's volumes by CSI name (CreateVolume finds
	// one again by its name), creates counts the volumes made, deleted
	// the ids deleted; createFails, when set, is the error CreateVolume
	// answers after making the volume (a crash before its answer).
	backend     map[string]string
	creates     int
	deleted     []string
	createFails error
	// createRefused, when set, is the error CreateVolume answers
	// without making the volume.
	createRefused error
	// phases are the containers' phases other than PREPARED.
	phases map[string]statev1.ContainerCheckpoint_Phase
}

func (f *fakeBackend) CreateVolume(_ context.Context, d *namedvol.Definition, _ map[string]string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.createRefused != nil {
		return f.createRefused
	}
	name := d.Provision.CSIName
	id, ok := f.backend[name]
	if !ok {
		if f.backend == nil {
			f.backend = map[string]string{}
		}
		f.creates++
		id = fmt.Sprintf("vol-%d", f.creates)
		f.backend[name] = id
	}
	if f.createFails != nil {
		return f.createFails
	}
	d.Created(id, map[string]string{"made-by": "fake"}, []*csi.Topology{{Segments: map[string]string{"zone": "a"}}})
	return nil
}

func (f *fakeBackend) DeleteVolume(_ context.Context, _, id string, _ map[string]string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.deleted = append(f.deleted, id)
	for name, v := range f.backend {
		if v == id {
			delete(f.backend, name)
		}
	}
	return nil
}

func (f *fakeBackend) Prepare(ctx context.Context, req *statev1.PrepareRequest) ([]*statev1.ContainerMount, error) {
	if f.prepare != nil {
		if err := f.prepare(ctx); err != nil {
			return nil, err
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.containers[req.GetContainerId()] = req
	return []*statev1.ContainerMount{{MountPoint: req.GetRootfs() + mountDir}}, nil
}

func (f *fakeBackend) Cleanup(_ context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.containers, id)
	f.cleanups++
	return nil
}

func (f *fakeBackend) ListContainers() []isolator.ContainerInfo {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []isolator.ContainerInfo
	for id := range f.containers {
		phase := statev1.ContainerCheckpoint_PREPARED
		if p, ok := f.phases[id]; ok {
			phase = p
		}
		out = append(out, isolator.ContainerInfo{ID: id, Phase: phase})
	}
	return out
}

func (f *fakeBackend) ListVolumes() []isolator.VolumeInfo { return f.volumes }
func (f *fakeBackend) CheckPlugin(string) error           { return nil }

func newTestServer(t *testing.T, b *fakeBackend) (*Server, string) {
	t.Helper()
	dir := t.TempDir()
	commit, err := atomicfile.New(dir)
	if err != nil {
		t.Fatal(err)
	}
	store, err := namedvol.OpenStore(commit, filepath.Join(dir, "named"))
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(Config{Store: store, Backend: b, Dir: filepath.Join(dir, "engine"), Commit: commit})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Create(context.Background(), &volume.CreateRequest{Name: "data", Options: map[string]string{"plugin": "p", "volume_id": "v"}}); err != nil {
		t.Fatal(err)
	}
	return s, dir
}

// Docker's cp mounts again with the container's mount id, and Podman uses
// one id for all its mounts: each Mount of a pair needs its Unmount.
func TestMountsOfOneIDAreCounted(t *testing.T) {
	ctx := context.Background()
	b := &fakeBackend{containers: map[string]*statev1.PrepareRequest{}}
	s, dir := newTestServer(t, b)
	for range 2 {
		if _, err := s.Mount(ctx, &volume.MountRequest{Name: "data", ID: "m1"}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Unmount(ctx, &volume.UnmountRequest{Name: "data", ID: "m1"}); err != nil {
		t.Fatal(err)
	}
	if b.cleanups != 0 {
		t.Fatal("the first of two Unmounts released the volume")
	}
	// The count survives a restart of the agent.
	s, err := New(Config{Store: s.cfg.Store, Backend: b, Dir: filepath.Join(dir, "engine"), Commit: s.cfg.Commit})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Remove(ctx, &volume.RemoveRequest{Name: "data"}); err == nil || !strings.Contains(err.Error(), "in use") {
		t.Errorf("Remove of a mounted volume: %v, want in use", err)
	}
	if err := s.Unmount(ctx, &volume.UnmountRequest{Name: "data", ID: "m1"}); err != nil {
		t.Fatal(err)
	}
	if b.cleanups != 1 || len(b.containers) != 0 {
		t.Errorf("after the last Unmount: %d cleanups, %d containers; want 1, 0", b.cleanups, len(b.containers))
	}
	if err := s.Unmount(ctx, &volume.UnmountRequest{Name: "data", ID: "m1"}); err != nil || b.cleanups != 1 {
		t.Errorf("a repeated Unmount: %v, %d cleanups", err, b.cleanups)
	}
	if ents, _ := os.ReadDir(filepath.Join(dir, "engine")); len(ents) != 0 {
		t.Errorf("left in the engine directory: %v", ents)
	}
	if err := s.Remove(ctx, &volume.RemoveRequest{Name: "data"}); err != nil {
		t.Errorf("Remove of an unmounted volume: %v", err)
	}
}

// A Mount whose engine gave up (its context ends) leaves no record and no
// directory.
func TestAbandonedMountLeavesNothing(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	b := &fakeBackend{containers: map[string]*statev1.PrepareRequest{}}
	b.prepare = func(ctx context.Context) error {
		cancel()
		<-ctx.Done()
		return ctx.Err()
	}
	s, dir := newTestServer(t, b)
	if _, err := s.Mount(ctx, &volume.MountRequest{Name: "data", ID: "m1"}); !errors.Is(err, context.Canceled) {
		t.Fatalf("abandoned Mount: %v", err)
	}
	if ents, _ := os.ReadDir(filepath.Join(dir, "engine")); len(ents) != 0 {
		t.Errorf("left in the engine directory: %v", ents)
	}
	if len(s.usersOf("data")) != 0 {
		t.Error("the abandoned Mount is counted as a user")
	}
}

// Reconcile releases, whatever their counts, the engine mounts whose id
// the engine no longer uses, and only those.
func TestReconcileReleasesForgottenMounts(t *testing.T) {
	ctx := context.Background()
	b := &fakeBackend{containers: map[string]*statev1.PrepareRequest{}}
	s, _ := newTestServer(t, b)
	docker := WithEngine(ctx, namedvol.EngineDocker, "/var/lib/docker")
	for _, id := range []string{"live", "gone", "gone"} {
		if _, err := s.Mount(docker, &volume.MountRequest{Name: "data", ID: id}); err != nil {
			t.Fatal(err)
		}
	}
	// Another engine's mount, and one of no known engine: Docker's live
	// ids say nothing of them.
	if _, err := s.Mount(WithEngine(ctx, namedvol.EnginePodman, ""), &volume.MountRequest{Name: "data", ID: "podman-mount"}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Mount(ctx, &volume.MountRequest{Name: "data", ID: "unknown-mount"}); err != nil {
		t.Fatal(err)
	}
	released, failed := s.Reconcile(ctx, namedvol.EngineDocker, []string{"live"})
	if len(released) != 1 || released[0] != "data/gone" || len(failed) != 0 {
		t.Fatalf("Reconcile = %v, %v; want data/gone released", released, failed)
	}
	if us := s.usersOf("data"); len(us) != 3 || len(b.containers) != 3 {
		t.Errorf("after Reconcile: users %v, %d containers; want the live mount and the other engines'", us, len(b.containers))
	}
	// The engine survives a restart (it is in the record).
	s, err := New(Config{Store: s.cfg.Store, Backend: b, Dir: s.cfg.Dir, Commit: s.cfg.Commit})
	if err != nil {
		t.Fatal(err)
	}
	if released, _ := s.Reconcile(ctx, namedvol.EnginePodman, nil); len(released) != 1 || released[0] != "data/podman-mount" {
		t.Errorf("Podman's reconcile after a restart released %v; want its mount only", released)
	}
	if released, _ := s.Reconcile(ctx, "", nil); len(released) != 1 || released[0] != "data/unknown-mount" {
		t.Errorf("the reconcile of no known engine released %v", released)
	}
}

// A Mount interrupted by a crash (its record written, its container
// rolled back by recovery) is not counted: the engine's next Mount of the
// id is its first.
func TestInterruptedMountIsNotCounted(t *testing.T) {
	ctx := context.Background()
	b := &fakeBackend{containers: map[string]*statev1.PrepareRequest{}}
	s, dir := newTestServer(t, b)
	if _, err := s.Mount(ctx, &volume.MountRequest{Name: "data", ID: "m1"}); err != nil {
		t.Fatal(err)
	}
	// The agent restarts; recovery rolled the container back after the
	// engine mount's record was loaded.
	s, err := New(Config{Store: s.cfg.Store, Backend: b, Dir: filepath.Join(dir, "engine"), Commit: s.cfg.Commit})
	if err != nil {
		t.Fatal(err)
	}
	delete(b.containers, containerID("data", "m1"))
	if _, err := s.Mount(ctx, &volume.MountRequest{Name: "data", ID: "m1"}); err != nil {
		t.Fatal(err)
	}
	if err := s.Unmount(ctx, &volume.UnmountRequest{Name: "data", ID: "m1"}); err != nil {
		t.Fatal(err)
	}
	if len(b.containers) != 0 || len(s.usersOf("data")) != 0 {
		t.Errorf("one Mount after the interrupted one, one Unmount: %d containers, users %v; want none", len(b.containers), s.usersOf("data"))
	}
}

// A Mount that a crash cut after its container's PREPARING record (the
// engine never got its answer, and recovery rolls the container back)
// is not counted after the restart: the volume is not in use, and can be
// removed. Before, its count stayed until the next restart: Remove was
// refused, and so was the annotation policy's use.
func TestMountCutByACrashIsNotAUser(t *testing.T) {
	ctx := context.Background()
	b := &fakeBackend{containers: map[string]*statev1.PrepareRequest{}}
	s, dir := newTestServer(t, b)
	for _, id := range []string{"cut", "quarantined"} {
		if _, err := s.Mount(ctx, &volume.MountRequest{Name: "data", ID: id}); err != nil {
			t.Fatal(err)
		}
	}
	cut, quarantined := containerID("data", "cut"), containerID("data", "quarantined")
	b.phases = map[string]statev1.ContainerCheckpoint_Phase{
		cut:         statev1.ContainerCheckpoint_PREPARING,
		quarantined: statev1.ContainerCheckpoint_PHASE_UNKNOWN, // recovery keeps it, mounted
	}
	s, err := New(Config{Store: s.cfg.Store, Backend: b, Dir: filepath.Join(dir, "engine"), Commit: s.cfg.Commit})
	if err != nil {
		t.Fatal(err)
	}
	delete(b.containers, cut) // recovery rolled it back
	if us := s.usersOf("data"); len(us) != 1 || us[0].ID != "quarantined" {
		t.Fatalf("users after a restart that found one mount's container PREPARING and one's quarantined: %v; want the quarantined one's", us)
	}
	if err := s.Unmount(ctx, &volume.UnmountRequest{Name: "data", ID: "quarantined"}); err != nil {
		t.Fatal(err)
	}
	if err := s.Remove(ctx, &volume.RemoveRequest{Name: "data"}); err != nil {
		t.Errorf("Remove of a volume whose one Mount a crash cut and the other was unmounted: %v", err)
	}
}

// Engine mounts recorded before a reboot are held by no engine: they are
// not counted after it, and ReleaseFormerBoot cleans their containers up
// unless an engine mounted them again since (then that Mount is the
// first of a new count). Before, their counts survived the reboot: a
// Mount again made 2, and the one Unmount that follows left the volume
// published for good.
func TestFormerBootMountsReleased(t *testing.T) {
	ctx := context.Background()
	b := &fakeBackend{containers: map[string]*statev1.PrepareRequest{}}
	s, dir := newTestServer(t, b)
	s.cfg.BootID = "boot-1"
	for _, id := range []string{"forgotten", "again"} {
		if _, err := s.Mount(ctx, &volume.MountRequest{Name: "data", ID: id}); err != nil {
			t.Fatal(err)
		}
	}
	s, err := New(Config{Store: s.cfg.Store, Backend: b, Dir: filepath.Join(dir, "engine"), Commit: s.cfg.Commit, BootID: "boot-2"})
	if err != nil {
		t.Fatal(err)
	}
	if us := s.usersOf("data"); len(us) != 0 {
		t.Fatalf("users after a reboot: %v; want none", us)
	}
	if _, err := s.Mount(ctx, &volume.MountRequest{Name: "data", ID: "again"}); err != nil {
		t.Fatal(err)
	}
	s.ReleaseFormerBoot(ctx)
	if _, ok := b.containers[containerID("data", "forgotten")]; ok {
		t.Error("the former boot's mount no engine mounted again is still prepared")
	}
	if us := s.usersOf("data"); len(us) != 1 || us[0].ID != "again" || us[0].Count != 1 {
		t.Fatalf("users: %+v; want the mount made again in this boot, counted once", us)
	}
	if err := s.Unmount(ctx, &volume.UnmountRequest{Name: "data", ID: "again"}); err != nil {
		t.Fatal(err)
	}
	if len(b.containers) != 0 {
		t.Errorf("after the one Unmount of this boot: %d containers left; want none", len(b.containers))
	}
}

// A named volume whose CSI volume a container holds through the agent
// (the csi.csiagent.io/mounts annotation, prepare --mounts), not through
// an engine mount, is in use too: Remove refuses it.
func TestRemoveRefusedWhileAContainerUsesTheVolume(t *testing.T) {
	ctx := context.Background()
	b := &fakeBackend{containers: map[string]*statev1.PrepareRequest{}}
	s, _ := newTestServer(t, b)
	b.volumes = []isolator.VolumeInfo{
		{Plugin: "p", ID: "other", Users: []string{"c0"}},
		{Plugin: "p", ID: "v", State: statev1.VolumeCheckpoint_PUBLISHED, Users: []string{"c1"}},
	}
	err := s.Remove(ctx, &volume.RemoveRequest{Name: "data"})
	if err == nil || !strings.Contains(err.Error(), "in use by 1 container(s): c1") {
		t.Errorf("Remove while container c1 uses the volume: %v, want in use by c1", err)
	}
	if _, err := s.cfg.Store.Get("data"); err != nil {
		t.Errorf("the refused Remove removed the definition: %v", err)
	}
	b.volumes = b.volumes[:1]
	if err := s.Remove(ctx, &volume.RemoveRequest{Name: "data"}); err != nil {
		t.Errorf("Remove once no container uses the volume: %v", err)
	}
}

// Docker, Podman and the API share one name space: an engine removes only
// the volumes it created (Podman's volume survives docker volume rm), the
// API any, and a definition stored before creators were kept anyone.
func TestEngineRemovesOnlyWhatItCreated(t *testing.T) {
	ctx := context.Background()
	docker, podman, other := WithEngine(ctx, namedvol.EngineDocker, "/var/lib/docker"), WithEngine(ctx, namedvol.EnginePodman, ""), WithEngine(ctx, "", "")
	s, dir := newTestServer(t, &fakeBackend{containers: map[string]*statev1.PrepareRequest{}})
	opts := map[string]string{"plugin": "p", "volume_id": "v"}
	for name, ctx := range map[string]context.Context{"bypodman": podman, "bydocker": docker, "byother": other} {
		if err := s.Create(ctx, &volume.CreateRequest{Name: name, Options: opts}); err != nil {
			t.Fatal(err)
		}
	}
	// The same definition again, from another engine, changes nothing
	// (Docker creates a volume it is asked to use but does not know).
	if err := s.Create(docker, &volume.CreateRequest{Name: "bypodman", Options: opts}); err != nil {
		t.Errorf("Docker's Create of Podman's identical definition: %v, want no change", err)
	}
	for _, tc := range []struct {
		ctx           context.Context
		name, creator string
		how           string
	}{
		{docker, "bypodman", "podman", "podman volume rm bypodman (or csi-agent volume rm bypodman as root)"},
		{podman, "bydocker", "docker", "docker volume rm bydocker"},
		{docker, "byother", "other", "the engine that created it (or csi-agent volume rm byother as root)"},
		{podman, "data", "csi-agent", "remove it with csi-agent volume rm data"},
	} {
		err := s.Remove(tc.ctx, &volume.RemoveRequest{Name: tc.name})
		if !errors.Is(err, namedvol.ErrOtherCreator) || !strings.Contains(err.Error(), "was created by "+tc.creator) || !strings.Contains(err.Error(), tc.how) {
			t.Errorf("removing %s (created by %s) from another engine: %v, want refused saying %q", tc.name, tc.creator, err, tc.how)
		}
		if st, err := s.Status(tc.name); err != nil || st.Creator != tc.creator {
			t.Errorf("%s after the refused removal: %+v, %v", tc.name, st, err)
		}
	}
	for name, ctx := range map[string]context.Context{"bypodman": podman, "bydocker": docker, "byother": other, "data": ctx} {
		if err := s.Remove(ctx, &volume.RemoveRequest{Name: name}); err != nil {
			t.Errorf("its creator removing %s: %v", name, err)
		}
	}
	// A definition stored by an agent that did not keep creators.
	legacy := []byte(`{"name": "old", "plugin": "p", "volume_id": "v"}` + "\n")
	if err := os.WriteFile(filepath.Join(dir, "named", "old.json"), legacy, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := s.Remove(docker, &volume.RemoveRequest{Name: "old"}); err != nil {
		t.Errorf("Docker removing a definition without a creator: %v", err)
	}
}

// The per-name locks of a long-running agent do not pile up: volumes
// created and removed, and calls on names that do not exist, leave none.
func TestNameLocksAreDropped(t *testing.T) {
	ctx := context.Background()
	b := &fakeBackend{containers: map[string]*statev1.PrepareRequest{}}
	s, _ := newTestServer(t, b)
	for _, name := range []string{"a", "b", "c"} {
		if err := s.Create(ctx, &volume.CreateRequest{Name: name, Options: map[string]string{"plugin": "p", "volume_id": name}}); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Mount(ctx, &volume.MountRequest{Name: name, ID: "m"}); err != nil {
			t.Fatal(err)
		}
		if err := s.Unmount(ctx, &volume.UnmountRequest{Name: name, ID: "m"}); err != nil {
			t.Fatal(err)
		}
		if err := s.Remove(ctx, &volume.RemoveRequest{Name: name}); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Mount(ctx, &volume.MountRequest{Name: "nosuch-" + name, ID: "m"}); !errors.Is(err, namedvol.ErrNotFound) {
			t.Fatalf("Mount of an unknown name: %v", err)
		}
	}
	// Concurrent calls on one name wait for each other, then drop the lock.
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			id := fmt.Sprint("m", i)
			if _, err := s.Mount(ctx, &volume.MountRequest{Name: "data", ID: id}); err != nil {
				t.Error(err)
			}
			if err := s.Unmount(ctx, &volume.UnmountRequest{Name: "data", ID: id}); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if len(b.containers) != 0 || len(s.usersOf("data")) != 0 {
		t.Errorf("after concurrent Mounts and Unmounts: %d containers, users %v", len(b.containers), s.usersOf("data"))
	}
	// Every name's lock is free (keyedlock keeps no entry for a free key).
	for _, name := range []string{"a", "b", "c", "nosuch-a", "data"} {
		unlock, ok := s.locks.TryLock(name)
		if !ok {
			t.Errorf("the lock of %s is held after every call returned", name)
			continue
		}
		unlock()
	}
}

// Page answers pages of at most pageBytes of definitions (or max
// volumes), which together hold every volume once, sorted by name.
func TestListPagesHoldEveryVolumeOnce(t *testing.T) {
	ctx := context.Background()
	b := &fakeBackend{containers: map[string]*statev1.PrepareRequest{}}
	s, _ := newTestServer(t, b)
	want := []string{"data"}
	// 300 volumes of about 8 KiB: 2.4 MiB, three pages or more.
	pad := strings.Repeat("x", 1000)
	for i := range 300 {
		name := fmt.Sprintf("v%03d", i)
		opts := map[string]string{"plugin": "p", "volume_id": name}
		for k := range 8 {
			opts[fmt.Sprint("context.k", k)] = pad
		}
		if err := s.Create(ctx, &volume.CreateRequest{Name: name, Options: opts}); err != nil {
			t.Fatal(err)
		}
		want = append(want, name)
	}
	// Names that sort otherwise than their files (a.json, a-b.json).
	for _, name := range []string{"a", "a-b", "a.b", "a_b"} {
		if err := s.Create(ctx, &volume.CreateRequest{Name: name, Options: map[string]string{"plugin": "p", "volume_id": name}}); err != nil {
			t.Fatal(err)
		}
	}
	want = append([]string{"a", "a-b", "a.b", "a_b"}, want...)
	for _, max := range []int{0, 7} {
		var got []string
		after, pages := "", 0
		for {
			sts, next, err := s.Page(after, max)
			if err != nil {
				t.Fatal(err)
			}
			pages++
			size := 0
			for _, st := range sts {
				size += st.Size()
				got = append(got, st.Name)
			}
			if size > pageBytes || (max > 0 && len(sts) > max) {
				t.Errorf("max %d, page %d: %d volumes, %d bytes of definitions", max, pages, len(sts), size)
			}
			if next == "" {
				break
			}
			after = next
		}
		if pages < 3 || strings.Join(got, " ") != strings.Join(want, " ") {
			t.Errorf("max %d: %d pages of %d volumes; want 3 or more of %d, each volume once, sorted", max, pages, len(got), len(want))
		}
	}
}

// A definition over namedvol.MaxDefinition is refused at Create, naming
// the cap.
func TestCreateRefusesDefinitionOverTheCap(t *testing.T) {
	s, _ := newTestServer(t, &fakeBackend{containers: map[string]*statev1.PrepareRequest{}})
	opts := map[string]string{"plugin": "p", "volume_id": "v"}
	for k := range 70 {
		opts[fmt.Sprint("context.k", k)] = strings.Repeat("x", 1000)
	}
	err := s.Create(context.Background(), &volume.CreateRequest{Name: "big", Options: opts})
	if !errors.Is(err, namedvol.ErrInvalid) || !strings.Contains(err.Error(), "cap of 65536 bytes") {
		t.Errorf("Create of a 70 KB definition: %v, want an error naming the 65536-byte cap", err)
	}
	if _, err := s.cfg.Store.Get("big"); !errors.Is(err, namedvol.ErrNotFound) {
		t.Errorf("the refused definition was stored: %v", err)
	}
}

// Resolve applies the annotation policy (a definition must allow
// annotations, and sharing while an engine mount holds it), refuses block
// volumes and unknown names, and holds the names' locks while use runs:
// an engine Mount of a resolved name waits for it.
func TestResolveAnnotationPolicy(t *testing.T) {
	ctx := context.Background()
	b := &fakeBackend{containers: map[string]*statev1.PrepareRequest{}}
	s, _ := newTestServer(t, b)
	create := func(name string, opts map[string]string) {
		t.Helper()
		all := map[string]string{namedvol.KeyPlugin: "loop", namedvol.KeyVolumeID: name}
		for k, v := range opts {
			all[k] = v
		}
		if err := s.Define(ctx, name, all, nil); err != nil {
			t.Fatalf("define %s: %v", name, err)
		}
	}
	create("closed", nil)
	create("explicit-false", map[string]string{namedvol.KeyAllowAnnotations: "false"})
	create("open", map[string]string{namedvol.KeyAllowAnnotations: "true", namedvol.KeyStageSecret: "ops/token"})
	create("held", map[string]string{namedvol.KeyAllowAnnotations: "true"})
	create("shared", map[string]string{namedvol.KeyAllowAnnotations: "true", namedvol.KeyShareEngineMounts: "true"})
	create("raw", map[string]string{namedvol.KeyAllowAnnotations: "true", namedvol.KeyBlock: "true"})
	// Another name for held's backend volume: held's engine mount holds
	// it too.
	create("alias-of-held", map[string]string{namedvol.KeyAllowAnnotations: "true", namedvol.KeyVolumeID: "held"})
	for _, name := range []string{"held", "shared"} {
		if _, err := s.Mount(ctx, &volume.MountRequest{Name: name, ID: "engine-" + name}); err != nil {
			t.Fatal(err)
		}
	}
	resolve := func(annotation bool, mounts ...namedvol.Mount) ([]*statev1.Volume, error) {
		var got []*statev1.Volume
		err := s.Resolve(ctx, mounts, annotation, func(vols []*statev1.Volume) error { got = vols; return nil })
		return got, err
	}
	for _, tc := range []struct {
		name string
		want []string
		is   error
	}{
		{"closed", []string{"mount 2", "named volume closed may not be named in an annotation", "allow_annotations=true", "csi-agent volume create closed ... --allow-annotations", "csi-agent volume rm closed"}, namedvol.ErrAnnotationRefused},
		{"explicit-false", []string{"may not be named in an annotation"}, namedvol.ErrAnnotationRefused},
		{"held", []string{"named volume held is held by 1 engine mount(s)", "--share-engine-mounts"}, namedvol.ErrAnnotationRefused},
		{"alias-of-held", []string{"is held by 1 engine mount(s)"}, namedvol.ErrAnnotationRefused},
		{"raw", []string{"block volume"}, namedvol.ErrInvalid},
		{"ghost", []string{"no such named volume"}, namedvol.ErrNotFound},
		{"../x", []string{"name"}, namedvol.ErrInvalid},
	} {
		_, err := resolve(true, namedvol.Mount{Name: "open", ContainerPath: "/a"}, namedvol.Mount{Name: tc.name, ContainerPath: "/data"})
		if !errors.Is(err, tc.is) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.is)
			continue
		}
		for _, w := range tc.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: %q lacks %q", tc.name, err, w)
			}
		}
	}
	got, err := resolve(true, namedvol.Mount{Name: "open", ContainerPath: "/data"}, namedvol.Mount{Name: "shared", ContainerPath: "/shared", ReadOnly: true})
	if err != nil || len(got) != 2 || got[0].GetSource().GetCsiVolume().GetStaticProvisioning().GetVolumeId() != "open" ||
		got[0].GetSource().GetCsiVolume().GetStaticProvisioning().GetNodeStageSecrets()["token"].GetReference().GetName() != "ops" ||
		got[1].GetContainerPath() != "/shared" || got[1].GetMode() != statev1.Volume_RO {
		t.Errorf("allowed volumes: %v, %v", got, err)
	}
	// The policy is the annotation's: an API caller names any volume.
	if got, err := resolve(false, namedvol.Mount{Name: "closed", ContainerPath: "/data"}, namedvol.Mount{Name: "held", ContainerPath: "/held"}); err != nil || len(got) != 2 {
		t.Errorf("not from an annotation: %v, %v", got, err)
	}

	// While use runs, an engine Mount of the name waits.
	inUse, release := make(chan struct{}), make(chan struct{})
	resolved := make(chan error, 1)
	go func() {
		resolved <- s.Resolve(ctx, []namedvol.Mount{{Name: "open", ContainerPath: "/data"}}, true, func([]*statev1.Volume) error {
			close(inUse)
			<-release
			return nil
		})
	}()
	<-inUse
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	if _, err := s.Mount(short, &volume.MountRequest{Name: "open", ID: "engine-open"}); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("an engine Mount during a resolved prepare: %v, want it to wait", err)
	}
	close(release)
	if err := <-resolved; err != nil {
		t.Fatal(err)
	}
}

// ReleaseUnused releases one Docker daemon's mounts of volumes it knows
// and no container of it holds, once their last Mount is older than the
// grace; not another engine's, not another daemon's (another data root, or
// none known), not one a container holds.
func TestReleaseUnused(t *testing.T) {
	ctx := context.Background()
	b := &fakeBackend{containers: map[string]*statev1.PrepareRequest{}}
	s, _ := newTestServer(t, b)
	for _, name := range []string{"held", "forgotten"} {
		if err := s.Define(ctx, name, map[string]string{"plugin": "p", "volume_id": name}, nil); err != nil {
			t.Fatal(err)
		}
	}
	docker := WithEngine(ctx, namedvol.EngineDocker, "/var/lib/docker")
	for _, m := range []struct {
		ctx      context.Context
		name, id string
	}{
		{docker, "held", "m1"}, {docker, "forgotten", "m2"},
		{WithEngine(ctx, namedvol.EngineDocker, "/srv/other-docker"), "forgotten", "m3"},
		{WithEngine(ctx, namedvol.EngineDocker, ""), "forgotten", "m4"},
		{WithEngine(ctx, namedvol.EnginePodman, ""), "forgotten", "m5"},
	} {
		if _, err := s.Mount(m.ctx, &volume.MountRequest{Name: m.name, ID: m.id}); err != nil {
			t.Fatal(err)
		}
	}
	known := map[string]bool{"held": true, "forgotten": true}
	inUse := map[string]bool{"held": true}
	if released, failed := s.ReleaseUnused(ctx, namedvol.EngineDocker, "/var/lib/docker", known, inUse, time.Hour); len(released) != 0 || len(failed) != 0 {
		t.Errorf("within the grace: released %v, failed %v", released, failed)
	}
	released, failed := s.ReleaseUnused(ctx, namedvol.EngineDocker, "/var/lib/docker", known, inUse, 0)
	if len(failed) != 0 || len(released) != 1 || released[0] != "forgotten/m2" {
		t.Errorf("released %v, failed %v; want forgotten/m2 only", released, failed)
	}
	if released, _ := s.ReleaseUnused(ctx, namedvol.EngineDocker, "", known, inUse, 0); len(released) != 0 {
		t.Errorf("a daemon of unknown data root released %v", released)
	}
	if len(b.containers) != 4 {
		t.Errorf("%d engine mounts left, want 4", len(b.containers))
	}
}
