// Package etcdtest runs a real 3-member etcd cluster inside a test
// process (go.etcd.io/etcd/server/v3/embed): each member an etcd server
// with its own data dir and loopback ports, which tests stop (as a kill
// would) and start again. For tests only: it links the etcd server.
package etcdtest

import (
	"fmt"
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

// Member is one member; e is nil while it is stopped.
type Member struct {
	name            string
	dir             string
	peerURL, cliURL url.URL
	initialCluster  string
	token           string
	tls             *transport.TLSInfo // clients over TLS when set
	mu              sync.Mutex
	e               *embed.Etcd
}

// Cluster is the members and their client URLs.
type Cluster struct {
	t         *testing.T
	Members   []*Member
	Endpoints []string
}

// memberStartTimeout bounds a member's start (a lone restarted member
// waits for no quorum: it is ready once it serves).
const memberStartTimeout = 20 * time.Second

// FreePorts reserves n loopback ports (listen on :0, close).
func FreePorts(t *testing.T, n int) []int {
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

// Start starts a 3-member cluster and waits until each member is
// ready; t.Cleanup stops it.
func Start(t *testing.T) *Cluster { return StartTLS(t, nil) }

// StartTLS is Start whose members serve clients over TLS (when
// tlsInfo is set) and ask for their certificates.
func StartTLS(t *testing.T, tlsInfo *transport.TLSInfo) *Cluster {
	t.Helper()
	scheme := "http"
	if tlsInfo != nil {
		scheme = "https"
	}
	ports := FreePorts(t, 6)
	ec := &Cluster{t: t}
	var initial []string
	for i := range 3 {
		m := &Member{
			name:    fmt.Sprintf("m%d", i),
			dir:     filepath.Join(t.TempDir(), fmt.Sprintf("m%d", i)),
			peerURL: url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", ports[2*i])},
			cliURL:  url.URL{Scheme: scheme, Host: fmt.Sprintf("127.0.0.1:%d", ports[2*i+1])},
			token:   fmt.Sprintf("%s-%d", t.Name(), ports[0]),
			tls:     tlsInfo,
		}
		initial = append(initial, m.name+"="+m.peerURL.String())
		ec.Members = append(ec.Members, m)
		ec.Endpoints = append(ec.Endpoints, m.cliURL.String())
	}
	for _, m := range ec.Members {
		m.initialCluster = strings.Join(initial, ",")
	}
	errs := make(chan error, 3)
	for _, m := range ec.Members {
		go func() { errs <- m.Start() }()
	}
	for range ec.Members {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		StopAll(ec.Members...)
	})
	return ec
}

func (m *Member) config() *embed.Config {
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

// Start starts the member (again: its data dir makes it rejoin).
func (m *Member) Start() error {
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

// StartNoWait starts a member that cannot be ready alone (no quorum):
// its readiness comes with the others'.
func (m *Member) StartNoWait() error {
	e, err := embed.StartEtcd(m.config())
	if err != nil {
		return fmt.Errorf("starting etcd member %s: %w", m.name, err)
	}
	m.mu.Lock()
	m.e = e
	m.mu.Unlock()
	return nil
}

func (m *Member) Stop() {
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

// Close stops every member gracefully: their servers' connections are
// closed before it returns (some seconds), so no goroutine of them
// outlives it, as a test checking for leaked goroutines needs. Start's
// cleanup stops them at once (as a kill), leaving such goroutines a while.
func (ec *Cluster) Close() {
	var wg sync.WaitGroup
	for _, m := range ec.Members {
		wg.Go(m.close)
	}
	wg.Wait()
}

func (m *Member) close() {
	m.mu.Lock()
	e := m.e
	m.e = nil
	m.mu.Unlock()
	if e != nil {
		e.Close()
	}
}

// StopAll stops members at once.
func StopAll(ms ...*Member) {
	var wg sync.WaitGroup
	for _, m := range ms {
		wg.Go(m.Stop)
	}
	wg.Wait()
}

// Leader is the member that leads now, waiting for one until timeout.
func (ec *Cluster) Leader(timeout time.Duration) *Member {
	ec.t.Helper()
	var l *Member
	deadline := time.Now().Add(timeout)
	for {
		for _, m := range ec.Members {
			m.mu.Lock()
			e := m.e
			m.mu.Unlock()
			if e != nil && e.Server.Leader() == e.Server.MemberID() {
				l = m
			}
		}
		if l != nil {
			return l
		}
		if time.Now().After(deadline) {
			ec.t.Fatalf("no etcd leader within %s", timeout)
		}
		time.Sleep(20 * time.Millisecond) // polling the members' state: no event to wait on
	}
}

// Name is the member's name.
func (m *Member) Name() string { return m.name }
