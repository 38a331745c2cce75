package fleet

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/csiagent/csiagent/internal/etcdtest"
	"github.com/csiagent/csiagent/internal/testhelp"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	"github.com/moby/sys/mountinfo"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// soakDurationEnv sets TestClusterSoak's length (make cluster-soak
// DURATION=...); unset, it is a smoke run of smokeDuration.
const (
	soakDurationEnv = "CSIAGENT_CLUSTER_SOAK_DURATION"
	smokeDuration   = 8 * time.Second
	// settleTimeout bounds the wait for the fleet to settle after the
	// chaos (a claim a killed agent took without recording it is
	// released by its reconciler once the agent is back).
	settleTimeout = 90 * time.Second
	soakVolumes   = 4
)

// soak is TestClusterSoak's state: the fleet, its counters and each
// host's containers.
type soak struct {
	f   *fleet
	rng *rand.Rand
	// mu guards rng, each host's agent while it is killed and restarted
	// (its lock is held for writing then), and violations.
	mu                                                                    sync.Mutex
	hostLocks                                                             []sync.RWMutex
	violations                                                            []string
	ops, claims, conflicts, unavailable, otherErrs, etcdKills, agentKills atomic.Int64
}

func (s *soak) violation(format string, args ...any) {
	s.mu.Lock()
	defer s.mu.Unlock()
	msg := fmt.Sprintf(format, args...)
	s.violations = append(s.violations, msg)
	s.f.t.Errorf("invariant violation: %s", msg)
}

func (s *soak) intn(n int) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.rng.IntN(n)
}

// TestClusterSoak runs random prepares and cleanups on three hosts,
// each host's own worker, while the chaos SIGKILLs agents and stops and
// restarts etcd members. An invariant checker reads the machine's mount
// table all along: no volume is ever mounted read-write under one host
// and mounted at all under another. Once the chaos stops and the fleet
// settles, every claim in etcd has a user on its holder and every user
// has its host's claim; after every cleanup no claim is left. It prints
// "cluster soak: N operations, N claims, N conflicts, N etcd kills, N
// agent kills, N violations".
func TestClusterSoak(t *testing.T) {
	testhelp.NeedRoot(t)
	d := smokeDuration
	if v := os.Getenv(soakDurationEnv); v != "" {
		var err error
		if d, err = time.ParseDuration(v); err != nil {
			t.Fatalf("%s=%q: %v", soakDurationEnv, v, err)
		}
	}
	f := newFleet(t, 3)
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	s := &soak{f: f, rng: rand.New(rand.NewPCG(uint64(seed), 0)), hostLocks: make([]sync.RWMutex, len(f.hosts))}
	var vols []string
	for i := range soakVolumes {
		v := fmt.Sprintf("v%d", i)
		vols = append(vols, v)
		f.createVolume(v)
		// Formatted by a writer: readers do not format.
		f.hosts[0].mustPrepare("format", volume(v, rwo))
		f.hosts[0].mustCleanup("format")
	}
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	var wg sync.WaitGroup
	containers := make([]map[string]bool, len(f.hosts))
	for i := range f.hosts {
		containers[i] = map[string]bool{}
		wg.Go(func() { s.worker(ctx, i, vols, containers[i]) })
	}
	wg.Go(func() { s.chaos(ctx) })
	checkerDone := make(chan struct{})
	go func() {
		defer close(checkerDone)
		for ctx.Err() == nil {
			s.checkMounts()
			select {
			case <-ctx.Done():
			case <-time.After(100 * time.Millisecond): // the checker's pace
			}
		}
	}()
	wg.Wait()
	<-checkerDone

	// Settle: every member and agent back, then the claims must match
	// the users.
	for _, m := range f.etcd.Members {
		_ = m.StartNoWait() // a running member: an error, ignored
	}
	for i, h := range f.hosts {
		if !h.running() {
			if err := h.startErr(); err != nil {
				s.violation("%s did not start again: %v", h.node, err)
				continue
			}
		}
		// Containers whose prepare or cleanup did not answer are
		// cleaned up (idempotent), as their runtime would.
		for id, uncertain := range containers[i] {
			if uncertain {
				if err := h.cleanup(id); err != nil {
					s.violation("%s: cleanup of %s: %v", h.node, id, err)
				}
				delete(containers[i], id)
			}
		}
	}
	s.checkMounts()
	why := s.waitSettled()
	if why != "" {
		s.violation("not settled within %v: %s", settleTimeout, why)
	}
	for _, h := range f.hosts {
		ctx, cancel := h.ctx()
		resp, err := h.api().Reconcile(ctx, &agentv1.ReconcileRequest{})
		cancel()
		if err != nil || len(resp.GetFailed()) > 0 {
			s.violation("%s: cleaning up every container: %v %v", h.node, err, resp.GetFailed())
		}
	}
	deadline := time.Now().Add(settleTimeout)
	for {
		resp, err := f.hosts[0].claims()
		if err == nil && len(resp.GetClaims()) == 0 {
			break
		}
		if time.Now().After(deadline) {
			s.violation("claims left after every cleanup: %v %v", resp.GetClaims(), err)
			break
		}
		time.Sleep(100 * time.Millisecond) // a pending release: no event to wait on
	}
	fmt.Printf("cluster soak: %d operations, %d claims, %d conflicts, %d etcd kills, %d agent kills, %d violations\n",
		s.ops.Load(), s.claims.Load(), s.conflicts.Load(), s.etcdKills.Load(), s.agentKills.Load(), len(s.violations))
	t.Logf("%s: %d prepares refused Unavailable (no quorum, an agent down), %d other errors", d, s.unavailable.Load(), s.otherErrs.Load())
}

