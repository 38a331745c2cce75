package isolator

import (
	"context"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/internal/testhelp"
	"github.com/csiagent/csiagent/mount"
	statev1 "github.com/csiagent/csiagent/proto/state/v1"
)

// After a reboot, mount ids start again from low numbers: a container
// record left CLEANING holds ids that may now name other mounts, even
// another container's bind of the same volume. The cleanup that recovery
// finishes must neither touch such a mount nor be stuck refusing it
// ("moved outside the root") for ever.
func TestMountIDsOfAnotherBootAreNotTrusted(t *testing.T) {
	testhelp.NeedRoot(t)
	ctx := context.Background()
	root, work := t.TempDir(), t.TempDir()
	defer unmountUnder(t, work)
	defer unmountUnder(t, root)
	iso, err := newTestIsolator(t, Config{WorkDir: work, Plugins: tmpfsPlugins{}, BootID: "boot-1"})
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"c1", "c2"} {
		if _, err := iso.Prepare(ctx, powercutRequest(t, id, root)); err != nil {
			t.Fatal(err)
		}
	}
	c1, c2 := iso.containers["c1"], iso.containers["c2"]
	theirs := c2.cp.GetMounts()[0]
	// c1's mount is gone and its record, left CLEANING by a crash, holds
	// an id that the next boot gave to c2's bind of the same volume.
	if err := unix.Unmount(c1.cp.GetMounts()[0].GetMountPoint(), 0); err != nil {
		t.Fatal(err)
	}
	if err := iso.updateContainer(c1, func(cp *statev1.ContainerCheckpoint) {
		cp.Phase = statev1.ContainerCheckpoint_CLEANING
		cp.Mounts[0].MountId = theirs.GetMountId()
	}); err != nil {
		t.Fatal(err)
	}
	if err := iso.commit.Sync(ctx); err != nil {
		t.Fatal(err)
	}

	iso2, err := newTestIsolator(t, Config{WorkDir: work, Plugins: tmpfsPlugins{}, BootID: "boot-2"})
	if err != nil {
		t.Fatal(err)
	}
	iso2.resync(ctx, true)
	if _, ok := iso2.containers["c1"]; ok {
		t.Errorf("after recovery c1's interrupted cleanup is not finished: %s", iso2.containers["c1"].cp.GetLastError())
	}
	if ok, _ := mount.IsMountPoint(theirs.GetMountPoint()); !ok {
		t.Fatal("c2's mount, whose id c1's record held, was unmounted")
	}
	if err := iso2.Cleanup(ctx, "c2", false); err != nil {
		t.Fatal(err)
	}
}
