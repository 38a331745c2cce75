package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// ReleaseNode hands over the claims of a dead node (volume "": all of
// them; else its claims on volumes with that id, in any plugin) and
// returns those it released. It is refused (ErrNodeAlive) while the
// node's lease lives, and unless the node is cut off its storage: fenced
// (called with the addresses the node registered, e.g. csi-addons
// FenceClusterNetwork) succeeded, or nodeIsDown (the operator's
// assertion that the node is powered off) is set (else ErrNotFenced).
// Each claim is released in a transaction that also checks that the
// node's lease key is still absent: a node that comes back midway keeps
// the rest (ErrNodeAlive, with what was released by then).
func (c *Cluster) ReleaseNode(ctx context.Context, node, volume string, nodeIsDown bool, fenced func(ctx context.Context, addresses []string) error) ([]ClaimStatus, error) {
	if node == "" {
		return nil, fmt.Errorf("%w: releasing a node's claims needs the node's id", ErrInvalid)
	}
	if node == c.cfg.NodeID {
		// Between two of its leases (a re-registration), a live node's
		// liveness key is gone for a moment: its claims are its own.
		return nil, fmt.Errorf("%w: node %s is this agent's own node: run the release on another host of the fleet", ErrNodeAlive, node)
	}
	gctx, cancel := c.callCtx(ctx)
	resp, err := c.client.Txn(gctx).Then(
		clientv3.OpGet(c.keys.nodeInfo(node)),
		clientv3.OpGet(c.keys.nodeAlive(node)),
	).Commit()
	cancel()
	if err != nil {
		return nil, c.etcdErr(ctx, "reading node "+node, err)
	}
	c.answered()
	infoKV, aliveKV := resp.Responses[0].GetResponseRange().GetKvs(), resp.Responses[1].GetResponseRange().GetKvs()
	if len(infoKV) == 0 {
		return nil, fmt.Errorf("%w: node %q never registered under %s (csi-agent cluster nodes lists the nodes)", ErrNotFound, node, c.cfg.Prefix)
	}
	if len(aliveKV) > 0 {
		var a aliveRecord
		_ = json.Unmarshal(aliveKV[0].Value, &a) // the message only
		return nil, fmt.Errorf("%w: node %s holds a live lease (%s, registered %s): it is up, or stopped less than its lease's TTL ago; its claims are released only once its lease is gone",
			ErrNodeAlive, node, a.Lease, a.Since.Format("2006-01-02T15:04:05Z07:00"))
	}
	var rec NodeRecord
	if err := json.Unmarshal(infoKV[0].Value, &rec); err != nil {
		return nil, fmt.Errorf("decoding node %s's record: %w", node, err)
	}
	if !nodeIsDown {
		if err := fence(ctx, node, rec.Info.FenceAddresses, fenced); err != nil {
			return nil, err
		}
	}
	lctx, cancel := c.callCtx(ctx)
	list, err := c.client.Get(lctx, c.keys.claims(), clientv3.WithPrefix())
	cancel()
	if err != nil {
		return nil, c.etcdErr(ctx, "listing claims", err)
	}
	stillDown := clientv3.Compare(clientv3.CreateRevision(c.keys.nodeAlive(node)), "=", 0)
	var released []ClaimStatus
	for _, kv := range list.Kvs {
		cl, err := decodeClaim(kv.Key, kv.Value)
		if err != nil {
			return released, err
		}
		since, held := cl.Holders[node]
		if !held || volume != "" && cl.Volume != volume {
			continue
		}
		switch err := c.removeNode(ctx, string(kv.Key), node, []clientv3.Cmp{stillDown}); {
		case errors.Is(err, errCmp):
			return released, fmt.Errorf("%w: node %s registered again during the release; its remaining claims stay", ErrNodeAlive, node)
		case err != nil:
			return released, err
		}
		c.log.Warn("cluster: released a dead node's claim", "of", node, "plugin", cl.Plugin, "volume", cl.Volume, "node_is_down", nodeIsDown)
		released = append(released, ClaimStatus{Plugin: cl.Plugin, Volume: cl.Volume, Mode: cl.Mode, Holders: []Holder{{Node: node, Since: since}}})
	}
	return released, nil
}

// fence cuts node off its storage with fenced, or says why it cannot.
func fence(ctx context.Context, node string, addresses []string, fenced func(context.Context, []string) error) error {
	switch {
	case fenced == nil:
		return fmt.Errorf("%w: node %s: no plugin can fence it; pass --node-is-down once you know it is powered off", ErrNotFenced, node)
	case len(addresses) == 0:
		return fmt.Errorf("%w: node %s registered no fencing addresses; pass --node-is-down once you know it is powered off", ErrNotFenced, node)
	}
	if err := fenced(ctx, addresses); err != nil {
		return fmt.Errorf("%w: fencing node %s (%v) failed: %w; its claims stay (pass --node-is-down once you know it is powered off)", ErrNotFenced, node, addresses, err)
	}
	return nil
}
