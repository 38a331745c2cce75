// Package volumestats polls the usage and health of published volumes:
// each volume once per interval at a slot of its own (a hash of its plugin
// and id spreads the volumes over the interval, so a host with many
// volumes does not call its plugins all at once), at most MaxConcurrent
// calls at a time, each bounded by CallTimeout. The last result of each
// volume is kept for the API and the metrics; a volume that is no longer
// listed is forgotten, so what is kept is bounded by what is published.
//
// A Source lists the volumes and polls each; the poller only schedules
// and keeps results. PollNode is the CSI half of a Source's Poll: it calls
// a node service's NodeGetVolumeStats and NodeGetVolumeHealth as its
// capabilities offer them (the condition of a plugin built on CSI 1.12 or
// earlier read from its stats, see csicompat); the Source dials the
// plugin and may do more first (the daemon's has the isolator repair a
// volume whose target path is not mounted). NewCollector exports the last
// results as Prometheus metrics. Do not use it to decide whether a volume
// may be used: a result is only as fresh as its time.
package volumestats
