package integration

import (
	"context"
	crand "crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/internal/testhelp"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	"github.com/csiagent/csiagent/supervisor"
)

// soakSmoke is how long TestSoak runs in `make test`; `make soak
// DURATION=10m` sets CSIAGENT_SOAK_DURATION for a long run.
const soakSmoke = 15 * time.Second

// soakStats are the figures a soak prints.
type soakStats struct {
	ops, prepares, cleanups, reclaims, agentKills, pluginKills, checks, checksums, violations int
}

// soak is the state of a soak run: the agent process, and the model of
// what must be true: which containers are alive with which volumes, and
// the checksum of every file written to each volume.
type soak struct {
	t     *testing.T
	h     *harness
	typ   string
	pool  string
	rng   *rand.Rand
	ca    *crashAgent
	vols  []string
	ids   []string
	sb    map[string]string
	alive map[string][]string // container -> volume ids
	files map[string]map[string][32]byte
	seq   int
	// pluginKillsInARow counts plugin kills since the last agent kill.
	pluginKillsInARow int
	stats             soakStats
}

// TestSoak runs random container prepares and cleanups on csi-loop-plugin
// volumes, writes checksummed files through the containers' paths, asks
// for reclaims, and SIGKILLs the agent and the managed plugin at random
// moments, some in the middle of a call. After every kill, and every few
// operations, it checks: no leaked mount or loop device, every volume's
// state and users match the containers alive, every checksum verifies.
// It runs for CSIAGENT_SOAK_DURATION (default 15s, the smoke run of `make
// test`), then cleans up and prints its figures.
func TestSoak(t *testing.T) {
	testhelp.NeedRoot(t)
	duration := soakSmoke
	if d := os.Getenv("CSIAGENT_SOAK_DURATION"); d != "" {
		var err error
		if duration, err = time.ParseDuration(d); err != nil {
			t.Fatalf("CSIAGENT_SOAK_DURATION: %v", err)
		}
	}
	seed := uint64(time.Now().UnixNano())
	t.Logf("soak: %v, seed %d", duration, seed)
	h := newHarness(t)
	sweepOnExit(t, h)
	s := &soak{
		t: t, h: h, typ: "loop.soak", rng: rand.New(rand.NewPCG(seed, seed^0x5eed)),
		vols: []string{"v0", "v1", "v2"}, sb: map[string]string{},
		alive: map[string][]string{}, files: map[string]map[string][32]byte{},
	}
	s.pool = h.loopPlugin(s.typ)
	for _, v := range s.vols {
		createVolumeSize(t, s.pool, v, "32MiB")
		s.files[v] = map[string][32]byte{}
	}
	for i := range 5 {
		id := fmt.Sprintf("c%d", i)
		s.ids = append(s.ids, id)
		s.sb[id] = h.dir("sb-" + id)
	}
	// The volumes start blank: faults may hit their very first format.
	s.ca = startCrashAgent(t, h, s.typ)

	deadline := time.Now().Add(duration)
	for time.Now().Before(deadline) && !t.Failed() {
		switch r := s.rng.IntN(100); {
		case r < 35:
			// With no fault injected, calls must succeed.
			if err := s.prepare(s.ca.client, s.pickDead()); err != nil {
				s.violation("Prepare: %v", err)
			}
		case r < 60:
			if err := s.cleanup(s.ca.client, s.pickAlive()); err != nil {
				s.violation("Cleanup: %v", err)
			}
		case r < 68:
			s.reclaim()
		case r < 84 || s.pluginKillsInARow >= 3:
			// Three plugin kills in a row make a crash loop whose
			// backoff (up to a minute) would idle the soak; an agent
			// restart resets it.
			s.killAgent()
		default:
			s.killPlugin()
		}
		s.stats.ops++
		if s.stats.ops%10 == 0 {
			s.check()
		}
	}
	s.check()
	// The end: every container cleaned up, every file of every volume
	// read back through one last container, nothing left.
	for _, id := range mapKeys(s.alive) {
		if err := s.cleanup(s.ca.client, id); err != nil {
			s.violation("Cleanup: %v", err)
		}
	}
	if err := s.prepareVolumes(s.ca.client, "verify", s.vols); err != nil {
		s.violation("Prepare of the verifier: %v", err)
	}
	if err := s.cleanup(s.ca.client, "verify"); err != nil {
		s.violation("Cleanup of the verifier: %v", err)
	}
	s.check()
	if ms := mountsUnder(t, h.work, h.extra); len(ms) > 0 {
		s.violation("mounts left at the end: %v", ms)
	}
	if devs := loopDevicesFor(t, s.pool); len(devs) > 0 {
		s.violation("loop devices left at the end: %v", devs)
	}
	st := s.stats
	summary := fmt.Sprintf("soak: duration=%v operations=%d prepares=%d cleanups=%d reclaims=%d agent_kills=%d plugin_kills=%d invariant_checks=%d checksums_verified=%d invariant_violations=%d",
		duration, st.ops, st.prepares, st.cleanups, st.reclaims, st.agentKills, st.pluginKills, st.checks, st.checksums, st.violations)
	t.Log(summary)
	if os.Getenv("CSIAGENT_SOAK_DURATION") != "" {
		fmt.Println(summary)
	}
	if st.violations > 0 {
		t.Fatalf("%d invariant violations", st.violations)
	}
}

