package cluster

import (
	"context"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"go.etcd.io/etcd/client/pkg/v3/transport"
	"go.uber.org/zap"

	"github.com/csiagent/csiagent/internal/atomicfile"

	"github.com/csiagent/csiagent/internal/etcdtest"
)

func capOf(mode csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
	}
}

var (
	rwo = capOf(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)
	rox = capOf(csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY)
	rwx = capOf(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)
)

// skipShort skips a test that starts etcd beside the three a -short run
// keeps (make unit); make test runs them all.
func skipShort(t *testing.T) {
	if testing.Short() {
		t.Skip("another 3-member etcd cluster (seconds); make test runs it")
	}
}

func testCtx(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// holders is what etcd shows holding plugin/volume (asked again while
// etcd is unavailable: a read right after a leader's death can fail
// "leader changed").
func holders(t *testing.T, n *testNode, plugin, volume string) []string {
	t.Helper()
	var st Status
	var err error
	waitFor(t, 10*time.Second, "etcd to answer", func() bool {
		st, err = n.Claims(testCtx(t, 5*time.Second))
		return !errors.Is(err, ErrUnavailable)
	})
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, c := range st.Claims {
		if c.Plugin == plugin && c.Volume == volume {
			for _, h := range c.Holders {
				out = append(out, h.Node)
			}
		}
	}
	return out
}

func TestClaimRace(t *testing.T) {
	ec := etcdtest.Start(t)
	a := newNode(t, ec.Endpoints, "node-a", t.TempDir(), true)
	b := newNode(t, ec.Endpoints, "node-b", t.TempDir(), true)
	nodes := []*testNode{a, b}
	wins := map[string]int{}
	for i := range 50 {
		ctx := testCtx(t, 10*time.Second)
		vol := fmt.Sprintf("vol/%d", i%3) // a "/" in an id stays one key segment
		var errs [2]error
		var wg sync.WaitGroup
		for j, n := range nodes {
			wg.Go(func() { errs[j] = n.Claim(ctx, "loop", vol, rwo) })
		}
		wg.Wait()
		if (errs[0] == nil) == (errs[1] == nil) {
			t.Fatalf("race %d: want exactly one winner, got errors %v and %v", i, errs[0], errs[1])
		}
		win, lose := 0, 1
		if errs[0] != nil {
			win, lose = 1, 0
		}
		winner := nodes[win].cfg.NodeID
		wins[winner]++
		if !errors.Is(errs[lose], ErrConflict) || !strings.Contains(errs[lose].Error(), winner) {
			t.Fatalf("race %d: the loser's error should be ErrConflict naming %s: %v", i, winner, errs[lose])
		}
		if h := holders(t, a, "loop", vol); !slices.Equal(h, []string{winner}) {
			t.Fatalf("race %d: etcd shows holders %v, want [%s]", i, h, winner)
		}
		if err := nodes[win].Release(ctx, "loop", vol); err != nil {
			t.Fatal(err)
		}
		if len(nodes[win].Local()) != 0 {
			t.Fatalf("race %d: the winner still records %v after Release", i, nodes[win].Local())
		}
	}
	if st := a.Stats().Conflicts + b.Stats().Conflicts; st != 50 {
		t.Errorf("conflicts counted: %d, want 50", st)
	}
	t.Logf("wins: %v", wins)
}

func TestSharedReadersAndModes(t *testing.T) {
	ec := etcdtest.Start(t)
	a := newNode(t, ec.Endpoints, "node-a", t.TempDir(), true)
	b := newNode(t, ec.Endpoints, "node-b", t.TempDir(), true)
	ctx := testCtx(t, 20*time.Second)

	if err := a.Claim(ctx, "loop", "rwx", rwx); err != nil {
		t.Fatal(err)
	}
	if err := b.Claim(ctx, "loop", "rwx", rwx); err != nil {
		t.Fatal(err)
	}
	// Multi-writers share one claim, which covers their readers; an
	// exclusive claim neither joins it nor lets it join (before, a
	// multi-writer took no claim, and staged a volume another node held
	// as its single writer).
	if h := holders(t, a, "loop", "rwx"); !slices.Equal(h, []string{"node-a", "node-b"}) {
		t.Fatalf("multi-writers: etcd shows %v", h)
	}
	if err := b.Claim(ctx, "loop", "rwx", rox); err != nil {
		t.Fatalf("a reader where its node is a multi-writer: %v", err)
	}
	if err := b.Claim(ctx, "loop", "rwx", rwo); !errors.Is(err, ErrConflict) || !strings.Contains(err.Error(), "node-a") {
		t.Fatalf("an exclusive claim on a multi-writer one: %v, want ErrConflict naming node-a", err)
	}
	if err := a.Claim(ctx, "loop", "x", rwo); err != nil {
		t.Fatal(err)
	}
	if err := b.Claim(ctx, "loop", "x", rwx); !errors.Is(err, ErrConflict) || !strings.Contains(err.Error(), "node-a") {
		t.Fatalf("a multi-writer on an exclusive claim: %v, want ErrConflict naming node-a", err)
	}
	for _, r := range []struct {
		n  *testNode
		id string
	}{{a, "x"}, {a, "rwx"}, {b, "rwx"}} {
		if err := r.n.Release(ctx, "loop", r.id); err != nil {
			t.Fatal(err)
		}
	}
	if h := holders(t, a, "loop", "rwx"); h != nil || len(a.Local()) != 0 {
		t.Fatalf("after the releases: etcd %v, local %v", h, a.Local())
	}
	if err := a.Claim(ctx, "loop", "v", &csi.VolumeCapability{}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("a capability without an access mode: %v, want ErrInvalid", err)
	}

	for _, n := range []*testNode{a, b} {
		if err := n.Claim(ctx, "loop", "ro", rox); err != nil {
			t.Fatal(err)
		}
	}
	if h := holders(t, a, "loop", "ro"); !slices.Equal(h, []string{"node-a", "node-b"}) {
		t.Fatalf("shared readers: etcd shows %v", h)
	}
	c := newNode(t, ec.Endpoints, "node-c", t.TempDir(), true)
	err := c.Claim(ctx, "loop", "ro", rwo)
	if !errors.Is(err, ErrConflict) || !strings.Contains(err.Error(), "node-a, node-b") {
		t.Fatalf("an exclusive claim on a shared one: %v, want ErrConflict naming node-a, node-b", err)
	}
	// An upgrade needs the node to be the only reader.
	if err := a.Claim(ctx, "loop", "ro", rwo); !errors.Is(err, ErrConflict) || !strings.Contains(err.Error(), "node-b") || strings.Contains(err.Error(), "node-a,") {
		t.Fatalf("upgrade beside another reader: %v", err)
	}
	if err := b.Release(ctx, "loop", "ro"); err != nil {
		t.Fatal(err)
	}
	if err := a.Claim(ctx, "loop", "ro", rwo); err != nil {
		t.Fatalf("upgrade as the only reader: %v", err)
	}
	if err := b.Claim(ctx, "loop", "ro", rox); !errors.Is(err, ErrConflict) || !strings.Contains(err.Error(), "node-a") {
		t.Fatalf("a reader on an exclusive claim: %v", err)
	}
	// The exclusive holder covers its own readers.
	if err := a.Claim(ctx, "loop", "ro", rox); err != nil {
		t.Fatal(err)
	}
	if l := a.Local(); len(l) != 1 || l[0].Mode != Exclusive || l[0].State != StateHeld {
		t.Fatalf("local claims: %+v", l)
	}
	nodes, err := a.Nodes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(nodes) != 3 || !nodes[0].Alive || nodes[0].ID != "node-a" || nodes[0].Info.Plugins[0].Topology["zone"] != "a" || nodes[0].Info.AgentVersion != "test" {
		t.Fatalf("nodes: %+v", nodes)
	}
	if st := a.Stats(); !st.Connected || st.ClaimsHeld != 1 || st.Conflicts != 1 {
		t.Fatalf("stats of node-a: %+v", st)
	}
	if err := a.SetInfo(ctx, NodeInfo{AgentVersion: "test-2"}); err != nil {
		t.Fatal(err)
	}
	if nodes, err = a.Nodes(ctx); err != nil || nodes[0].Info.AgentVersion != "test-2" || !nodes[0].Alive {
		t.Fatalf("nodes after SetInfo: %+v, %v", nodes, err)
	}
}

func TestRestartFromClaimRecordsWithoutEtcd(t *testing.T) {
	skipShort(t)
	ec := etcdtest.Start(t)
	dir := t.TempDir()
	a := newNode(t, ec.Endpoints, "node-a", dir, true)
	ctx := testCtx(t, 30*time.Second)
	if err := a.Claim(ctx, "loop", "v1", rwo); err != nil {
		t.Fatal(err)
	}
	a.crash(t)

	// Restarted with etcd unreachable (nothing listens there).
	dead := []string{fmt.Sprintf("http://127.0.0.1:%d", etcdtest.FreePorts(t, 1)[0])}
	a2 := newNode(t, dead, "node-a", dir, false)
	if err := a2.Claim(ctx, "loop", "v1", rwo); err != nil {
		t.Fatalf("a claim held in its record, etcd down: %v", err)
	}
	start := time.Now()
	err := a2.Claim(ctx, "loop", "v2", rwo)
	if !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "v2") {
		t.Fatalf("a new claim, etcd down: %v, want ErrUnavailable", err)
	}
	if d := time.Since(start); d > 3*testCall {
		t.Errorf("the refused claim took %s (call timeout %s)", d, testCall)
	}
	if err := a2.Release(ctx, "loop", "v1"); err != nil {
		t.Fatalf("Release with etcd down: %v", err)
	}
	if l := a2.Local(); len(l) != 1 || l[0].State != StateReleasing {
		t.Fatalf("a release with etcd down should be pending: %+v", l)
	}
	// A pending release is not a held claim: a new container needs etcd.
	if err := a2.Claim(ctx, "loop", "v1", rwo); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("claiming a claim pending release, etcd down: %v", err)
	}
	a2.close(t)

	// Another node id on the same claim records is refused.
	_, err = Join(ctx, Config{Endpoints: dead, NodeID: "node-x", StateDir: dir, InUse: func(string, string) bool { return false }})
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "node-a") {
		t.Fatalf("claim records of another node: %v", err)
	}

	// Back with etcd: the reconciler finishes the pending release.
	a3 := newNode(t, ec.Endpoints, "node-a", dir, true)
	waitFor(t, 10*time.Second, "the pending release finished", func() bool { return len(a3.Local()) == 0 })
	if h := holders(t, a3, "loop", "v1"); h != nil {
		t.Fatalf("etcd still shows %v holding v1", h)
	}
}

