package loopplugin

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/internal/loopdev"
	"github.com/csiagent/csiagent/mount"
)

// The node operations proper; node.go validates, locks and calls them.

// stageMount and stageBlock stage from attached, the controller's device
// (attach mode), or, when nil, a device of their own.
func (p *Plugin) stageMount(ctx context.Context, vol Volume, staging string, acc access, attached *loopdev.Device) error {
	ds, err := devicesOf(vol)
	if err != nil {
		return err
	}
	m, mounted, err := mount.Lookup(staging)
	if err != nil {
		return err
	}
	if mounted {
		if _, ok := ds.withFS(m); !ok {
			return incompatiblef("staging path %s holds another mount (%s from %s)", staging, m.FSType, m.Source)
		}
		if diff := acc.stagedDiff(m.FSType, m.Options); diff != "" {
			return incompatiblef("volume %s is already staged at %s: %s", vol.ID, staging, diff)
		}
		return nil
	}
	if _, ok, err := boundDevice(filepath.Join(staging, BlockStagingFile)); err != nil {
		return err
	} else if ok {
		return incompatiblef("volume %s is staged at %s for block access", vol.ID, staging)
	}
	if err := p.detachIdle(vol); err != nil {
		return err
	}
	if ds, err = devicesOf(vol); err != nil {
		return err
	}

	// Hold the device open until the filesystem is mounted: with autoclear,
	// the last close of an unmounted device detaches it, so a failure (or a
	// crash) below leaves nothing attached. A device still attached here is
	// in use elsewhere (staged at another path): share it.
	var dev loopdev.Device
	var f *os.File
	// Readers on many nodes of a shared pool each stage a read-only
	// device of their own (a device found here is another node's).
	shared := acc.sharedReaders()
	if attached != nil {
		dev = *attached
		f, err = os.OpenFile(dev.Path, map[bool]int{false: os.O_RDWR, true: os.O_RDONLY}[dev.ReadOnly]|unix.O_CLOEXEC, 0)
	} else if i := slices.IndexFunc(ds, func(d loopdev.Device) bool { return !d.ReadOnly }); i >= 0 && !shared {
		dev = ds[i]
		f, err = os.OpenFile(dev.Path, os.O_RDWR|unix.O_CLOEXEC, 0)
	} else {
		dev, f, err = loopdev.Attach(ctx, vol.Path, loopdev.Options{AutoClear: true, ReadOnly: shared})
	}
	if err != nil {
		return fmt.Errorf("stage volume %s: %w", vol.ID, err)
	}
	defer f.Close()
	if err := p.prepareFS(ctx, vol, f, dev.Path, acc.fsType, acc.readOnlyMode()); err != nil {
		return err
	}
	if err := mount.Mount(dev.Path, staging, acc.fsType, acc.mountOptions()); err != nil {
		return fmt.Errorf("stage volume %s: %w", vol.ID, err)
	}
	p.log.Info("staged", "volume", vol.ID, "device", dev.Path, "staging", staging, "fs_type", acc.fsType)
	return nil
}