func mapKeys[V any](m map[string]V) []string {
	return slices.Sorted(maps.Keys(m))
}

// violation records a broken invariant.
func (s *soak) violation(format string, args ...any) {
	s.t.Helper()
	s.stats.violations++
	s.t.Errorf("invariant violation: "+format, args...)
}

func (s *soak) pickDead() string {
	var dead []string
	for _, id := range s.ids {
		if _, ok := s.alive[id]; !ok {
			dead = append(dead, id)
		}
	}
	if len(dead) == 0 {
		return ""
	}
	return dead[s.rng.IntN(len(dead))]
}

func (s *soak) pickAlive() string {
	ids := mapKeys(s.alive)
	if len(ids) == 0 {
		return ""
	}
	return ids[s.rng.IntN(len(ids))]
}

// request builds a Prepare request for id with the given volumes, each
// at <sandbox>/<volume id>.
func (s *soak) request(id string, vols []string) *agentv1.PrepareRequest {
	req := &agentv1.PrepareRequest{ContainerId: id, Sandbox: s.sb[id]}
	if req.Sandbox == "" {
		req.Sandbox = s.h.dir("sb-" + id)
		s.sb[id] = req.Sandbox
	}
	for _, v := range vols {
		req.Volumes = append(req.Volumes, volumeSpec{plugin: s.typ, id: v, path: v}.volume())
	}
	return req
}

func (s *soak) randomVolumes() []string {
	vols := slices.Clone(s.vols)
	s.rng.Shuffle(len(vols), func(i, j int) { vols[i], vols[j] = vols[j], vols[i] })
	return vols[:1+s.rng.IntN(2)]
}

// prepare prepares id (if any) with random volumes and writes a file to
// each through the container's path.
func (s *soak) prepare(c agentv1.AgentClient, id string) error {
	if id == "" {
		return nil
	}
	return s.prepareVolumes(c, id, s.randomVolumes())
}

func (s *soak) prepareVolumes(c agentv1.AgentClient, id string, vols []string) error {
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	_, err := c.Prepare(ctx, s.request(id, vols))
	s.stats.prepares++
	if err != nil {
		return err
	}
	s.alive[id] = vols
	for _, v := range vols {
		s.verifyVolume(id, v)
		s.writeFile(id, v)
	}
	return nil
}

