package cluster

import (
	"cmp"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"

	"github.com/csiagent/csiagent/internal/atomicfile"
	"github.com/csiagent/csiagent/internal/optrace"
)

// Mode is how a claim is held.
type Mode string

const (
	// Exclusive: one node (single-node access modes,
	// MULTI_NODE_SINGLE_WRITER).
	Exclusive Mode = "exclusive"
	// Shared: any number of nodes (MULTI_NODE_READER_ONLY).
	Shared Mode = "shared"
	// MultiWriter: any number of nodes, writers (MULTI_NODE_MULTI_WRITER)
	// and readers; never beside an exclusive claim, whose single writer
	// it would not be.
	MultiWriter Mode = "multi-writer"
)

// ModeOf is the claim an access mode needs; ok false: none. An unknown or
// missing mode is ErrInvalid.
func ModeOf(volCap *csi.VolumeCapability) (m Mode, ok bool, err error) {
	switch mode := volCap.GetAccessMode().GetMode(); mode {
	case csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER:
		return MultiWriter, true, nil
	case csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY:
		return Shared, true, nil
	case csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER,
		csi.VolumeCapability_AccessMode_MULTI_NODE_SINGLE_WRITER:
		return Exclusive, true, nil
	default:
		return "", false, fmt.Errorf("%w: access mode %s needs a claim the cluster does not know", ErrInvalid, mode)
	}
}

// covers reports whether holding m is enough for a request of want.
func (m Mode) covers(want Mode) bool {
	return m == Exclusive || m == want || m == MultiWriter && want == Shared
}

// joins reports whether a node may join a claim held as m by others for a
// request of want, and the claim's mode then: readers join readers;
// writers and readers join multi-writers, and readers become a
// multi-writer claim when a multi-writer joins them.
func (m Mode) joins(want Mode) (Mode, bool) {
	switch {
	case m == Shared && want == Shared:
		return Shared, true
	case m == MultiWriter && want != Exclusive, m == Shared && want == MultiWriter:
		return MultiWriter, true
	}
	return "", false
}

// claimRecord is a claim key's value in etcd.
type claimRecord struct {
	Plugin string `json:"plugin"`
	Volume string `json:"volume"`
	Mode   Mode   `json:"mode"`
	// Holders maps each holding node to when it claimed.
	Holders map[string]time.Time `json:"holders"`
}

func (r *claimRecord) holderList() []string { return slices.Sorted(maps.Keys(r.Holders)) }

// State of a claim in this node's claim records.
type State string

const (
	// StateHeld: this node holds the claim.
	StateHeld State = "held"
	// StateReleasing: released by the node; etcd not told yet (a
	// pending release the reconciler finishes).
	StateReleasing State = "releasing"
	// StateRevoked: held here, but released in etcd (ReleaseNode while
	// this node was away): new Claims are refused until Release.
	StateRevoked State = "revoked"
)

// LocalClaim is a claim in this node's claim records.
type LocalClaim struct {
	Plugin string    `json:"plugin"`
	Volume string    `json:"volume"`
	Mode   Mode      `json:"mode"`
	State  State     `json:"state"`
	Since  time.Time `json:"since"`
	// Rev is the claim key's mod revision after this node's write (0:
	// unknown): a release tries it first, saving a read.
	Rev int64 `json:"rev,omitempty"`
	// Note says why a claim was revoked.
	Note string `json:"note,omitempty"`
}

// claimsDir is the directory of the node's claim records in
// Config.StateDir: claimBuckets atomicfile records at most, each holding
// the claims whose digest falls in it (bucketName), so that taking or
// releasing a claim rewrites a record of about 1/claimBuckets of the
// claims, in a slot of a file that stays (a bucket emptied is kept), not a
// record of them all.
const claimsDir = "claims"

// claimBuckets is the number of claim records: a bucket fits a record
// slot up to about 15 claims, so a node holding up to about 1,000 claims
// never replaces a record whole.
const claimBuckets = 64

// legacyClaimsFile is the claims file of earlier releases (every claim in
// one record), imported once by Join.
const legacyClaimsFile = "cluster-claims"

// stateFile is the payload of a claim record, and of legacyClaimsFile.
type stateFile struct {
	Version int          `json:"version"`
	Node    string       `json:"node"`
	Claims  []LocalClaim `json:"claims"`
}

// The versions of the claim records and of the legacy claims file.
const (
	stateVersion       = 2
	legacyStateVersion = 1
)