func TestQuorumLossFailsClosed(t *testing.T) {
	skipShort(t)
	ec := etcdtest.Start(t)
	a := newNode(t, ec.Endpoints, "node-a", t.TempDir(), true)
	b := newNode(t, ec.Endpoints, "node-b", t.TempDir(), true)
	ctx := testCtx(t, 45*time.Second)
	if err := a.Claim(ctx, "loop", "held", rwo); err != nil {
		t.Fatal(err)
	}
	if err := a.Claim(ctx, "loop", "released", rwo); err != nil {
		t.Fatal(err)
	}
	if err := a.Claim(ctx, "loop", "back", rwo); err != nil {
		t.Fatal(err)
	}
	etcdtest.StopAll(ec.Members[1:]...)

	if err := a.Claim(ctx, "loop", "held", rwo); err != nil {
		t.Fatalf("a held claim without quorum: %v", err)
	}
	if err := b.Claim(ctx, "loop", "new", rwo); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("a new claim without quorum: %v, want ErrUnavailable", err)
	}
	if err := a.Release(ctx, "loop", "released"); err != nil {
		t.Fatalf("a release without quorum: %v", err)
	}
	// Released too, then back on the node (recovery brought it up for
	// a user whose cleanup was interrupted): its release must not go
	// through.
	if err := a.Release(ctx, "loop", "back"); err != nil {
		t.Fatalf("a release without quorum: %v", err)
	}
	a.setInUse("loop", "back", true)
	if _, _, err := a.Lock(ctx, "volume", "x", nil); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("a lock without quorum: %v", err)
	}
	if st := a.Stats(); st.Connected || st.PendingReleases != 2 || st.ClaimsHeld != 1 {
		t.Fatalf("stats without quorum: %+v", st)
	}

	errs := make(chan error, 2)
	for _, m := range ec.Members[1:] {
		go func() { errs <- m.StartNoWait() }()
	}
	for range 2 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	ec.Leader(20 * time.Second)
	waitFor(t, 20*time.Second, "the pending release finished", func() bool { return a.Stats().PendingReleases == 0 })
	waitFor(t, 20*time.Second, "both nodes registered again", func() bool { return a.Stats().Connected && b.Stats().Connected })
	if err := b.Claim(ctx, "loop", "released", rwo); err != nil {
		t.Fatalf("claiming what node-a released without quorum: %v", err)
	}
	if err := b.Claim(ctx, "loop", "held", rwo); !errors.Is(err, ErrConflict) || !strings.Contains(err.Error(), "node-a") {
		t.Fatalf("node-a's claim after the quorum came back: %v", err)
	}
	if l := a.Local(); len(l) != 2 || l[0].Volume != "back" || l[0].State != StateHeld || l[1].Volume != "held" || l[1].State != StateHeld {
		t.Fatalf("node-a's claims after the quorum came back: %+v", l)
	}
	if h := holders(t, b, "loop", "back"); !slices.Equal(h, []string{"node-a"}) {
		t.Fatalf("the volume back on node-a: held by %v, want node-a", h)
	}
}

