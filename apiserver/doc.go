// Package apiserver is the agent's gRPC API edge (proto/agent/v1's Agent
// service on the API socket): it checks who calls (peer credentials: root
// and members of --api-group), limits what members may do (Members: a
// rootfs or sandbox only below --api-group-roots, only their own user and
// processes, no Reconcile, cleanup only below the prefixes; root keeps
// the whole API), waits for the first recovery pass before volume calls,
// translates requests to the isolator's own types and its results back,
// and maps errors to status codes (a plugin's own code is kept; never
// Unknown).
//
// It holds no state of its own: everything it serves comes from the
// interfaces Config names, declared here as the handlers use them (Core:
// the isolator; Plugins; Schedules: reclaim and key rotation; Stats: the
// volume stats poller; NamedVolumes), which the daemon (package agent)
// fills with its components and the tests with fakes. Not for: the
// Controller API (package controllerops) or the container engines'
// endpoint (package dockerplugin), which have their own edges.
package apiserver
