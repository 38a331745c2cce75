package fleet

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/csiagent/csiagent/internal/etcdtest"
	"github.com/csiagent/csiagent/internal/testhelp"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	"github.com/csiagent/csiagent/supervisor"
)

// bins are the real binaries the tests run, built once in TestMain.
var bins struct{ agent, loop string }

func TestMain(m *testing.M) {
	if code, ownNamespace := inOwnMountNamespace(); !ownNamespace {
		os.Exit(code)
	}
	os.Exit(testMain(m))
}

// ownNamespaceEnv marks the test binary run again in a mount namespace of
// its own.
const ownNamespaceEnv = "CSIAGENT_FLEET_OWN_MOUNT_NAMESPACE"

// inOwnMountNamespace, as root, runs the test binary again in a mount
// namespace of its own (private: its mounts are not propagated out) and
// returns its exit code; ownNamespace is true in that run (or without
// root: the tests skip). The hosts' mounts then have no copy in the
// namespaces other processes of the machine make meanwhile (make test
// runs ./integration beside this package): a copy is, rightly, a mount
// elsewhere that keeps a volume from being torn down (and its claim
// released) until it is gone.
func inOwnMountNamespace() (code int, ownNamespace bool) {
	if os.Geteuid() != 0 || os.Getenv(ownNamespaceEnv) != "" {
		return 0, true
	}
	cmd := exec.Command(os.Args[0], os.Args[1:]...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.Env = append(os.Environ(), ownNamespaceEnv+"=1")
	// Go makes / private (MS_REC|MS_PRIVATE) in the new namespace.
	cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS}
	err := cmd.Run()
	var exit *exec.ExitError
	switch {
	case err == nil:
		return 0, false
	case errors.As(err, &exit):
		return exit.ExitCode(), false
	default:
		fmt.Fprintf(os.Stderr, "running the tests in a mount namespace of their own: %v\n", err)
		return 1, false
	}
}

func testMain(m *testing.M) int {
	paths, remove, err := testhelp.BuildBinaries("github.com/csiagent/csiagent/cmd/csi-agent", "github.com/csiagent/csiagent/cmd/csi-loop-plugin")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer remove()
	bins.agent, bins.loop = paths[0], paths[1]
	return m.Run()
}

// waitTimeout bounds every wait for an expected state: a failure bound,
// not a synchronisation sleep.
const waitTimeout = 30 * time.Second

// The agents' cluster settings: a short lease, so that a killed host is
// down (and its claims releasable) soon, and a short etcd deadline, so
// that a claim without a quorum fails soon.
const (
	leaseTTL    = 2 * time.Second
	etcdTimeout = time.Second
)

// loopType is the plugin type of every host's csi-loop-plugin: the
// README's.
const loopType = "loop.csi.csiagent.io"

// fleet is a 3-member etcd and hosts sharing one pool.
type fleet struct {
	t     *testing.T
	etcd  *etcdtest.Cluster
	pool  string
	hosts []*host
}

// host is one agent host: its directories, its csi-loop-plugin (run by
// the test, so that it outlives the agent as a managed one would) and
// its agent process while it runs.
type host struct {
	f                      *fleet
	node                   string
	conf, work, run, extra string
	fenceCIDR              string
	// mu guards ag, nil while the agent does not run.
	mu sync.Mutex
	ag *agentProc
}

// agentProc is a running csi-agent serve.
type agentProc struct {
	cmd    *exec.Cmd
	exited chan struct{}
	conn   *grpc.ClientConn
	api    agentv1.AgentClient
}

// newFleet starts etcd and n hosts (node-a, node-b, ...), each agent
// ready with its plugin. When the test ends, every host's containers are
// cleaned up, the agents stopped and nothing may be left mounted or
// attached.
func newFleet(t *testing.T, n int) *fleet {
	t.Helper()
	testhelp.NeedRoot(t)
	f := &fleet{t: t, pool: filepath.Join(t.TempDir(), "pool")}
	mkdirs(t, f.pool)
	f.etcd = etcdtest.Start(t)
	t.Cleanup(f.etcd.Close)
	for i := range n {
		f.hosts = append(f.hosts, f.newHost(fmt.Sprintf("node-%c", 'a'+i), i))
	}
	// After the plugins' cleanups are registered, so it runs before them.
	t.Cleanup(f.teardown)
	t.Cleanup(f.logProblems) // before the teardown adds to the logs
	for _, h := range f.hosts {
		h.start()
	}
	return f
}

