package mount_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/csiagent/csiagent/internal/loopdev"
	"github.com/csiagent/csiagent/internal/testhelp"
	"github.com/csiagent/csiagent/mount"
)

// TestBlockReadOnly: BLKROGET through a bind of the device node, as a
// plugin's read-only publish gives it: a read-only loop device is, a
// writable one is not; a file that is not a block device is an error.
func TestBlockReadOnly(t *testing.T) {
	testhelp.NeedRoot(t)
	base := testhelp.LeakCheckedDir(t)
	ctx := context.Background()
	for _, ro := range []bool{true, false} {
		img := filepath.Join(base, map[bool]string{true: "ro", false: "rw"}[ro]+".img")
		if err := os.WriteFile(img, make([]byte, 1<<20), 0o600); err != nil {
			t.Fatal(err)
		}
		dev, f, err := loopdev.Attach(ctx, img, loopdev.Options{ReadOnly: ro})
		if err != nil {
			t.Fatal(err)
		}
		f.Close()
		t.Cleanup(func() { _ = loopdev.Detach(dev, img) })
		target := img + "-target"
		if err := os.WriteFile(target, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		must(t, mount.Bind(dev.Path, target, false))
		t.Cleanup(func() { _ = mount.Unmount(ctx, target) })
		if got, err := mount.BlockReadOnly(target); err != nil || got != ro {
			t.Errorf("BlockReadOnly(loop device, read-only %v) = %v, %v", ro, got, err)
		}
	}
	if _, err := mount.BlockReadOnly(filepath.Join(base, "rw.img")); err == nil {
		t.Error("BlockReadOnly of a regular file: no error")
	}
}
