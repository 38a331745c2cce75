package loopplugin

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/moby/sys/mountinfo"

	"github.com/csiagent/csiagent/internal/loopdev"
	"github.com/csiagent/csiagent/mount"
)

// Quiescing: before the images of staged volumes are copied (snapshots,
// clones, replication syncs), their filesystems are frozen (FIFREEZE): the
// kernel flushes them to a consistent state and blocks every writer. The
// loop device has written everything into the image file by then, so the
// copy is what a crash at that instant would have left, but clean: no
// journal to replay. All members of a group are frozen together, then
// copied, then thawed.
//
// A writer blocked on a frozen filesystem cannot be killed, so the thaw
// never depends on the copy finishing: mount.WhileFrozen thaws from its own
// goroutine when the work returns or when the freeze deadline passes,
// whichever comes first.
//
// A filesystem frozen already (FIFREEZE fails with EBUSY: the agent froze
// a container's volumes for a group snapshot and called
// CreateVolumeGroupSnapshot) is consistent as it is: the copy goes on and
// the plugin leaves the thaw to whoever froze it.

const (
	// DefaultFreezeTimeout bounds how long filesystems stay frozen for a
	// copy unless the request's freezeTimeout parameter says otherwise.
	// A copy that takes longer is abandoned (the filesystems are thawed
	// at the deadline) and the call fails with DeadlineExceeded.
	DefaultFreezeTimeout = mount.DefaultMaxFrozen
	// maxFreezeTimeout is the largest freezeTimeout accepted.
	maxFreezeTimeout = 5 * time.Minute
	// paramFreezeTimeout names the parameter (snapshot, group snapshot
	// and replication requests) that sets the freeze deadline.
	paramFreezeTimeout = "freezeTimeout"
	// reservedParamPrefix marks parameters that CO sidecars add
	// (csi.storage.k8s.io/...); they are accepted and ignored.
	reservedParamPrefix = "csi.storage.k8s.io/"
)

// parseFreezeTimeout reads the freezeTimeout parameter: a Go duration in
// (0, maxFreezeTimeout]. Absent means DefaultFreezeTimeout.
func parseFreezeTimeout(params map[string]string) (time.Duration, error) {
	v, ok := params[paramFreezeTimeout]
	if !ok {
		return DefaultFreezeTimeout, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil || d <= 0 || d > maxFreezeTimeout {
		return 0, invalidf("parameter %s=%q: want a duration in (0, %s]", paramFreezeTimeout, v, maxFreezeTimeout)
	}
	return d, nil
}

// checkParams refuses parameters other than the known ones and the
// reserved csi.storage.k8s.io/ ones.
func checkParams(params map[string]string, known ...string) error {
	for k := range params {
		if strings.HasPrefix(k, reservedParamPrefix) {
			continue
		}
		ok := false
		for _, n := range known {
			ok = ok || k == n
		}
		if !ok {
			return invalidf("unknown parameter %q (supported: %s)", k, strings.Join(known, ", "))
		}
	}
	return nil
}

// quiescePoint returns a mount point of the filesystem on the image at
// path, if the image is attached to a loop device whose filesystem is
// mounted (a staged volume with mount access). An image whose device node
// is bound somewhere (block access) has no quiesce point: blocked = true.
// A detached image, or one attached with nothing mounted from it (the
// controller's attachment before a stage or after an unstage), needs no
// quiescing: "", false.
func quiescePoint(path string) (point string, blocked bool, err error) {
	ds, err := loopdev.FindAll(path)
	if err != nil {
		return "", false, fmt.Errorf("image %s: %w", path, err)
	}
	if len(ds) == 0 {
		return "", false, nil
	}
	ms, err := mount.List(func(m *mountinfo.Info) (skip, stop bool) {
		_, ok := devices(ds).withFS(m)
		return !ok, ok
	})
	if err != nil {
		return "", false, err
	}
	if len(ms) == 0 {
		at, err := devices(ds).allMounts()
		return "", len(at) > 0, err
	}
	return ms[0].Mountpoint, false, nil
}

// whileFrozen freezes the filesystems mounted at points, in order, runs fn
// and thaws them all, in reverse order; the thaws happen when fn returns or
// when timeout passes, whichever is first (fn's context ends then). With
// no points, fn just runs: nothing is frozen, so nothing bounds it but
// ctx. fn's error and the thaw errors are all returned.
func (p *Plugin) whileFrozen(ctx context.Context, points []string, timeout time.Duration, fn func(context.Context) error) error {
	if len(points) == 0 {
		return fn(ctx)
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	start := time.Now()
	err := mount.WhileAllFrozen(ctx, points, func(point string) {
		p.log.Info("filesystem already frozen by someone else (the agent freezing a container for a group snapshot): copying it frozen, leaving its thaw to them", "filesystem", point)
	}, fn)
	p.log.Info("thawed", "filesystems", strings.Join(points, ","), "frozen_for", time.Since(start).Round(time.Microsecond))
	if err != nil && errors.Is(ctx.Err(), context.DeadlineExceeded) {
		err = fmt.Errorf("freeze deadline %s passed, filesystems thawed, copy abandoned: %w", timeout, err)
	}
	return err
}
