package cluster

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"

	"github.com/csiagent/csiagent/internal/atomicfile"
	"github.com/csiagent/csiagent/internal/bootid"
	"github.com/csiagent/csiagent/internal/keyedlock"
)

// Defaults of Config's durations.
const (
	DefaultPrefix            = "/csiagent"
	DefaultLeaseTTL          = 10 * time.Second
	DefaultCallTimeout       = 5 * time.Second
	DefaultReconcileInterval = 30 * time.Second
)

// Error classes; the agent maps them to status codes (in brackets).
var (
	// ErrInvalid: a malformed config or request (InvalidArgument).
	ErrInvalid = errors.New("invalid cluster request")
	// ErrConflict: another node holds the claim (FailedPrecondition).
	ErrConflict = errors.New("volume claimed by another node")
	// ErrUnavailable: etcd did not answer within the call's deadline (no
	// quorum, unreachable) (Unavailable).
	ErrUnavailable = errors.New("cluster store unavailable")
	// ErrRevoked: this node held the claim, and it was released in etcd
	// while the node was away (FailedPrecondition).
	ErrRevoked = errors.New("claim revoked")
	// ErrNodeAlive: ReleaseNode refused because the node's lease lives
	// (FailedPrecondition).
	ErrNodeAlive = errors.New("node is alive")
	// ErrNotFenced: ReleaseNode refused because the node was neither
	// fenced nor asserted down (FailedPrecondition).
	ErrNotFenced = errors.New("node not fenced")
	// ErrNotFound: ReleaseNode of a node etcd does not know (NotFound).
	ErrNotFound = errors.New("node not found")
)

// TLSFiles are PEM files for etcd's client TLS; all empty: plain TCP.
type TLSFiles struct {
	// CACert verifies the members' certificates (the system roots when
	// empty).
	CACert string
	// Cert and Key, both or neither: the client certificate.
	Cert, Key string
}

// PluginInfo is one plugin as a node registers it.
type PluginInfo struct {
	// Type is the plugin's type (volumes' plugin_name).
	Type string `json:"type"`
	// Topology is NodeGetInfo's accessible_topology segments.
	Topology map[string]string `json:"topology,omitempty"`
	// AvailableCapacity is GetCapacity's available_capacity in bytes (0:
	// not reported).
	AvailableCapacity int64 `json:"available_capacity,omitempty"`
	// MaxVolumes is NodeGetInfo's max_volumes_per_node (0: no limit).
	MaxVolumes int64 `json:"max_volumes,omitempty"`
}

// NodeInfo is what a node registers about itself; the caller fills it.
type NodeInfo struct {
	Plugins      []PluginInfo `json:"plugins,omitempty"`
	AgentVersion string       `json:"agent_version,omitempty"`
	// FenceAddresses are the CIDRs a plugin fences to cut the node off
	// its storage (csi-addons FenceClusterNetwork); ReleaseNode passes
	// them to its fenced function.
	FenceAddresses []string `json:"fence_addresses,omitempty"`
}

// Config configures Join.
type Config struct {
	// Endpoints are etcd's client URLs (at least one).
	Endpoints []string
	TLS       TLSFiles
	// Prefix is where the agents' keys live in etcd; DefaultPrefix when
	// empty. Agents that share a prefix are one cluster.
	Prefix string
	// NodeID names this node in the cluster: unique, and the same across
	// restarts (its claims are recorded under it).
	NodeID string
	Info   NodeInfo
	// StateDir holds the node's claim records (claimsDir), made if missing.
	StateDir string
	// Commit, when set, is the daemon's Committer; StateDir must be below
	// its root. Nil: Join makes one rooted at StateDir.
	Commit *atomicfile.Committer
	// InUse reports whether a volume is on this node (staged, published
	// or being prepared). The reconciler releases a claim etcd holds for
	// this node, which the node has no record of, only once InUse says
	// false. Required. It is called under the claim's lock, which Claim
	// and Release hold while the caller may hold its own per-volume lock:
	// it must neither call back into the Cluster nor wait for that lock
	// (read a snapshot of the volumes instead).
	InUse func(plugin, volumeID string) bool
	// Recovered, when set, closes once InUse knows every volume on the
	// node (the isolator's first recovery pass has rebuilt what a power
	// cut lost): the reconciler releases nothing, and revokes nothing,
	// before. Nil: InUse knows from the start.
	Recovered <-chan struct{}
	// LeaseTTL is the node's lease: it is listed as down this long after
	// it stops. DefaultLeaseTTL when 0; whole seconds, rounded up.
	LeaseTTL time.Duration
	// CallTimeout bounds every etcd call; DefaultCallTimeout when 0.
	CallTimeout time.Duration
	// ReconcileInterval is how often claims are reconciled with etcd
	// (besides after each registration and each pending release);
	// DefaultReconcileInterval when 0.
	ReconcileInterval time.Duration
	Logger            *slog.Logger
}