// bucketName is the name of the claim record holding the claim of plugin
// on volume: its bucket, from a digest of both (no caller-given byte in a
// path; the record holds them, and its frame is bound to its path).
func bucketName(plugin, volume string) string {
	sum := sha256.Sum256([]byte(plugin + "\x00" + volume))
	return fmt.Sprintf("%02x", sum[0]%claimBuckets)
}

// openState sets up the Committer, loads the claim records and imports a
// legacy claims file.
func (c *Cluster) openState(ctx context.Context) error {
	state := filepath.Clean(c.cfg.StateDir)
	c.dir = filepath.Join(state, claimsDir)
	c.commit = c.cfg.Commit
	if c.commit == nil {
		if err := atomicfile.MkdirAll(state, 0o700); err != nil {
			return fmt.Errorf("creating the cluster state directory: %w", err)
		}
		if err := atomicfile.SyncFS(state); err != nil {
			return fmt.Errorf("syncing the cluster state directory's filesystem before reading it: %w", err)
		}
		cm, err := atomicfile.New(state)
		if err != nil {
			return err
		}
		c.commit = cm
	}
	if err := c.commit.MkdirAll(c.dir, 0o700); err != nil {
		return fmt.Errorf("creating the cluster state directory: %w", err)
	}
	if err := c.loadRecords(); err != nil {
		return err
	}
	if err := c.loadInstall(filepath.Join(state, installFile)); err != nil {
		return err
	}
	wctx, cancel := context.WithTimeout(ctx, c.cfg.CallTimeout)
	defer cancel()
	if err := c.importLegacy(wctx, filepath.Join(state, legacyClaimsFile)); err != nil {
		return err
	}
	if err := c.commit.Sync(wctx); err != nil {
		return fmt.Errorf("making the cluster state directory durable: %w", err)
	}
	return nil
}

// installFile, in Config.StateDir, holds the node's install identity: a
// random id made once, registered with the node's liveness, so that a
// second host given the same node id (the default is the hostname, which
// cloned hosts share) is refused instead of sharing the first one's
// claims.
const installFile = "install-id"

// installRecord is installFile's payload.
type installRecord struct {
	Install string `json:"install"`
}

// loadInstall reads the node's install identity at path, making one if
// there is none (durable with openState's Sync, before any registration).
func (c *Cluster) loadInstall(path string) error {
	payload, _, err := c.commit.ReadRecord(path)
	if err == nil {
		var r installRecord
		if err := json.Unmarshal(payload, &r); err != nil || r.Install == "" {
			return fmt.Errorf("reading the node's install identity %s: %w", path, cmp.Or(err, errors.New("empty")))
		}
		c.install = r.Install
		return nil
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("reading the node's install identity: %w", err)
	}
	id := make([]byte, 16)
	if _, err := rand.Read(id); err != nil {
		return fmt.Errorf("making the node's install identity: %w", err)
	}
	b, err := json.Marshal(installRecord{Install: hex.EncodeToString(id)})
	if err != nil {
		return err
	}
	if _, err := c.commit.Put(path, b, 0o600); err != nil {
		return fmt.Errorf("writing the node's install identity: %w", err)
	}
	c.install = hex.EncodeToString(id)
	return nil
}

// loadRecords reads every claim record.
func (c *Cluster) loadRecords() error {
	ents, err := os.ReadDir(c.dir)
	if err != nil {
		return fmt.Errorf("reading the claim records: %w", err)
	}
	for _, e := range ents {
		if !e.Type().IsRegular() || strings.HasPrefix(e.Name(), ".") {
			continue // what a crash left of a record never acknowledged
		}
		path := filepath.Join(c.dir, e.Name())
		var f stateFile
		if err := c.readState(path, "the claim record", &f, stateVersion); err != nil {
			return err
		}
		for _, l := range f.Claims {
			if bucketName(l.Plugin, l.Volume) != e.Name() {
				return fmt.Errorf("the claim record %s holds the claim on volume %q of plugin %q, which is not recorded there", path, l.Volume, l.Plugin)
			}
			c.local[c.keys.claim(l.Plugin, l.Volume)] = &l
		}
	}
	return nil
}

// stamped is a state record's payload: its version and node id.
type stamped interface {
	stamp() (version int, node string)
}

func (f *stateFile) stamp() (int, string) { return f.Version, f.Node }

