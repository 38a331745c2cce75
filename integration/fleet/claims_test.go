package fleet

import (
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/internal/etcdtest"
)

const (
	rwo     = csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER
	readers = csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY
	onHost  = csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER
	rounds  = 50
)

// race has every host prepare container id with vol at once and returns
// each host's error.
func (f *fleet) race(id string, vol string, mode csi.VolumeCapability_AccessMode_Mode) []error {
	errs := make([]error, len(f.hosts))
	var wg sync.WaitGroup
	for i, h := range f.hosts {
		wg.Go(func() { errs[i] = h.prepare(id, volume(vol, mode)) })
	}
	wg.Wait()
	return errs
}

// winner checks that at most one host's prepare succeeded and that every
// other was refused FailedPrecondition naming it (or, when allowed,
// Unavailable: no quorum); it returns the winner's index, -1 if none.
func (f *fleet) winner(round int, errs []error, unavailableOK bool) int {
	f.t.Helper()
	won := -1
	for i, err := range errs {
		if err != nil {
			continue
		}
		if won >= 0 {
			f.t.Fatalf("round %d: %s and %s both prepared the single-node volume", round, f.hosts[won].node, f.hosts[i].node)
		}
		won = i
	}
	for i, err := range errs {
		switch {
		case err == nil:
		case unavailableOK && status.Code(err) == codes.Unavailable:
		case status.Code(err) != codes.FailedPrecondition:
			f.t.Fatalf("round %d: %s got %v; want FailedPrecondition", round, f.hosts[i].node, err)
		case won >= 0 && !strings.Contains(err.Error(), f.hosts[won].node):
			f.t.Fatalf("round %d: %s's refusal does not name the holder %s: %v", round, f.hosts[i].node, f.hosts[won].node, err)
		}
	}
	return won
}

// TestClaimRace: three hosts race for one SINGLE_NODE_WRITER volume,
// 50 times; exactly one wins every time, the others are refused
// FailedPrecondition naming it, and the claim goes with the winner's
// cleanup. csi-agent cluster nodes and claims show the fleet.
func TestClaimRace(t *testing.T) {
	f := newFleet(t, 3)
	f.createVolume("rwo")
	for round := range rounds {
		won := f.winner(round, f.race("c", "rwo", rwo), false)
		if won < 0 {
			t.Fatalf("round %d: no host prepared the volume", round)
		}
		if round == 0 {
			other := f.hosts[(won+1)%3]
			for cmd, want := range map[string][]string{
				"nodes":  {"node-a", "node-b", "node-c", "true", "10.99.0.1/32"},
				"claims": {"loop", "rwo", "exclusive", f.hosts[won].node},
			} {
				out, err := other.cli("cluster", cmd)
				for _, w := range want {
					if err != nil || !strings.Contains(out, w) {
						t.Errorf("csi-agent cluster %s: %v\n%s\nwant %q in it", cmd, err, out, w)
					}
				}
			}
		}
		f.hosts[won].mustCleanup("c")
		if h := f.hosts[won].holders("rwo"); h != "" {
			t.Fatalf("round %d: the claim is held by %s after the only user's cleanup", round, h)
		}
	}
}

// TestSharedReaders: MULTI_NODE_READER_ONLY users on two hosts share one
// claim; a writer on the third is refused naming both, and gets the
// volume once the readers are gone, after which readers are refused.
func TestSharedReaders(t *testing.T) {
	f := newFleet(t, 3)
	f.createVolume("shared")
	a, b, c := f.hosts[0], f.hosts[1], f.hosts[2]
	// Formatted by a first writer: readers do not format.
	c.mustPrepare("w0", volume("shared", rwo))
	c.mustCleanup("w0")
	a.mustPrepare("r1", volume("shared", readers))
	b.mustPrepare("r2", volume("shared", readers))
	if got := a.holders("shared"); got != "node-a,node-b" {
		t.Fatalf("holders of the readers' claim: %q, want node-a,node-b", got)
	}
	err := c.prepare("w", volume("shared", rwo))
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "node-a") || !strings.Contains(err.Error(), "node-b") {
		t.Fatalf("a writer while two hosts read: %v; want FailedPrecondition naming node-a and node-b", err)
	}
	a.mustCleanup("r1")
	if got := a.holders("shared"); got != "node-b" {
		t.Fatalf("holders after node-a's reader left: %q, want node-b", got)
	}
	b.mustCleanup("r2")
	c.mustPrepare("w", volume("shared", rwo))
	if err := a.prepare("r3", volume("shared", readers)); status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "node-c") {
		t.Fatalf("a reader while node-c writes: %v; want FailedPrecondition naming node-c", err)
	}
	c.mustCleanup("w")
}

