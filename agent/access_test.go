package agent

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
