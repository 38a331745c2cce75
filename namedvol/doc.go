// Package namedvol holds named CSI volumes: a name bound to a plugin, a
// volume id (pre-provisioned, or created by the agent: Provision, with its
// intent recorded before the plugin's CreateVolume and a name, CSIName,
// that finds the volume again after a crash), a capability, a volume
// context and secret references, as
// container engines name volumes (docker volume create NAME, the
// csi.csiagent.io/mounts annotation). Definitions are parsed from the
// engines' flat key=value options (ParseOptions), one JSON file per name in
// a directory (Store), at most MaxDefinition bytes each, each written
// crash-safely: a definition is either there whole or not at all, and
// durable once Create or Remove returns.
//
// A named volume has no owner: engines' volume plugin protocol carries no
// caller identity, and whoever may create a container can set an
// annotation. So a definition says itself whether annotations may name it
// (allow_annotations, false unless set, also for definitions stored
// before the option existed) and whether annotation users may have it
// while engine mounts hold it (share_engine_mounts); the agent enforces
// both (Status.CheckAnnotationUse) for the mounts the OCI hook passes as
// an annotation's, engine mounts (docker run -v) are not affected.
//
// Docker, Podman and the agent API share one name space; each definition
// records its creator (an engine, or CreatorAPI), and an engine may remove
// only what it created (Definition.CheckRemove). Definition.Volume is a
// definition as the isolator's own volume request.
//
// Mount and ParseMounts are the NAME:PATH[:ro];... form of the
// annotation and of prepare --mounts; Status is a definition with its use,
// as the agent reports it.
package namedvol