// readState decodes the state record at path (what it is, for errors)
// into v, which must have version want and this node's id (a record of
// another node is ErrInvalid: claims are taken under the node id).
func (c *Cluster) readState(path, what string, v stamped, want int) error {
	b, _, err := atomicfile.ReadRecord(c.commit.Root(), path)
	if err != nil {
		return fmt.Errorf("reading %s %s: %w", what, path, err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("decoding %s %s: %w", what, path, err)
	}
	switch version, node := v.stamp(); {
	case version != want:
		return fmt.Errorf("%s %s has version %d; this agent reads version %d", what, path, version, want)
	case node != c.cfg.NodeID:
		return fmt.Errorf("%w: %s %s holds claims of node %q, not %q: a node id must stay the same across restarts (release node %q's claims, or restore its id)",
			ErrInvalid, what, path, node, c.cfg.NodeID, node)
	}
	return nil
}

// importLegacy writes each claim of a legacy claims file as its own
// record, makes them durable, then removes the file (a crash in between
// imports it again, to the same records).
func (c *Cluster) importLegacy(ctx context.Context, path string) error {
	var st stateFile
	err := c.readState(path, "the claims file", &st, legacyStateVersion)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	c.mu.Lock()
	buckets := map[string]bool{}
	for _, l := range st.Claims {
		c.local[c.keys.claim(l.Plugin, l.Volume)] = &l
		buckets[bucketName(l.Plugin, l.Volume)] = true
	}
	for b := range buckets {
		if _, err := c.persistLocked(b); err != nil {
			c.mu.Unlock()
			return fmt.Errorf("importing the claims file %s: %w", path, err)
		}
	}
	c.mu.Unlock()
	if err := c.commit.Sync(ctx); err != nil {
		return fmt.Errorf("importing the claims file %s: %w", path, err)
	}
	if _, err := c.commit.Remove(path); err != nil {
		return fmt.Errorf("removing the imported claims file: %w", err)
	}
	return nil
}

// byPluginVolume orders local claims by plugin, then volume id.
func byPluginVolume(a, b LocalClaim) int {
	return cmp.Or(strings.Compare(a.Plugin, b.Plugin), strings.Compare(a.Volume, b.Volume))
}

// persistLocked writes claim record bucket (c.mu held) from the local
// claims and returns the change to wait for.
func (c *Cluster) persistLocked(bucket string) (uint64, error) {
	st := stateFile{Version: stateVersion, Node: c.cfg.NodeID, Claims: []LocalClaim{}}
	for _, l := range c.local {
		if bucketName(l.Plugin, l.Volume) == bucket {
			st.Claims = append(st.Claims, *l)
		}
	}
	slices.SortFunc(st.Claims, byPluginVolume)
	b, err := json.Marshal(st)
	if err != nil {
		return 0, fmt.Errorf("encoding the claim record: %w", err)
	}
	n, err := c.commit.Put(filepath.Join(c.dir, bucket), b, 0o600)
	if err != nil {
		return 0, fmt.Errorf("writing the claim record: %w", err)
	}
	return n, nil
}

// setLocal changes (nil: removes) the local claim of key and writes its
// record; durable waits until the change is durable.
func (c *Cluster) setLocal(ctx context.Context, key string, l *LocalClaim, durable bool) error {
	written := optrace.Begin(ctx, optrace.Other, "claim record write")
	c.mu.Lock()
	old, had := c.local[key]
	if l == nil && !had {
		c.mu.Unlock()
		written()
		return nil
	}
	at := l
	if at == nil {
		at = old
		delete(c.local, key)
	} else {
		c.local[key] = l
	}
	n, err := c.persistLocked(bucketName(at.Plugin, at.Volume))
	if err != nil {
		if had {
			c.local[key] = old
		} else {
			delete(c.local, key)
		}
	}
	c.mu.Unlock()
	written()
	if err != nil || !durable {
		return err
	}
	defer optrace.Begin(ctx, optrace.Commit, "Wait: claim record durable")()
	if err := c.commit.Wait(ctx, n); err != nil {
		return fmt.Errorf("making the claim record durable: %w", err)
	}
	return nil
}

func (c *Cluster) getLocal(key string) (LocalClaim, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	l, ok := c.local[key]
	if !ok {
		return LocalClaim{}, false
	}
	return *l, true
}

// maxCASAttempts bounds a claim's compare-and-put retries (other nodes
// changing the same key meanwhile).
const maxCASAttempts = 16

// Claim takes this node's claim on a volume before the volume comes onto
// the node (see the package doc for where). It returns nil at once when
// the access mode needs no claim, and when this node holds the claim
// already (etcd is asked unless down; unreachable, the claim records
// answer). A claim held by another node: ErrConflict, naming it. A new
// claim with etcd unreachable: ErrUnavailable. A revoked claim:
// ErrRevoked until Release. The claim is in its record before Claim
// returns nil, durable with the caller's next wait on Config.Commit (a
// claim lost with a power cut before that is an orphan in etcd, released
// by the reconciler once the volume is not on the node).
func (c *Cluster) Claim(ctx context.Context, plugin, volumeID string, volCap *csi.VolumeCapability) error {
	want, needed, err := ModeOf(volCap)
	if err != nil || !needed {
		return err
	}
	if plugin == "" || volumeID == "" {
		return fmt.Errorf("%w: a claim needs a plugin and a volume id (got %q, %q)", ErrInvalid, plugin, volumeID)
	}
	key := c.keys.claim(plugin, volumeID)
	unlock, err := c.volumes.Lock(ctx, key)
	if err != nil {
		return fmt.Errorf("claiming volume %s of plugin %s: %w", volumeID, plugin, err)
	}
	defer unlock()
	if l, ok := c.getLocal(key); ok {
		switch {
		case l.State == StateRevoked:
			return c.revokedErr(l)
		case l.State == StateHeld && l.Mode.covers(want):
			if err := c.confirm(ctx, key, l); err != nil {
				return err
			}
			if l.Since.Before(c.started) {
				// An earlier run's claim, this run's now: the
				// reconciler releases earlier runs' claims of volumes
				// not on the node, which this one is about to be.
				l.Since = time.Now().UTC()
				if err := c.setLocal(ctx, key, &l, false); err != nil {
					return fmt.Errorf("claiming volume %s of plugin %s: recording the claim on this node: %w", volumeID, plugin, err)
				}
			}
			return nil
		}
	}
	return c.take(ctx, key, plugin, volumeID, want)
}

func (c *Cluster) revokedErr(l LocalClaim) error {
	return fmt.Errorf("%w: this node's claim on volume %s of plugin %s was released in the cluster while the node was away (%s); it must not be used by new containers here: move its remaining containers off, and once the volume has left this node its claim can be taken again",
		ErrRevoked, l.Volume, l.Plugin, l.Note)
}

// confirm checks a claim held locally against etcd unless etcd is down:
// still ours, nil; gone or another node's, revoked. etcd not answering:
// the local record stands (fail closed keeps what this node holds). At
// the start, before the node has registered, etcd is asked: a node back
// after its claims were released must find so before a new container
// gets the volume.
func (c *Cluster) confirm(ctx context.Context, key string, l LocalClaim) error {
	if c.down.Load() {
		return nil
	}
	rec, _, err := c.read(ctx, key)
	if err != nil {
		if ctx.Err() != nil {
			return err
		}
		c.log.Warn("cluster: etcd did not confirm a claim this node holds; using its claim record", "plugin", l.Plugin, "volume", l.Volume, "error", err)
		return nil
	}
	if why := lostReason(rec, c.cfg.NodeID); why != "" {
		l = c.revoke(ctx, key, l, why)
		return c.revokedErr(l)
	}
	return nil
}

// lostReason says why etcd's record shows node not holding the claim,
// "" when it does.
func lostReason(rec *claimRecord, node string) string {
	switch {
	case rec == nil:
		return "its claim key is gone"
	case rec.Holders[node].IsZero():
		return fmt.Sprintf("etcd shows it held %s by %s", rec.Mode, strings.Join(rec.holderList(), ", "))
	}
	return ""
}

// revoke marks a local claim revoked, loudly.
func (c *Cluster) revoke(ctx context.Context, key string, l LocalClaim, why string) LocalClaim {
	l.State, l.Note = StateRevoked, why
	c.log.Error("cluster: a claim this node holds was released in the cluster (ReleaseNode while the node was away); new containers are refused the volume, existing ones are left alone",
		"plugin", l.Plugin, "volume", l.Volume, "why", why)
	if err := c.setLocal(ctx, key, &l, false); err != nil {
		c.log.Error("cluster: recording a revoked claim", "plugin", l.Plugin, "volume", l.Volume, "error", err)
	}
	return l
}

// read gets a claim key: nil when absent, with its mod revision.
func (c *Cluster) read(ctx context.Context, key string) (*claimRecord, int64, error) {
	gctx, cancel := c.callCtx(ctx)
	defer cancel()
	defer optrace.Begin(ctx, optrace.Claim, "etcd Get")()
	resp, err := c.client.Get(gctx, key)
	if err != nil {
		return nil, 0, c.etcdErr(ctx, "reading claim "+key, err)
	}
	c.answered()
	if len(resp.Kvs) == 0 {
		return nil, 0, nil
	}
	rec, err := decodeClaim(resp.Kvs[0].Key, resp.Kvs[0].Value)
	return rec, resp.Kvs[0].ModRevision, err
}

func decodeClaim(key, value []byte) (*claimRecord, error) {
	var rec claimRecord
	if err := json.Unmarshal(value, &rec); err != nil {
		return nil, fmt.Errorf("decoding claim %s: %w", key, err)
	}
	return &rec, nil
}

// cas replaces key's value if its mod revision is still rev (0: if it is
// absent); next (nil: delete). ok true: curRev is the key's new mod
// revision; ok false: it changed, and the current record and revision
// are returned, or, the key as expected, one of the extra comparisons
// failed: errCmp.
func (c *Cluster) cas(ctx context.Context, key string, rev int64, next *claimRecord, what string, extra ...clientv3.Cmp) (ok bool, cur *claimRecord, curRev int64, err error) {
	cmp := clientv3.Compare(clientv3.ModRevision(key), "=", rev)
	op := clientv3.OpDelete(key)
	if next != nil {
		b, err := json.Marshal(next)
		if err != nil {
			return false, nil, 0, fmt.Errorf("encoding claim %s: %w", key, err)
		}
		op = clientv3.OpPut(key, string(b))
	}
	tctx, cancel := c.callCtx(ctx)
	defer cancel()
	defer optrace.Begin(ctx, optrace.Claim, "etcd Txn")()
	resp, err := c.client.Txn(tctx).If(append([]clientv3.Cmp{cmp}, extra...)...).Then(op).Else(clientv3.OpGet(key)).Commit()
	if err != nil {
		return false, nil, 0, c.etcdErr(ctx, what, err)
	}
	c.answered()
	if resp.Succeeded {
		return true, nil, resp.Header.GetRevision(), nil
	}
	kvs := resp.Responses[0].GetResponseRange().GetKvs()
	curRev = 0
	if len(kvs) > 0 {
		cur, err = decodeClaim(kvs[0].Key, kvs[0].Value)
		curRev = kvs[0].ModRevision
	}
	if err == nil && len(extra) > 0 && curRev == rev {
		return false, cur, curRev, errCmp // the key is as it was: an extra comparison failed
	}
	return false, cur, curRev, err
}

// take takes (or upgrades to) a claim in etcd, then records it locally.
// A claim this node has no record of is first tried as a new key (one
// round trip when no node holds it); else the key is read first.
func (c *Cluster) take(ctx context.Context, key, plugin, volumeID string, want Mode) error {
	what := fmt.Sprintf("claiming volume %s of plugin %s", volumeID, plugin)
	const noClaim = "; this node does not hold the claim, so the volume cannot come onto it until etcd answers"
	var rec *claimRecord
	var rev int64
	if _, known := c.getLocal(key); known {
		var err error
		if rec, rev, err = c.read(ctx, key); err != nil {
			return fmt.Errorf("%w%s", err, noClaim)
		}
	}
	node := c.cfg.NodeID
	// Taken only while this node is registered under its id with its own
	// lease: a second host given the same node id (ErrDuplicateNode)
	// cannot register, so it takes no claim as the first.
	session := c.registration(ctx)
	if session == nil {
		return fmt.Errorf("%w: %s: this node is not registered in etcd (not yet, or another host is registered under its node id: see the log)%s", ErrUnavailable, what, noClaim)
	}
	registered := clientv3.Compare(clientv3.LeaseValue(c.keys.nodeAlive(node)), "=", session.Lease())
	for range maxCASAttempts {
		next, mode, cerr := grant(rec, plugin, volumeID, node, want)
		if cerr != nil {
			c.conflicts.Add(1)
			return fmt.Errorf("%s: %w", what, cerr)
		}
		ok := next == nil // held in etcd already as needed
		if !ok {
			var err error
			ok, rec, rev, err = c.cas(ctx, key, rev, next, what, registered)
			if errors.Is(err, errCmp) {
				return fmt.Errorf("%w: %s: this node's registration in etcd is not its lease's (lost, or another host's)%s", ErrUnavailable, what, noClaim)
			}
			if err != nil {
				return fmt.Errorf("%w%s", err, noClaim)
			}
		}
		if ok {
			// Durable with the caller's next durable point (a
			// Prepare's answer waits for it); lost with a power cut
			// before that, the claim is an orphan in etcd, which the
			// reconciler releases, and the unacknowledged Prepare's
			// volume is claimed again on its way up.
			l := &LocalClaim{Plugin: plugin, Volume: volumeID, Mode: mode, State: StateHeld, Since: time.Now().UTC(), Rev: rev}
			if err := c.setLocal(ctx, key, l, false); err != nil {
				c.undo(ctx, key, plugin, volumeID)
				return fmt.Errorf("%s: recording the claim on this node: %w", what, err)
			}
			return nil
		}
	}
	return fmt.Errorf("%w: %s: the claim key changed on each of %d attempts (other nodes claiming and releasing it); retry", ErrUnavailable, what, maxCASAttempts)
}

// registration is the node's session, waited for while the node is not
// registered (right after Join, or after its lease was lost) within
// ctx and Config.CallTimeout; nil if it is not registered by then.
func (c *Cluster) registration(ctx context.Context) *concurrency.Session {
	c.mu.Lock()
	s, registered := c.session, c.registered
	c.mu.Unlock()
	if s != nil {
		return s
	}
	wctx, cancel := c.callCtx(ctx)
	defer cancel()
	select {
	case <-registered:
	case <-wctx.Done():
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.session
}

// grant computes the claim record after node takes want: nil when the
// record already gives it, with the mode held; a conflict names the
// holders.
func grant(rec *claimRecord, plugin, volumeID, node string, want Mode) (next *claimRecord, held Mode, err error) {
	now := time.Now().UTC()
	if rec == nil || len(rec.Holders) == 0 {
		return &claimRecord{Plugin: plugin, Volume: volumeID, Mode: want, Holders: map[string]time.Time{node: now}}, want, nil
	}
	_, mine := rec.Holders[node]
	switch {
	case mine && rec.Mode.covers(want):
		return nil, rec.Mode, nil
	case mine && len(rec.Holders) == 1: // held by this node alone: upgrade
		return &claimRecord{Plugin: plugin, Volume: volumeID, Mode: want, Holders: map[string]time.Time{node: now}}, want, nil
	}
	if mode, ok := rec.Mode.joins(want); ok {
		next := *rec
		next.Mode, next.Holders = mode, maps.Clone(rec.Holders)
		next.Holders[node] = now
		return &next, mode, nil
	}
	others := slices.DeleteFunc(rec.holderList(), func(h string) bool { return h == node })
	return nil, "", fmt.Errorf("%w: volume %s of plugin %s is held %s by node %s (since %s); a %s claim needs it released there first",
		ErrConflict, volumeID, plugin, rec.Mode, strings.Join(others, ", "), rec.Holders[others[0]].Format(time.RFC3339), want)
}

// undo drops a claim this node just took but could not record durably:
// from its record (which may be written, not durable) and from
// etcd; what etcd keeps, the reconciler releases as an orphan.
func (c *Cluster) undo(ctx context.Context, key, plugin, volumeID string) {
	if err := c.setLocal(ctx, key, nil, false); err != nil {
		c.log.Error("cluster: dropping a claim this node could not record", "plugin", plugin, "volume", volumeID, "error", err)
	}
	if err := c.removeHolder(ctx, key); err != nil {
		c.log.Error("cluster: undoing a claim this node could not record; the reconciler releases it", "plugin", plugin, "volume", volumeID, "error", err)
	}
}

// removeHolder removes this node from key's holders (the key when it was
// the last); nothing when it does not hold it. An exclusive claim whose
// revision this node recorded is tried as that first (one round trip
// when no one changed it).
func (c *Cluster) removeHolder(ctx context.Context, key string) error {
	if l, ok := c.getLocal(key); ok && l.Rev > 0 && l.Mode == Exclusive {
		guess := &claimRecord{Plugin: l.Plugin, Volume: l.Volume, Mode: l.Mode, Holders: map[string]time.Time{c.cfg.NodeID: l.Since}}
		return c.removeNodeFrom(ctx, key, c.cfg.NodeID, nil, guess, l.Rev, nil)
	}
	return c.removeNode(ctx, key, c.cfg.NodeID, nil)
}

// removeNode removes node from key's holders, under the extra
// comparisons (false: the release is refused with errCmp).
func (c *Cluster) removeNode(ctx context.Context, key, node string, extra []clientv3.Cmp) error {
	rec, rev, err := c.read(ctx, key)
	return c.removeNodeFrom(ctx, key, node, extra, rec, rev, err)
}

// removeNodeFrom is removeNode from a record and revision read (or
// guessed: a wrong guess costs the comparison, which returns the key as
// it is).
func (c *Cluster) removeNodeFrom(ctx context.Context, key, node string, extra []clientv3.Cmp, rec *claimRecord, rev int64, err error) error {
	for range maxCASAttempts {
		if err != nil {
			return err
		}
		if rec == nil || rec.Holders[node].IsZero() {
			return nil
		}
		var next *claimRecord
		if len(rec.Holders) > 1 {
			n := *rec
			n.Holders = maps.Clone(rec.Holders)
			delete(n.Holders, node)
			next = &n
		}
		var ok bool
		ok, rec, rev, err = c.cas(ctx, key, rev, next, "releasing claim "+key+" of node "+node, extra...)
		if ok || errors.Is(err, errCmp) {
			return err
		}
	}
	return fmt.Errorf("%w: releasing claim %s of node %s: the key changed on each of %d attempts; retry", ErrUnavailable, key, node, maxCASAttempts)
}

// errCmp: an extra comparison of cas failed (the key was as expected).
var errCmp = errors.New("release condition failed")

// Release gives up this node's claim after the volume left the node (see
// the package doc for where). It always returns nil unless ctx ends
// before the release is recorded: the release is in the claim's record,
// durably, first, and with it every change made on Config.Commit before
// the call (the caller's teardown: the Committer's rounds are ordered);
// etcd not answering leaves it pending, and the reconciler finishes it.
// A claim this node does not hold: nil, no call.
func (c *Cluster) Release(ctx context.Context, plugin, volumeID string) error {
	key := c.keys.claim(plugin, volumeID)
	unlock, err := c.volumes.Lock(ctx, key)
	if err != nil {
		return fmt.Errorf("releasing volume %s of plugin %s: %w", volumeID, plugin, err)
	}
	defer unlock()
	l, ok := c.getLocal(key)
	if !ok {
		return nil
	}
	if l.State == StateRevoked { // another node's now: nothing of ours in etcd
		return c.setLocal(ctx, key, nil, false)
	}
	if l.State != StateReleasing {
		l.State = StateReleasing
		if err := c.setLocal(ctx, key, &l, true); err != nil {
			return fmt.Errorf("releasing volume %s of plugin %s: %w", volumeID, plugin, err)
		}
	}
	if c.down.Load() {
		c.pokeReconciler()
		return nil
	}
	if err := c.removeHolder(ctx, key); err != nil {
		c.log.Warn("cluster: release pending until etcd answers", "plugin", plugin, "volume", volumeID, "error", err)
		c.pokeReconciler()
		return nil
	}
	if err := c.setLocal(ctx, key, nil, false); err != nil {
		c.log.Error("cluster: removing a released claim's record; the reconciler retries", "plugin", plugin, "volume", volumeID, "error", err)
	}
	return nil
}

func (c *Cluster) pokeReconciler() {
	select {
	case c.poke <- struct{}{}:
	default:
	}
}

// reconcile brings the claim records and etcd together, once
// Config.Recovered has closed: pending releases are finished; a claim
// held here but not in etcd is revoked; a claim etcd holds for this node
// that the file does not know is released once InUse says false. Stops
// at the first etcd error (the next round retries).
func (c *Cluster) reconcile(ctx context.Context) {
	defer c.reconciles.Add(1)
	if err := c.reconcileOnce(ctx); err != nil && ctx.Err() == nil {
		c.log.Warn("cluster: reconciling claims with etcd; retrying later", "error", err)
	}
}

func (c *Cluster) reconcileOnce(ctx context.Context) error {
	if r := c.cfg.Recovered; r != nil {
		select {
		case <-r:
		default:
			return nil // InUse does not know every volume yet
		}
	}
	gctx, cancel := c.callCtx(ctx)
	resp, err := c.client.Get(gctx, c.keys.claims(), clientv3.WithPrefix())
	cancel()
	if err != nil {
		return c.etcdErr(ctx, "listing claims", err)
	}
	c.answered()
	inEtcd := map[string]bool{} // claim keys etcd shows this node holding
	for _, kv := range resp.Kvs {
		rec, err := decodeClaim(kv.Key, kv.Value)
		if err != nil {
			c.log.Error("cluster: skipping a claim key", "error", err)
			continue
		}
		if !rec.Holders[c.cfg.NodeID].IsZero() {
			inEtcd[string(kv.Key)] = true
		}
	}
	c.mu.Lock()
	localKeys := slices.Collect(maps.Keys(c.local))
	c.mu.Unlock()
	var errs []error
	for _, key := range localKeys {
		if err := c.reconcileLocal(ctx, key, inEtcd[key]); err != nil {
			errs = append(errs, err)
		}
	}
	orphans := slices.Sorted(maps.Keys(inEtcd))
	for _, key := range orphans {
		if err := c.reconcileOrphan(ctx, key); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// reconcileLocal reconciles one claim of the claim records; listed: the
// listing showed this node holding it.
func (c *Cluster) reconcileLocal(ctx context.Context, key string, listed bool) error {
	unlock, err := c.volumes.Lock(ctx, key)
	if err != nil {
		return err
	}
	defer unlock()
	l, ok := c.getLocal(key)
	if !ok {
		return nil
	}
	switch l.State {
	case StateReleasing:
		if c.cfg.InUse(l.Plugin, l.Volume) {
			if !listed {
				// The release reached etcd (another node may hold
				// the volume now) before the volume came back.
				c.revoke(ctx, key, l, "its release reached etcd before the volume came onto the node again")
				return nil
			}
			// Back on the node (its last user's cleanup was
			// interrupted, and recovery brought it up again): the
			// claim stays, held.
			l.State = StateHeld
			c.log.Warn("cluster: a volume whose claim was being released is on the node again; keeping the claim", "plugin", l.Plugin, "volume", l.Volume)
			return c.setLocal(ctx, key, &l, true)
		}
		// The release's record, and the teardown before it, durable
		// first (Release's own wait may have ended before).
		sctx, cancel := c.callCtx(ctx)
		err := c.commit.Sync(sctx)
		cancel()
		if err != nil {
			return fmt.Errorf("finishing the release of volume %s of plugin %s: %w", l.Volume, l.Plugin, err)
		}
		if err := c.removeHolder(ctx, key); err != nil {
			return err
		}
		c.log.Info("cluster: pending release finished", "plugin", l.Plugin, "volume", l.Volume)
		return c.setLocal(ctx, key, nil, false)
	case StateHeld:
		if l.Since.Before(c.started) && !c.cfg.InUse(l.Plugin, l.Volume) {
			// An earlier run's claim on a volume not on the node: it
			// stopped between the volume's teardown and the release
			// (a volume brought up again later is claimed again).
			if err := c.removeHolder(ctx, key); err != nil {
				return err
			}
			c.log.Info("cluster: released an earlier run's claim on a volume not on the node", "plugin", l.Plugin, "volume", l.Volume)
			return c.setLocal(ctx, key, nil, false)
		}
		if listed {
			return nil
		}
		// The listing may predate a claim taken since: ask again, under
		// the key's lock.
		rec, _, err := c.read(ctx, key)
		if err != nil {
			return err
		}
		if why := lostReason(rec, c.cfg.NodeID); why != "" {
			c.revoke(ctx, key, l, why)
		}
	}
	return nil
}

// reconcileOrphan releases a claim etcd holds for this node that the
// claim records do not know (a crash between etcd's commit and the
// record's), once nothing uses the volume.
func (c *Cluster) reconcileOrphan(ctx context.Context, key string) error {
	unlock, err := c.volumes.Lock(ctx, key)
	if err != nil {
		return err
	}
	defer unlock()
	if _, ok := c.getLocal(key); ok {
		return nil
	}
	rec, _, err := c.read(ctx, key)
	if err != nil || rec == nil || rec.Holders[c.cfg.NodeID].IsZero() {
		return err
	}
	if c.cfg.InUse(rec.Plugin, rec.Volume) {
		c.log.Warn("cluster: etcd holds a claim for this node that its claim records do not know, and the volume is in use here; kept", "plugin", rec.Plugin, "volume", rec.Volume)
		return nil
	}
	if err := c.removeHolder(ctx, key); err != nil {
		return err
	}
	c.log.Info("cluster: released a claim etcd held for this node without a record here (unused)", "plugin", rec.Plugin, "volume", rec.Volume)
	return nil
}

// Local lists the claim records, sorted by plugin and volume; it never
// calls etcd.
func (c *Cluster) Local() []LocalClaim {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]LocalClaim, 0, len(c.local))
	for _, l := range c.local {
		out = append(out, *l)
	}
	slices.SortFunc(out, byPluginVolume)
	return out
}

// Revoked lists the claims revoked (StateRevoked) for the agent to
// report.
func (c *Cluster) Revoked() []LocalClaim {
	return slices.DeleteFunc(c.Local(), func(l LocalClaim) bool { return l.State != StateRevoked })
}
