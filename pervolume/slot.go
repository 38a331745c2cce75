package pervolume

import (
	"hash/fnv"
	"time"
)

// volumeHash is FNV-64a of plugin+"\x00"+id: a volume's offset inside any
// interval is volumeHash mod interval.
func volumeHash(plugin, id string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(plugin))
	h.Write([]byte{0})
	h.Write([]byte(id))
	return h.Sum64()
}

// nextSlot returns the first of the volume's slots strictly after t. The
// slots are the Unix epoch + k*interval + (h mod interval), for every
// integer k. interval must be positive.
func nextSlot(t time.Time, interval time.Duration, h uint64) time.Time {
	iv := int64(interval)
	off := int64(h % uint64(iv))
	n := t.UnixNano() - off
	k := n / iv
	if n%iv < 0 {
		k-- // floor, also before the epoch
	}
	return time.Unix(0, (k+1)*iv+off).UTC()
}

// firstRun returns when a volume first seen (or whose interval changed)
// runs, given its persisted next run time: zero, its first slot after it
// was published (since; now if unknown); more than one interval away (the
// interval was shortened), its next slot; otherwise the persisted time.
// A time in the past (a run missed while the agent was down) runs once, as
// soon as the caps allow.
func firstRun(persisted, since, now time.Time, interval time.Duration, h uint64) time.Time {
	switch {
	case persisted.IsZero() && !since.IsZero() && !since.After(now):
		return nextSlot(since, interval, h)
	case persisted.IsZero() || persisted.Sub(now) > interval:
		return nextSlot(now, interval, h)
	}
	return persisted
}
