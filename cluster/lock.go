package cluster

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sort"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
)

// lockHeld is a lock this node holds.
type lockHeld struct {
	kind, id string
	since    time.Time
}

// Lock takes the cluster-wide lock of one object (kind: "volume",
// "volumegroup", "groupsnapshot", ...; id: the plugin's id of it), waiting
// while another node or caller holds it until ctx ends; ctx must carry a
// deadline (the operation's), which bounds every etcd call of the wait.
// The lock lives on the node's lease: held is ctx, cancelled when the
// lease is lost (etcd unreachable for the lease's TTL, or revoked), since
// another node may take the lock then: the operation must run under it.
// unlock releases it. A lock key that cannot be deleted (etcd not
// answering) is deleted again in the background, this node's next caller
// of the object waiting, until it is gone or the lease is: it never
// holds the object for other nodes. waiting, if set, is called once,
// before the wait, when the lock is held, with its holder ("this node"
// for another call here, "" when etcd could not say).
func (c *Cluster) Lock(ctx context.Context, kind, id string, waiting func(holder string)) (held context.Context, unlock func(), err error) {
	if kind == "" || id == "" {
		return nil, nil, fmt.Errorf("%w: a lock needs a kind and an id (got %q, %q)", ErrInvalid, kind, id)
	}
	if _, ok := ctx.Deadline(); !ok {
		return nil, nil, fmt.Errorf("%w: locking %s %s: the context has no deadline (pass the operation's)", ErrInvalid, kind, id)
	}
	c.mu.Lock()
	s := c.session
	c.mu.Unlock()
	if s == nil {
		return nil, nil, fmt.Errorf("%w: locking %s %s: this node is not registered in etcd (etcd unreachable or no quorum)", ErrUnavailable, kind, id)
	}
	prefix := c.keys.lock(kind, id)
	// Callers on this node first take a local lock: the node's callers
	// share its session (one key per session), so its etcd lock alone
	// would let them all in.
	waited := false
	wait := func(holder string) {
		waited = true
		if waiting != nil {
			waiting(holder)
		}
	}
	unlockLocal, err := c.objects.LockWaiting(ctx, prefix, func() { wait("this node") })
	if err != nil {
		return nil, nil, fmt.Errorf("locking %s %s (held by another call on this node): %w", kind, id, err)
	}
	key := fmt.Sprintf("%s/%x", prefix, s.Lease())
	err = c.acquireLock(ctx, prefix, key, s.Lease(), func() {
		if !waited {
			hctx, cancel := c.callCtx(ctx)
			holder, _ := c.lockHolder(hctx, prefix) // for the message only
			cancel()
			wait(holder)
		}
	})
	if waited {
		c.lockWaits.Add(1)
	}
	if err != nil {
		// The key may be written (an answer lost): gone before this
		// node's next caller of the object may write it again, in the
		// background (etcd may not answer: the caller's deadline is
		// past).
		go c.dropLockKey(s, key, unlockLocal)
		what := fmt.Sprintf("locking %s %s", kind, id)
		if ctx.Err() != nil {
			// For the message only, and briefly: etcd may be what
			// ended the wait.
			hctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), min(c.cfg.CallTimeout, holderLookup))
			defer cancel()
			if holder, herr := c.lockHolder(hctx, prefix); herr == nil && holder != "" {
				what += " (held by node " + holder + ")"
			}
		}
		return nil, nil, c.etcdErr(ctx, what, err)
	}
	c.mu.Lock()
	c.held[key] = lockHeld{kind: kind, id: id, since: time.Now().UTC()}
	c.mu.Unlock()
	held, cancelHeld := context.WithCancelCause(ctx)
	stop := context.AfterFunc(s.Ctx(), func() {
		cancelHeld(fmt.Errorf("%w: the node's lease in etcd was lost while it held the lock of %s %s: another node may hold it now", ErrUnavailable, kind, id))
	})
	var once sync.Once
	return held, func() {
		once.Do(func() {
			stop()
			cancelHeld(nil)
			c.mu.Lock()
			delete(c.held, key)
			c.mu.Unlock()
			c.dropLockKey(s, key, unlockLocal)
		})
	}, nil
}

