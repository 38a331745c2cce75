package dockerplugin

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/docker/go-plugins-helpers/sdk"
	"github.com/docker/go-plugins-helpers/volume"

	"github.com/csiagent/csiagent/internal/atomicfile"
	"github.com/csiagent/csiagent/internal/keyedlock"
	"github.com/csiagent/csiagent/isolator"
	"github.com/csiagent/csiagent/namedvol"
	statev1 "github.com/csiagent/csiagent/proto/state/v1"
)

// StatusOptions is the key of a volume's Status that holds its definition
// as options.
const StatusOptions = "options"

// mountDir is where, inside a mount's own directory, the volume is bound.
const mountDir = "/data"

// maxRequest bounds a request body.
const maxRequest = 1 << 20

// pageBytes bounds the definitions of a Page, as JSON options: a page
// holds at least one volume, and more only while they fit.
const pageBytes = 1 << 20

// Backend is the agent's isolator, as the server uses it (its own types:
// an engine mount is an isolator container).
type Backend interface {
	// Prepare and Cleanup wait for the isolator's first recovery pass.
	Prepare(ctx context.Context, req *statev1.PrepareRequest) ([]*statev1.ContainerMount, error)
	Cleanup(ctx context.Context, containerID string) error
	ListContainers() []isolator.ContainerInfo
	ListVolumes() []isolator.VolumeInfo
	// CheckPlugin says why a plugin type cannot be used (not configured).
	CheckPlugin(pluginType string) error
	// CreateVolume creates a definition's backend volume (CSI CreateVolume
	// with its Provision's CSIName, its capability, and secrets) and records
	// the answer in it (Definition.Created); DeleteVolume deletes one.
	CreateVolume(ctx context.Context, d *namedvol.Definition, secrets map[string]string) error
	DeleteVolume(ctx context.Context, pluginType, volumeID string, secrets map[string]string) error
}

// Config configures a Server.
type Config struct {
	Store   *namedvol.Store
	Backend Backend
	// Dir holds the engine mounts: a directory and a record per mount.
	Dir string
	// Commit writes the records: the daemon's Committer of the work dir
	// Dir is in.
	Commit *atomicfile.Committer
	Logger *slog.Logger
	// NodeID is the agent's node id: the names of the volumes it creates
	// are made from it (namedvol.CSIName).
	NodeID string
	// CrashPoint, for crash tests only, is called after each step of a
	// volume's creation with a name for the point; it may kill the
	// process.
	CrashPoint func(point string)
	// BootID is the boot the agent runs in: engine mounts recorded in
	// another one are held by no engine (ReleaseFormerBoot).
	BootID string
}

// Server is the volume plugin endpoint.
type Server struct {
	cfg    Config
	log    *slog.Logger
	commit *atomicfile.Committer

	// locks serialise the calls on each volume name.
	locks keyedlock.Map

	mu    sync.Mutex
	users map[string]*user // by container id
	// formerBoot are the engine mounts recorded in another boot, by
	// container id (volume name as value), for ReleaseFormerBoot.
	formerBoot map[string]string
}

// user is one engine mount of a named volume, as recorded in Dir/ID.json.
type user struct {
	Name string `json:"name"`
	// ID is the engine's mount id.
	ID string `json:"id"`
	// Count is how many Mounts of the pair have not been unmounted.
	Count int `json:"count"`
	// Engine is the engine that mounted it (WithEngine: docker, podman),
	// "" when unknown (records written before engines were told apart);
	// Instance which daemon of it (Docker: its data root), "" if unknown.
	Engine   string `json:"engine,omitempty"`
	Instance string `json:"instance,omitempty"`
	// MountedAt is the time of its last Mount (zero in records written
	// before it was kept).
	MountedAt time.Time `json:"mounted_at,omitzero"`
	// Boot is the boot of its last Mount ("" in records written before
	// it was kept).
	Boot string `json:"boot,omitempty"`
}

type engineKey struct{}

// engine is who makes the calls of a context (WithEngine).
type engine struct{ name, instance string }

// WithEngine says which engine (namedvol.EngineDocker, namedvol.EnginePodman, "" unknown)
// makes the calls of ctx, and which daemon of it (instance: Docker's data
// root; "" unknown); Mount records both with the engine mount.
func WithEngine(ctx context.Context, name, instance string) context.Context {
	return context.WithValue(ctx, engineKey{}, engine{name, instance})
}