// Cluster is this node's membership, claims and locks. Its methods are
// safe for concurrent use.
type Cluster struct {
	cfg    Config
	keys   keys
	client *clientv3.Client
	log    *slog.Logger

	commit *atomicfile.Committer
	dir    string // the claim records (claimsDir)

	// volumes serialises Claim, Release and the reconciler per claim key.
	volumes keyedlock.Map
	// objects serialises this node's Lock callers per lock key.
	objects keyedlock.Map

	mu      sync.Mutex
	local   map[string]*LocalClaim // by claim key
	session *concurrency.Session   // nil while not registered
	// registered is closed when the node registers (session set); a new
	// one is made when the registration is lost.
	registered chan struct{}
	held       map[string]lockHeld // locks held, by mutex key

	connected atomic.Bool
	// down: the last etcd call did not answer (false at the start, before
	// any call: etcd is asked then). Claim and Release skip etcd while it
	// is down, answering from the node's claim records.
	down      atomic.Bool
	conflicts atomic.Uint64
	lockWaits atomic.Uint64
	// reconciles counts reconcile rounds (tests wait on it).
	reconciles atomic.Uint64

	poke chan struct{}
	// started is when Join ran: a claim recorded before is an earlier
	// run's.
	started time.Time
	// install is the node's install identity (installFile), boot the
	// host's boot id: registered with the node's liveness.
	install, boot string
	stop          context.CancelFunc
	closing       atomic.Bool
	wg            sync.WaitGroup
}

// Join checks cfg, loads the node's claim records and starts registering
// the node and reconciling its claims in the background; it does not
// wait for etcd (a node starts with its local claims when etcd is down:
// Stats().Connected tells when it is registered). Close stops it.
func Join(ctx context.Context, cfg Config) (*Cluster, error) {
	if err := cfg.check(); err != nil {
		return nil, err
	}
	tlsCfg, err := cfg.TLS.config()
	if err != nil {
		return nil, err
	}
	c := &Cluster{
		cfg:     cfg,
		keys:    keys{prefix: cfg.Prefix},
		log:     cfg.Logger.With("component", "cluster", "node", cfg.NodeID),
		local:   map[string]*LocalClaim{},
		held:    map[string]lockHeld{},
		poke:    make(chan struct{}, 1),
		started: time.Now().UTC(),

		registered: make(chan struct{}),
	}
	if c.boot, err = bootid.Current(); err != nil {
		return nil, err
	}
	if err := c.openState(ctx); err != nil {
		return nil, errors.Join(err, c.closeOwnState(ctx))
	}
	c.client, err = clientv3.New(clientv3.Config{
		Endpoints:            cfg.Endpoints,
		TLS:                  tlsCfg,
		DialKeepAliveTime:    cfg.CallTimeout,
		DialKeepAliveTimeout: cfg.CallTimeout,
		// grpc's reconnect backoff grows to 2 minutes by default: a member
		// back after an outage would wait that long for this node.
		DialOptions: []grpc.DialOption{grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: cfg.CallTimeout},
			MinConnectTimeout: cfg.CallTimeout,
		})},
		Logger: zap.NewNop(),
	})
	if err != nil {
		return nil, errors.Join(fmt.Errorf("%w: etcd client for %s: %w", ErrInvalid, strings.Join(cfg.Endpoints, ","), err), c.closeOwnState(ctx))
	}
	runCtx, stop := context.WithCancel(context.WithoutCancel(ctx))
	c.stop = stop
	c.wg.Go(func() { c.run(runCtx) })
	return c, nil
}