// logProblems, after a failure, shows what each agent logged above INFO.
func (f *fleet) logProblems() {
	if !f.t.Failed() {
		return
	}
	for _, h := range f.hosts {
		b, err := os.ReadFile(filepath.Join(h.extra, "agent.log"))
		if err != nil {
			f.t.Logf("%s: agent log: %v", h.node, err)
			continue
		}
		for line := range strings.Lines(string(b)) {
			if !strings.Contains(line, "level=INFO") && !strings.Contains(line, "level=DEBUG") {
				f.t.Logf("%s: %s", h.node, strings.TrimSuffix(line, "\n"))
			}
		}
	}
}

func mkdirs(t *testing.T, dirs ...string) {
	t.Helper()
	for _, d := range dirs {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
}

// newHost makes a host's directories and starts its plugin.
func (f *fleet) newHost(node string, i int) *host {
	t := f.t
	base := t.TempDir()
	// Short: the agent's sockets are in it (sun_path).
	run, err := os.MkdirTemp("", "csf")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(run) })
	h := &host{f: f, node: node, conf: filepath.Join(base, "conf"), work: filepath.Join(base, "work"), run: filepath.Join(run, "agent"),
		extra: filepath.Join(base, "extra"), fenceCIDR: fmt.Sprintf("10.99.0.%d/32", i+1)}
	mkdirs(t, h.conf, h.extra, h.run)
	sock := filepath.Join(run, "loop.sock")
	plugin := exec.Command(bins.loop, "--endpoint", "unix://"+sock, "--pool", f.pool, "--node-id", node, "--node-only", "--shared-pool")
	logf, err := os.Create(filepath.Join(h.extra, "loop.log"))
	if err != nil {
		t.Fatal(err)
	}
	plugin.Stdout, plugin.Stderr = logf, logf
	if err := plugin.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = plugin.Process.Kill()
		_ = plugin.Wait()
		logf.Close()
	})
	// Its controller too (--node-only: no attach): the node registers the
	// pool's capacity (GetCapacity).
	cfg, _ := json.Marshal(map[string]any{
		"type": loopType,
		"endpoints": []any{map[string]any{"csi_service": "NODE_SERVICE", "endpoint": "unix://" + sock},
			map[string]any{"csi_service": "CONTROLLER_SERVICE", "endpoint": "unix://" + sock}},
	})
	if err := os.WriteFile(filepath.Join(h.conf, "loop.json"), cfg, 0o644); err != nil {
		t.Fatal(err)
	}
	return h
}

// start runs the host's agent and waits until it serves, has recovered
// and its plugin is ready.
func (h *host) start() {
	h.f.t.Helper()
	if err := h.startErr(); err != nil {
		h.f.t.Fatal(err)
	}
}

// startErr is start, its failure returned.
func (h *host) startErr() error {
	logf, err := os.OpenFile(filepath.Join(h.extra, "agent.log"), os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		return err
	}
	defer logf.Close()
	cmd := exec.Command(bins.agent, "serve", "--csi-plugin-config-dir", h.conf, "--work-dir", h.work, "--runtime-dir", h.run,
		"--node-id", h.node, "--plugin-probe-interval", "100ms", "--log-level", "debug", "--reclaim-interval", "0",
		"--volume-stats-interval", "0", "--docker-host", "none", "--docker-plugin-socket", "none",
		"--cluster-etcd-endpoints", strings.Join(h.f.etcd.Endpoints, ","), "--cluster-lease-ttl", leaseTTL.String(),
		"--cluster-etcd-timeout", etcdTimeout.String(), "--cluster-fence-cidrs", h.fenceCIDR)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		return err
	}
	ag := &agentProc{cmd: cmd, exited: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		close(ag.exited)
	}()
	if err := h.ready(ag); err != nil {
		_ = cmd.Process.Kill()
		<-ag.exited
		if ag.conn != nil {
			ag.conn.Close()
		}
		return fmt.Errorf("%s: %w; log in %s", h.node, err, h.extra)
	}
	h.mu.Lock()
	h.ag = ag
	h.mu.Unlock()
	return nil
}

// api is the running agent's client, nil while it does not run.
func (h *host) api() agentv1.AgentClient {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.ag == nil {
		return nil
	}
	return h.ag.api
}

// running reports whether the host's agent runs.
func (h *host) running() bool { return h.api() != nil }

