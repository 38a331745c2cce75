package cluster

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"
)

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
// used are the plugin/volume keys on the node from the start.
func newNode(t *testing.T, endpoints []string, id, dir string, wait bool, used ...string) *testNode {
	t.Helper()
	return joinNode(t, endpoints, id, dir, TLSFiles{}, wait, used...)
}

// newNodeTLS is newNode with TLS files and a state dir of its own.
func newNodeTLS(t *testing.T, endpoints []string, id string, tlsFiles TLSFiles, wait bool) *testNode {
	t.Helper()
	return joinNode(t, endpoints, id, t.TempDir(), tlsFiles, wait)
}

func joinNode(t *testing.T, endpoints []string, id, dir string, tlsFiles TLSFiles, wait bool, used ...string) *testNode {
	t.Helper()
	return joinConfigured(t, endpoints, id, dir, tlsFiles, wait, nil, used...)
}

// joinConfigured is joinNode with configure (if not nil) applied to the
// node's Config before it joins.
func joinConfigured(t *testing.T, endpoints []string, id, dir string, tlsFiles TLSFiles, wait bool, configure func(*Config), used ...string) *testNode {
	t.Helper()
	n := &testNode{inUse: map[string]bool{}}
	for _, k := range used {
		n.inUse[k] = true
	}
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
	if configure != nil {
		configure(&n.cfg)
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