// closeOwnState ends a Join that failed: a Committer Join made for
// itself (no Config.Commit) is checkpointed, so that no commit round of it
// outlives the call in the state directory.
func (c *Cluster) closeOwnState(ctx context.Context) error {
	if c.cfg.Commit != nil || c.commit == nil {
		return nil
	}
	return c.commit.Checkpoint(ctx)
}

func (cfg *Config) check() error {
	var bad []string
	if len(cfg.Endpoints) == 0 {
		bad = append(bad, "no etcd endpoints")
	}
	if cfg.NodeID == "" {
		bad = append(bad, "no node id")
	}
	if cfg.StateDir == "" {
		bad = append(bad, "no state directory")
	}
	if cfg.InUse == nil {
		bad = append(bad, "no InUse function")
	}
	if (cfg.TLS.Cert == "") != (cfg.TLS.Key == "") {
		bad = append(bad, "a client certificate needs both --cluster-etcd-cert and --cluster-etcd-key")
	}
	if cfg.LeaseTTL < 0 || cfg.CallTimeout < 0 || cfg.ReconcileInterval < 0 {
		bad = append(bad, "negative duration")
	}
	if len(bad) > 0 {
		return fmt.Errorf("%w: cluster config: %s", ErrInvalid, strings.Join(bad, "; "))
	}
	if cfg.Prefix == "" {
		cfg.Prefix = DefaultPrefix
	}
	cfg.Prefix = "/" + strings.Trim(cfg.Prefix, "/")
	if cfg.LeaseTTL == 0 {
		cfg.LeaseTTL = DefaultLeaseTTL
	}
	if cfg.CallTimeout == 0 {
		cfg.CallTimeout = DefaultCallTimeout
	}
	if cfg.ReconcileInterval == 0 {
		cfg.ReconcileInterval = DefaultReconcileInterval
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return nil
}

func (t TLSFiles) config() (*tls.Config, error) {
	if t == (TLSFiles{}) {
		return nil, nil
	}
	info := transport.TLSInfo{CertFile: t.Cert, KeyFile: t.Key, TrustedCAFile: t.CACert}
	cfg, err := info.ClientConfig()
	if err != nil {
		return nil, fmt.Errorf("%w: etcd TLS (cacert %q, cert %q, key %q): %w", ErrInvalid, t.CACert, t.Cert, t.Key, err)
	}
	return cfg, nil
}

// Close stops the background work, revokes the node's lease (it is
// listed as down at once; its claims stay) and makes its claim records'
// last changes durable, within ctx.
func (c *Cluster) Close(ctx context.Context) error {
	return c.shutdown(ctx, true)
}

// shutdown stops; revoke false leaves the lease to expire, as a crash
// would (tests).
func (c *Cluster) shutdown(ctx context.Context, revoke bool) error {
	if !c.closing.CompareAndSwap(false, true) {
		return nil
	}
	c.stop()
	c.wg.Wait()
	var errs []error
	c.mu.Lock()
	s := c.session
	c.session = nil
	c.mu.Unlock()
	if s != nil {
		s.Orphan()
		if revoke {
			rctx, cancel := c.callCtx(ctx)
			if _, err := c.client.Revoke(rctx, s.Lease()); err != nil {
				errs = append(errs, fmt.Errorf("revoking the lease of node %s: %w", c.cfg.NodeID, err))
			}
			cancel()
		}
	}
	c.connected.Store(false)
	if err := c.client.Close(); err != nil && !errors.Is(err, context.Canceled) {
		errs = append(errs, fmt.Errorf("closing the etcd client: %w", err))
	}
	// Its own Committer is checkpointed (the claim records alone hold
	// the claims, no journal); the daemon's is the daemon's to checkpoint.
	durable := c.commit.Sync
	if c.cfg.Commit == nil {
		durable = c.commit.Checkpoint
	}
	if err := durable(ctx); err != nil {
		errs = append(errs, fmt.Errorf("making the claim records durable: %w", err))
	}
	return errors.Join(errs...)
}

// callCtx bounds one etcd call.
func (c *Cluster) callCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, c.cfg.CallTimeout)
}

