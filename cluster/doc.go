// Package cluster is the agent's multi-host layer on etcd: the node's
// membership in the fleet, its claims on volumes that only one host may
// use at a time, the release of a dead host's claims, and cluster-wide
// locks for operations that must have one call in flight per object. One
// host with no etcd does not use it.
//
// Join registers the node under a lease (NodeInfo, which the caller
// fills: plugins with topology, capacity and max volumes, agent version,
// fencing addresses) and keeps the lease alive, registering again under a
// new lease when it is lost. The node's liveness key carries a random
// install identity made once in Config.StateDir and the boot id: only
// this host's earlier run in the same boot takes a live registration
// over; another host alive under the same node id refuses it
// (ErrDuplicateNode), and anything else (a run before a reboot, a copy of
// the disk) is waited out until its lease expires. A claim is taken only
// registered (Claim waits up to Config.CallTimeout for the
// registration), in a transaction that finds the node's liveness key on
// the node's own lease, so a host that cannot register takes none. Nodes lists every node that ever registered,
// with its liveness. The package knows the agent only through
// Config.InUse (is a volume on this node?); it calls no plugin and
// unmounts nothing.
//
// # Claims
//
// Claim takes a claim key per plugin and volume id, in one etcd
// compare-and-put transaction: exclusive for the single-node access modes
// and MULTI_NODE_SINGLE_WRITER, shared by the MULTI_NODE_READER_ONLY
// readers, multi-writer for MULTI_NODE_MULTI_WRITER, shared by
// multi-writers and readers and refused beside an exclusive claim (ModeOf,
// Mode.joins). A claim is never
// bound to a lease: a host that dies keeps its claims (partitioned, it may
// still be writing) until ReleaseNode. The node records its claims in its
// claim records (Config.StateDir/claims/, atomicfile records on the
// daemon's Committer: written before Claim returns, durable with the
// caller's next durable point, which a Prepare's answer waits for), so it
// restarts knowing them without etcd. A Release's record is durable
// before etcd is told, and with it the caller's teardown written before
// (the Committer's rounds are ordered).
//
// The isolator calls Claim before the first node call of a volume that is
// not yet on the node (before ControllerPublishVolume where the plugin
// attaches, else before NodeStageVolume, else NodePublishVolume), before
// any other way up (recovery bringing a volume up again), and
// Release after the last call that takes it off the node
// (ControllerUnpublishVolume, else NodeUnstageVolume, else
// NodeUnpublishVolume) is durable in its checkpoint. It calls Claim
// again before each new container of a volume already on the node: a
// claim the node holds answers from its record (after a round trip
// to etcd unless etcd is down, which finds a revocation: right after a
// restart too, before the node has registered), a revoked one refuses
// the new container (ErrRevoked).
//
// Fail closed: when etcd does not answer (no quorum, unreachable; every
// call is bounded by Config.CallTimeout), a Claim this node holds
// succeeds from its record, a new one fails ErrUnavailable, and
// Release records a pending release (durably) and returns nil; the
// reconciler finishes it when etcd is back, unless the volume is on the
// node again by then (InUse: recovery brought it up for a user whose
// cleanup was interrupted), when the claim stays held. The reconciler (after each
// registration, each pending release and every Config.ReconcileInterval)
// works both ways: a claim recorded here that etcd shows gone or another
// node's is marked revoked (logged as an error, listed by Revoked and
// counted in Stats; new Claims refused with ErrRevoked until Release;
// nothing is unmounted), and a claim etcd holds for this node that no
// record here knows (a crash between the two writes) is released once
// Config.InUse says the volume is not on the node. A claim an earlier run
// of the node recorded, on a volume InUse says is not on the node (the
// agent stopped between the volume's teardown and its release), is
// released too: a volume brought up again later is claimed again.
//
// ReleaseNode hands a dead node's claims over: refused while the node's
// lease lives, accepted once it is gone and either the caller's fencing
// (csi-addons FenceClusterNetwork with the addresses the node registered)
// succeeded or the operator asserted the node down. Each release
// re-checks in its transaction that the node has not come back.
//
// Lock takes an etcd mutex per object kind and id on the node's session
// (concurrency.Mutex's keys and order, with a wait and a cleanup bounded
// by the caller's deadline and retried in the background: a key left
// behind would hold the object for the node's lease's whole life), and
// returns a context that ends with the lease, under which the operation
// runs: another node may take the lock once the lease is gone. Claims reads every
// claim and lock of the cluster (csi-agent cluster claims); Local and
// Revoked read this node's claim records; Stats are the counters for
// metrics (connected, claims held, pending releases, revoked, conflicts,
// lock waits, locks held).
//
// # Keys in etcd
//
// Under Config.Prefix (P), each caller-given name (node id, plugin,
// volume id, lock kind and id) one url.PathEscape'd path segment:
//
//	P/nodes/<node>/info              NodeRecord JSON, no lease (a dead node stays listed)
//	P/nodes/<node>/alive             {"lease": hex, "since": time}, on the node's lease
//	P/claims/<plugin>/<volume>       {"plugin", "volume", "mode": "exclusive"|"shared",
//	                                  "holders": {node: since}}, no lease
//	P/locks/<kind>/<id>/<lease hex>  mutex keys on the holder's lease (concurrency.Mutex's)
//
// # Claim records
//
// The node's claims are in at most 64 atomicfile records (framed,
// checksummed, written in slots; see package atomicfile) in
// Config.StateDir/claims/, each holding the claims whose digest falls in
// it: the record named by the first byte of SHA-256(plugin NUL volume id)
// modulo 64, in two hex digits (no caller-given byte in a path), holding
// JSON:
//
//	{"version": 2, "node": "<node id>",
//	 "claims": [{"plugin", "volume", "mode", "state": "held"|"releasing"|"revoked",
//	             "since", "rev", "note"}]}
//
// Taking, releasing or revoking a claim rewrites its bucket alone, in a
// slot of a file that stays (an emptied bucket is kept): no file made or
// removed per claim, and no record replaced whole below about 1,000
// claims. A record of another node id is refused at Join (ErrInvalid):
// claims are taken under the node id, which must not change. The claims
// file of earlier releases (Config.StateDir/cluster-claims, version 1:
// every claim in one record) is imported once by Join: its claims are
// written to their buckets, durably, then the file is removed.
//
// # Errors
//
//	ErrConflict     another node holds the claim; the message names the
//	                node(s), never containers        FailedPrecondition
//	ErrUnavailable  etcd did not answer within CallTimeout (no quorum,
//	                unreachable), the node is not registered (Lock), or a
//	                claim key changed on every retry; retry later  Unavailable
//	ErrRevoked      this node's claim was released while it was away;
//	                Release it once the volume left   FailedPrecondition
//	ErrNodeAlive    ReleaseNode of a node whose lease lives, or that came
//	                back midway                       FailedPrecondition
//	ErrNotFenced    ReleaseNode without fencing (failed, no addresses, no
//	                fencer) and without nodeIsDown    FailedPrecondition
//	ErrNotFound     ReleaseNode of a node that never registered  NotFound
//	ErrInvalid      a bad config, an access mode without a claim rule, a
//	                Lock without a deadline, a claim record of another
//	                node                              InvalidArgument
//	the ctx's error when the caller's context ended first.
//
// # When not to call
//
// Never call Release while any
// container, stage or attachment of the volume remains on the node: the
// claim is what keeps other hosts off it. Do not unmount anything on
// ErrRevoked or on a Revoked entry: report it; the containers using the
// volume are the operator's to move. Do not call ReleaseNode on a
// timer: it is the operator's decision (csi-agent cluster release), and
// nodeIsDown is their assertion. Do not hold a Lock across a lease loss
// and trust it: a node that loses its lease (Stats().Connected false for
// the lease's TTL) loses its locks.
package cluster