// worker prepares and cleans up containers on host i until ctx ends;
// containers maps its containers to whether their state is uncertain (a
// call that did not answer).
func (s *soak) worker(ctx context.Context, i int, vols []string, containers map[string]bool) {
	h := s.f.hosts[i]
	n := 0
	for ctx.Err() == nil {
		s.hostLocks[i].RLock()
		api := h.api()
		if api == nil {
			s.hostLocks[i].RUnlock()
			time.Sleep(50 * time.Millisecond) // its agent restarts
			continue
		}
		var ids []string
		for id := range containers {
			ids = append(ids, id)
		}
		slices.Sort(ids)
		cctx, cancel := context.WithTimeout(ctx, callTimeout)
		if len(ids) < 3 && s.intn(100) < 60 {
			n++
			id := fmt.Sprintf("%s-%d", h.node, n)
			mode := rwo
			if s.intn(100) < 25 {
				mode = readers
			}
			if err := os.MkdirAll(h.sandbox(id), 0o755); err != nil {
				s.violation("%v", err)
			}
			_, err := api.Prepare(cctx, &agentv1.PrepareRequest{ContainerId: id, Sandbox: h.sandbox(id), Volumes: []*agentv1.Volume{volume(vols[s.intn(len(vols))], mode)}})
			s.count(err, true)
			switch {
			case err == nil:
				containers[id] = false
			case status.Code(err) != codes.FailedPrecondition:
				containers[id] = true // maybe prepared
			}
		} else if len(ids) > 0 {
			id := ids[s.intn(len(ids))]
			_, err := api.Cleanup(cctx, &agentv1.CleanupRequest{ContainerId: id})
			s.count(err, false)
			if err == nil {
				delete(containers, id)
			} else {
				containers[id] = true
			}
		}
		cancel()
		s.hostLocks[i].RUnlock()
	}
}

// count counts an operation's outcome.
func (s *soak) count(err error, prepare bool) {
	s.ops.Add(1)
	switch code := status.Code(err); {
	case err == nil:
		if prepare {
			s.claims.Add(1)
		}
	case code == codes.FailedPrecondition:
		s.conflicts.Add(1)
	case code == codes.Unavailable || code == codes.DeadlineExceeded || code == codes.Canceled:
		s.unavailable.Add(1)
	default:
		s.otherErrs.Add(1)
		s.f.t.Logf("operation failed: %v", err)
	}
}

// chaos kills an agent (SIGKILL, then starts it again) or stops an etcd
// member for a while, every 0.5 to 2 s, until ctx ends.
func (s *soak) chaos(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Duration(500+s.intn(1500)) * time.Millisecond):
		}
		if s.intn(2) == 0 {
			i := s.intn(len(s.f.hosts))
			h := s.f.hosts[i]
			// Killed while its worker's call is in flight.
			h.kill()
			s.agentKills.Add(1)
			s.hostLocks[i].Lock()
			if err := h.startErr(); err != nil {
				s.violation("%s did not start again after SIGKILL: %v", h.node, err)
			}
			s.hostLocks[i].Unlock()
			continue
		}
		m := s.f.etcd.Members[s.intn(len(s.f.etcd.Members))]
		etcdtest.StopAll(m)
		s.etcdKills.Add(1)
		select {
		case <-ctx.Done():
		case <-time.After(time.Duration(200+s.intn(2000)) * time.Millisecond):
		}
		if err := m.StartNoWait(); err != nil {
			s.violation("etcd member %s did not start again: %v", m.Name(), err)
		}
	}
}