func (s *soak) cleanup(c agentv1.AgentClient, id string) error {
	if id == "" {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	_, err := c.Cleanup(ctx, &agentv1.CleanupRequest{ContainerId: id})
	s.stats.cleanups++
	if err == nil {
		delete(s.alive, id)
	}
	return err
}

// writeFile writes a random file to volume v through container id's path
// and remembers its checksum.
func (s *soak) writeFile(id, v string) {
	s.t.Helper()
	s.seq++
	b := make([]byte, 1024+s.rng.IntN(64<<10))
	_, _ = crand.Read(b)
	name := fmt.Sprintf("f%06d", s.seq)
	f, err := os.OpenFile(filepath.Join(s.sb[id], v, name), os.O_CREATE|os.O_WRONLY|os.O_EXCL, 0o644)
	if err == nil {
		_, err = f.Write(b)
		err = errors.Join(err, f.Sync(), f.Close())
	}
	if err != nil {
		s.violation("writing through container %s to %s: %v", id, v, err)
		return
	}
	s.files[v][name] = sha256.Sum256(b)
}

// verifyVolume checks every file written to v, read through container
// id's path.
func (s *soak) verifyVolume(id, v string) {
	s.t.Helper()
	for name, sum := range s.files[v] {
		b, err := os.ReadFile(filepath.Join(s.sb[id], v, name))
		if err != nil || sha256.Sum256(b) != sum {
			s.violation("volume %s file %s read through container %s: %v (checksum mismatch or missing): data lost", v, name, id, err)
			continue
		}
		s.stats.checksums++
	}
}

func (s *soak) reclaim() {
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	stream, err := s.ca.client.ReclaimSpace(ctx, &agentv1.ReclaimSpaceRequest{Target: &agentv1.ReclaimSpaceRequest_All{All: true}})
	for err == nil {
		_, err = stream.Recv()
	}
	if !errors.Is(err, io.EOF) {
		s.t.Logf("reclaim: %v", err) // not an invariant: a reclaim may fail
	}
	s.stats.reclaims++
}

// inFlight starts a random prepare or cleanup and returns a channel that
// yields once it has returned, and the container it is about.
func (s *soak) inFlight() (string, bool, <-chan error) {
	done := make(chan error, 1)
	client := s.ca.client
	if id := s.pickAlive(); id != "" && s.rng.IntN(2) == 0 {
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
			defer cancel()
			_, err := client.Cleanup(ctx, &agentv1.CleanupRequest{ContainerId: id})
			done <- err
		}()
		return id, false, done
	}
	id := s.pickDead()
	if id == "" {
		done <- errors.New("no container to prepare")
		return "", true, done
	}
	vols := s.randomVolumes()
	req := s.request(id, vols)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
		defer cancel()
		_, err := client.Prepare(ctx, req)
		done <- err
	}()
	s.alive[id] = vols // provisional: settled by what the agent reports
	return id, true, done
}

// adopt settles the model for the container an interrupted call was
// about: prepared (with the volumes asked) or absent, as the agent
// reports; anything else is a violation.
func (s *soak) adopt(id string, preparing bool, containers []*agentv1.ContainerStatus) {
	if id == "" {
		return
	}
	var found *agentv1.ContainerStatus
	for _, c := range containers {
		if c.ContainerId == id {
			found = c
		}
	}
	if found == nil {
		delete(s.alive, id)
		return
	}
	var got []string
	for _, m := range found.Mounts {
		got = append(got, m.VolumeId)
	}
	want := slices.Clone(s.alive[id])
	sort.Strings(got)
	sort.Strings(want)
	if !slices.Equal(got, want) {
		s.violation("container %s after an interrupted %s has volumes %v, want %v", id, map[bool]string{true: "prepare", false: "cleanup"}[preparing], got, want)
	}
	if preparing {
		for _, v := range s.alive[id] {
			s.verifyVolume(id, v)
			s.writeFile(id, v)
		}
	}
}

// killAgent SIGKILLs the agent, sometimes in the middle of a call, and
// starts a new one.
func (s *soak) killAgent() {
	id, preparing, done := "", false, (<-chan error)(nil)
	if s.rng.IntN(4) > 0 {
		id, preparing, done = s.inFlight()
		time.Sleep(time.Duration(s.rng.IntN(40)) * time.Millisecond)
	}
	s.ca.kill()
	s.stats.agentKills++
	s.pluginKillsInARow = 0
	if done != nil {
		<-done
	}
	s.ca = startCrashAgent(s.t, s.h, s.typ)
	containers, _ := settle(s.t, s.ca.client)
	s.adopt(id, preparing, containers)
	s.check()
}

