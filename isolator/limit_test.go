package isolator

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
)

// TestUnitMaxVolumesPerNode: a plugin's NodeGetInfo max_volumes_per_node
// is enforced before any call for a volume coming onto the node (ErrLimit,
// naming the volume and the limit), a volume already on the node takes
// more users, two volumes racing for the last place do not both get it,
// and a cleaned-up volume frees its place.
func TestUnitMaxVolumesPerNode(t *testing.T) {
	w := newWorld(t)
	w.node("loop").maxVolumes = 2
	iso := w.run(Config{})
	ctx := context.Background()
	w.prepare(iso, w.request("c1", vol{"loop", "vol-1", "/data", false}))
	w.prepare(iso, w.request("c2", vol{"loop", "vol-2", "/data", false}))
	w.calls("loop")

	_, err := iso.Prepare(ctx, w.request("c3", vol{"loop", "vol-3", "/data", false}))
	if !errors.Is(err, ErrLimit) || !strings.Contains(err.Error(), "vol-3") || !strings.Contains(err.Error(), "at most 2 volume(s)") {
		t.Fatalf("a third volume with a limit of 2: %v; want ErrLimit naming vol-3 and the limit", err)
	}
	if got := w.calls("loop"); len(got) > 0 {
		t.Errorf("the refused volume cost plugin calls: %v", got)
	}
	if v := volumeOf(iso, "loop", "vol-3"); v != nil && v.State != stCreated {
		t.Errorf("the refused volume is %v on the node", v.State)
	}
	// A volume already on the node is not a new one.
	w.prepare(iso, w.request("c4", vol{"loop", "vol-1", "/shared", false}))
	// Another plugin's volumes do not count.
	w.prepare(iso, w.request("c5", vol{"plain", "vol-9", "/data", false}))

	w.cleanup(iso, "c2")
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for i, id := range []string{"vol-4", "vol-5"} {
		wg.Go(func() {
			_, errs[i] = iso.Prepare(ctx, w.request("r"+id, vol{"loop", id, "/data", false}))
		})
	}
	wg.Wait()
	if (errs[0] == nil) == (errs[1] == nil) || !errors.Is(errors.Join(errs...), ErrLimit) {
		t.Errorf("two volumes racing for the last place: %v; want exactly one refused with ErrLimit", errs)
	}
	for _, id := range []string{"c1", "c3", "c4", "c5", "rvol-4", "rvol-5"} {
		w.cleanup(iso, id)
	}
	w.checkEmpty(iso)
}