// TestLeaderKilledDuringClaims: the etcd leader is killed while the hosts
// race, and started again later. No round ever has two winners; a claim
// that could not be decided fails Unavailable; once etcd has a leader
// again the races are won again.
func TestLeaderKilledDuringClaims(t *testing.T) {
	f := newFleet(t, 3)
	f.createVolume("rwo")
	won, unavailable := 0, 0
	for round := range 30 {
		var killed sync.WaitGroup
		if round == 5 {
			leader := f.etcd.Leader(waitTimeout)
			t.Logf("round %d: killing the etcd leader %s while the hosts claim", round, leader.Name())
			killed.Go(leader.Stop)
			t.Cleanup(func() { _ = leader.StartNoWait() })
			defer func() {
				if err := leader.Start(); err != nil {
					t.Errorf("restarting etcd member %s: %v", leader.Name(), err)
				}
			}()
		}
		errs := f.race("c", "rwo", rwo)
		killed.Wait()
		w := f.winner(round, errs, true)
		for _, err := range errs {
			if status.Code(err) == codes.Unavailable {
				unavailable++
			}
		}
		if w >= 0 {
			won++
			f.hosts[w].mustCleanup("c")
		}
	}
	t.Logf("%d of 30 rounds won, %d prepares refused Unavailable", won, unavailable)
	if won < 20 {
		t.Fatalf("only %d of 30 rounds had a winner: the fleet did not recover from losing its leader", won)
	}
	// Whatever an undecided claim left is released by its node's
	// reconciler: the volume is free again.
	f.waitFor("no claim left on the volume", func() bool { return f.hosts[0].holders("rwo") == "" })
}

// writeFile writes into the container's view of a volume and reads it
// back.
func (h *host) writeFile(id, vol, content string) {
	h.f.t.Helper()
	p := filepath.Join(h.sandbox(id), "data-"+vol, "file")
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		h.f.t.Fatalf("%s: writing into container %s's volume %s: %v", h.node, id, vol, err)
	}
	h.checkFile(id, vol, content)
}

// checkFile checks what the container sees in a volume.
func (h *host) checkFile(id, vol, want string) {
	h.f.t.Helper()
	got, err := os.ReadFile(filepath.Join(h.sandbox(id), "data-"+vol, "file"))
	if err != nil || string(got) != want {
		h.f.t.Fatalf("%s: container %s's volume %s holds %q, %v; want %q", h.node, id, vol, got, err, want)
	}
}

// TestMajorityStopped: with two of the three etcd members stopped, the
// containers that have volumes keep them untouched; a Prepare that needs
// a claim the host does not hold fails Unavailable saying why; a Prepare
// on a claim the host holds and every cleanup work. Once the quorum is
// back, the releases made meanwhile reach etcd and new claims work.
func TestMajorityStopped(t *testing.T) {
	f := newFleet(t, 3)
	f.createVolume("held")
	f.createVolume("other")
	a, b := f.hosts[0], f.hosts[1]
	a.mustPrepare("c1", volume("held", onHost))
	a.writeFile("c1", "held", "before")
	stopped := []*etcdtest.Member{f.etcd.Members[0], f.etcd.Members[1]}
	etcdtest.StopAll(stopped...)
	restarted := false
	restart := func() {
		if restarted {
			return
		}
		restarted = true
		for _, m := range stopped {
			if err := m.StartNoWait(); err != nil {
				t.Errorf("restarting etcd member %s: %v", m.Name(), err)
			}
		}
	}
	t.Cleanup(restart)
	a.checkFile("c1", "held", "before")
	err := b.prepare("c2", volume("other", rwo))
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "etcd") {
		t.Fatalf("a new claim without a quorum: %v; want Unavailable naming etcd", err)
	}
	a.mustPrepare("c3", volume("held", onHost))
	a.checkFile("c3", "held", "before")
	a.mustCleanup("c3")
	a.mustCleanup("c1")
	b.mustCleanup("c2")
	restart()
	f.waitFor("the release made without a quorum to reach etcd", func() bool {
		resp, err := b.claims()
		return err == nil && len(resp.GetClaims()) == 0
	})
	b.mustPrepare("c4", volume("held", rwo))
	b.checkFile("c4", "held", "before")
	b.mustCleanup("c4")
}