func TestLeaderKilledDuringClaims(t *testing.T) {
	skipShort(t)
	ec := etcdtest.Start(t)
	a := newNode(t, ec.Endpoints, "node-a", t.TempDir(), true)
	b := newNode(t, ec.Endpoints, "node-b", t.TempDir(), true)
	ctx := testCtx(t, 45*time.Second)
	const vols = 20
	// Both nodes claim the same volumes at once while the leader is
	// killed; a claim refused for unavailability is retried.
	claim := func(n *testNode, won map[string]bool) error {
		for i := range vols {
			vol := fmt.Sprintf("v%d", i)
			for {
				err := n.Claim(ctx, "loop", vol, rwo)
				if errors.Is(err, ErrUnavailable) {
					continue // bounded by ctx: each try by the call timeout
				}
				if err == nil {
					won[vol] = true
				} else if !errors.Is(err, ErrConflict) {
					return err
				}
				break
			}
		}
		return nil
	}
	wonA, wonB := map[string]bool{}, map[string]bool{}
	var wg sync.WaitGroup
	var errA, errB error
	wg.Go(func() { errA = claim(a, wonA) })
	wg.Go(func() { errB = claim(b, wonB) })
	waitFor(t, 20*time.Second, "some claims", func() bool {
		return a.Stats().ClaimsHeld+b.Stats().ClaimsHeld+int(a.Stats().Conflicts+b.Stats().Conflicts) >= 4
	})
	leader := ec.Leader(10 * time.Second)
	leader.Stop()
	t.Logf("killed leader %s", leader.Name())
	wg.Wait()
	if errA != nil || errB != nil {
		t.Fatalf("claims: %v, %v", errA, errB)
	}
	for i := range vols {
		vol := fmt.Sprintf("v%d", i)
		if wonA[vol] == wonB[vol] {
			t.Fatalf("%s: won by node-a %v, node-b %v: want exactly one", vol, wonA[vol], wonB[vol])
		}
		want := "node-a"
		if wonB[vol] {
			want = "node-b"
		}
		if h := holders(t, a, "loop", vol); !slices.Equal(h, []string{want}) {
			t.Fatalf("%s: etcd shows %v, want [%s]", vol, h, want)
		}
	}
	if len(a.Local())+len(b.Local()) != vols {
		t.Fatalf("local claims: %d + %d, want %d", len(a.Local()), len(b.Local()), vols)
	}
	if err := leader.Start(); err != nil {
		t.Fatal(err)
	}
}