// ready waits until ag serves, has recovered and its plugin is ready.
func (h *host) ready(ag *agentProc) error {
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	if err := supervisor.WaitForSocket(ctx, h.socket(), ag.exited); err != nil {
		return fmt.Errorf("API socket: %w (exit: %v)", err, ag.cmd.ProcessState)
	}
	var err error
	if ag.conn, err = grpc.NewClient("unix://"+h.socket(), grpc.WithTransportCredentials(insecure.NewCredentials())); err != nil {
		return err
	}
	ag.api = agentv1.NewAgentClient(ag.conn)
	// Cleanup of an unknown container waits for the first recovery.
	if _, err := ag.api.Cleanup(ctx, &agentv1.CleanupRequest{ContainerId: "no-such-container"}, grpc.WaitForReady(true)); err != nil {
		return fmt.Errorf("no recovery within %v: %w", waitTimeout, err)
	}
	stream, err := ag.api.WatchPlugins(ctx, &agentv1.ListPluginsRequest{})
	if err != nil {
		return err
	}
	for {
		resp, err := stream.Recv()
		if err != nil {
			return fmt.Errorf("plugin %s not ready: %w", loopType, err)
		}
		for _, p := range resp.GetPlugins() {
			if p.GetType() == loopType && p.GetState() == agentv1.PluginState_PLUGIN_STATE_READY {
				return nil
			}
		}
	}
}

func (h *host) socket() string { return filepath.Join(h.run, "agent.sock") }

// detach takes the running agent off the host (which then has none).
func (h *host) detach() *agentProc {
	h.mu.Lock()
	defer h.mu.Unlock()
	ag := h.ag
	h.ag = nil
	return ag
}

// kill SIGKILLs the host's agent (its plugin and mounts stay).
func (h *host) kill() {
	ag := h.detach()
	_ = ag.cmd.Process.Signal(unix.SIGKILL)
	<-ag.exited
	ag.conn.Close()
}

// stop stops the host's agent as SIGTERM does.
func (h *host) stop() {
	ag := h.detach()
	_ = ag.cmd.Process.Signal(unix.SIGTERM)
	select {
	case <-ag.exited:
	case <-time.After(waitTimeout):
		h.f.t.Errorf("%s: the agent did not stop within %v of SIGTERM", h.node, waitTimeout)
		_ = ag.cmd.Process.Kill()
		<-ag.exited
	}
	ag.conn.Close()
}

// callTimeout bounds one API call of a test.
const callTimeout = 20 * time.Second

func (h *host) ctx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), callTimeout)
}

// volume is a loop volume of the shared pool as a container's mount.
func volume(id string, mode csi.VolumeCapability_AccessMode_Mode) *agentv1.Volume {
	rw := agentv1.Volume_RW
	if mode == csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY || mode == csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY {
		rw = agentv1.Volume_RO
	}
	return &agentv1.Volume{
		ContainerPath: "data-" + id,
		Mode:          rw,
		Source: &agentv1.Volume_Source{
			Type: agentv1.Volume_Source_CSI_VOLUME,
			CsiVolume: &agentv1.CSIVolume{
				PluginName: loopType,
				StaticProvisioning: &agentv1.StaticProvisioning{
					VolumeId: id,
					VolumeCapability: &csi.VolumeCapability{
						AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
						AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
					},
				},
			},
		},
	}
}

// sandbox is container id's sandbox directory on the host.
func (h *host) sandbox(id string) string { return filepath.Join(h.extra, "sandbox-"+id) }

// prepare gives container id the volumes.
func (h *host) prepare(id string, vols ...*agentv1.Volume) error {
	if err := os.MkdirAll(h.sandbox(id), 0o755); err != nil {
		return err
	}
	ctx, cancel := h.ctx()
	defer cancel()
	_, err := h.api().Prepare(ctx, &agentv1.PrepareRequest{ContainerId: id, Sandbox: h.sandbox(id), Volumes: vols})
	return err
}

func (h *host) mustPrepare(id string, vols ...*agentv1.Volume) {
	h.f.t.Helper()
	if err := h.prepare(id, vols...); err != nil {
		h.f.t.Fatalf("%s: Prepare %s: %v", h.node, id, err)
	}
}

func (h *host) cleanup(id string) error {
	ctx, cancel := h.ctx()
	defer cancel()
	_, err := h.api().Cleanup(ctx, &agentv1.CleanupRequest{ContainerId: id})
	return err
}

func (h *host) mustCleanup(id string) {
	h.f.t.Helper()
	if err := h.cleanup(id); err != nil {
		h.f.t.Fatalf("%s: Cleanup %s: %v", h.node, id, err)
	}
}

