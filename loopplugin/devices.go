package loopplugin

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/internal/loopdev"
	"github.com/csiagent/csiagent/mount"
)

// This file answers "where is this volume?" from the kernel alone: the loop
// devices backed by its image, and the mount table.

// devices are the loop devices backed by one volume's image. Usually there
// is one; a read-only block publish of a read-write staged volume adds a
// read-only one (a read-only bind mount does not stop writes to a device
// node, a read-only loop device does).
type devices []loopdev.Device

func devicesOf(vol Volume) (devices, error) {
	ds, err := loopdev.FindAll(vol.Path)
	if err != nil {
		return nil, fmt.Errorf("volume %s: %w", vol.ID, err)
	}
	return ds, nil
}

// sameDev reports whether the mount is a filesystem on the device.
func sameDev(m *mountinfo.Info, d loopdev.Device) bool {
	return uint32(m.Major) == d.Major && uint32(m.Minor) == d.Minor
}

// withFS returns the device whose filesystem m is.
func (ds devices) withFS(m *mountinfo.Info) (loopdev.Device, bool) {
	for _, d := range ds {
		if sameDev(m, d) {
			return d, true
		}
	}
	return loopdev.Device{}, false
}

// withRdev returns the device with the device number.
func (ds devices) withRdev(rdev uint64) (loopdev.Device, bool) {
	for _, d := range ds {
		if d.Rdev() == rdev {
			return d, true
		}
	}
	return loopdev.Device{}, false
}

// at returns the device visible at path, which is mounted as m: its
// filesystem, or its device node bind-mounted there.
func (ds devices) at(m *mountinfo.Info, path string) (loopdev.Device, bool) {
	if d, ok := ds.withFS(m); ok {
		return d, true
	}
	rdev, ok, err := deviceNodeAt(path)
	if err != nil || !ok {
		return loopdev.Device{}, false
	}
	return ds.withRdev(rdev)
}

// mounts returns, in one pass over the mount table, the mount points where
// each device (by name) is visible: its filesystem (mount access) and bind
// mounts of its device node (block access).
func (ds devices) mounts() (map[string][]string, error) {
	out := map[string][]string{}
	if len(ds) == 0 {
		return out, nil
	}
	ms, err := mount.List(func(m *mountinfo.Info) (skip, stop bool) {
		if _, ok := ds.withFS(m); ok {
			return false, false
		}
		for _, d := range ds {
			if m.Root == "/"+d.Name {
				return false, false // maybe a bind of its node: checked below
			}
		}
		return true, false
	})
	if err != nil {
		return nil, err
	}
	for _, m := range ms {
		if d, ok := ds.at(m, m.Mountpoint); ok {
			out[d.Name] = append(out[d.Name], m.Mountpoint)
		}
	}
	return out, nil
}

// allMounts returns every mount point where one of the devices is visible,
// sorted.
func (ds devices) allMounts() ([]string, error) {
	byDev, err := ds.mounts()
	if err != nil {
		return nil, err
	}
	return flatten(byDev), nil
}

// flatten is every mount point of mounts' result, sorted.
func flatten(byDev map[string][]string) []string {
	var all []string
	for _, ms := range byDev {
		all = append(all, ms...)
	}
	slices.Sort(all)
	return all
}

// deviceNodeAt returns the device number of the block device node at path,
// or ok = false if path is not a block device node.
func deviceNodeAt(path string) (rdev uint64, ok bool, err error) {
	var st unix.Stat_t
	err = unix.Lstat(path, &st)
	if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, fmt.Errorf("stat %s: %w", path, err)
	}
	return st.Rdev, st.Mode&unix.S_IFMT == unix.S_IFBLK, nil
}

// detachedNodeAt reports whether path is a loop device node whose device
// backs no file any more: one of this plugin's, detached by someone it was
// given to while no plugin held it. It names nothing, so whoever's target
// it is may remove it.
func detachedNodeAt(path string) bool {
	rdev, ok, err := deviceNodeAt(path)
	return err == nil && ok && loopdev.Unbound(rdev)
}

// boundDevice reports whether path is a bind mount of a block device node,
// and which device.
func boundDevice(path string) (rdev uint64, ok bool, err error) {
	if _, mounted, err := mount.Lookup(path); err != nil || !mounted {
		return 0, false, err
	}
	return deviceNodeAt(path)
}