// answered notes that etcd answered a call.
func (c *Cluster) answered() {
	c.connected.Store(true)
	c.down.Store(false)
}

// etcdErr classifies a failed etcd call: the caller's own end stays
// what it is; anything else means etcd did not answer (ErrUnavailable).
// what names the call.
func (c *Cluster) etcdErr(ctx context.Context, what string, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("%s: %w", what, ctx.Err())
	}
	c.connected.Store(false)
	c.down.Store(true)
	if errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("%w: %s: etcd at %s did not answer within %s (no quorum, or unreachable): %w",
			ErrUnavailable, what, strings.Join(c.cfg.Endpoints, ","), c.cfg.CallTimeout, err)
	}
	return fmt.Errorf("%w: %s: etcd at %s: %w", ErrUnavailable, what, strings.Join(c.cfg.Endpoints, ","), err)
}

// ttlSeconds is the lease TTL in whole seconds, rounded up.
func (c *Cluster) ttlSeconds() int {
	return max(1, int(math.Ceil(c.cfg.LeaseTTL.Seconds())))
}

// run registers the node, keeps it registered (a new lease when the old
// one is lost) and reconciles claims, until ctx ends.
func (c *Cluster) run(ctx context.Context) {
	retry := time.NewTimer(0)
	defer retry.Stop()
	reconcile := time.NewTicker(c.cfg.ReconcileInterval)
	defer reconcile.Stop()
	var lost <-chan struct{} // the session's Done while registered
	recovered := c.cfg.Recovered
	for {
		select {
		case <-ctx.Done():
			return
		case <-retry.C:
			s, err := c.register(ctx)
			switch {
			case errors.Is(err, ErrDuplicateNode):
				c.log.Error("cluster: the node cannot register: it takes no new claims until it does; retrying", "error", err)
				retry.Reset(c.cfg.LeaseTTL)
				continue
			case errors.Is(err, errRegistrationWait):
				c.log.Warn("cluster: the node cannot register yet: it takes no new claims until it does; retrying", "error", err)
				retry.Reset(min(c.cfg.LeaseTTL, time.Second))
				continue
			}
			if err != nil {
				c.log.Warn("cluster: registering the node failed; retrying", "error", err)
				retry.Reset(min(c.cfg.CallTimeout, time.Second))
				continue
			}
			lost = s.Done()
			c.reconcile(ctx)
		case <-lost:
			lost = nil
			c.mu.Lock()
			c.session = nil
			c.registered = make(chan struct{})
			clear(c.held)
			c.mu.Unlock()
			c.connected.Store(false)
			c.down.Store(true)
			c.log.Warn("cluster: the node's lease was lost (etcd unreachable for its TTL, or revoked); registering again; locks held are lost")
			retry.Reset(0)
		case <-reconcile.C:
			if lost != nil { // registering reconciles first
				c.reconcile(ctx)
			}
		case <-c.poke:
			if lost != nil {
				c.reconcile(ctx)
			}
		case <-recovered:
			recovered = nil
			if lost != nil {
				c.reconcile(ctx)
			}
		}
	}
}

// NodeRecord is a node's permanent record in etcd.
type NodeRecord struct {
	ID         string    `json:"id"`
	Info       NodeInfo  `json:"info"`
	Registered time.Time `json:"registered"`
}

// aliveRecord is a node's lease-bound key.
type aliveRecord struct {
	Lease string    `json:"lease"` // hex, as in lock keys
	Since time.Time `json:"since"`
	// Install and Boot are the registering host's install identity and
	// boot id ("": an earlier release's, which did not record them).
	Install string `json:"install,omitempty"`
	Boot    string `json:"boot,omitempty"`
}

// ErrDuplicateNode: another host is registered under this node's id.
var ErrDuplicateNode = errors.New("node id in use by another host")

// errRegistrationWait: another lease of this node's id is alive, which
// may be this host's (a run before a reboot): waited out.
var errRegistrationWait = errors.New("waiting for the node's previous lease")