// claims is the fleet's claims as the host's agent reports them.
func (h *host) claims() (*agentv1.ClusterClaimsResponse, error) {
	ctx, cancel := h.ctx()
	defer cancel()
	return h.api().ClusterClaims(ctx, &agentv1.ClusterClaimsRequest{})
}

// holders are the nodes holding the claim on a volume ("" none).
func (h *host) holders(id string) string {
	h.f.t.Helper()
	resp, err := h.claims()
	if err != nil {
		h.f.t.Fatalf("%s: ClusterClaims: %v", h.node, err)
	}
	for _, c := range resp.GetClaims() {
		if c.GetPluginName() == loopType && c.GetVolumeId() == id {
			var hs []string
			for _, x := range c.GetHolders() {
				hs = append(hs, x.GetNodeId())
			}
			return strings.Join(hs, ",")
		}
	}
	return ""
}

// alive reports whether the host's agent lists node alive.
func (h *host) alive(node string) bool {
	h.f.t.Helper()
	ctx, cancel := h.ctx()
	defer cancel()
	resp, err := h.api().ClusterNodes(ctx, &agentv1.ClusterNodesRequest{})
	if err != nil {
		h.f.t.Fatalf("%s: ClusterNodes: %v", h.node, err)
	}
	for _, n := range resp.GetNodes() {
		if n.GetNodeId() == node {
			return n.GetAlive()
		}
	}
	h.f.t.Fatalf("%s: ClusterNodes does not list %s: %v", h.node, node, resp)
	return false
}

// cli runs csi-agent with args against the host's agent.
func (h *host) cli(args ...string) (string, error) {
	out, err := exec.Command(bins.agent, append(args, "--api-socket", h.socket())...).CombinedOutput()
	return string(out), err
}

// createVolume pre-provisions a sparse 64 MiB volume in the shared pool.
func (f *fleet) createVolume(name string) {
	f.t.Helper()
	if out, err := exec.Command(bins.loop, "create-volume", "--pool", f.pool, "--name", name, "--size", "64MiB").CombinedOutput(); err != nil {
		f.t.Fatalf("create-volume %s: %v\n%s", name, err, out)
	}
}

// waitFor polls cond (every 50 ms, bounded by waitTimeout): what it
// waits on (a lease expiring, a reconciler's round) has no event here.
func (f *fleet) waitFor(what string, cond func() bool) {
	f.t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for !cond() {
		if time.Now().After(deadline) {
			f.t.Fatalf("not within %v: %s", waitTimeout, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// teardown cleans up every host's containers (starting a stopped agent),
// stops the agents and checks that nothing is left mounted or attached;
// what is left is removed, so that it cannot disturb the next test.
func (f *fleet) teardown() {
	t := f.t
	for _, h := range f.hosts {
		if !h.running() {
			h.start()
		}
		ctx, cancel := h.ctx()
		resp, err := h.api().Reconcile(ctx, &agentv1.ReconcileRequest{})
		cancel()
		if err != nil {
			t.Errorf("%s: cleaning up at the end of the test: %v", h.node, err)
		} else if len(resp.GetFailed()) > 0 {
			t.Errorf("%s: cleaning up at the end of the test: %v", h.node, resp.GetFailed())
		}
		h.stop()
	}
	for _, h := range f.hosts {
		ms, err := mountinfo.GetMounts(func(m *mountinfo.Info) (skip, stop bool) {
			return !strings.HasPrefix(m.Mountpoint, h.work+"/") && !strings.HasPrefix(m.Mountpoint, h.extra+"/"), false
		})
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range ms {
			t.Errorf("%s: left mounted: %s", h.node, m.Mountpoint)
			_ = unix.Unmount(m.Mountpoint, unix.MNT_DETACH)
		}
	}
	for _, dev := range loopDevices(t, f.pool) {
		t.Errorf("loop device left on the pool: %s", dev)
		_ = exec.Command("losetup", "-d", dev).Run()
	}
}

// loopDevices are the loop devices whose backing file is in pool.
func loopDevices(t *testing.T, pool string) []string {
	t.Helper()
	files, err := filepath.Glob("/sys/block/loop*/loop/backing_file")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err == nil && strings.HasPrefix(strings.TrimSpace(string(b)), pool+"/") {
			out = append(out, "/dev/"+filepath.Base(filepath.Dir(filepath.Dir(f))))
		}
	}
	return out
}
