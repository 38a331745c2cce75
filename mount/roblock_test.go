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

// TestReadOnlyBlock: a device published writable where read-only was asked
// (a plugin that ignores readonly for block) is given to read-only users
// as a read-only loop device of the agent's, bound at its own path, made
// once; writes through it fail while the plugin's device still takes them;
// dropping it leaves nothing attached over the device and the target free
// to unmount. A device the plugin made read-only is given as it is.
func TestReadOnlyBlock(t *testing.T) {
	testhelp.NeedRoot(t)
	base := testhelp.LeakCheckedDir(t)
	ctx := context.Background()
	attach := func(name string, ro bool) string {
		img := filepath.Join(base, name+".img")
		if err := os.WriteFile(img, make([]byte, 1<<20), 0o600); err != nil {
			t.Fatal(err)
		}
		dev, f, err := loopdev.Attach(ctx, img, loopdev.Options{ReadOnly: ro})
		if err != nil {
			t.Fatal(err)
		}
		f.Close()
		t.Cleanup(func() { _ = loopdev.Detach(dev, img) })
		target := filepath.Join(base, name+"-target")
		if err := os.WriteFile(target, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		must(t, mount.Bind(dev.Path, target, false))
		t.Cleanup(func() { _ = mount.Unmount(ctx, target) })
		return target
	}
	write := func(path string) error {
		f, err := os.OpenFile(path, os.O_WRONLY, 0)
		if err != nil {
			return err
		}
		defer f.Close()
		if _, err := f.Write(make([]byte, 512)); err != nil {
			return err
		}
		return f.Sync()
	}

	// The plugin honoured readonly: its device is given as it is.
	roTarget := attach("ro", true)
	if got, err := mount.ReadOnlyBlock(ctx, roTarget, filepath.Join(base, "ro-own")); err != nil || got != roTarget {
		t.Fatalf("ReadOnlyBlock(read-only device) = %q, %v; want %q", got, err, roTarget)
	}
	if _, err := os.Lstat(filepath.Join(base, "ro-own")); !os.IsNotExist(err) {
		t.Errorf("own path made for a read-only device: %v", err)
	}

	// The plugin ignored it.
	target, own := attach("rw", false), filepath.Join(base, "rw-own")
	if err := write(target); err != nil {
		t.Fatalf("the plugin's device is not writable: %v", err)
	}
	got, err := mount.ReadOnlyBlock(ctx, target, own)
	if err != nil || got != own {
		t.Fatalf("ReadOnlyBlock(writable device) = %q, %v; want %q", got, err, own)
	}
	if err := write(own); err == nil {
		t.Fatal("a write through the read-only device succeeded")
	}
	if err := write(target); err != nil {
		t.Errorf("the plugin's device stopped taking writes: %v", err)
	}
	// Made once.
	if again, err := mount.ReadOnlyBlock(ctx, target, own); err != nil || again != own {
		t.Errorf("second ReadOnlyBlock = %q, %v", again, err)
	}
	if devs, err := loopdev.FindAll(target); err != nil || len(devs) != 1 {
		t.Errorf("loop devices over the target: %v, %v; want one", devs, err)
	}

	must(t, mount.DropReadOnlyBlock(ctx, target, own))
	if devs, err := loopdev.FindAll(target); err != nil || len(devs) != 0 {
		t.Errorf("loop devices over the target after the drop: %v, %v", devs, err)
	}
	if _, err := os.Lstat(own); !os.IsNotExist(err) {
		t.Errorf("own path after the drop: %v", err)
	}
	// The plugin's unpublish is not held up.
	must(t, mount.Unmount(ctx, target))
	// Dropping again, the target gone: nothing to do.
	must(t, mount.DropReadOnlyBlock(ctx, target, own))
}
