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
// deadline (the operation's). The lock lives on the node's lease: it is
// lost if the node loses its lease (etcd unreachable for the lease's
// TTL). unlock releases it (within Config.CallTimeout; a failure leaves
// it to the lease). waiting, if set, is called once, before the wait,
// when the lock is held, with its holder ("this node" for another call
// here, "" when etcd could not say).
func (c *Cluster) Lock(ctx context.Context, kind, id string, waiting func(holder string)) (unlock func(), err error) {
	if kind == "" || id == "" {
		return nil, fmt.Errorf("%w: a lock needs a kind and an id (got %q, %q)", ErrInvalid, kind, id)
	}
	if _, ok := ctx.Deadline(); !ok {
		return nil, fmt.Errorf("%w: locking %s %s: the context has no deadline (pass the operation's)", ErrInvalid, kind, id)
	}
	c.mu.Lock()
	s := c.session
	c.mu.Unlock()
	if s == nil {
		return nil, fmt.Errorf("%w: locking %s %s: this node is not registered in etcd (etcd unreachable or no quorum)", ErrUnavailable, kind, id)
	}
	prefix := c.keys.lock(kind, id)
	// Callers on this node first take a local lock: the node's callers
	// share its session, so its etcd mutex alone would let them all in.
	waited := false
	wait := func(holder string) {
		waited = true
		if waiting != nil {
			waiting(holder)
		}
	}
	unlockLocal, err := c.objects.LockWaiting(ctx, prefix, func() { wait("this node") })
	if err != nil {
		return nil, fmt.Errorf("locking %s %s (held by another call on this node): %w", kind, id, err)
	}
	m := concurrency.NewMutex(s, prefix)
	tctx, cancel := c.callCtx(ctx)
	err = m.TryLock(tctx)
	cancel()
	if errors.Is(err, concurrency.ErrLocked) {
		if !waited {
			hctx, cancel := c.callCtx(ctx)
			holder, _ := c.lockHolder(hctx, prefix) // for the message only
			cancel()
			wait(holder)
		}
		err = m.Lock(ctx)
	}
	if waited {
		c.lockWaits.Add(1)
	}
	if err != nil {
		unlockLocal()
		what := fmt.Sprintf("locking %s %s", kind, id)
		if ctx.Err() != nil {
			hctx, cancel := c.callCtx(context.WithoutCancel(ctx))
			defer cancel()
			if holder, herr := c.lockHolder(hctx, prefix); herr == nil && holder != "" {
				what += " (held by node " + holder + ")"
			}
		}
		return nil, c.etcdErr(ctx, what, err)
	}
	c.mu.Lock()
	c.held[m.Key()] = lockHeld{kind: kind, id: id, since: time.Now().UTC()}
	c.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			c.mu.Lock()
			delete(c.held, m.Key())
			c.mu.Unlock()
			defer unlockLocal()
			uctx, cancel := c.callCtx(context.Background())
			defer cancel()
			if err := m.Unlock(uctx); err != nil {
				c.log.Warn("cluster: unlocking; the lock goes with the node's lease", "kind", kind, "id", id, "error", err)
			}
		})
	}, nil
}

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