// register grants a lease, writes the node's records and keeps the lease
// alive in a session (also the locks' session).
func (c *Cluster) register(ctx context.Context) (*concurrency.Session, error) {
	gctx, cancel := c.callCtx(ctx)
	defer cancel()
	lease, err := c.client.Grant(gctx, int64(c.ttlSeconds()))
	if err != nil {
		return nil, c.etcdErr(ctx, "granting the node's lease", err)
	}
	now := time.Now().UTC()
	c.mu.Lock()
	info, err := json.Marshal(NodeRecord{ID: c.cfg.NodeID, Info: c.cfg.Info, Registered: now})
	c.mu.Unlock()
	if err != nil {
		return nil, fmt.Errorf("encoding the node record: %w", err)
	}
	alive, err := json.Marshal(aliveRecord{Lease: fmt.Sprintf("%x", int64(lease.ID)), Since: now, Install: c.install, Boot: c.boot})
	if err != nil {
		return nil, fmt.Errorf("encoding the node's liveness record: %w", err)
	}
	if err := c.writeAlive(ctx, string(info), string(alive), lease.ID); err != nil {
		rctx, cancel := c.callCtx(context.WithoutCancel(ctx))
		c.client.Revoke(rctx, lease.ID) // unused; it would expire anyway
		cancel()
		return nil, err
	}
	s, err := concurrency.NewSession(c.client, concurrency.WithLease(lease.ID), concurrency.WithTTL(c.ttlSeconds()), concurrency.WithContext(ctx))
	if err != nil {
		return nil, c.etcdErr(ctx, "keeping the node's lease alive", err)
	}
	c.mu.Lock()
	c.session = s
	close(c.registered)
	c.mu.Unlock()
	c.answered()
	c.log.Info("cluster: node registered", "lease", fmt.Sprintf("%x", int64(lease.ID)), "ttl", c.ttlSeconds())
	return s, nil
}

// writeAlive writes the node's records, its liveness on lease, unless
// another lease is registered alive under the node's id. Only this host's
// earlier run in this boot (the same install and boot identities: an
// agent restarted before its lease expired) is replaced; anything else
// (another host: ErrDuplicateNode; this host's run before a reboot, a
// copy of its disk, an earlier release, which recorded no identity:
// ErrRegistrationWait) is waited out: the registration is retried.
func (c *Cluster) writeAlive(ctx context.Context, info, alive string, lease clientv3.LeaseID) error {
	key := c.keys.nodeAlive(c.cfg.NodeID)
	var rev int64 // the alive key's mod revision seen (0: none)
	for range maxCASAttempts {
		pctx, cancel := c.callCtx(ctx)
		resp, err := c.client.Txn(pctx).If(clientv3.Compare(clientv3.ModRevision(key), "=", rev)).Then(
			clientv3.OpPut(c.keys.nodeInfo(c.cfg.NodeID), info),
			clientv3.OpPut(key, alive, clientv3.WithLease(lease)),
		).Else(clientv3.OpGet(key)).Commit()
		cancel()
		if err != nil {
			return c.etcdErr(ctx, "writing the node's records", err)
		}
		if resp.Succeeded {
			return nil
		}
		kvs := resp.Responses[0].GetResponseRange().GetKvs()
		if len(kvs) == 0 {
			rev = 0
			continue
		}
		var other aliveRecord
		if err := json.Unmarshal(kvs[0].Value, &other); err != nil {
			return fmt.Errorf("decoding %s: %w", key, err)
		}
		switch {
		case other.Install != "" && other.Install != c.install:
			return fmt.Errorf("%w: node id %s is registered by another host (install %s, lease %s, alive since %s): two hosts may not share a node id; give each its own --node-id (the default is the hostname)",
				ErrDuplicateNode, c.cfg.NodeID, other.Install, other.Lease, other.Since.Format(time.RFC3339))
		case other.Install == "" || other.Boot == "" || other.Boot != c.boot:
			return fmt.Errorf("%w: node id %s is registered under another lease (%s, alive since %s): this host's run before a reboot, an earlier release, or a copy of this host's disk; it is taken once that lease expires",
				errRegistrationWait, c.cfg.NodeID, other.Lease, other.Since.Format(time.RFC3339))
		}
		rev = kvs[0].ModRevision
	}
	return fmt.Errorf("%w: writing the node's records: its liveness key changed on each of %d attempts", ErrUnavailable, maxCASAttempts)
}

