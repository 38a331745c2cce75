package agent

import (
	"errors"
	"fmt"
	"time"

	"github.com/csiagent/csiagent/isolator"
	"github.com/csiagent/csiagent/pervolume"
	"github.com/csiagent/csiagent/pluginconfig"
)

// The per-volume schedules' defaults (agent-wide; a plugin's config may
// override interval, timeout and the per-plugin cap). Each schedule has
// its own caps: reclaims and key rotations do not share capacity.
const (
	DefaultReclaimInterval      = 7 * 24 * time.Hour
	DefaultReclaimTimeout       = 10 * time.Minute
	DefaultReclaimMaxConcurrent = 2
	// DefaultReclaimPluginMax is the default per-plugin cap.
	DefaultReclaimPluginMax = 1

	// DefaultKeyRotationTimeout bounds one scheduled EncryptionKeyRotate
	// call. Key rotation has no default interval: it is off unless set.
	DefaultKeyRotationTimeout       = 10 * time.Minute
	DefaultKeyRotationMaxConcurrent = 2
	// DefaultKeyRotationPluginMax is the default per-plugin cap.
	DefaultKeyRotationPluginMax = 1
)

// The schedules' names: each one's logs carry job=<name>.
const (
	reclaimJobName     = "reclaim"
	keyRotationJobName = "key-rotation"
)

// policy is a schedule's policy for plugin typ: the overrides of its
// config (picked by which) on the agent's defaults; the zero policy (not
// scheduled) for a plugin no config defines.
func (a *Agent) policy(typ string, defaults pervolume.Policy, which func(*pluginconfig.Settings) *pluginconfig.ReclaimPolicy) pervolume.Policy {
	p := a.set.Get(typ)
	if p == nil {
		return pervolume.Policy{}
	}
	if s := p.Config().Info.Settings; s != nil {
		return overridden(defaults, which(s))
	}
	return defaults
}

// reclaimPolicy is a plugin's reclaim schedule (csiagent.reclaim_space).
func (a *Agent) reclaimPolicy(typ string) pervolume.Policy {
	return a.policy(typ, a.cfg.ReclaimDefaults, func(s *pluginconfig.Settings) *pluginconfig.ReclaimPolicy { return s.ReclaimSpace })
}

// keyRotationPolicy is a plugin's key rotation schedule
// (csiagent.key_rotation). The interval is 0 (not scheduled) unless set:
// rotating a key is the storage owner's decision, and a plugin that needs
// secrets for it gets none from a schedule.
func (a *Agent) keyRotationPolicy(typ string) pervolume.Policy {
	return a.policy(typ, a.cfg.KeyRotationDefaults, func(s *pluginconfig.Settings) *pluginconfig.ReclaimPolicy { return s.KeyRotation })
}

// overridden is a schedule's policy with a plugin config's overrides (nil:
// none).
func overridden(p pervolume.Policy, o *pluginconfig.ReclaimPolicy) pervolume.Policy {
	if o == nil {
		return p
	}
	if o.Interval != nil {
		p.Interval = time.Duration(*o.Interval)
	}
	if o.Timeout != nil {
		p.Timeout = time.Duration(*o.Timeout)
	}
	if o.MaxConcurrent != nil {
		p.MaxConcurrent = *o.MaxConcurrent
	}
	return p
}

// publishedOffering lists the published volumes of plugins that offer
// service, each with its next run (picked by next).
func (a *Agent) publishedOffering(service string, next func(isolator.PublishedVolume) time.Time) []pervolume.Volume {
	var out []pervolume.Volume
	offers := map[string]bool{}
	for _, pv := range a.iso.Published() {
		ok, seen := offers[pv.Plugin]
		if !seen {
			ok = a.set.Offers(pv.Plugin, service)
			offers[pv.Plugin] = ok
		}
		if ok {
			out = append(out, pervolume.Volume{Plugin: pv.Plugin, ID: pv.ID, Next: next(pv), Since: pv.Since})
		}
	}
	return out
}

// notPublished wraps pervolume.ErrNotPublished around an error of the
// isolator's that says the volume is not published, so that the schedule
// forgets the volume.
func notPublished(err error) error {
	if errors.Is(err, isolator.ErrNotPublished) {
		return fmt.Errorf("%w: %w", pervolume.ErrNotPublished, err)
	}
	return err
}