// engineOf is the engine WithEngine put in ctx, zero if none.
func engineOf(ctx context.Context) engine {
	e, _ := ctx.Value(engineKey{}).(engine)
	return e
}

// creatorOf is who defines or removes a volume in ctx: the engine
// WithEngine names (namedvol.EngineUnknown for a peer it did not recognise), or,
// without WithEngine, namedvol.CreatorAPI.
func creatorOf(ctx context.Context) string {
	e, ok := ctx.Value(engineKey{}).(engine)
	switch {
	case !ok:
		return namedvol.CreatorAPI
	case e.name == "":
		return namedvol.EngineUnknown
	}
	return e.name
}

// New loads the recorded engine mounts. Records whose container the
// isolator does not have (a crash before the prepare, or after the
// cleanup) are removed with their directories; those whose container is
// PREPARING or CLEANING (a Mount or an Unmount a crash cut: never
// answered, and rolled back or finished by the isolator's recovery) are
// not counted. A quarantined container's mount counts: it stays.
func New(cfg Config) (*Server, error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	s := &Server{cfg: cfg, log: cfg.Logger, commit: cfg.Commit, users: map[string]*user{}, formerBoot: map[string]string{}}
	if err := s.commit.MkdirAll(cfg.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("creating the engine mount directory: %w", err)
	}
	phases := map[string]statev1.ContainerCheckpoint_Phase{}
	for _, c := range cfg.Backend.ListContainers() {
		phases[c.ID] = c.Phase
	}
	ents, err := os.ReadDir(cfg.Dir)
	if err != nil {
		return nil, fmt.Errorf("reading the engine mount records: %w", err)
	}
	for _, e := range ents {
		cid, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok || !strings.HasPrefix(cid, namedvol.EngineMountPrefix) {
			continue
		}
		u := &user{}
		data, _, err := atomicfile.ReadRecord(s.commit.Root(), filepath.Join(cfg.Dir, e.Name()))
		if err == nil {
			err = json.Unmarshal(data, u)
		}
		phase, known := phases[cid]
		if err != nil || containerID(u.Name, u.ID) != cid || !known {
			s.log.Info("removing an engine mount record without its container", "record", e.Name(), "error", err)
			if err := s.forget(cid); err != nil {
				// Left for the next start; the agent starts.
				s.log.Error("removing an engine mount record without its container", "record", e.Name(), "error", err)
			}
			continue
		}
		if phase == statev1.ContainerCheckpoint_PREPARING || phase == statev1.ContainerCheckpoint_CLEANING {
			// Its record and directory go with the next start, once
			// recovery has undone the mount.
			s.log.Info("an engine mount a crash interrupted is not counted", "volume", u.Name, "mount_id", namedvol.Clip(u.ID))
			continue
		}
		if u.Boot != "" && cfg.BootID != "" && u.Boot != cfg.BootID {
			// Mounted before a reboot: no engine holds it now (one
			// that mounts it again starts a new count).
			s.formerBoot[cid] = u.Name
			continue
		}
		s.users[cid] = u
	}
	return s, nil
}

// ReleaseFormerBoot cleans up the engine mounts recorded before a reboot
// that no engine has mounted again since (their containers, which the
// isolator's recovery brought back, and their records): engines hold no
// mount across a reboot, and one that unmounts nothing would leave the
// volume published for good. Called once the isolator has recovered;
// what fails is logged and left to Reconcile.
func (s *Server) ReleaseFormerBoot(ctx context.Context) {
	s.mu.Lock()
	former := maps.Clone(s.formerBoot)
	clear(s.formerBoot)
	s.mu.Unlock()
	for _, cid := range slices.Sorted(maps.Keys(former)) {
		name := former[cid]
		func() {
			unlock, err := s.lock(ctx, name)
			if err != nil {
				s.log.Warn("releasing an engine mount of a former boot", "volume", name, "error", err)
				return
			}
			defer unlock()
			s.mu.Lock()
			again := s.users[cid] != nil // mounted again in this boot
			s.mu.Unlock()
			if again {
				return
			}
			if err := s.cfg.Backend.Cleanup(ctx, cid); err != nil {
				s.log.Warn("releasing an engine mount of a former boot", "volume", name, "error", err)
				return
			}
			if err := s.forget(cid); err != nil {
				s.log.Warn("removing an engine mount record of a former boot", "volume", name, "error", err)
				return
			}
			s.log.Info("released an engine mount of a former boot", "volume", name)
		}()
	}
}

