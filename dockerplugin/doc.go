// Package dockerplugin serves Docker's volume plugin protocol (HTTP+JSON
// on a unix socket: /Plugin.Activate, /VolumeDriver.Create, Remove, Mount,
// Unmount, Path, Get, List, Capabilities), which Docker, Podman, Nomad's
// docker driver and Mesos's docker/volume isolator (through dvdcli) speak,
// so that their containers get csiagent's named CSI volumes.
//
// Each engine mount (a volume name and the engine's mount id) is one
// container of the isolator with a synthetic id (namedvol.EngineMountPrefix and a
// hash of the pair), prepared into a directory of the server's own: it
// shares the isolator's locks, checkpoints, reference counts and
// recovery. How many times the engine mounted the pair (Docker's cp
// mounts again with the same id; Podman uses one id for every mount) is
// recorded durably next to it, so Unmounts after an agent restart release
// exactly what they should. Requests and responses are the types of
// github.com/docker/go-plugins-helpers/volume, served from this package's
// own mux so that each call has the request's context: a Mount whose
// engine gave up (a client timeout) is cancelled and rolled back.
//
// Limits bound the socket's connections (read, idle and write timeouts
// that never cut a call short, and how many are served at once).
//
// The Server is also where the agent API's named-volume calls land (in
// core types, namedvol.Status): Define and Undefine, Status, Page (the
// volumes in pages of bounded size), Reconcile (engine mounts a crashed
// engine forgot) and Resolve, which turns named mounts into volumes under
// the names' locks, applying the annotation policy, for a Prepare. The
// Client speaks the protocol as an engine does (the tests play Docker with
// it) and fails on any answer over its limit rather than cutting it.
package dockerplugin
