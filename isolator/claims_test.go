package isolator

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
)

// fleetClaims is a fleet's claim registry in memory (package cluster's, on
// etcd, is tested against real etcd there): one holder per volume.
type fleetClaims struct {
	mu      sync.Mutex
	holders map[string]string
	// order records "node claim|release volume", in order.
	order []string
}

// nodeClaims is one node's view of the registry: Config.Claims.
type nodeClaims struct {
	fleet *fleetClaims
	node  string
}

func (c nodeClaims) Claim(_ context.Context, plugin, id string, _ *csi.VolumeCapability) error {
	c.fleet.mu.Lock()
	defer c.fleet.mu.Unlock()
	k := plugin + "/" + id
	if h, ok := c.fleet.holders[k]; ok && h != c.node {
		return fmt.Errorf("%w: claimed by node %s", ErrPrecondition, h)
	}
	c.fleet.holders[k] = c.node
	c.fleet.order = append(c.fleet.order, c.node+" claim "+k)
	return nil
}

func (c nodeClaims) Release(_ context.Context, plugin, id string) error {
	c.fleet.mu.Lock()
	defer c.fleet.mu.Unlock()
	k := plugin + "/" + id
	if c.fleet.holders[k] == c.node {
		delete(c.fleet.holders, k)
	}
	c.fleet.order = append(c.fleet.order, c.node+" release "+k)
	return nil
}

// TestUnitClaims: with Config.Claims, a volume is claimed before its first
// call (the attach) and released after its teardown; a second host's
// Prepare of a claimed volume is refused before any call, naming the
// holder, and succeeds once the first host's last user is cleaned up.
func TestUnitClaims(t *testing.T) {
	fleet := &fleetClaims{holders: map[string]string{}}
	// Two hosts (each its own model of its plugin's node side).
	a, b := newWorld(t), newWorld(t)
	isoA := a.run(Config{Claims: nodeClaims{fleet, "a"}})
	isoB := b.run(Config{Claims: nodeClaims{fleet, "b"}})
	a.prepare(isoA, a.request("c1", vol{"attach", "vol-1", "/data", false}))
	if got := fleet.order; len(got) != 1 || got[0] != "a claim attach/vol-1" {
		t.Fatalf("claims after the first prepare: %v", got)
	}
	_, err := isoB.Prepare(context.Background(), b.request("c2", vol{"attach", "vol-1", "/data", false}))
	if !errors.Is(err, ErrPrecondition) || !strings.Contains(err.Error(), "claimed by node a") {
		t.Fatalf("the second host's prepare: %v; want ErrPrecondition naming node a", err)
	}
	if got := b.calls("attach"); len(got) > 0 {
		t.Errorf("the refused prepare cost plugin calls: %v", got)
	}
	a.cleanup(isoA, "c1")
	b.prepare(isoB, b.request("c2", vol{"attach", "vol-1", "/data", false}))
	b.cleanup(isoB, "c2")
	want := "[a claim attach/vol-1 b release attach/vol-1 a release attach/vol-1 b claim attach/vol-1 b release attach/vol-1]"
	if got := fmt.Sprint(fleet.order); got != want {
		t.Errorf("claims and releases %s, want %s", got, want)
	}
}

// TestUnitClaimCheckedForEveryNewUser: a new container on a volume
// already on the node asks Claims again (a local answer for a claim the
// node holds), so a claim revoked while the node was away (the volume
// handed to another host) refuses new containers, while the container
// that has the volume keeps it and its cleanup works.
func TestUnitClaimCheckedForEveryNewUser(t *testing.T) {
	fleet := &fleetClaims{holders: map[string]string{}}
	a := newWorld(t)
	iso := a.run(Config{Claims: nodeClaims{fleet, "a"}})
	a.prepare(iso, a.request("c1", vol{"attach", "vol-1", "/data", false}))
	a.prepare(iso, a.request("c2", vol{"attach", "vol-1", "/data", false}))
	if got := fmt.Sprint(fleet.order); got != "[a claim attach/vol-1 a claim attach/vol-1]" {
		t.Fatalf("claims: %s; want one for each new user", got)
	}
	fleet.mu.Lock()
	fleet.holders["attach/vol-1"] = "b" // released by an operator, taken by b
	fleet.mu.Unlock()
	_, err := iso.Prepare(context.Background(), a.request("c3", vol{"attach", "vol-1", "/data", false}))
	if !errors.Is(err, ErrPrecondition) || !strings.Contains(err.Error(), "claimed by node b") {
		t.Fatalf("a new user of a volume whose claim went to b: %v; want ErrPrecondition naming b", err)
	}
	a.cleanup(iso, "c1")
	a.cleanup(iso, "c2")
	a.cleanup(iso, "c3")
}