// checkMounts checks, in the machine's mount table, that no volume is
// mounted read-write under one host's directories while it is mounted
// under another's; a suspect is read again, since the table is read in
// pieces while mounts come and go.
func (s *soak) checkMounts() {
	for range 3 {
		why := s.mountConflict()
		if why == "" {
			return
		}
		time.Sleep(20 * time.Millisecond) // read again: a torn read of the table passes
		if s.mountConflict() == why {
			s.violation("%s", why)
			return
		}
	}
}

// mountConflict is the first volume mounted read-write under one host
// and under another, "" if none.
func (s *soak) mountConflict() string {
	ms, err := mountinfo.GetMounts(nil)
	if err != nil {
		return "reading the mount table: " + err.Error()
	}
	backing := map[string]string{} // /dev/loopN -> volume
	type use struct{ rw, any map[string]bool }
	uses := map[string]*use{} // volume -> hosts
	for _, m := range ms {
		if !strings.HasPrefix(m.Source, "/dev/loop") {
			continue
		}
		vol, ok := backing[m.Source]
		if !ok {
			b, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(m.Source), "loop/backing_file"))
			if err == nil && strings.HasPrefix(strings.TrimSpace(string(b)), s.f.pool+"/") {
				vol = strings.TrimSuffix(filepath.Base(strings.TrimSpace(string(b))), ".img")
			}
			backing[m.Source] = vol
		}
		if vol == "" {
			continue
		}
		for _, h := range s.f.hosts {
			if !strings.HasPrefix(m.Mountpoint, h.work+"/") && !strings.HasPrefix(m.Mountpoint, h.extra+"/") {
				continue
			}
			u := uses[vol]
			if u == nil {
				u = &use{rw: map[string]bool{}, any: map[string]bool{}}
				uses[vol] = u
			}
			u.any[h.node] = true
			if slices.Contains(strings.Split(m.Options, ","), "rw") {
				u.rw[h.node] = true
			}
		}
	}
	for vol, u := range uses {
		for w := range u.rw {
			for o := range u.any {
				if o != w {
					return fmt.Sprintf("volume %s is mounted read-write under %s and mounted under %s", vol, w, o)
				}
			}
		}
	}
	return ""
}

// waitSettled waits until the claims in etcd match the users: every
// holder has a container on the volume, every volume with containers is
// claimed by its host. It returns why not, "" once they match.
func (s *soak) waitSettled() string {
	deadline := time.Now().Add(settleTimeout)
	for {
		why := s.unsettled()
		if why == "" || time.Now().After(deadline) {
			return why
		}
		time.Sleep(200 * time.Millisecond) // reconcilers' rounds: no event to wait on
	}
}

func (s *soak) unsettled() string {
	resp, err := s.f.hosts[0].claims()
	if err != nil {
		return err.Error()
	}
	held := map[string]bool{} // node/volume
	for _, c := range resp.GetClaims() {
		for _, h := range c.GetHolders() {
			held[h.GetNodeId()+"/"+c.GetVolumeId()] = true
		}
	}
	used := map[string]bool{}
	for _, h := range s.f.hosts {
		ctx, cancel := h.ctx()
		vs, err := h.api().ListVolumes(ctx, &agentv1.ListVolumesRequest{})
		cancel()
		if err != nil {
			return err.Error()
		}
		for _, v := range vs.GetVolumes() {
			if len(v.GetContainers()) == 0 {
				continue
			}
			used[h.node+"/"+v.GetVolumeId()] = true
			if !held[h.node+"/"+v.GetVolumeId()] {
				return fmt.Sprintf("%s has users of volume %s (%v) without a claim", h.node, v.GetVolumeId(), v.GetContainers())
			}
		}
	}
	for k := range held {
		if !used[k] {
			return fmt.Sprintf("claim %s without a user", k)
		}
	}
	return ""
}