func (p *Plugin) stageBlock(ctx context.Context, vol Volume, staging string, acc access, attached *loopdev.Device) error {
	if m, mounted, err := mount.Lookup(staging); err != nil {
		return err
	} else if mounted {
		return incompatiblef("staging path %s holds a mount (%s): staged for mount access?", staging, m.FSType)
	}
	ds, err := devicesOf(vol)
	if err != nil {
		return err
	}
	file := filepath.Join(staging, BlockStagingFile)
	rdev, bound, err := boundDevice(file)
	if err != nil {
		return err
	}
	readOnly := acc.readOnlyMode()
	if bound {
		d, ok := ds.withRdev(rdev)
		switch {
		case !ok:
			return incompatiblef("staging path %s already exposes another device", staging)
		case d.ReadOnly != readOnly:
			return incompatiblef("volume %s is already staged at %s with read-only=%v", vol.ID, staging, d.ReadOnly)
		}
		return nil
	}
	if err := p.detachIdle(vol); err != nil {
		return err
	}
	// No autoclear: only the plugin's hold keeps the device open while it
	// is bind-mounted. Unstage detaches it; after a crash before the bind,
	// the next stage or unstage finds it idle and detaches it. The
	// controller's device is held from its attach to its detach.
	var dev loopdev.Device
	if attached != nil {
		if attached.ReadOnly != readOnly {
			return incompatiblef("volume %s is attached with readonly=%v, staged for read-only=%v", vol.ID, attached.ReadOnly, readOnly)
		}
		dev = *attached
	} else {
		d, f, err := loopdev.Attach(ctx, vol.Path, loopdev.Options{ReadOnly: readOnly})
		if err != nil {
			return fmt.Errorf("stage volume %s: %w", vol.ID, err)
		}
		p.held.keep(d.Name, f)
		dev = d
	}
	if err := createFile(file); err != nil {
		return errors.Join(err, p.detachIdle(vol))
	}
	if err := mount.Bind(dev.Path, file, false); err != nil {
		return errors.Join(fmt.Errorf("stage volume %s: %w", vol.ID, err), p.detachIdle(vol))
	}
	p.log.Info("staged", "volume", vol.ID, "device", dev.Path, "staging", file, "access", "block", "read_only", readOnly)
	return nil
}

