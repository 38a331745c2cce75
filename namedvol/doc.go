// Package namedvol holds named CSI volumes: a name bound to a plugin, a
// volume id, a capability, a volume context and secret references, as
// container engines name volumes (docker volume create NAME, the
// csi.csiagent.io/mounts annotation). Definitions are parsed from the
// engines' flat key=value options (ParseOptions), one JSON file per name in
// a directory (Store), at most MaxDefinition bytes each, each written
// crash-safely: a definition is either there whole or not at all, and
// durable once Create or Remove returns.
package namedvol
