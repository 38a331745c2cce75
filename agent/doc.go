// Package agent is the csiagent daemon's wiring: New checks a Config,
// loads the volume checkpoints and the snapshot catalogue (package
// snapcat) and builds the parts; Run takes the runtime directory's lock,
// thaws the filesystems a group snapshot left frozen when an agent died
// (before anything else starts), follows the plugin config directory
// (pluginconfig.Watch) into the supervised plugin set (supervisor.Set),
// serves the Agent API (package apiserver) and the Controller API
// (package controllerops) on a unix socket and the Docker volume plugin
// protocol (package dockerplugin) on another, runs the isolator (volume
// lifecycle and recovery), the reclaim and key rotation schedules (two
// instances of pervolume.Scheduler, each with its own job, result type,
// caps and job= log name; package reclaim for reclaim's) and the volume
// stats poller (package volumestats), rotates plugin logs, talks to
// systemd (sd_notify, watchdog) and serves Prometheus metrics and pprof
// when asked. Run is a list of components, each started in order and
// stopped in reverse (run.go).
//
// What is left here is the glue between those parts: small adapters that
// let each see the others through its own interface (isolator.Plugins,
// pervolume.Job, volumestats.Source, controllerops.Plugins,
// apiserver.Plugins, apiserver.Schedules, apiserver.Stats,
// dockerplugin.Backend), the metrics registry and the daemon's lifecycle.
//
// Contract: one Agent per runtime directory (a second Run fails on its
// lock). Run returns when its context ends, after in-flight API calls had
// ShutdownTimeout to finish; managed plugin processes keep running so that
// the next agent adopts them, and every published volume stays published.
// Not for: calling from a client; use the API (cli, proto/agent/v1).
package agent
