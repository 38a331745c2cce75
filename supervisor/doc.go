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
// The daemon consumes a Set: Apply turns the config directory's updates
// into started, rolled (processes whose launch config is unchanged are
// kept) and stopped plugins; Ready waits for a plugin's instance serving a
// service to be ready; ConnFor, Offers and NodeCapabilities tell what it
// serves; Node is a node service that follows the plugin's restarts;
// Statuses reports every plugin; Changed wakes waiters at every change.
// It hears of changes through Config.OnChange and Config.OnReady. The
// package knows nothing of the daemon. Not for: choosing which plugins
// exist (the daemon follows the config directory) or deciding which
// volume RPCs to make.
package supervisor