// TestUnitClaimedOnEveryWayUp: a volume that recovery brings up from
// anywhere but off the node (here: its record lost, rebuilt from its
// container's, its staging and target unmounted) is claimed first. Its
// claim went to another node meanwhile (a release that was pending when
// the agent stopped, and another node's claim), so recovery does not
// stage it: the soak found it staged on two nodes before.
func TestUnitClaimedOnEveryWayUp(t *testing.T) {
	fleet := &fleetClaims{holders: map[string]string{}}
	w := newWorld(t)
	iso := w.run(Config{Claims: nodeClaims{fleet, "a"}})
	w.prepare(iso, w.request("c1", vol{"loop", "vol-1", "/data", false}))
	v := iso.volumes[volumeKey{"loop", "vol-1"}]
	w.unmountBehindOurBack(v.cp.GetTargetPath())
	w.unmountBehindOurBack(v.cp.GetStagingPath())
	w.lose(iso, filepath.Join(v.dir, volumeStateFile))
	fleet.mu.Lock()
	fleet.holders["loop/vol-1"] = "b"
	fleet.mu.Unlock()
	w.calls("loop") // drained
	iso = w.run(Config{Claims: nodeClaims{fleet, "a"}})
	for _, c := range w.calls("loop") {
		if strings.HasPrefix(c, "NodeStageVolume") || strings.HasPrefix(c, "NodePublishVolume") {
			t.Errorf("recovery brought up a volume whose claim is node b's: %s", c)
		}
	}
	fleet.mu.Lock()
	fleet.holders["loop/vol-1"] = "a" // b is done with it
	fleet.mu.Unlock()
	w.cleanup(iso, "c1")
}

// TestUnitClaimedAfterAReboot: after a reboot, recovery brings a volume
// that still has users up again from a mid-way state (NODE_STAGE, or
// CONTROLLER_PUBLISH for a plugin that attaches) it records first; the
// node's claim is asked for on that way up too. Here it went to node b
// while this node was down (an operator's release of a node taken for
// dead), so nothing is attached, staged or published: the review found
// the volume brought up on both nodes.
func TestUnitClaimedAfterAReboot(t *testing.T) {
	for _, plugin := range []string{"loop", "attach"} {
		t.Run(plugin, func(t *testing.T) {
			fleet := &fleetClaims{holders: map[string]string{}}
			w := newWorld(t)
			iso := w.run(Config{Claims: nodeClaims{fleet, "a"}})
			w.prepare(iso, w.request("c1", vol{plugin, "vol-1", "/data", false}))
			w.reboot()
			fleet.mu.Lock()
			fleet.holders[plugin+"/vol-1"] = "b"
			fleet.mu.Unlock()
			w.calls(plugin) // drained
			iso = w.run(Config{Claims: nodeClaims{fleet, "a"}})
			for _, c := range w.calls(plugin) {
				for _, up := range []string{"ControllerPublishVolume", "NodeStageVolume", "NodePublishVolume"} {
					if strings.HasPrefix(c, up) {
						t.Errorf("after a reboot, recovery brought up a volume whose claim is node b's: %s", c)
					}
				}
			}
			fleet.mu.Lock()
			fleet.holders[plugin+"/vol-1"] = "a" // b is done with it
			fleet.mu.Unlock()
			w.cleanup(iso, "c1")
		})
	}
}
