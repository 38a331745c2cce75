// Package agent is the csiagent daemon's wiring: New checks a Config and
// loads the volume checkpoints; Run takes the runtime directory's lock,
// follows the plugin config directory (pluginconfig.Watch) and has each
// plugin supervised (package supervisor), serves the agent API and the
// Controller API on a unix socket (root, or --api-group, by SO_PEERCRED),
// runs the isolator (volume lifecycle and recovery) and the reclaim
// scheduler, rotates plugin logs, talks to systemd (sd_notify, watchdog)
// and serves Prometheus metrics and pprof when asked.
//
// Contract: one Agent per runtime directory (a second Run fails on its
// lock). Run returns when its context ends, after in-flight API calls had
// ShutdownTimeout to finish; managed plugin processes keep running so that
// the next agent adopts them, and every published volume stays published.
//
// It holds no volume logic (package isolator), no mount code (package
// mount) and no plugin process handling (package supervisor): it connects
// them. Not for: calling from a client; use the API (cli, proto/agent/v1).
package agent