// TestHostKilledAndReleased: an agent host holding a claim is SIGKILLed.
// Its claim persists; a release is refused while its lease lives, and
// without fencing or --node-is-down, and when fencing fails; it is
// accepted with --node-is-down once the lease is gone. The host then
// returns: its container keeps the volume, untouched, but new containers
// there are refused (the claim is revoked), loudly; its cleanup leaves
// the fleet's claim alone, and the volume can be claimed again.
func TestHostKilledAndReleased(t *testing.T) {
	f := newFleet(t, 3)
	f.createVolume("rwo")
	a, b := f.hosts[0], f.hosts[1]
	a.mustPrepare("c1", volume("rwo", rwo))
	a.writeFile("c1", "rwo", "a's data")
	a.kill()
	if got := b.holders("rwo"); got != "node-a" {
		t.Fatalf("the killed host's claim: held by %q, want node-a", got)
	}
	out, err := b.cli("cluster", "release", "--node", "node-a", "--node-is-down")
	if err == nil || !strings.Contains(out, "live lease") {
		t.Fatalf("release while node-a's lease lives: %v\n%s\nwant it refused, saying so", err, out)
	}
	out, err = b.cli("cluster", "release", "--node", "node-a")
	if err == nil || !strings.Contains(out, "--node-is-down") {
		t.Fatalf("release without fencing or --node-is-down: %v\n%s\nwant a usage error", err, out)
	}
	if err := b.prepare("c2", volume("rwo", rwo)); status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "node-a") {
		t.Fatalf("node-b's prepare of node-a's volume: %v; want FailedPrecondition naming node-a", err)
	}
	f.waitFor("node-a listed down", func() bool { return !b.alive("node-a") })
	out, err = b.cli("cluster", "release", "--node", "node-a", "--fence-plugin", loopType)
	if err == nil || !strings.Contains(out, "fenc") {
		t.Fatalf("release fenced by a plugin that cannot fence: %v\n%s\nwant it refused", err, out)
	}
	if got := b.holders("rwo"); got != "node-a" {
		t.Fatalf("after the refused releases the claim is held by %q, want node-a", got)
	}
	out, err = b.cli("cluster", "release", "--node", "node-a", "--node-is-down")
	if err != nil || !strings.Contains(out, "released "+loopType+" rwo (exclusive) from node-a") {
		t.Fatalf("release --node-is-down of a dead node: %v\n%s", err, out)
	}
	if got := b.holders("rwo"); got != "" {
		t.Fatalf("after the release the claim is held by %q", got)
	}

	a.start()
	a.checkFile("c1", "rwo", "a's data")
	err = a.prepare("c3", volume("rwo", rwo))
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "released in the cluster while the node was away") {
		t.Fatalf("a new container on the returned host: %v; want FailedPrecondition: the claim was released", err)
	}
	a.checkFile("c1", "rwo", "a's data")
	log, err := os.ReadFile(filepath.Join(a.extra, "agent.log"))
	if err != nil || !strings.Contains(string(log), "level=ERROR") || !strings.Contains(string(log), "revoked") {
		t.Errorf("the returned host's log does not report the revoked claim as an error (%v)", err)
	}
	a.mustCleanup("c1")
	b.mustPrepare("c2", volume("rwo", rwo))
	b.checkFile("c2", "rwo", "a's data")
	if got := a.holders("rwo"); got != "node-b" {
		t.Fatalf("after node-b's prepare the claim is held by %q, want node-b", got)
	}
	b.mustCleanup("c2")
}