// acquireLock writes key (on lease, in the lock at prefix) unless it is
// there, and waits, calling wait first, until every older key of the
// lock is gone (the oldest key holds it), or ctx ends: the wait of
// concurrency.Mutex.Lock, whose cleanup after a failed wait has no
// deadline (it blocked for as long as etcd did not answer).
func (c *Cluster) acquireLock(ctx context.Context, prefix, key string, lease clientv3.LeaseID, wait func()) error {
	tctx, cancel := c.callCtx(ctx)
	resp, err := c.client.Txn(tctx).If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)).
		Then(clientv3.OpPut(key, "", clientv3.WithLease(lease)), clientv3.OpGet(prefix+"/", clientv3.WithFirstCreate()...)).
		Else(clientv3.OpGet(key), clientv3.OpGet(prefix+"/", clientv3.WithFirstCreate()...)).Commit()
	cancel()
	if err != nil {
		return err
	}
	mine := resp.Header.Revision
	if !resp.Succeeded {
		mine = resp.Responses[0].GetResponseRange().GetKvs()[0].CreateRevision
	}
	if owner := resp.Responses[1].GetResponseRange().GetKvs(); len(owner) == 0 || owner[0].CreateRevision == mine {
		return nil
	}
	wait()
	// The older keys go one by one (each holder's unlock, or its lease).
	for {
		resp, err := c.client.Get(ctx, prefix+"/", append(clientv3.WithLastCreate(), clientv3.WithMaxCreateRev(mine-1))...)
		if err != nil {
			return err
		}
		if len(resp.Kvs) == 0 {
			break
		}
		if err := c.waitDelete(ctx, string(resp.Kvs[0].Key), resp.Header.Revision); err != nil {
			return err
		}
	}
	// The key itself must still be there (its lease may have gone).
	resp2, err := c.client.Get(ctx, key)
	if err != nil {
		return err
	}
	if len(resp2.Kvs) == 0 {
		return fmt.Errorf("the node's lease ended while it waited for the lock")
	}
	return nil
}