func TestReleaseDeadNodeAndComeBackRevoked(t *testing.T) {
	skipShort(t)
	ec := etcdtest.Start(t)
	dirA := t.TempDir()
	a := newNode(t, ec.Endpoints, "node-a", dirA, true)
	b := newNode(t, ec.Endpoints, "node-b", t.TempDir(), true)
	ctx := testCtx(t, 45*time.Second)
	for _, v := range []string{"v1", "v2"} {
		if err := a.Claim(ctx, "loop", v, rwo); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := b.ReleaseNode(ctx, "node-a", "", true, nil); !errors.Is(err, ErrNodeAlive) {
		t.Fatalf("ReleaseNode of a live node: %v, want ErrNodeAlive", err)
	}
	if _, err := b.ReleaseNode(ctx, "node-z", "", true, nil); !errors.Is(err, ErrNotFound) {
		t.Fatalf("ReleaseNode of an unknown node: %v, want ErrNotFound", err)
	}
	if _, err := a.ReleaseNode(ctx, "node-a", "", true, nil); !errors.Is(err, ErrNodeAlive) || !strings.Contains(err.Error(), "own node") {
		t.Fatalf("ReleaseNode of the caller's own node: %v, want ErrNodeAlive naming its own node", err)
	}
	a.crash(t)
	if _, err := b.ReleaseNode(ctx, "node-a", "", true, nil); !errors.Is(err, ErrNodeAlive) {
		t.Fatalf("ReleaseNode while the crashed node's lease lives: %v, want ErrNodeAlive", err)
	}
	waitFor(t, 3*testTTL, "node-a's lease expired", func() bool {
		nodes, err := b.Nodes(ctx)
		return err == nil && len(nodes) == 2 && nodes[0].ID == "node-a" && !nodes[0].Alive && nodes[1].Alive
	})
	if _, err := b.ReleaseNode(ctx, "node-a", "", false, nil); !errors.Is(err, ErrNotFenced) {
		t.Fatalf("ReleaseNode without fencing or nodeIsDown: %v, want ErrNotFenced", err)
	}
	fenceErr := errors.New("fence refused")
	if _, err := b.ReleaseNode(ctx, "node-a", "", false, func(context.Context, []string) error { return fenceErr }); !errors.Is(err, ErrNotFenced) || !errors.Is(err, fenceErr) {
		t.Fatalf("ReleaseNode with fencing failed: %v", err)
	}
	released, err := b.ReleaseNode(ctx, "node-a", "v1", true, nil)
	if err != nil || len(released) != 1 || released[0].Volume != "v1" {
		t.Fatalf("ReleaseNode v1 with nodeIsDown: %+v, %v", released, err)
	}
	if err := b.Claim(ctx, "loop", "v1", rwo); err != nil {
		t.Fatalf("claiming the released v1: %v", err)
	}
	if err := b.Claim(ctx, "loop", "v2", rwo); !errors.Is(err, ErrConflict) || !strings.Contains(err.Error(), "node-a") {
		t.Fatalf("v2, still node-a's: %v", err)
	}
	var fencedWith []string
	released, err = b.ReleaseNode(ctx, "node-a", "", false, func(_ context.Context, addrs []string) error { fencedWith = addrs; return nil })
	if err != nil || len(released) != 1 || released[0].Volume != "v2" || !slices.Equal(fencedWith, []string{"192.0.2.1/32"}) {
		t.Fatalf("ReleaseNode fenced: %+v, %v, fenced with %v", released, err, fencedWith)
	}

	// node-a comes back with both volumes still on it: both claims are
	// revoked, loudly, and refused.
	a2 := newNode(t, ec.Endpoints, "node-a", dirA, true, "loop/v1", "loop/v2")
	waitFor(t, 10*time.Second, "node-a's claims revoked", func() bool { return len(a2.Revoked()) == 2 })
	err = a2.Claim(ctx, "loop", "v1", rwo)
	if !errors.Is(err, ErrRevoked) || !strings.Contains(err.Error(), "v1") {
		t.Fatalf("claiming a revoked claim: %v, want ErrRevoked", err)
	}
	if st := a2.Stats(); st.Revoked != 2 || st.ClaimsHeld != 0 {
		t.Fatalf("stats of node-a: %+v", st)
	}
	// Once the volume left node-a, Release forgets the revoked claim and
	// leaves node-b's alone.
	if err := a2.Release(ctx, "loop", "v1"); err != nil {
		t.Fatal(err)
	}
	if h := holders(t, b, "loop", "v1"); !slices.Equal(h, []string{"node-b"}) {
		t.Fatalf("v1 after node-a's release of its revoked claim: %v", h)
	}
	if err := a2.Claim(ctx, "loop", "v1", rwo); !errors.Is(err, ErrConflict) || !strings.Contains(err.Error(), "node-b") {
		t.Fatalf("claiming v1 again: %v, want ErrConflict naming node-b", err)
	}
}

// An earlier run's claim on a volume that is not on the node (the agent
// stopped between the volume's teardown and its release) is released;
// one on a volume still on it is kept.
func TestEarlierRunsClaimReleasedWhenUnused(t *testing.T) {
	skipShort(t)
	ec := etcdtest.Start(t)
	dir := t.TempDir()
	a := newNode(t, ec.Endpoints, "node-a", dir, true)
	ctx := testCtx(t, 20*time.Second)
	for _, v := range []string{"gone", "kept"} {
		if err := a.Claim(ctx, "loop", v, rwo); err != nil {
			t.Fatal(err)
		}
	}
	a.crash(t)
	a2 := newNode(t, ec.Endpoints, "node-a", dir, true, "loop/kept")
	waitFor(t, 10*time.Second, "the unused claim of the earlier run released", func() bool { return holders(t, a2, "loop", "gone") == nil })
	if h := holders(t, a2, "loop", "kept"); !slices.Equal(h, []string{"node-a"}) {
		t.Fatalf("the claim on a volume still on the node: %v", h)
	}
	if l := a2.Local(); len(l) != 1 || l[0].Volume != "kept" || l[0].State != StateHeld {
		t.Fatalf("local claims: %+v", l)
	}
}

// An earlier run's claim that a Claim of this run confirms is this run's:
// the reconciler, which waits for Config.Recovered, does not release it
// although the volume is not on the node yet (its Prepare has claimed it
// and not yet recorded it); before, it was released under the Prepare,
// which then staged the volume with no claim.
func TestConfirmedClaimIsThisRuns(t *testing.T) {
	skipShort(t)
	ec := etcdtest.Start(t)
	dir := t.TempDir()
	a := newNode(t, ec.Endpoints, "node-a", dir, true)
	ctx := testCtx(t, 20*time.Second)
	if err := a.Claim(ctx, "loop", "v", rwo); err != nil {
		t.Fatal(err)
	}
	a.crash(t)
	recovered := make(chan struct{})
	a2 := joinConfigured(t, ec.Endpoints, "node-a", dir, TLSFiles{}, true, func(c *Config) { c.Recovered = recovered })
	if err := a2.Claim(ctx, "loop", "v", rwo); err != nil {
		t.Fatal(err)
	}
	rounds := a2.reconciles.Load()
	close(recovered)
	waitFor(t, 10*time.Second, "two reconcile rounds after the recovery", func() bool { return a2.reconciles.Load() >= rounds+2 })
	if h := holders(t, a2, "loop", "v"); !slices.Equal(h, []string{"node-a"}) {
		t.Fatalf("the claim this run's Claim confirmed: etcd shows %v; want node-a's", h)
	}
}

// A pending release whose volume is on the node again is kept as held
// only if etcd still shows the node holding it; a release that reached
// etcd makes it revoked (another node may hold the volume now): before,
// it was taken as held.
func TestPendingReleaseBackOnTheNode(t *testing.T) {
	skipShort(t)
	ec := etcdtest.Start(t)
	a := newNode(t, ec.Endpoints, "node-a", t.TempDir(), true)
	ctx := testCtx(t, 20*time.Second)
	for _, v := range []string{"kept", "released"} {
		if err := a.Claim(ctx, "loop", v, rwo); err != nil {
			t.Fatal(err)
		}
		a.setInUse("loop", v, true)
		key := a.keys.claim("loop", v)
		l, _ := a.getLocal(key)
		l.State = StateReleasing
		if err := a.setLocal(ctx, key, &l, true); err != nil {
			t.Fatal(err)
		}
	}
	if err := a.removeHolder(ctx, a.keys.claim("loop", "released")); err != nil {
		t.Fatal(err)
	}
	if err := a.reconcileOnce(ctx); err != nil {
		t.Fatal(err)
	}
	states := map[string]State{}
	for _, l := range a.Local() {
		states[l.Volume] = l.State
	}
	if states["kept"] != StateHeld || states["released"] != StateRevoked {
		t.Fatalf("pending releases back on the node: %v; want kept held, released revoked", states)
	}
}

// A second host given a node id another host is registered under (the
// default node id is the hostname, which cloned hosts share) is refused
// registration, and so takes no claim, while the first is alive; it
// registers once the first is gone. Before, both registered and both
// held one single-writer claim.
func TestDuplicateNodeIDRefused(t *testing.T) {
	skipShort(t)
	ec := etcdtest.Start(t)
	a := newNode(t, ec.Endpoints, "ubuntu", t.TempDir(), true)
	ctx := testCtx(t, 30*time.Second)
	if err := a.Claim(ctx, "loop", "v", rwo); err != nil {
		t.Fatal(err)
	}
	clone := newNode(t, ec.Endpoints, "ubuntu", t.TempDir(), false)
	err := clone.Claim(ctx, "loop", "v", rwo)
	if !errors.Is(err, ErrUnavailable) && !errors.Is(err, ErrConflict) {
		t.Fatalf("the clone's claim of the first host's volume: %v; want it refused", err)
	}
	if err := clone.Claim(ctx, "loop", "w", rwo); !errors.Is(err, ErrUnavailable) || !strings.Contains(err.Error(), "not registered") {
		t.Fatalf("the clone's claim of a free volume: %v; want ErrUnavailable, not registered", err)
	}
	if clone.Stats().Connected {
		t.Fatal("the clone registered under a node id another host is alive under")
	}
	if h := holders(t, a, "loop", "w"); h != nil {
		t.Fatalf("the clone took a claim: %v", h)
	}
	a.Close(ctx) // the first host goes (its lease revoked); its claims stay
	waitFor(t, 20*time.Second, "the clone registered once the first host's lease is gone", func() bool { return clone.Stats().Connected })

	// A claim asked for right after Join waits for the node's
	// registration (claims are taken only registered) instead of
	// failing.
	fresh := newNode(t, ec.Endpoints, "node-fresh", t.TempDir(), false)
	if err := fresh.Claim(ctx, "loop", "x", rwo); err != nil {
		t.Fatalf("a claim right after Join: %v", err)
	}
}

// A claim etcd holds for this node without a record here (a crash
// between etcd's commit and the claim record's) is released once unused.
func TestOrphanClaimReleasedWhenUnused(t *testing.T) {
	skipShort(t)
	ec := etcdtest.Start(t)
	a := newNode(t, ec.Endpoints, "node-a", t.TempDir(), true)
	ctx := testCtx(t, 20*time.Second)
	a.setInUse("loop", "orphan", true)
	rec := &claimRecord{Plugin: "loop", Volume: "orphan", Mode: Exclusive, Holders: map[string]time.Time{"node-a": time.Now()}}
	if ok, _, _, err := a.cas(ctx, a.keys.claim("loop", "orphan"), 0, rec, "test"); !ok || err != nil {
		t.Fatalf("writing an orphan claim: %v %v", ok, err)
	}
	rounds := a.reconciles.Load()
	waitFor(t, 10*time.Second, "two reconcile rounds", func() bool { return a.reconciles.Load() >= rounds+2 })
	if h := holders(t, a, "loop", "orphan"); !slices.Equal(h, []string{"node-a"}) {
		t.Fatalf("an orphan claim in use was touched: %v", h)
	}
	a.setInUse("loop", "orphan", false)
	waitFor(t, 10*time.Second, "the unused orphan claim released", func() bool { return holders(t, a, "loop", "orphan") == nil })
}

func TestLockSerialisesAcrossNodes(t *testing.T) {
	ec := etcdtest.Start(t)
	a := newNode(t, ec.Endpoints, "node-a", t.TempDir(), true)
	b := newNode(t, ec.Endpoints, "node-b", t.TempDir(), true)
	ctx := testCtx(t, 30*time.Second)

	if _, _, err := a.Lock(context.Background(), "volume", "x", nil); !errors.Is(err, ErrInvalid) {
		t.Fatalf("Lock without a deadline: %v, want ErrInvalid", err)
	}
	_, unlock, err := a.Lock(ctx, "volume", "x", nil)
	if err != nil {
		t.Fatal(err)
	}
	st, err := b.Claims(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Locks) != 1 || st.Locks[0].Holder != "node-a" || st.Locks[0].Kind != "volume" || st.Locks[0].ID != "x" {
		t.Fatalf("locks: %+v", st.Locks)
	}
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	var waitedFor []string
	_, _, err = b.Lock(short, "volume", "x", func(holder string) { waitedFor = append(waitedFor, holder) })
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "node-a") {
		t.Fatalf("Lock of a held lock past its deadline: %v, want DeadlineExceeded naming node-a", err)
	}
	if !slices.Equal(waitedFor, []string{"node-a"}) {
		t.Fatalf("waiting called with %q, want once with node-a", waitedFor)
	}
	unlock()

	var inside, overlaps, runs atomic.Int32
	var wg sync.WaitGroup
	for _, n := range []*testNode{a, b} {
		wg.Go(func() {
			for range 10 {
				_, unlock, err := n.Lock(ctx, "volume", "y", nil)
				if err != nil {
					t.Error(err)
					return
				}
				if inside.Add(1) != 1 {
					overlaps.Add(1)
				}
				runs.Add(1)
				// Hold it across a round trip so that the other node waits.
				if _, err := n.Nodes(ctx); err != nil {
					t.Error(err)
				}
				inside.Add(-1)
				unlock()
			}
		})
	}
	wg.Wait()
	if overlaps.Load() != 0 || runs.Load() != 20 {
		t.Fatalf("%d of %d critical sections overlapped", overlaps.Load(), runs.Load())
	}
	// Two callers on one node share its session: they are serialised too.
	_, unlock, err = a.Lock(ctx, "volume", "z", nil)
	if err != nil {
		t.Fatal(err)
	}
	short, cancel = context.WithTimeout(ctx, 300*time.Millisecond)
	_, _, err = a.Lock(short, "volume", "z", nil)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a second Lock on the same node: %v, want DeadlineExceeded", err)
	}
	unlock()
	if a.Stats().LockWaits+b.Stats().LockWaits == 0 {
		t.Errorf("no Lock waited")
	}
	if a.Stats().LocksHeld != 0 || b.Stats().LocksHeld != 0 {
		t.Errorf("locks held after unlocking: %d, %d", a.Stats().LocksHeld, b.Stats().LocksHeld)
	}
}

