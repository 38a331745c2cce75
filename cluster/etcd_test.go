package cluster

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"go.etcd.io/etcd/client/pkg/v3/transport"
	"go.etcd.io/etcd/server/v3/embed"
)

// A real 3-member etcd cluster in the test process: each member an etcd
// server (embed) with its own data dir and loopback ports, stopped and
// restarted by the tests.

// etcdMember is one member; e is nil while it is stopped.
type etcdMember struct {
	name            string
	dir             string
	peerURL, cliURL url.URL
	initialCluster  string
	token           string
	tls             *transport.TLSInfo // clients over TLS when set
	mu              sync.Mutex
	e               *embed.Etcd
}

type etcdCluster struct {
	t         *testing.T
	members   []*etcdMember
	endpoints []string
}

// memberStartTimeout bounds a member's start (a lone restarted member
// waits for no quorum: it is ready once it serves).
const memberStartTimeout = 20 * time.Second

// freePorts reserves n loopback ports (listen on :0, close).
func freePorts(t *testing.T, n int) []int {
	t.Helper()
	var ports []int
	var ls []net.Listener
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	for _, l := range ls {
		l.Close()
	}
	return ports
}

// startEtcd starts a 3-member cluster and waits until each member is
// ready; t.Cleanup stops it.
func startEtcd(t *testing.T) *etcdCluster { return startEtcdTLS(t, nil) }

// startEtcdTLS is startEtcd whose members serve clients over TLS (when
// tlsInfo is set) and ask for their certificates.
func startEtcdTLS(t *testing.T, tlsInfo *transport.TLSInfo) *etcdCluster {
	t.Helper()
	scheme := "http"
	if tlsInfo != nil {
		scheme = "https"
	}
	ports := freePorts(t, 6)
	ec := &etcdCluster{t: t}
	var initial []string
	for i := range 3 {
		m := &etcdMember{
			name:    fmt.Sprintf("m%d", i),
			dir:     filepath.Join(t.TempDir(), fmt.Sprintf("m%d", i)),
			peerURL: url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", ports[2*i])},
			cliURL:  url.URL{Scheme: scheme, Host: fmt.Sprintf("127.0.0.1:%d", ports[2*i+1])},
			token:   fmt.Sprintf("%s-%d", t.Name(), ports[0]),
			tls:     tlsInfo,
		}
		initial = append(initial, m.name+"="+m.peerURL.String())
		ec.members = append(ec.members, m)
		ec.endpoints = append(ec.endpoints, m.cliURL.String())
	}
	for _, m := range ec.members {
		m.initialCluster = strings.Join(initial, ",")
	}
	errs := make(chan error, 3)
	for _, m := range ec.members {
		go func() { errs <- m.start() }()
	}
	for range ec.members {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		stopAll(ec.members...)
	})
	return ec
}

func (m *etcdMember) config() *embed.Config {
	cfg := embed.NewConfig()
	cfg.Name = m.name
	cfg.Dir = m.dir
	cfg.ListenPeerUrls = []url.URL{m.peerURL}
	cfg.AdvertisePeerUrls = []url.URL{m.peerURL}
	cfg.ListenClientUrls = []url.URL{m.cliURL}
	cfg.AdvertiseClientUrls = []url.URL{m.cliURL}
	cfg.InitialCluster = m.initialCluster
	cfg.InitialClusterToken = m.token
	if m.tls != nil {
		cfg.ClientTLSInfo = *m.tls
	}
	// Short ticks keep elections and the minimum lease TTL (1.5
	// election timeouts: 2 s here) short; generous enough for -race on
	// a shared machine.
	cfg.TickMs = 50
	cfg.ElectionMs = 1000
	cfg.UnsafeNoFsync = true // a test's data dies with it
	cfg.LogLevel = "error"
	cfg.LogOutputs = []string{filepath.Join(filepath.Dir(m.dir), m.name+".log")}
	return cfg
}

// start starts the member (again: its data dir makes it rejoin).
func (m *etcdMember) start() error {
	e, err := embed.StartEtcd(m.config())
	if err != nil {
		return fmt.Errorf("starting etcd member %s: %w", m.name, err)
	}
	select {
	case <-e.Server.ReadyNotify():
	case err := <-e.Err():
		e.Close()
		return fmt.Errorf("etcd member %s: %w", m.name, err)
	case <-time.After(memberStartTimeout):
		e.Close()
		return fmt.Errorf("etcd member %s not ready within %s", m.name, memberStartTimeout)
	}
	m.mu.Lock()
	m.e = e
	m.mu.Unlock()
	return nil
}

