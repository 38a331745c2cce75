package integration

import (
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/internal/testhelp"
)

// TestSingleWriterAccess: a SINGLE_NODE_SINGLE_WRITER volume serves one
// container at a time: a second one is refused (read-write or
// read-only) until the first is cleaned up, and no refusal names the
// container that has the volume.
func TestSingleWriterAccess(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	h.writeConfig("t.json", testPluginConfig("t", "--data-dir="+h.dir("data")))
	h.start(fastConfig(h))
	single := volumeSpec{plugin: "t", id: "v", path: "d", access: csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER}
	h.mustPrepare("owner-x7", h.dir("sb1"), "", single)
	h.mustPrepare("owner-x7", h.dir("sb1"), "", single) // the same container again: idempotent
	ro := single
	ro.ro = true
	multi := single
	multi.access = csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER
	for _, c := range []struct {
		name string
		spec volumeSpec
	}{{"other access mode", multi}, {"read-write", single}, {"read-only", ro}} {
		_, err := h.prepare("second", h.dir("sb2"), "", c.spec)
		if status.Code(err) != codes.FailedPrecondition {
			t.Errorf("second container, %s: %v; want FailedPrecondition", c.name, err)
			h.mustCleanup("second")
		} else if strings.Contains(err.Error(), "owner-x7") {
			t.Errorf("second container, %s: the refusal names the other container: %v", c.name, err)
		}
	}
	if vs := h.volumes(); len(vs) != 1 || len(vs[0].Containers) != 1 {
		t.Errorf("volumes after the refusals: %v", vs)
	}
	h.mustCleanup("owner-x7")
	h.mustPrepare("second", h.dir("sb2"), "", single)
	h.mustCleanup("second")
	h.assertClean()
}

// TestMaxVolumesPerNode: through the daemon, a plugin whose NodeGetInfo
// says max_volumes_per_node=1 gets no second volume on the node: the
// Prepare fails ResourceExhausted naming the volume and the limit, and
// leaves nothing; a second user of the volume already there is let in;
// once the first volume is cleaned up, the other gets the place.
func TestMaxVolumesPerNode(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	h.writeConfig("t.json", testPluginConfig("t", "--data-dir="+h.dir("data"), "--max-volumes-per-node=1"))
	h.start(fastConfig(h))
	first := volumeSpec{plugin: "t", id: "v1", path: "d", access: csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER}
	second := volumeSpec{plugin: "t", id: "v2", path: "d"}
	h.mustPrepare("c1", h.dir("sb1"), "", first)
	_, err := h.prepare("c2", h.dir("sb2"), "", second)
	if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "t/v2") || !strings.Contains(err.Error(), "at most 1 volume(s)") {
		t.Fatalf("a second volume with max_volumes_per_node=1: %v; want ResourceExhausted naming t/v2 and the limit", err)
	}
	h.mustCleanup("c2")
	h.mustPrepare("c3", h.dir("sb3"), "", first)
	if vs := h.volumes(); len(vs) != 1 || len(vs[0].Containers) != 2 {
		t.Errorf("volumes after the refusal: %v; want v1 alone, with two users", vs)
	}
	h.mustCleanup("c1")
	h.mustCleanup("c3")
	h.mustPrepare("c2", h.dir("sb2"), "", second)
	h.mustCleanup("c2")
	h.assertClean()
}