// TestLockBoundedWhenEtcdStops: a Lock waiting for another node's lock
// returns at its deadline when etcd stops answering meanwhile (the etcd
// mutex's cleanup after a failed wait had no deadline: it blocked for as
// long as etcd was gone), and the lock it held is taken by the next
// caller once etcd is back. A held lock's context ends when the node's
// lease does (etcd gone past the lease's TTL; the lease revoked).
func TestLockBoundedWhenEtcdStops(t *testing.T) {
	skipShort(t)
	ec := etcdtest.Start(t)
	a := newNode(t, ec.Endpoints, "node-a", t.TempDir(), true)
	b := newNode(t, ec.Endpoints, "node-b", t.TempDir(), true)
	ctx := testCtx(t, 60*time.Second)
	held, unlock, err := a.Lock(ctx, "volume", "x", nil)
	if err != nil {
		t.Fatal(err)
	}
	waiting := make(chan struct{})
	done := make(chan error, 1)
	start := time.Now()
	go func() {
		short, cancel := context.WithTimeout(ctx, 3*time.Second)
		defer cancel()
		_, _, err := b.Lock(short, "volume", "x", func(string) { close(waiting) })
		done <- err
	}()
	<-waiting
	etcdtest.StopAll(ec.Members...)
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("Lock of a held lock succeeded with etcd stopped")
		}
		if took := time.Since(start); took > 8*time.Second {
			t.Errorf("Lock with a 3s deadline returned after %v", took)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("Lock with a 3s deadline still blocked 20s later, etcd stopped")
	}
	// Stopped past the lease's TTL: the lock may be another node's now.
	select {
	case <-held.Done():
	case <-time.After(20 * time.Second):
		t.Fatal("the held lock's context lives on 20s after etcd stopped (lease TTL 2s)")
	}
	for _, m := range ec.Members {
		if err := m.StartNoWait(); err != nil {
			t.Fatal(err)
		}
	}
	if ec.Leader(30*time.Second) == nil {
		t.Fatal("no leader after the restart")
	}
	unlock()
	waitFor(t, 20*time.Second, "node-b takes the lock node-a released", func() bool {
		short, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		_, unlockB, err := b.Lock(short, "volume", "x", nil)
		if err != nil {
			return false
		}
		unlockB()
		return true
	})

	// The lease revoked (etcd up): the held lock's context ends.
	waitFor(t, 20*time.Second, "node-a registered again and locking", func() bool {
		held, unlock, err = a.Lock(ctx, "volume", "y", nil)
		return err == nil
	})
	defer unlock()
	a.Cluster.mu.Lock()
	lease := a.session.Lease()
	a.Cluster.mu.Unlock()
	if _, err := b.client.Revoke(ctx, lease); err != nil {
		t.Fatal(err)
	}
	select {
	case <-held.Done():
	case <-time.After(20 * time.Second):
		t.Fatal("the held lock's context lives on 20s after the node's lease was revoked")
	}
}