// createFile creates an empty regular file at path unless a regular file is
// there already.
func createFile(path string) error {
	f, err := os.OpenFile(path, os.O_RDONLY|os.O_CREATE|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		if errors.Is(err, unix.EISDIR) {
			return incompatiblef("%s is a directory, block access needs a file", path)
		}
		return fmt.Errorf("create %s: %w", path, err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() {
		return incompatiblef("%s exists and is not a regular file", path)
	}
	return nil
}

func (p *Plugin) unstage(ctx context.Context, vol Volume, staging string) error {
	ds, err := devicesOf(vol)
	if err != nil {
		return err
	}
	file := filepath.Join(staging, BlockStagingFile)
	byDev, err := ds.mounts()
	if err != nil {
		return err
	}
	// Published from this stage's device, not from another node's
	// (readers of a shared pool each have their own); any device's
	// when none is staged here.
	all := flatten(byDev)
	rest := others(all, staging, file)
	for _, ms := range byDev {
		if slices.Contains(ms, staging) || slices.Contains(ms, file) {
			rest = others(ms, staging, file)
		}
	}
	if len(rest) > 0 {
		return preconditionf("volume %s is still published at %s", vol.ID, strings.Join(rest, ", "))
	}
	m, mounted, err := mount.Lookup(staging)
	if err != nil {
		return err
	}
	var staged loopdev.Device // the device of the filesystem unmounted here
	if mounted {
		d, ok := ds.withFS(m)
		if !ok {
			// Another volume is mounted here: this one is not staged at
			// this path. Leave the other alone.
			return p.detachIdle(vol)
		}
		if err := mount.Unmount(ctx, staging); err != nil {
			return fmt.Errorf("unstage volume %s: %w", vol.ID, err)
		}
		staged = d
	}
	if rdev, bound, err := boundDevice(file); err != nil {
		return err
	} else if bound {
		if _, ok := ds.withRdev(rdev); !ok {
			if !detachedNodeAt(file) {
				return preconditionf("%s exposes another device, not volume %s", file, vol.ID)
			}
			p.log.Warn("the staged device was detached by someone else", "volume", vol.ID, "staging", file)
		}
		if err := mount.Unmount(ctx, file); err != nil {
			return fmt.Errorf("unstage volume %s: %w", vol.ID, err)
		}
	}
	if fi, err := os.Lstat(file); err == nil && fi.Mode().IsRegular() && fi.Size() == 0 {
		if err := os.Remove(file); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("unstage volume %s: %w", vol.ID, err)
		}
	}
	// A mounted filesystem's autoclear device is usually gone already;
	// a shared reader's read-only one leaves its policy behind.
	if err := p.detachIdle(vol); err != nil {
		return err
	}
	if err := loopdev.ReleaseReadOnly(staged); err != nil {
		p.log.Warn("unstaged; the read-only device stays read-only for its next user", "volume", vol.ID, "error", err)
	}
	if len(all) > 0 {
		p.log.Info("unstaged", "volume", vol.ID, "staging", staging)
	}
	return nil
}

func (p *Plugin) publish(ctx context.Context, vol Volume, staging, target string, acc access, readOnly bool) error {
	ds, err := devicesOf(vol)
	if err != nil {
		return err
	}
	var staged loopdev.Device
	if acc.block {
		rdev, ok, err := boundDevice(filepath.Join(staging, BlockStagingFile))
		if err != nil {
			return err
		}
		if ok {
			staged, ok = ds.withRdev(rdev)
		}
		if !ok {
			return preconditionf("volume %s is not staged at %s for block access", vol.ID, staging)
		}
	} else {
		m, ok, err := mount.Lookup(staging)
		if err != nil {
			return err
		}
		if ok {
			staged, ok = ds.withFS(m)
		}
		if !ok {
			return preconditionf("volume %s is not staged at %s for mount access", vol.ID, staging)
		}
	}

	if m, ok, err := mount.Lookup(target); err != nil {
		return err
	} else if ok {
		if _, ours := ds.at(m, target); !ours {
			return incompatiblef("target path %s holds another mount (%s from %s)", target, m.FSType, m.Source)
		}
		if mount.HasOption(m.Options, "ro") != readOnly {
			return incompatiblef("volume %s is already published at %s with read-only=%v", vol.ID, target, !readOnly)
		}
		return nil
	}
	if acc.mode == csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER {
		all, err := ds.allMounts()
		if err != nil {
			return err
		}
		if rest := others(all, staging, filepath.Join(staging, BlockStagingFile)); len(rest) > 0 {
			return preconditionf("volume %s has access mode SINGLE_NODE_SINGLE_WRITER and is already published at %s", vol.ID, strings.Join(rest, ", "))
		}
	}
	if err := os.MkdirAll(filepath.Dir(target), 0o750); err != nil {
		return fmt.Errorf("create target parent: %w", err)
	}
	source := staging
	if acc.block {
		if err := createFile(target); err != nil {
			return err
		}
		source = staged.Path
		if readOnly && !staged.ReadOnly {
			dev, err := p.readOnlyDevice(ctx, vol, ds)
			if err != nil {
				return err
			}
			source = dev.Path
		}
	} else if err := os.Mkdir(target, 0o750); err != nil && !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("create target: %w", err)
	} else if fi, err := os.Lstat(target); err != nil {
		return err
	} else if !fi.IsDir() {
		return incompatiblef("target path %s exists and is not a directory", target)
	}
	if err := mount.Bind(source, target, readOnly); err != nil {
		err = fmt.Errorf("publish volume %s: %w", vol.ID, err)
		if acc.block {
			err = errors.Join(err, p.detachIdle(vol))
		}
		return err
	}
	p.log.Info("published", "volume", vol.ID, "target", target, "read_only", readOnly, "device", source)
	return nil
}

// readOnlyDevice returns a read-only loop device of the volume, attaching
// one if there is none: block targets published read-only get it, because
// a read-only bind mount of a device node does not stop writes to it.
func (p *Plugin) readOnlyDevice(ctx context.Context, vol Volume, ds devices) (loopdev.Device, error) {
	if i := slices.IndexFunc(ds, func(d loopdev.Device) bool { return d.ReadOnly }); i >= 0 {
		return ds[i], nil
	}
	dev, f, err := loopdev.Attach(ctx, vol.Path, loopdev.Options{ReadOnly: true})
	if err != nil {
		return loopdev.Device{}, fmt.Errorf("publish volume %s read-only: %w", vol.ID, err)
	}
	p.held.keep(dev.Name, f)
	return dev, nil
}