// waitDelete waits until key is deleted at or after revision rev, or ctx
// ends.
func (c *Cluster) waitDelete(ctx context.Context, key string, rev int64) error {
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	for wr := range c.client.Watch(wctx, key, clientv3.WithRev(rev)) {
		if err := wr.Err(); err != nil {
			return err
		}
		for _, ev := range wr.Events {
			if ev.Type == mvccpb.DELETE {
				return nil
			}
		}
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	return errors.New("the watch for the lock's older key ended")
}

// dropLockKey deletes a lock key of session s, then calls done (which
// lets this node's next caller of the object write it again). Until a
// delete succeeds or the session ends (the lease takes the key), it
// retries in the background, at most lockDropRetry apart.
func (c *Cluster) dropLockKey(s *concurrency.Session, key string, done func()) {
	del := func() bool {
		dctx, cancel := c.callCtx(context.Background())
		defer cancel()
		_, err := c.client.Delete(dctx, key)
		return err == nil
	}
	if del() {
		done()
		return
	}
	c.log.Warn("cluster: deleting a lock key failed; retrying until etcd answers or the node's lease ends", "key", key)
	go func() {
		defer done()
		for {
			select {
			case <-s.Done():
				return
			case <-time.After(lockDropRetry):
			}
			if del() {
				return
			}
		}
	}()
}

// lockDropRetry spaces the retries of a lock key's deletion.
const lockDropRetry = time.Second

// holderLookup bounds the look-up of a lock's holder for the message of a
// failed Lock.
const holderLookup = time.Second

// lockHolder names the node whose session holds the lock at prefix ("":
// none).
func (c *Cluster) lockHolder(ctx context.Context, prefix string) (string, error) {
	resp, err := c.client.Txn(ctx).Then(
		clientv3.OpGet(prefix+"/", clientv3.WithFirstCreate()...),
		clientv3.OpGet(c.keys.nodes(), clientv3.WithPrefix()),
	).Commit()
	if err != nil {
		return "", err
	}
	kvs := resp.Responses[0].GetResponseRange().GetKvs()
	if len(kvs) == 0 {
		return "", nil
	}
	leases, err := c.leaseNodes(resp.Responses[1].GetResponseRange().GetKvs())
	if err != nil {
		return "", err
	}
	_, _, lease, err := c.keys.parseLockKey(string(kvs[0].Key))
	if err != nil {
		return "", err
	}
	return nodeOfLease(leases, lease), nil
}

// leaseNodes maps live leases (hex) to their nodes from the nodes' keys.
func (c *Cluster) leaseNodes(kvs []*mvccpb.KeyValue) (map[string]string, error) {
	out := map[string]string{}
	for _, kv := range kvs {
		node, leaf, err := c.keys.parseNodeKey(string(kv.Key))
		if err != nil {
			return nil, err
		}
		if leaf != "alive" {
			continue
		}
		var a aliveRecord
		if err := json.Unmarshal(kv.Value, &a); err != nil {
			return nil, fmt.Errorf("decoding %s: %w", kv.Key, err)
		}
		out[a.Lease] = node
	}
	return out, nil
}

func nodeOfLease(leases map[string]string, lease string) string {
	if n, ok := leases[lease]; ok {
		return n
	}
	return "lease " + lease
}

// Holder is a node holding a claim.
type Holder struct {
	Node  string
	Since time.Time
	// Alive: the node's lease lives.
	Alive bool
}

// ClaimStatus is one claim key in etcd.
type ClaimStatus struct {
	Plugin, Volume string
	Mode           Mode
	Holders        []Holder // sorted by node
}

// LockStatus is one cluster-wide lock with a holder.
type LockStatus struct {
	Kind, ID string
	// Holder is the holding node ("lease <hex>" when its lease belongs
	// to no registered node).
	Holder string
	// Waiters are the nodes waiting for it, oldest first.
	Waiters []string
}

// Status is the cluster's claims and locks, read in one etcd
// transaction.
type Status struct {
	Claims []ClaimStatus // sorted by plugin and volume
	Locks  []LockStatus  // sorted by kind and id
}

// Claims reads every claim and lock of the cluster (csi-agent cluster
// claims). For this node's own records without etcd, see Local.
func (c *Cluster) Claims(ctx context.Context) (Status, error) {
	gctx, cancel := c.callCtx(ctx)
	defer cancel()
	resp, err := c.client.Txn(gctx).Then(
		clientv3.OpGet(c.keys.claims(), clientv3.WithPrefix()),
		clientv3.OpGet(c.keys.locks(), clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend)),
		clientv3.OpGet(c.keys.nodes(), clientv3.WithPrefix()),
	).Commit()
	if err != nil {
		return Status{}, c.etcdErr(ctx, "reading the cluster's claims and locks", err)
	}
	c.answered()
	leases, err := c.leaseNodes(resp.Responses[2].GetResponseRange().GetKvs())
	if err != nil {
		return Status{}, err
	}
	alive := map[string]bool{}
	for _, n := range leases {
		alive[n] = true
	}
	var st Status
	for _, kv := range resp.Responses[0].GetResponseRange().GetKvs() {
		rec, err := decodeClaim(kv.Key, kv.Value)
		if err != nil {
			return Status{}, err
		}
		cs := ClaimStatus{Plugin: rec.Plugin, Volume: rec.Volume, Mode: rec.Mode}
		for _, n := range rec.holderList() {
			cs.Holders = append(cs.Holders, Holder{Node: n, Since: rec.Holders[n], Alive: alive[n]})
		}
		st.Claims = append(st.Claims, cs)
	}
	sort.Slice(st.Claims, func(i, j int) bool {
		a, b := st.Claims[i], st.Claims[j]
		return a.Plugin < b.Plugin || a.Plugin == b.Plugin && a.Volume < b.Volume
	})
	locks := map[[2]string]*LockStatus{}
	for _, kv := range resp.Responses[1].GetResponseRange().GetKvs() { // oldest first
		kind, id, lease, err := c.keys.parseLockKey(string(kv.Key))
		if err != nil {
			return Status{}, err
		}
		node := nodeOfLease(leases, lease)
		if l := locks[[2]string{kind, id}]; l != nil {
			l.Waiters = append(l.Waiters, node)
		} else {
			locks[[2]string{kind, id}] = &LockStatus{Kind: kind, ID: id, Holder: node}
		}
	}
	for _, k := range slices.SortedFunc(maps.Keys(locks), func(a, b [2]string) int {
		return cmp.Or(cmp.Compare(a[0], b[0]), cmp.Compare(a[1], b[1]))
	}) {
		st.Locks = append(st.Locks, *locks[k])
	}
	return st, nil
}