// Members that serve clients over TLS and want a client certificate: a
// node with the CA, its certificate and key joins; one without its
// certificate never registers and cannot claim.
func TestTLS(t *testing.T) {
	skipShort(t)
	certs, err := transport.SelfCert(zap.NewNop(), t.TempDir(), []string{"127.0.0.1:0"}, 1, x509.ExtKeyUsageClientAuth)
	if err != nil {
		t.Fatal(err)
	}
	certs.TrustedCAFile = certs.CertFile
	certs.ClientCertAuth = true
	ec := etcdtest.StartTLS(t, &certs)
	tlsFiles := TLSFiles{CACert: certs.CertFile, Cert: certs.CertFile, Key: certs.KeyFile}
	ctx := testCtx(t, 20*time.Second)

	a := newNodeTLS(t, ec.Endpoints, "node-a", tlsFiles, true)
	if err := a.Claim(ctx, "loop", "v1", rwo); err != nil {
		t.Fatal(err)
	}
	b := newNodeTLS(t, ec.Endpoints, "node-b", TLSFiles{CACert: certs.CertFile}, false)
	if err := b.Claim(ctx, "loop", "v2", rwo); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("a claim without a client certificate: %v, want ErrUnavailable", err)
	}
	if b.Stats().Connected {
		t.Fatal("a node without a client certificate registered")
	}
	if _, err := Join(ctx, Config{Endpoints: ec.Endpoints, NodeID: "node-c", StateDir: t.TempDir(), InUse: a.cfg.InUse, TLS: TLSFiles{Cert: certs.CertFile}}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("a certificate without its key: %v, want ErrInvalid", err)
	}
}

