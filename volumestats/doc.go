// Package volumestats polls the usage and health of published volumes:
// each volume once per interval at a slot of its own (a hash of its plugin
// and id spreads the volumes over the interval, so a host with many
// volumes does not call its plugins all at once), at most MaxConcurrent
// calls at a time, each bounded by CallTimeout. The last result of each
// volume is kept for the API and the metrics; a volume that is no longer
// listed is forgotten, so what is kept is bounded by what is published.
//
// The package knows nothing of CSI: a Source lists the volumes and makes
// the calls (NodeGetVolumeStats, NodeGetVolumeHealth). Do not use it to
// decide whether a volume may be used: a result is only as fresh as its
// time.
package volumestats
