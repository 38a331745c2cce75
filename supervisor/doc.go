// Package supervisor runs and watches CSI plugins for the daemon: for
// each plugin config it keeps one instance per container (managed: a
// process it launches) or endpoint (unmanaged: a socket someone else
// serves) healthy.
//
// An instance's life: launch the process (or adopt the one a previous
// agent recorded in process.json, if pid, start time, boot id and config
// hash all match), wait for its socket, Probe until ready, discover what
// it is and offers (CSI identity and node info, csi-addons services), then
// Probe every ProbeInterval. A process that exits or fails three probes in
// a row is restarted after an exponential backoff with jitter (unmanaged:
// marked UNAVAILABLE until it answers again). Processes lead their own
// process group, log straight to files, run with the config's user, and
// get cgroup v2 limits where the host allows; they outlive the agent on
// purpose.
//
// The daemon consumes Start, Plugin.Stop, Plugin.Status, Plugin.Instance
// (a ready connection for a service), Plugin.Offers and Plugin.LogDir, and
// hears of changes through Config.OnChange and Config.OnReady. The package
// knows nothing of the daemon. Not for: choosing which plugins exist (the
// daemon follows the config directory) or calling their volume RPCs.
package supervisor