// A claim is in its record before Claim returns, durable with the
// caller's next durable point; a release is durable before etcd is told.
func TestClaimAndReleaseDurability(t *testing.T) {
	skipShort(t)
	ec := etcdtest.Start(t)
	cfg, commit := onCommitter(t, ec.Endpoints)
	var failing atomic.Bool
	commit.Fsync = func(string) error {
		if failing.Load() {
			return errors.New("injected fsync failure")
		}
		return nil
	}
	ctx := testCtx(t, 20*time.Second)
	c, err := Join(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	n := &testNode{Cluster: c}
	t.Cleanup(func() {
		cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := c.Close(cctx); err == nil || !strings.Contains(err.Error(), "injected fsync failure") {
			t.Errorf("Close should report the failed commit: %v", err)
		}
	})
	waitFor(t, 10*time.Second, "node-a registered", func() bool { return c.Stats().Connected })
	if err := c.Claim(ctx, "loop", "v1", rwo); err != nil {
		t.Fatal(err)
	}
	failing.Store(true)
	// Recorded before Claim returns; durable with the caller's next
	// durable point, which fails here (a Prepare then fails and its
	// rollback releases the claim).
	if err := c.Claim(ctx, "loop", "v2", rwo); err != nil {
		t.Fatalf("a claim whose record is not durable yet: %v", err)
	}
	if l := c.Local(); len(l) != 2 || l[1].Volume != "v2" || l[1].State != StateHeld {
		t.Fatalf("local claims: %+v", l)
	}
	if err := commit.Sync(ctx); err == nil || !strings.Contains(err.Error(), "injected fsync failure") {
		t.Fatalf("the caller's durable point after the claim: %v, want the injected failure", err)
	}
	// A release is durable before etcd is told: failing, it stays.
	if err := c.Release(ctx, "loop", "v2"); err == nil || !strings.Contains(err.Error(), "injected fsync failure") {
		t.Fatalf("a release whose record cannot be made durable: %v", err)
	}
	if h := holders(t, n, "loop", "v2"); !slices.Equal(h, []string{"node-a"}) {
		t.Fatalf("etcd after a release that could not be made durable: %v", h)
	}
}

// TestClaimCostDoesNotGrowWithClaimsHeld: a claim taken or released
// rewrites its bucket's record alone, so a node holding many claims pays
// for one claim what a node holding one does: no record of all the
// claims replaced (a durable rewrite, two fsyncs under the Committer's
// lock) per change once it outgrows a record slot.
func TestClaimCostDoesNotGrowWithClaimsHeld(t *testing.T) {
	skipShort(t)
	ec := etcdtest.Start(t)
	cfg, commit := onCommitter(t, ec.Endpoints)
	cfg.InUse, cfg.ReconcileInterval = func(string, string) bool { return true }, time.Hour
	ctx := testCtx(t, time.Minute)
	c, err := Join(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		c.Close(cctx)
	})
	waitFor(t, 10*time.Second, "node-a registered", func() bool { return c.Stats().Connected })
	const held, measured = 100, 20
	for i := range held {
		if err := c.Claim(ctx, "loop", fmt.Sprintf("held-%03d", i), rwo); err != nil {
			t.Fatal(err)
		}
	}
	if err := commit.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	_, f0, _ := commit.Stats()
	for i := range measured {
		v := fmt.Sprintf("new-%03d", i)
		if err := c.Claim(ctx, "loop", v, rwo); err != nil {
			t.Fatal(err)
		}
		if err := c.Release(ctx, "loop", v); err != nil {
			t.Fatal(err)
		}
	}
	if err := commit.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	_, f1, _ := commit.Stats()
	// A commit round (one journal fdatasync) per record change at most:
	// the claim's record, its release intent (waited for), its removal;
	// and a new journal's creation (its own and its directory's fsync).
	if got, limit := f1-f0, uint64(3*measured+2); got > limit {
		t.Errorf("%d claims and releases with %d claims held cost %d fsyncs, want at most %d (a round per record change)", measured, held, got, limit)
	}
	// No record grows with the claims held.
	err = filepath.WalkDir(cfg.StateDir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		info, err := d.Info()
		if err == nil && info.Size() > 3*4096 {
			t.Errorf("%s is %d bytes with %d claims held: the claims' state grows into one record", p, info.Size(), held)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	// All still there after a restart.
	if err := c.Close(ctx); err != nil {
		t.Fatal(err)
	}
	c2, err := Join(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close(ctx)
	if l := c2.Local(); len(l) != held || l[0].Volume != "held-000" || l[held-1].Volume != fmt.Sprintf("held-%03d", held-1) {
		t.Fatalf("after a restart the node knows %d claims (%v…), want the %d it held", len(l), l[:min(3, len(l))], held)
	}
}

// TestImportsLegacyClaimsFile: the claims file of earlier releases (every
// claim in one record) is imported once into the claim records and
// removed; one of another node id is refused.
func TestImportsLegacyClaimsFile(t *testing.T) {
	dir := t.TempDir()
	writeLegacy := func(node string) {
		t.Helper()
		commit, err := atomicfile.New(dir)
		if err != nil {
			t.Fatal(err)
		}
		since := time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC)
		b, err := json.Marshal(stateFile{Version: legacyStateVersion, Node: node, Claims: []LocalClaim{
			{Plugin: "loop", Volume: "v1", Mode: Exclusive, State: StateHeld, Since: since, Rev: 7},
			{Plugin: "loop", Volume: "a/../v2", Mode: Shared, State: StateReleasing, Since: since},
		}})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := commit.Put(filepath.Join(dir, legacyClaimsFile), b, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := commit.Checkpoint(testCtx(t, 10*time.Second)); err != nil {
			t.Fatal(err)
		}
	}
	dead := []string{fmt.Sprintf("http://127.0.0.1:%d", etcdtest.FreePorts(t, 1)[0])}
	join := func(node string) (*Cluster, error) {
		return Join(testCtx(t, 10*time.Second), Config{Endpoints: dead, NodeID: node, StateDir: dir, InUse: func(string, string) bool { return true },
			CallTimeout: testCall, ReconcileInterval: time.Hour})
	}
	writeLegacy("node-b")
	if _, err := join("node-a"); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "node-b") {
		t.Fatalf("a legacy claims file of another node: %v, want ErrInvalid naming node-b", err)
	}
	writeLegacy("node-a")
	for run := range 2 { // imported, then read from the records
		c, err := join("node-a")
		if err != nil {
			t.Fatal(err)
		}
		l := c.Local()
		if len(l) != 2 || l[0].Volume != "a/../v2" || l[0].State != StateReleasing || l[0].Mode != Shared ||
			l[1].Volume != "v1" || l[1].State != StateHeld || l[1].Rev != 7 {
			t.Errorf("run %d: local claims %+v, want the legacy file's two", run, l)
		}
		if err := c.Close(testCtx(t, 10*time.Second)); err != nil && !errors.Is(err, ErrUnavailable) && !strings.Contains(err.Error(), "lease") {
			t.Fatal(err)
		}
		if _, err := os.Stat(filepath.Join(dir, legacyClaimsFile)); !errors.Is(err, fs.ErrNotExist) {
			t.Fatalf("run %d: the legacy claims file is still there: %v", run, err)
		}
		ents, err := os.ReadDir(filepath.Join(dir, claimsDir))
		if err != nil || len(ents) == 0 || len(ents) > 2 {
			t.Fatalf("run %d: claim records %v %v, want the two claims' buckets", run, ents, err)
		}
	}
}

// onCommitter is node-a's config with its claim records on a Committer
// of their own root (as on the daemon's work dir), and that Committer.
func onCommitter(t *testing.T, endpoints []string) (Config, *atomicfile.Committer) {
	t.Helper()
	root := t.TempDir()
	commit, err := atomicfile.New(root)
	if err != nil {
		t.Fatal(err)
	}
	return Config{Endpoints: endpoints, Prefix: "/test", NodeID: "node-a", StateDir: filepath.Join(root, "cluster"), Commit: commit,
		InUse: func(string, string) bool { return false }, LeaseTTL: testTTL, CallTimeout: testCall, ReconcileInterval: testReconcile}, commit
}

// TestReturningNodeAsksEtcdFirst: a node restarted after its claim was
// released in etcd refuses a new container on the volume (ErrRevoked)
// from its first Claim, before it has registered: etcd is asked unless
// it is known down.
func TestReturningNodeAsksEtcdFirst(t *testing.T) {
	skipShort(t)
	ec := etcdtest.Start(t)
	dir := t.TempDir()
	a := newNode(t, ec.Endpoints, "node-a", dir, true, "loop/v1")
	ctx := testCtx(t, 30*time.Second)
	if err := a.Claim(ctx, "loop", "v1", rwo); err != nil {
		t.Fatal(err)
	}
	a.crash(t)
	// Released while node-a was away (as ReleaseNode does, without the
	// wait for its lease).
	b := newNode(t, ec.Endpoints, "node-b", t.TempDir(), true)
	if _, err := b.client.Delete(ctx, b.keys.claim("loop", "v1")); err != nil {
		t.Fatal(err)
	}
	a2 := newNode(t, ec.Endpoints, "node-a", dir, false, "loop/v1")
	err := a2.Claim(ctx, "loop", "v1", rwo)
	if !errors.Is(err, ErrRevoked) {
		t.Fatalf("the returned node's first claim on a volume released while it was away: %v (registered: %v); want ErrRevoked", err, a2.Stats().Connected)
	}
}