// SetInfo replaces what the node registers (a plugin came or went, its
// capacity was polled): written now when the node is registered, else at
// its next registration (then SetInfo's error says so; the new info is
// kept).
func (c *Cluster) SetInfo(ctx context.Context, info NodeInfo) error {
	c.mu.Lock()
	c.cfg.Info = info
	var rec []byte
	var err error
	registered := c.session != nil
	if registered {
		rec, err = json.Marshal(NodeRecord{ID: c.cfg.NodeID, Info: info, Registered: time.Now().UTC()})
	}
	c.mu.Unlock()
	if err != nil {
		return fmt.Errorf("encoding the node record: %w", err)
	}
	if !registered {
		return fmt.Errorf("%w: node %s is not registered; its info is written when it registers", ErrUnavailable, c.cfg.NodeID)
	}
	pctx, cancel := c.callCtx(ctx)
	defer cancel()
	if _, err := c.client.Put(pctx, c.keys.nodeInfo(c.cfg.NodeID), string(rec)); err != nil {
		return c.etcdErr(ctx, "writing the node's record", err)
	}
	return nil
}

// NodeStatus is a node of the fleet.
type NodeStatus struct {
	NodeRecord
	// Alive: the node's lease lives.
	Alive bool
	// Lease is the live lease's id (hex), "" when down.
	Lease string
}

// Nodes lists every node that ever registered under the prefix, sorted
// by id, with its liveness.
func (c *Cluster) Nodes(ctx context.Context) ([]NodeStatus, error) {
	gctx, cancel := c.callCtx(ctx)
	defer cancel()
	resp, err := c.client.Get(gctx, c.keys.nodes(), clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByKey, clientv3.SortAscend))
	if err != nil {
		return nil, c.etcdErr(ctx, "listing the nodes", err)
	}
	c.answered()
	byID := map[string]*NodeStatus{}
	var order []string
	for _, kv := range resp.Kvs {
		node, leaf, err := c.keys.parseNodeKey(string(kv.Key))
		if err != nil {
			return nil, err
		}
		st := byID[node]
		if st == nil {
			st = &NodeStatus{NodeRecord: NodeRecord{ID: node}}
			byID[node] = st
			order = append(order, node)
		}
		switch leaf {
		case "info":
			if err := json.Unmarshal(kv.Value, &st.NodeRecord); err != nil {
				return nil, fmt.Errorf("decoding %s: %w", kv.Key, err)
			}
		case "alive":
			var a aliveRecord
			if err := json.Unmarshal(kv.Value, &a); err != nil {
				return nil, fmt.Errorf("decoding %s: %w", kv.Key, err)
			}
			st.Alive, st.Lease = true, a.Lease
		}
	}
	out := make([]NodeStatus, 0, len(order))
	for _, id := range order {
		out = append(out, *byID[id])
	}
	return out, nil
}

// Stats are the counters the agent exports as metrics.
type Stats struct {
	// Connected: the node is registered and its last etcd call answered.
	Connected bool
	// ClaimsHeld counts the claims this node holds (its claim records).
	ClaimsHeld int
	// PendingReleases counts released claims etcd has not been told of.
	PendingReleases int
	// Revoked counts claims released in etcd while this node held them.
	Revoked int
	// Conflicts counts claims refused because another node held them.
	Conflicts uint64
	// LockWaits counts Lock calls that found the lock held and waited.
	LockWaits uint64
	// LocksHeld counts the locks this node holds now.
	LocksHeld int
}

// Stats returns the counters; it never calls etcd.
func (c *Cluster) Stats() Stats {
	c.mu.Lock()
	defer c.mu.Unlock()
	st := Stats{
		Connected: c.connected.Load() && c.session != nil,
		Conflicts: c.conflicts.Load(),
		LockWaits: c.lockWaits.Load(),
		LocksHeld: len(c.held),
	}
	for _, l := range c.local {
		switch l.State {
		case StateHeld:
			st.ClaimsHeld++
		case StateReleasing:
			st.PendingReleases++
		case StateRevoked:
			st.Revoked++
		}
	}
	return st
}