// containerID names an engine mount's isolator container.
func containerID(name, mountID string) string {
	h := sha256.Sum256([]byte(name + "\x00" + mountID))
	return namedvol.EngineMountPrefix + hex.EncodeToString(h[:16])
}

func (s *Server) recordPath(cid string) string { return filepath.Join(s.cfg.Dir, cid+".json") }
func (s *Server) rootfs(cid string) string     { return filepath.Join(s.cfg.Dir, cid) }

// record writes a user's record, durably.
func (s *Server) record(ctx context.Context, cid string, u *user) error {
	data, err := json.Marshal(u)
	if err != nil {
		return fmt.Errorf("encoding the mount record: %w", err)
	}
	n, err := s.commit.Put(s.recordPath(cid), data, 0o600)
	if err != nil {
		return fmt.Errorf("recording the mount: %w", err)
	}
	return s.commit.Wait(ctx, n)
}

// forget removes a mount's directory (only if empty: nothing is mounted
// on it) and then its record.
func (s *Server) forget(cid string) error {
	root := s.rootfs(cid)
	for _, dir := range []string{root + mountDir, root} {
		if err := os.Remove(dir); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("removing the mount directory: %w", err)
		}
	}
	if _, err := s.commit.Remove(s.recordPath(cid)); err != nil {
		return fmt.Errorf("removing the mount record: %w", err)
	}
	s.mu.Lock()
	delete(s.users, cid)
	s.mu.Unlock()
	return nil
}

// lock serialises the calls on one volume name.
func (s *Server) lock(ctx context.Context, name string) (func(), error) {
	unlock, err := s.locks.Lock(ctx, name)
	if err != nil {
		return nil, fmt.Errorf("volume %s: waiting for another call on it: %w", name, err)
	}
	return unlock, nil
}

// backendEngineMounts lists the engine mount ids of every named volume
// defined as the backend volume plugin/id.
func (s *Server) backendEngineMounts(plugin, id string) []string {
	s.mu.Lock()
	byName := map[string][]string{}
	for _, u := range s.users {
		byName[u.Name] = append(byName[u.Name], u.ID)
	}
	s.mu.Unlock()
	var out []string
	for name, ids := range byName { // one definition read a name
		if d, err := s.cfg.Store.Get(name); err == nil && d.Plugin == plugin && d.VolumeID == id {
			out = append(out, ids...)
		}
	}
	slices.Sort(out)
	return out
}