// killPlugin SIGKILLs the managed plugin, sometimes in the middle of a
// call; the agent restarts it and retries.
func (s *soak) killPlugin() {
	pid := s.pluginPid()
	id, preparing, done := "", false, (<-chan error)(nil)
	if s.rng.IntN(2) > 0 {
		id, preparing, done = s.inFlight()
		time.Sleep(time.Duration(s.rng.IntN(40)) * time.Millisecond)
	}
	if pid <= 0 {
		// kill(0) or kill(-1) would kill the test itself, or everything.
		s.t.Fatalf("plugin pid %d", pid)
	}
	_ = unix.Kill(pid, unix.SIGKILL)
	s.stats.pluginKills++
	if done != nil {
		if err := <-done; err != nil {
			s.t.Logf("call interrupted by the plugin's death: %v", err)
		}
	}
	s.pluginKillsInARow++
	// The agent restarts a crash-looping plugin with backoff (1 s doubling
	// to 1 min, +20% jitter): wait for that, not just waitTimeout. The
	// agent clears the pid a moment before it leaves READY: wait for a
	// new pid, not just another one.
	deadline := time.Now().Add(agentBackoffMax*6/5 + waitTimeout)
	for {
		p := s.plugin()
		if p != nil && ready(p) && len(p.Instances) == 1 && p.Instances[0].Pid > 0 && int(p.Instances[0].Pid) != pid {
			break
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("plugin %s not restarted within %v: %v", s.typ, agentBackoffMax*6/5+waitTimeout, p)
		}
		time.Sleep(50 * time.Millisecond)
	}
	containers, _ := settle(s.t, s.ca.client)
	s.adopt(id, preparing, containers)
	s.check()
}

func (h *harness) a0socket() string { return filepath.Join(h.run, "agent.sock") }

// agentBackoffMax is the agent's longest restart delay for a plugin.
const agentBackoffMax = supervisor.DefaultBackoffMax

func (s *soak) plugin() *agentv1.Plugin {
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	resp, err := s.ca.client.GetPlugin(ctx, &agentv1.GetPluginRequest{Type: s.typ})
	if err != nil {
		return nil
	}
	return resp.Plugin
}

// pluginPid waits for the plugin to be ready with a process and returns
// its pid.
func (s *soak) pluginPid() int {
	p := watchUntil(s.t, s.h.a0socket(), s.typ, "ready with a process", func(p *agentv1.Plugin) bool {
		return ready(p) && len(p.Instances) == 1 && p.Instances[0].Pid > 0
	})
	return int(p.Instances[0].Pid)
}

// check verifies every invariant against the settled agent.
func (s *soak) check() {
	s.t.Helper()
	s.stats.checks++
	containers, volumes := settle(s.t, s.ca.client)
	got := map[string][]string{}
	for _, c := range containers {
		for _, m := range c.Mounts {
			got[c.ContainerId] = append(got[c.ContainerId], m.VolumeId)
			if ok, err := mountinfo.Mounted(m.MountPoint); err != nil || !ok {
				s.violation("container %s: %s not mounted (%v)", c.ContainerId, m.MountPoint, err)
			}
		}
	}
	for id, vols := range s.alive {
		g := slices.Sorted(slices.Values(got[id]))
		if w := slices.Sorted(slices.Values(vols)); !slices.Equal(g, w) {
			s.violation("container %s has volumes %v, want %v", id, g, w)
		}
		delete(got, id)
	}
	for id := range got {
		s.violation("container %s is tracked but not alive", id)
	}
	// Users of each volume = the containers alive that use it (settle
	// checked that against the agent's own container list).
	users := map[string][]string{}
	for id, vols := range s.alive {
		for _, v := range vols {
			users[v] = append(users[v], id)
		}
	}
	var wantMounts []string
	for _, v := range volumes {
		if w := slices.Sorted(slices.Values(users[v.VolumeId])); !slices.Equal(v.Containers, w) {
			s.violation("volume %s has users %v, want %v", v.VolumeId, v.Containers, w)
		}
		wantMounts = append(wantMounts, v.StagingPath, v.TargetPath)
		delete(users, v.VolumeId)
	}
	for v := range users {
		s.violation("volume %s is used but not tracked", v)
	}
	for id, vols := range s.alive {
		for _, v := range vols {
			wantMounts = append(wantMounts, filepath.Join(s.sb[id], v))
		}
	}
	gotMounts := mountsUnder(s.t, s.h.work, s.h.extra)
	sort.Strings(wantMounts)
	sort.Strings(gotMounts)
	if !slices.Equal(gotMounts, wantMounts) {
		s.violation("mounts %v, want %v", gotMounts, wantMounts)
	}
	if devs := loopDevicesFor(s.t, s.pool); len(devs) != len(volumes) {
		s.violation("%d loop devices on the pool for %d staged volumes: %v", len(devs), len(volumes), devs)
	}
	for id, vols := range s.alive {
		for _, v := range vols {
			s.verifyVolume(id, v)
		}
	}
}
