package agent

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/controllerops"
	"github.com/csiagent/csiagent/reclaim"
)

// DefaultKeyRotationTimeout bounds one scheduled EncryptionKeyRotate call.
const DefaultKeyRotationTimeout = 10 * time.Minute

// keyRotationPolicy is a plugin's key rotation schedule: its config's
// overrides (csiagent.key_rotation) on the agent's defaults. The interval
// is 0 (not scheduled) unless set: rotating a key is the storage owner's
// decision, and a plugin that needs secrets for it gets none from a
// schedule.
func (a *Agent) keyRotationPolicy(typ string) reclaim.Policy {
	p := a.cfg.KeyRotationDefaults
	a.mu.Lock()
	r := a.plugins[typ]
	a.mu.Unlock()
	if r == nil {
		return reclaim.Policy{}
	}
	if s := r.plugin.Info.Settings; s != nil {
		p = overridden(p, s.KeyRotation)
	}
	return p
}

// keyRotationTarget lets a second instance of the reclaim scheduler rotate
// the keys of published volumes: same slots, caps, error table and
// persisted next run, another call.
type keyRotationTarget struct{ a *Agent }

var _ reclaim.Target = keyRotationTarget{}

// Volumes lists published volumes of plugins that offer key rotation.
func (t keyRotationTarget) Volumes() []reclaim.Volume {
	var out []reclaim.Volume
	offers := map[string]bool{}
	for _, pv := range t.a.iso.Published() {
		ok, seen := offers[pv.Plugin]
		if !seen {
			ok = t.a.pluginOffers(pv.Plugin, controllerops.KeyRotationService)
			offers[pv.Plugin] = ok
		}
		if ok {
			out = append(out, reclaim.Volume{Plugin: pv.Plugin, ID: pv.ID, Next: pv.NextKeyRotation, Since: pv.Since})
		}
	}
	return out
}

// Reclaim (the scheduler's call) rotates the volume's key once.
func (t keyRotationTarget) Reclaim(ctx context.Context, plugin, id string) (reclaim.Result, error) {
	start := time.Now()
	err := t.a.ctrlops.RotateKeyOnce(ctx, plugin, id)
	if status.Code(err) == codes.FailedPrecondition {
		if _, published := controllerPlugins(t).Published(plugin, id); !published {
			err = fmt.Errorf("%w: %w", reclaim.ErrNotPublished, err)
		}
	}
	t.a.metrics.keyRotations.WithLabelValues(plugin, codeOf(err)).Inc()
	return reclaim.Result{Start: start, Duration: time.Since(start), PreUsage: -1, PostUsage: -1}, err
}

func (t keyRotationTarget) Schedule(plugin, id string, next time.Time) error {
	return t.a.iso.ScheduleKeyRotation(context.Background(), plugin, id, next)
}