// startNoWait starts a member that cannot be ready alone (no quorum):
// its readiness comes with the others'.
func (m *etcdMember) startNoWait() error {
	e, err := embed.StartEtcd(m.config())
	if err != nil {
		return fmt.Errorf("starting etcd member %s: %w", m.name, err)
	}
	m.mu.Lock()
	m.e = e
	m.mu.Unlock()
	return nil
}

func (m *etcdMember) stop() {
	m.mu.Lock()
	e := m.e
	m.e = nil
	m.mu.Unlock()
	if e != nil {
		// As a kill would: raft stops at once, with no leadership
		// transfer, so the client streams end and Close need not wait
		// for them.
		e.Server.HardStop()
		e.Close()
	}
}

// stopAll stops members at once.
func stopAll(ms ...*etcdMember) {
	var wg sync.WaitGroup
	for _, m := range ms {
		wg.Go(m.stop)
	}
	wg.Wait()
}

// leader is the member that leads now, waiting for one until timeout.
func (ec *etcdCluster) leader(timeout time.Duration) *etcdMember {
	ec.t.Helper()
	var l *etcdMember
	waitFor(ec.t, timeout, "an etcd leader", func() bool {
		for _, m := range ec.members {
			m.mu.Lock()
			e := m.e
			m.mu.Unlock()
			if e != nil && e.Server.Leader() == e.Server.MemberID() {
				l = m
				return true
			}
		}
		return false
	})
	return l
}

// waitFor polls cond until it holds or timeout passes (then fails the
// test naming what).
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// testTimeouts of the nodes the tests make.
const (
	testTTL       = 2 * time.Second
	testCall      = time.Second
	testReconcile = 300 * time.Millisecond
)

type testNode struct {
	*Cluster
	cfg Config

	mu    sync.Mutex
	inUse map[string]bool // plugin/volume
}

func (n *testNode) setInUse(plugin, volume string, used bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.inUse[plugin+"/"+volume] = used
}

// newNode joins a node (state under dir) to the cluster at endpoints and
// waits until it is registered when wait is set; t.Cleanup closes it.
func newNode(t *testing.T, endpoints []string, id, dir string, wait bool) *testNode {
	t.Helper()
	return joinNode(t, endpoints, id, dir, TLSFiles{}, wait)
}

// newNodeTLS is newNode with TLS files and a state dir of its own.
func newNodeTLS(t *testing.T, endpoints []string, id string, tlsFiles TLSFiles, wait bool) *testNode {
	t.Helper()
	return joinNode(t, endpoints, id, t.TempDir(), tlsFiles, wait)
}

func joinNode(t *testing.T, endpoints []string, id, dir string, tlsFiles TLSFiles, wait bool) *testNode {
	t.Helper()
	n := &testNode{inUse: map[string]bool{}}
	n.cfg = Config{
		Endpoints: endpoints, TLS: tlsFiles, Prefix: "/test", NodeID: id, StateDir: dir,
		Info: NodeInfo{AgentVersion: "test", FenceAddresses: []string{"192.0.2.1/32"},
			Plugins: []PluginInfo{{Type: "loop", Topology: map[string]string{"zone": "a"}, MaxVolumes: 8}}},
		InUse: func(plugin, volume string) bool {
			n.mu.Lock()
			defer n.mu.Unlock()
			return n.inUse[plugin+"/"+volume]
		},
		LeaseTTL: testTTL, CallTimeout: testCall, ReconcileInterval: testReconcile,
		Logger: slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn})),
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := Join(ctx, n.cfg)
	if err != nil {
		t.Fatal(err)
	}
	n.Cluster = c
	t.Cleanup(func() { n.close(t) })
	if wait {
		waitFor(t, 10*time.Second, "node "+id+" registered", func() bool { return c.Stats().Connected })
	}
	return n
}

func (n *testNode) close(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := n.Close(ctx); err != nil && !errors.Is(err, ErrUnavailable) && !strings.Contains(err.Error(), "lease") {
		t.Errorf("closing node %s: %v", n.cfg.NodeID, err)
	}
}

// crash stops the node as a SIGKILL would: its lease is left to expire.
func (n *testNode) crash(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := n.shutdown(ctx, false); err != nil {
		t.Fatalf("crashing node %s: %v", n.cfg.NodeID, err)
	}
}