// usersOf lists a volume's engine mounts.
func (s *Server) usersOf(name string) []*user {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*user
	for _, u := range s.users {
		if u.Name == name {
			out = append(out, u)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// Create is Docker's Create: Define.
func (s *Server) Create(ctx context.Context, req *volume.CreateRequest) error {
	return s.Define(ctx, req.Name, req.Options, nil)
}

// Define defines a named volume from engine options; with size it creates
// the backend volume (see provision).
func (s *Server) Define(ctx context.Context, name string, options map[string]string, secrets map[string]string) error {
	if err := namedvol.ValidateName(name); err != nil {
		return err
	}
	d, err := namedvol.ParseOptions(name, options)
	if err != nil {
		return err
	}
	d.Creator = creatorOf(ctx)
	if err := s.cfg.Backend.CheckPlugin(d.Plugin); err != nil {
		return fmt.Errorf("option %s=%s: %w", namedvol.KeyPlugin, d.Plugin, err)
	}
	unlock, err := s.lock(ctx, name)
	if err != nil {
		return err
	}
	defer unlock()
	if d.Provision != nil {
		return s.provision(ctx, d, secrets)
	}
	if err := s.cfg.Store.Create(ctx, d); err != nil {
		return err
	}
	s.log.Info("named volume created", "name", d.Name, "plugin", d.Plugin, "volume_id", d.VolumeID, "creator", d.Creator)
	return nil
}

// Remove is Docker's Remove: Undefine.
// An engine's removal deletes the backend volume of a definition created
// with delete_on_remove=true.
func (s *Server) Remove(ctx context.Context, req *volume.RemoveRequest) error {
	return s.undefine(ctx, req.Name, deleteOnRemove, nil)
}

// deletion is what undefine does to the backend volume.
type deletion int

const (
	keepVolume deletion = iota
	// deleteVolume deletes it (DeleteVolume) before the definition goes.
	deleteVolume
	// deleteOnRemove deletes it when the definition says so
	// (delete_on_remove=true): an engine's removal.
	deleteOnRemove
)

// Undefine deletes a named volume that no engine mount and no container
// uses (namedvol.ErrInUse); an engine (WithEngine) only one it created
// (namedvol.Definition.CheckRemove), the API any. With del, the backend
// volume is deleted first (secrets for DeleteVolume); a crash between the
// two leaves the definition, and removing it again deletes again (a
// volume already gone counts as deleted).
func (s *Server) Undefine(ctx context.Context, name string, del bool, secrets map[string]string) error {
	return s.undefine(ctx, name, map[bool]deletion{false: keepVolume, true: deleteVolume}[del], secrets)
}

func (s *Server) undefine(ctx context.Context, name string, deletion deletion, secrets map[string]string) error {
	if err := namedvol.ValidateName(name); err != nil {
		return err
	}
	unlock, err := s.lock(ctx, name)
	if err != nil {
		return err
	}
	defer unlock()
	d, err := s.cfg.Store.Get(name)
	if errors.Is(err, namedvol.ErrNotFound) {
		// Maybe removed by a call whose wait ended first: answered as
		// that call would have been, once its removal is durable.
		if serr := s.cfg.Store.Sync(ctx); serr != nil {
			return serr
		}
	}
	if err != nil {
		return err
	}
	if by := creatorOf(ctx); by != namedvol.CreatorAPI {
		if err := d.CheckRemove(by); err != nil {
			return err
		}
	}
	if us := s.usersOf(name); len(us) > 0 {
		return fmt.Errorf("volume %s is in use by %d engine mount(s); unmount it first: %w", name, len(us), namedvol.ErrInUse)
	}
	// Containers given the volume by name through the agent (the mounts
	// annotation, prepare --mounts) hold its CSI volume.
	for _, v := range s.cfg.Backend.ListVolumes() {
		if cs := v.Users; v.Plugin == d.Plugin && v.ID == d.VolumeID && len(cs) > 0 {
			shown := strings.Join(cs[:min(len(cs), 3)], ", ")
			if len(cs) > 3 {
				shown += ", ..."
			}
			return fmt.Errorf("volume %s is in use by %d container(s): %s; clean them up first: %w", name, len(cs), shown, namedvol.ErrInUse)
		}
	}
	if d.Creating() {
		// The plugin may have made the volume, under the name only
		// this intent records: removing it would lose the volume.
		return fmt.Errorf("volume %s: %w: the plugin may have made its volume already; create it again with the same options to finish it, then remove it", name, namedvol.ErrCreating)
	}
	remove := deletion == deleteVolume || (deletion == deleteOnRemove && d.Provision != nil && d.Provision.DeleteOnRemove)
	if remove {
		if err := s.cfg.Backend.DeleteVolume(ctx, d.Plugin, d.VolumeID, secrets); err != nil {
			return fmt.Errorf("volume %s: deleting its backend volume %s: %w", name, d.VolumeID, err)
		}
	}
	if err := s.cfg.Store.Remove(ctx, name); err != nil {
		return err
	}
	s.log.Info("named volume removed", "name", name, "backend_volume_deleted", remove)
	return nil
}

// Mount stages and publishes the volume for one engine mount and returns
// the directory the engine binds into its container.
func (s *Server) Mount(ctx context.Context, req *volume.MountRequest) (*volume.MountResponse, error) {
	unlock, err := s.lock(ctx, req.Name)
	if err != nil {
		return nil, err
	}
	defer unlock()
	d, err := s.cfg.Store.Get(req.Name)
	if err != nil {
		return nil, err
	}
	if err := d.CheckUsable(); err != nil {
		return nil, err
	}
	if d.Block {
		return nil, fmt.Errorf("volume %s is a block volume: container engines' volume plugins mount filesystems only", req.Name)
	}
	if req.ID == "" || len(req.ID) > namedvol.MaxValue {
		return nil, fmt.Errorf("mount id %q (%d bytes): expected 1 to %d bytes", namedvol.Clip(req.ID), len(req.ID), namedvol.MaxValue)
	}
	cid := containerID(req.Name, req.ID)
	s.mu.Lock()
	u := s.users[cid]
	s.mu.Unlock()
	if u != nil && !s.prepared(cid) {
		// A Mount that a crash interrupted (then rolled back by the
		// isolator's recovery) never answered the engine: not a user.
		u = nil
	}
	eng := engineOf(ctx)
	next := &user{Name: req.Name, ID: req.ID, Count: 1, Engine: eng.name, Instance: eng.instance, MountedAt: time.Now(), Boot: s.cfg.BootID}
	if u != nil {
		next.Count = u.Count + 1
	}
	// Recorded first: after a crash, a record without its container is
	// removed; a container without its record cannot exist.
	if err := s.record(ctx, cid, next); err != nil {
		return nil, err
	}
	root := s.rootfs(cid)
	mounts, err := func() ([]*statev1.ContainerMount, error) {
		if err := os.MkdirAll(root, 0o700); err != nil {
			return nil, fmt.Errorf("creating the mount directory: %w", err)
		}
		return s.cfg.Backend.Prepare(ctx, &statev1.PrepareRequest{
			ContainerId: cid, Rootfs: root, Volumes: []*statev1.Volume{d.Volume(mountDir, false)}, User: d.EngineUser(),
		})
	}()
	if err != nil {
		if u == nil {
			// The failed prepare was rolled back: nothing is mounted.
			if ferr := s.forget(cid); ferr != nil {
				s.log.Error("removing a failed mount's directory", "volume", req.Name, "error", ferr)
			}
		} else if rerr := s.record(context.WithoutCancel(ctx), cid, u); rerr != nil {
			s.log.Error("restoring a mount record", "volume", req.Name, "error", rerr)
		}
		return nil, fmt.Errorf("mounting volume %s: %w", req.Name, err)
	}
	s.mu.Lock()
	s.users[cid] = next
	s.mu.Unlock()
	s.log.Info("engine mounted a volume", "volume", req.Name, "mount_id", req.ID, "count", next.Count)
	return &volume.MountResponse{Mountpoint: mounts[0].GetMountPoint()}, nil
}

// prepared reports whether the isolator holds an engine mount's container
// prepared.
func (s *Server) prepared(cid string) bool {
	for _, c := range s.cfg.Backend.ListContainers() {
		if c.ID == cid {
			return c.Phase == statev1.ContainerCheckpoint_PREPARED
		}
	}
	return false
}

// Unmount releases one engine mount; the last release of a pair cleans
// its container up (the volume's last user unpublishes it).
func (s *Server) Unmount(ctx context.Context, req *volume.UnmountRequest) error {
	unlock, err := s.lock(ctx, req.Name)
	if err != nil {
		return err
	}
	defer unlock()
	cid := containerID(req.Name, req.ID)
	s.mu.Lock()
	u := s.users[cid]
	s.mu.Unlock()
	if u == nil {
		return nil
	}
	if u.Count > 1 {
		next := &user{Name: u.Name, ID: u.ID, Count: u.Count - 1, Engine: u.Engine, Instance: u.Instance, MountedAt: u.MountedAt}
		if err := s.record(ctx, cid, next); err != nil {
			return err
		}
		s.mu.Lock()
		s.users[cid] = next
		s.mu.Unlock()
		return nil
	}
	if err := s.releaseLocked(ctx, cid, req.Name); err != nil {
		return err
	}
	s.log.Info("engine unmounted a volume", "volume", req.Name, "mount_id", req.ID)
	return nil
}

// releaseLocked cleans up an engine mount's container and forgets it;
// the caller holds the volume's lock.
func (s *Server) releaseLocked(ctx context.Context, cid, name string) error {
	if err := s.cfg.Backend.Cleanup(ctx, cid); err != nil {
		return fmt.Errorf("unmounting volume %s: %w", name, err)
	}
	return s.forget(cid)
}

// Reconcile releases, whatever their counts, the engine's mounts whose id
// is not live: what an engine forgot to unmount (it crashed, or lost its
// state) would otherwise stay published. Other engines' mounts are not
// looked at ("": the mounts of no known engine). It returns NAME/ID of
// each released mount and the error of each that was not.
func (s *Server) Reconcile(ctx context.Context, engine string, live []string) (released []string, failed map[string]string) {
	isLive := map[string]bool{}
	for _, id := range live {
		isLive[id] = true
	}
	return s.releaseWhere(ctx, func(u *user) bool { return u.Engine == engine && !isLive[u.ID] })
}

// ReleaseUnused releases, whatever their counts, the mounts made by one
// daemon of the engine (instance: Docker's data root) of volumes it knows
// (known, by name) but no container of it uses (inUse), last mounted more
// than grace ago (a docker cp of a stopped container mounts for the length
// of its copy): what the daemon forgot when it was killed with containers
// running. Another daemon's mounts, and mounts whose daemon is unknown,
// are kept. Returns as Reconcile.
func (s *Server) ReleaseUnused(ctx context.Context, engine, instance string, known, inUse map[string]bool, grace time.Duration) (released []string, failed map[string]string) {
	return s.releaseWhere(ctx, func(u *user) bool {
		return u.Engine == engine && instance != "" && u.Instance == instance && known[u.Name] && !inUse[u.Name] && time.Since(u.MountedAt) > grace
	})
}

// HasMounts reports whether the engine holds any mount (ReleaseUnused
// then has something to look at).
func (s *Server) HasMounts(engine string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, u := range s.users {
		if u.Engine == engine {
			return true
		}
	}
	return false
}

// releaseWhere releases the engine mounts gone says are gone, asking it
// again under each name's lock.
func (s *Server) releaseWhere(ctx context.Context, gone func(*user) bool) (released []string, failed map[string]string) {
	s.mu.Lock()
	var candidates []user
	for _, u := range s.users {
		if gone(u) {
			candidates = append(candidates, *u)
		}
	}
	s.mu.Unlock()
	sort.Slice(candidates, func(i, j int) bool {
		return candidates[i].Name+candidates[i].ID < candidates[j].Name+candidates[j].ID
	})
	released, failed = []string{}, map[string]string{}
	for _, u := range candidates {
		ok, err := s.release(ctx, u.Name, u.ID, gone)
		switch {
		case err != nil:
			failed[u.Name+"/"+u.ID] = err.Error()
		case ok:
			released = append(released, u.Name+"/"+u.ID)
		}
	}
	return released, failed
}

// release drops every count of one engine mount if gone still says so.
func (s *Server) release(ctx context.Context, name, id string, gone func(*user) bool) (bool, error) {
	unlock, err := s.lock(ctx, name)
	if err != nil {
		return false, err
	}
	defer unlock()
	cid := containerID(name, id)
	s.mu.Lock()
	u := s.users[cid]
	s.mu.Unlock()
	if u == nil || !gone(u) {
		return false, nil
	}
	if err := s.releaseLocked(ctx, cid, name); err != nil {
		return false, err
	}
	s.log.Info("released an engine mount the engine no longer uses", "volume", name, "mount_id", id, "engine", u.Engine, "count", u.Count)
	return true, nil
}

// mountpoint is where a volume is mounted for the engine (its first
// mount), or "".
func (s *Server) mountpoint(name string) string {
	if us := s.usersOf(name); len(us) > 0 {
		return s.rootfs(containerID(name, us[0].ID)) + mountDir
	}
	return ""
}

// Path reports where the volume is mounted.
func (s *Server) Path(req *volume.PathRequest) (*volume.PathResponse, error) {
	if _, err := s.cfg.Store.Get(req.Name); err != nil {
		return nil, err
	}
	return &volume.PathResponse{Mountpoint: s.mountpoint(req.Name)}, nil
}

// Get reports one named volume.
func (s *Server) Get(req *volume.GetRequest) (*volume.GetResponse, error) {
	st, err := s.Status(req.Name)
	if err != nil {
		return nil, err
	}
	return &volume.GetResponse{Volume: dockerVolume(st)}, nil
}

// List reports every named volume.
func (s *Server) List() (*volume.ListResponse, error) {
	defs, err := s.cfg.Store.List()
	if err != nil && len(defs) == 0 {
		return nil, err
	}
	if err != nil {
		s.log.Warn("listing named volumes", "error", err)
	}
	vols := s.cfg.Backend.ListVolumes()
	out := &volume.ListResponse{Volumes: []*volume.Volume{}}
	for _, d := range defs {
		out.Volumes = append(out.Volumes, dockerVolume(s.status(d, vols)))
	}
	return out, nil
}

// Status reports one named volume.
func (s *Server) Status(name string) (namedvol.Status, error) {
	d, err := s.cfg.Store.Get(name)
	if err != nil {
		return namedvol.Status{}, err
	}
	return s.status(d, s.cfg.Backend.ListVolumes()), nil
}

// Page reports the named volumes whose names sort after after ("": from
// the first), at most max of them (0: no bound) and while their
// definitions fit in pageBytes (always one), and the after of the next
// page ("" after the last). A definition that cannot be read is logged and
// skipped, as List does.
func (s *Server) Page(after string, max int) ([]namedvol.Status, string, error) {
	names, err := s.cfg.Store.Names()
	if err != nil {
		return nil, "", err
	}
	names = names[sort.SearchStrings(names, after):]
	if len(names) > 0 && names[0] == after {
		names = names[1:]
	}
	vols := s.cfg.Backend.ListVolumes()
	var out []namedvol.Status
	size := 0
	for _, name := range names {
		d, err := s.cfg.Store.Get(name)
		if err != nil {
			// A volume removed since Names is no problem.
			if !errors.Is(err, namedvol.ErrNotFound) {
				s.log.Warn("listing named volumes", "error", err)
			}
			continue
		}
		if len(out) > 0 && (size+d.Size() > pageBytes || (max > 0 && len(out) == max)) {
			return out, out[len(out)-1].Name, nil
		}
		size += d.Size()
		out = append(out, s.status(d, vols))
	}
	return out, "", nil
}

// status is a named volume's definition and use.
func (s *Server) status(d *namedvol.Definition, vols []isolator.VolumeInfo) namedvol.Status {
	st := namedvol.Status{Definition: d, State: namedvol.NotPublished, EngineMounts: []string{}, Mountpoint: s.mountpoint(d.Name)}
	if d.Creating() {
		st.State = namedvol.Creating
	}
	for _, v := range vols {
		if v.Plugin == d.Plugin && v.ID == d.VolumeID {
			st.State = v.State.String()
			st.Containers = len(v.Users)
		}
	}
	for _, u := range s.usersOf(d.Name) {
		st.EngineMounts = append(st.EngineMounts, u.ID)
	}
	return st
}

// dockerVolume is a named volume as Get and List show it to engines:
// Status holds the definition's options (secret references, never values;
// they parse back with namedvol.ParseOptions), the volume's state in the
// agent and its engine mounts.
func dockerVolume(st namedvol.Status) *volume.Volume {
	status := map[string]any{StatusOptions: st.Options(), "state": st.State, "mounts": st.EngineMounts}
	if st.Creator != "" {
		status["creator"] = st.Creator
	}
	if st.State != namedvol.NotPublished {
		status["containers"] = st.Containers
	}
	return &volume.Volume{Name: st.Name, Mountpoint: st.Mountpoint, Status: status}
}

// Resolve makes the volumes of named mounts, with the annotation policy
// when they come from an annotation (Status.CheckAnnotationUse), and
// calls use with them while it holds their names' locks: no engine mount
// and no removal of those names comes between the check and use (a
// prepare). Block volumes cannot be named.
func (s *Server) Resolve(ctx context.Context, mounts []namedvol.Mount, annotation bool, use func([]*statev1.Volume) error) error {
	var names []string
	for i, m := range mounts {
		if err := namedvol.ValidateName(m.Name); err != nil {
			return fmt.Errorf("%s: %w", namedvol.MountLabel(annotation, i), err)
		}
		names = append(names, m.Name)
	}
	unlock, err := s.locks.LockAll(ctx, names...)
	if err != nil {
		return fmt.Errorf("named volumes %s: waiting for another call on them: %w", strings.Join(names, ", "), err)
	}
	defer unlock()
	vols := make([]*statev1.Volume, 0, len(mounts))
	for i, m := range mounts {
		st, err := s.Status(m.Name)
		if err == nil {
			err = st.CheckUsable()
		}
		if err == nil && annotation {
			// Every engine mount of its backend volume counts, under
			// any name that defines it (an alias may lack the policy).
			st.EngineMounts = s.backendEngineMounts(st.Plugin, st.VolumeID)
			err = st.CheckAnnotationUse()
		}
		if err == nil && st.Block {
			err = fmt.Errorf("%w: volume %s is a block volume; give it as a volume, not by name", namedvol.ErrInvalid, st.Name)
		}
		if err != nil {
			return fmt.Errorf("%s: %w", namedvol.MountLabel(annotation, i), err)
		}
		vols = append(vols, st.Volume(m.ContainerPath, m.ReadOnly))
	}
	return use(vols)
}

// Handler serves the protocol. Each call is bounded by timeout.
func (s *Server) Handler(timeout time.Duration) http.Handler {
	mux := http.NewServeMux()
	reply := func(w http.ResponseWriter, res any, err error) {
		if err != nil {
			sdk.EncodeResponse(w, volume.NewErrorResponse(err.Error()), true)
			return
		}
		sdk.EncodeResponse(w, res, false)
	}
	// handle decodes a request of type Req and answers with what f
	// returns.
	handle := func(path string, f func(ctx context.Context, body []byte) (any, error)) {
		mux.HandleFunc("POST "+path, func(w http.ResponseWriter, r *http.Request) {
			ctx, cancel := context.WithTimeout(r.Context(), timeout)
			defer cancel()
			body, err := readBody(w, r)
			if err != nil {
				reply(w, nil, err)
				return
			}
			res, err := f(ctx, body)
			switch {
			case errors.Is(err, namedvol.ErrNotFound):
				// Engines ask for volumes of other drivers.
				s.log.Debug("volume plugin call failed", "call", path, "error", err)
			case err != nil:
				s.log.Warn("volume plugin call failed", "call", path, "error", err)
			}
			reply(w, res, err)
		})
	}
	handle("/Plugin.Activate", func(context.Context, []byte) (any, error) {
		return map[string][]string{"Implements": {"VolumeDriver"}}, nil
	})
	handle("/VolumeDriver.Capabilities", func(context.Context, []byte) (any, error) {
		return &volume.CapabilitiesResponse{Capabilities: volume.Capability{Scope: "local"}}, nil
	})
	handle("/VolumeDriver.List", func(context.Context, []byte) (any, error) { return s.List() })
	handle("/VolumeDriver.Create", decoded(func(ctx context.Context, req *volume.CreateRequest) (any, error) {
		return struct{}{}, s.Create(ctx, req)
	}))
	handle("/VolumeDriver.Remove", decoded(func(ctx context.Context, req *volume.RemoveRequest) (any, error) {
		return struct{}{}, s.Remove(ctx, req)
	}))
	handle("/VolumeDriver.Mount", decoded(s.Mount))
	handle("/VolumeDriver.Unmount", decoded(func(ctx context.Context, req *volume.UnmountRequest) (any, error) {
		return struct{}{}, s.Unmount(ctx, req)
	}))
	handle("/VolumeDriver.Path", decoded(func(_ context.Context, req *volume.PathRequest) (any, error) { return s.Path(req) }))
	handle("/VolumeDriver.Get", decoded(func(_ context.Context, req *volume.GetRequest) (any, error) { return s.Get(req) }))
	return mux
}

// decoded adapts a typed call to the mux: the body is the JSON of Req.
func decoded[Req any, Res any](f func(context.Context, *Req) (Res, error)) func(context.Context, []byte) (any, error) {
	return func(ctx context.Context, body []byte) (any, error) {
		req := new(Req)
		if err := json.Unmarshal(body, req); err != nil {
			return nil, fmt.Errorf("decoding the request: %w", err)
		}
		return f(ctx, req)
	}
}

func readBody(w http.ResponseWriter, r *http.Request) ([]byte, error) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxRequest))
	if err != nil {
		return nil, fmt.Errorf("reading the request: %w", err)
	}
	return body, nil
}