// others returns the paths not among except (compared canonically).
func others(paths []string, except ...string) []string {
	var ex []string
	for _, e := range except {
		if c, err := mount.Canonical(e); err == nil {
			ex = append(ex, c)
		}
	}
	var out []string
	for _, p := range paths {
		if !slices.Contains(ex, p) {
			out = append(out, p)
		}
	}
	return out
}

// held keeps an open descriptor of each loop device the plugin gave for
// block access (a staged device, a read-only publish device), from its
// attach to the plugin's own detach. A device node bound into a container
// is not an opener; without a holder, the container could detach the device
// (LOOP_CLR_FD needs only an open descriptor) and its number would go to the
// next volume attached while the container's node still names it. With one,
// its LOOP_CLR_FD only marks the device for clearing at the last close.
// Serve re-holds what a previous run attached (holdAttached).
type held struct {
	mu    sync.Mutex
	files map[string]*os.File // by device name
}

// keep holds f (an open descriptor of the device called name) until release.
func (h *held) keep(name string, f *os.File) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if old := h.files[name]; old != nil {
		old.Close()
	}
	h.files[name] = f
}

// release closes the descriptor held for the device called name, if any.
func (h *held) release(name string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if f := h.files[name]; f != nil {
		f.Close()
		delete(h.files, name)
	}
}

// sweep clears the autoclear mark an opener's LOOP_CLR_FD left on a held
// device, so that the plugin's exit (a crash, an upgrade) does not detach
// it, and puts back a window onto the image an opener moved
// (loopdev.KeepAttached). Serve runs it every holdSweep and on its way out.
func (h *held) sweep(log *slog.Logger) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for name, f := range h.files {
		changed, err := loopdev.KeepAttached(f)
		switch {
		case err != nil:
			log.Warn("cannot check a held block device", "device", name, "error", err)
		case changed:
			log.Warn("an opener of a block device asked to detach it (LOOP_CLR_FD) or moved its offset or size; undone", "device", name)
		}
	}
}

// claimWait bounds how long a device just unmounted may stay claimed (the
// kernel may finish releasing a filesystem's device after the unmount
// returns) before it counts as held elsewhere.
const claimWait = 2 * time.Second

// claimedAfterUnmount is loopdev.Claimed, asked again for up to claimWait
// while it says claimed.
func claimedAfterUnmount(d loopdev.Device) (bool, error) {
	deadline := time.Now().Add(claimWait)
	for {
		claimed, err := loopdev.Claimed(d)
		if err != nil || !claimed || time.Now().After(deadline) {
			return claimed, err
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// detachIdle detaches the volume's loop devices that nothing is mounted
// from: left over by an unstage, by the unpublish of a read-only block
// target, or by a crash between attaching and mounting. Callers hold the
// volume's lock, so no stage of this plugin is between its attach and its
// mount. The controller's attachment stays (ControllerUnpublishVolume
// detaches it).
func (p *Plugin) detachIdle(vol Volume) error {
	ds, err := devicesOf(vol)
	if err != nil {
		return err
	}
	if a, ok, err := p.attachmentOf(vol.ID); err != nil {
		return err
	} else if ok {
		ds = slices.DeleteFunc(ds, func(d loopdev.Device) bool { return d.Rdev() == a.rdev() })
	}
	byDev, err := ds.mounts()
	if err != nil {
		return err
	}
	for _, d := range ds {
		if len(byDev[d.Name]) > 0 {
			continue
		}
		// Mounted nowhere here, but its filesystem may live on in a copy
		// of a mount that another mount namespace keeps: detached, the
		// next stage would attach a second device and run a second
		// instance of the filesystem beside it, each overwriting the
		// other's blocks.
		if claimed, err := claimedAfterUnmount(d); err != nil {
			return fmt.Errorf("volume %s: %w", vol.ID, err)
		} else if claimed {
			return preconditionf("volume %s: its filesystem is still mounted outside this mount namespace (%s is held: another mount namespace keeps a copy of its mount); it stays attached, and is detached by the next call once that mount is gone", vol.ID, d.Path)
		}
		p.held.release(d.Name)
		if err := loopdev.Detach(d, vol.Path); err != nil {
			return fmt.Errorf("volume %s: %w", vol.ID, err)
		}
		p.log.Info("detached", "volume", vol.ID, "device", d.Path)
	}
	return nil
}
