// Package snapcat is the agent's durable catalogue of the snapshots and
// group snapshots it took, and of the filesystems it froze for them.
//
// The catalogue is a directory (the agent's WORK_DIR/snapshots): one JSON
// file per entry, NAME.json, keyed by the name the user gave (snapshots
// and group snapshots share one name space). An entry holds the plugin,
// the source volume(s) (and the named volume they came from), the
// plugin's snapshot id or group snapshot id with the group's members
// (source volume id → snapshot id), the creation time, the size and
// whether the plugin reported it ready. Every change is written as
// internal/atomicfile.Write does (temporary file, fsync, rename,
// directory fsync) before the API call that made it is acknowledged, so a
// crash leaves either the old or the new version of each file; leftover
// temporary files are removed when the catalogue is opened, and a file
// that cannot be parsed is reported and skipped (kept for the operator).
//
// An entry is first written as an intent (Intent set, no plugin id)
// before the plugin's create call, then replaced by the result. A crash
// in between leaves the intent: running the same create again finds it and
// repeats the plugin call, which is idempotent by the CSI name derived from
// the entry's name (CSIName), so it finds the snapshot the first call made
// rather than cutting a second one.
//
// Freeze records (frozen/NAME.json) list the filesystems a group snapshot
// of a container is about to freeze (path, mount id, device number). One
// is written durably before the first FIFREEZE and removed after the
// thaw; ThawRecorded, which the agent runs at start before it reports
// ready, thaws every filesystem of any record left by a crash (one whose
// mount id or device no longer match is left alone) and removes it; a
// record with a thaw that failed is kept for the next start.
//
// Lookup gives `volume create --from-snapshot` the plugin and snapshot id
// of a catalogue name (NAME, or GROUP/SOURCE_VOLUME_ID for a member of a
// group snapshot).
package snapcat
