package integration

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/fsnotify/fsnotify"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/internal/testhelp"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	"github.com/csiagent/csiagent/supervisor"
)

// Tests of the isolator's crash safety and concurrency against real plugins,
// real loop devices and real mounts: the agent killed at every crash point,
// many containers sharing volumes at once, corrupt checkpoints, and the node
// RPC retry policy.

// settlePoll is how often settle re-reads the API: it has no change stream
// for volumes and containers. Only a poll period; the bound is waitTimeout.
const settlePoll = 10 * time.Millisecond

// sweepOnExit makes sure a test leaves nothing behind even when it fails
// half-way (with no agent left to clean up, or one that cannot): see
// powerOff. Register it right after newHarness, so it runs after the
// harness's own cleanup.
func sweepOnExit(t *testing.T, h *harness) {
	t.Cleanup(func() { powerOff(t, h, func(format string, args ...any) { t.Logf("sweep: "+format, args...) }) })
}

// powerOff is a reboot's end of everything the test's agents made: it
// kills every process whose command line names the test's directories
// (agents and plugins), lazily unmounts whatever is mounted below them and
// detaches loop devices backed by files below them, telling logf of each.
func powerOff(t *testing.T, h *harness, logf func(format string, args ...any)) {
	base := filepath.Dir(h.work)
	for _, pid := range processesNaming(base, h.run) {
		logf("killing leftover process %d", pid)
		killAndWait(t, pid)
	}
	for range 10 {
		ms, err := mountinfo.GetMounts(mountinfo.PrefixFilter(base))
		if err != nil || len(ms) == 0 {
			break
		}
		// Newest (topmost) first.
		sort.Slice(ms, func(i, j int) bool { return ms[i].ID > ms[j].ID })
		for _, m := range ms {
			logf("unmounting leftover %s", m.Mountpoint)
			_ = unix.Unmount(m.Mountpoint, unix.MNT_DETACH)
		}
	}
	for _, f := range loopDevicesFor(t, base) {
		dev := "/dev/" + filepath.Base(filepath.Dir(filepath.Dir(f)))
		logf("detaching leftover %s (%s)", dev, loopUsers(dev))
		if fd, err := unix.Open(dev, unix.O_RDONLY|unix.O_CLOEXEC, 0); err == nil {
			_ = unix.IoctlSetInt(fd, unix.LOOP_CLR_FD, 0)
			unix.Close(fd)
		}
	}
}

// loopUsers says who keeps a loop device: processes that have it open
// and processes whose mount namespace mounts it.
func loopUsers(dev string) string {
	var st unix.Stat_t
	if err := unix.Stat(dev, &st); err != nil {
		return err.Error()
	}
	majmin := fmt.Sprintf(" %d:%d ", unix.Major(st.Rdev), unix.Minor(st.Rdev))
	var open, mounting []string
	fds, _ := filepath.Glob("/proc/[0-9]*/fd/*")
	for _, fd := range fds {
		if l, err := os.Readlink(fd); err == nil && l == dev {
			open = append(open, fd)
		}
	}
	infos, _ := filepath.Glob("/proc/[0-9]*/mountinfo")
	seen := map[string]bool{}
	for _, f := range infos {
		ns, _ := os.Readlink(filepath.Join(filepath.Dir(f), "ns", "mnt"))
		if seen[ns] {
			continue
		}
		seen[ns] = true
		if b, err := os.ReadFile(f); err == nil && bytes.Contains(b, []byte(majmin)) {
			comm, _ := os.ReadFile(filepath.Join(filepath.Dir(f), "comm"))
			mounting = append(mounting, fmt.Sprintf("%s (%s, %s)", filepath.Dir(f), strings.TrimSpace(string(comm)), ns))
		}
	}
	return fmt.Sprintf("open by %v, mounted in the namespaces of %v", open, mounting)
}

// processesNaming lists the processes (other than this one) whose command
// line mentions one of dirs.
func processesNaming(dirs ...string) []int {
	cmdlines, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	var pids []int
	for _, f := range cmdlines {
		pid, err := strconv.Atoi(filepath.Base(filepath.Dir(f)))
		if err != nil || pid == os.Getpid() {
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		for _, d := range dirs {
			if bytes.Contains(b, []byte(d+"/")) || bytes.Contains(b, append([]byte(d), 0)) {
				pids = append(pids, pid)
				break
			}
		}
	}
	return pids
}

// crashAgent is a `csi-agent serve` process with the crash-test hook's
// environment.
type crashAgent struct {
	cmd    *exec.Cmd
	exited chan struct{}
	conn   *grpc.ClientConn
	client agentv1.AgentClient
	// pluginPid is the ready plugin's process.
	pluginPid int
}

// startCrashAgent runs the agent binary with env added (CSIAGENT_TEST_CRASH_*
// of the test's own environment removed) and waits until plugin typ is
// ready through it (adopted, after the first start).
func startCrashAgent(t *testing.T, h *harness, typ string, env ...string) *crashAgent {
	t.Helper()
	cmd := exec.Command(bins.agent, "serve", "--csi-plugin-config-dir", h.confDir, "--work-dir", h.work,
		"--runtime-dir", h.run, "--node-id", "node-1", "--plugin-probe-interval", "100ms", "--log-level", "info",
		// Scheduled reclaims checkpoint volumes at times of their own,
		// which would make the crash points' order vary.
		"--reclaim-interval", "0")
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "CSIAGENT_TEST_CRASH_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, env...)
	cmd.Stderr = testWriter{t}
	// A killed predecessor left its socket: clients must not try it (a
	// refused connection backs off for a second).
	socket := filepath.Join(h.run, "agent.sock")
	if err := os.Remove(socket); err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	ca := &crashAgent{cmd: cmd, exited: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		close(ca.exited)
	}()
	t.Cleanup(ca.kill)
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	if err := supervisor.WaitForSocket(ctx, socket, ca.exited); err != nil {
		t.Fatal(err)
	}
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	ca.conn = conn
	ca.client = agentv1.NewAgentClient(conn)
	// The socket exists from bind(2), a moment before listen(2): wait for
	// the connection.
	stream, err := ca.client.WatchPlugins(ctx, &agentv1.ListPluginsRequest{}, grpc.WaitForReady(true))
	if err != nil {
		t.Fatal(err)
	}
	for {
		resp, err := stream.Recv()
		if err != nil {
			t.Fatalf("plugin %s not ready: %v", typ, err)
		}
		for _, p := range resp.Plugins {
			if p.Type == typ && ready(p) && len(p.Instances) == 1 {
				ca.pluginPid = int(p.Instances[0].Pid)
				return ca
			}
		}
	}
}

func (ca *crashAgent) kill() {
	_ = ca.cmd.Process.Signal(unix.SIGKILL)
	<-ca.exited
	if ca.conn != nil {
		ca.conn.Close()
	}
}

// waitCrash waits for the agent to have killed itself with SIGKILL.
func (ca *crashAgent) waitCrash(t *testing.T) {
	t.Helper()
	select {
	case <-ca.exited:
	case <-time.After(waitTimeout):
		t.Fatalf("agent %d did not crash", ca.cmd.Process.Pid)
	}
	if ws, ok := ca.cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != unix.SIGKILL {
		t.Fatalf("agent exited with %v, want killed by SIGKILL at the crash point", ca.cmd.ProcessState)
	}
}

// crashCase drives the crash test: two containers sharing one loop
// volume, each with its own sandbox.
type crashCase struct {
	t    *testing.T
	h    *harness
	typ  string
	pool string
	ids  []string
	sb   map[string]string
	// markers are files written into the volume, by name, with their
	// content; every later look at the volume must find them intact.
	markers map[string]string
	// pluginPid is the managed plugin's process, which every agent after
	// the first adopts: it survives the agent's SIGKILL.
	pluginPid int
}

// start starts an agent process with env added and checks that the
// plugin it finds ready is the one every agent before it ran.
func (cc *crashCase) start(env ...string) *crashAgent {
	cc.t.Helper()
	ca := startCrashAgent(cc.t, cc.h, cc.typ, env...)
	switch cc.pluginPid {
	case 0:
		cc.pluginPid = ca.pluginPid
		// After the last agent is killed (cleanups run last first).
		cc.t.Cleanup(func() { killAndWait(cc.t, cc.pluginPid) })
	case ca.pluginPid:
	default:
		cc.t.Fatalf("plugin process %d replaced by %d: the agent's successor should adopt it", cc.pluginPid, ca.pluginPid)
	}
	return ca
}

func (cc *crashCase) spec() volumeSpec {
	return volumeSpec{plugin: cc.typ, id: "vol-1", path: "data"}
}

func (cc *crashCase) request(id string) *agentv1.PrepareRequest {
	return &agentv1.PrepareRequest{ContainerId: id, Sandbox: cc.sb[id], Volumes: []*agentv1.Volume{cc.spec().volume()}}
}

// prepareAll prepares the containers in order, stopping at the first
// error.
func (cc *crashCase) prepareAll(c agentv1.AgentClient) error {
	for _, id := range cc.ids {
		ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
		_, err := c.Prepare(ctx, cc.request(id))
		cancel()
		if err != nil {
			return fmt.Errorf("Prepare %s: %w", id, err)
		}
	}
	return nil
}

// cleanupAll cleans the containers up in order, stopping at the first
// error.
func (cc *crashCase) cleanupAll(c agentv1.AgentClient) error {
	for _, id := range cc.ids {
		ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
		_, err := c.Cleanup(ctx, &agentv1.CleanupRequest{ContainerId: id})
		cancel()
		if err != nil {
			return fmt.Errorf("Cleanup %s: %w", id, err)
		}
	}
	return nil
}

// checkPrepared checks what a settled agent reports: exactly the
// containers in want, each PREPARED with its volume mounted, the marker
// files intact, and a new one written through the first and read through
// the others (they share the volume).
func (cc *crashCase) checkPrepared(c agentv1.AgentClient, want []string, marker string) {
	t := cc.t
	t.Helper()
	containers, _ := settle(t, c)
	var got []string
	var mountPoints []string
	for _, cs := range containers {
		got = append(got, cs.ContainerId)
		if len(cs.Mounts) != 1 {
			t.Fatalf("container %s has mounts %v, want 1", cs.ContainerId, cs.Mounts)
		}
		mp := cs.Mounts[0].MountPoint
		if want := filepath.Join(cc.sb[cs.ContainerId], "data"); mp != want {
			t.Fatalf("container %s mount point %s, want %s", cs.ContainerId, mp, want)
		}
		if ok, err := mountinfo.Mounted(mp); err != nil || !ok {
			t.Fatalf("container %s is PREPARED but %s is not a mount (%v)", cs.ContainerId, mp, err)
		}
		mountPoints = append(mountPoints, mp)
	}
	if !slices.Equal(got, want) {
		t.Fatalf("containers after recovery: %v, want %v", got, want)
	}
	if len(mountPoints) == 0 {
		return
	}
	if err := os.WriteFile(filepath.Join(mountPoints[0], marker), []byte(marker), 0o644); err != nil {
		t.Fatalf("volume not writable: %v", err)
	}
	cc.markers[marker] = marker
	for _, mp := range mountPoints {
		cc.checkMarkers(mp)
	}
}

func (cc *crashCase) checkMarkers(dir string) {
	cc.t.Helper()
	for name, content := range cc.markers {
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil || string(b) != content {
			cc.t.Fatalf("volume data lost: %s/%s = %q, %v; want %q", dir, name, b, err, content)
		}
	}
}

// assertClean is harness.assertClean for an agent process: no mount
// under the test's directories, no loop device on the pool, nothing
// tracked.
func (cc *crashCase) assertClean(c agentv1.AgentClient) {
	t := cc.t
	t.Helper()
	if ms := mountsUnder(t, cc.h.work, cc.h.extra); len(ms) > 0 {
		t.Fatalf("leaked mounts: %v", ms)
	}
	if devs := loopDevicesFor(t, cc.pool); len(devs) > 0 {
		t.Fatalf("leaked loop devices: %v", devs)
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	cr, cerr := c.ListContainers(ctx, &agentv1.ListContainersRequest{})
	vr, verr := c.ListVolumes(ctx, &agentv1.ListVolumesRequest{})
	if err := errors.Join(cerr, verr); err != nil {
		t.Fatal(err)
	}
	if len(cr.Containers) > 0 || len(vr.Volumes) > 0 {
		t.Fatalf("still tracked: containers %v, volumes %v", cr.Containers, vr.Volumes)
	}
	// The records go after the answers, in the background: gone before
	// the agent is killed, or the next start (numbering crash points from
	// 1) would finish the cleanup, crossing points of its own.
	deadline := time.Now().Add(waitTimeout)
	for {
		left := recordFiles(t, cc.h.work)
		if len(left) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("records left %v after the cleanups", left)
		}
		time.Sleep(settlePoll)
	}
}

// recordFiles lists the container and volume record files under work.
func recordFiles(t *testing.T, work string) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(work, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil // removed meanwhile
			}
			return err
		}
		if name := d.Name(); !d.IsDir() && strings.HasSuffix(strings.TrimSuffix(name, ".new"), ".state") {
			out = append(out, path)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// settle waits until the agent's state is a fixed point of recovery:
// every container PREPARED, every volume PUBLISHED to exactly the
// containers that mount it, no errors. It returns that state.
func settle(t *testing.T, c agentv1.AgentClient) ([]*agentv1.ContainerStatus, []*agentv1.VolumeStatus) {
	t.Helper()
	deadline := time.Now().Add(waitTimeout)
	tick := time.NewTicker(settlePoll)
	defer tick.Stop()
	for {
		ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
		cr, cerr := c.ListContainers(ctx, &agentv1.ListContainersRequest{})
		vr, verr := c.ListVolumes(ctx, &agentv1.ListVolumesRequest{})
		cancel()
		if err := errors.Join(cerr, verr); err != nil {
			t.Fatal(err)
		}
		why := unsettled(cr.Containers, vr.Volumes)
		if why == "" {
			return cr.Containers, vr.Volumes
		}
		if time.Now().After(deadline) {
			t.Fatalf("agent state not settled within %v: %s", waitTimeout, why)
		}
		<-tick.C
	}
}

func unsettled(containers []*agentv1.ContainerStatus, volumes []*agentv1.VolumeStatus) string {
	users := map[string][]string{}
	for _, cs := range containers {
		if cs.Phase != agentv1.ContainerStatus_PREPARED || cs.LastError != "" {
			return fmt.Sprintf("container %s is %v (last error %q)", cs.ContainerId, cs.Phase, cs.LastError)
		}
		for _, m := range cs.Mounts {
			k := m.PluginName + "/" + m.VolumeId
			users[k] = append(users[k], cs.ContainerId)
		}
	}
	for _, v := range volumes {
		k := v.PluginName + "/" + v.VolumeId
		want := users[k]
		sort.Strings(want)
		if v.State != agentv1.VolumeStatus_PUBLISHED || v.LastError != "" || !slices.Equal(v.Containers, want) {
			return fmt.Sprintf("volume %s is %v with containers %v, want PUBLISHED with %v (last error %q)", k, v.State, v.Containers, want, v.LastError)
		}
		delete(users, k)
	}
	for k := range users {
		return "volume " + k + " is mounted by containers but not tracked"
	}
	return ""
}

// traceLines reads a crash trace.
func traceLines(t *testing.T, path string) []string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return strings.Split(strings.TrimSuffix(string(b), "\n"), "\n")
}

// indexes returns the 1-based positions of point in trace.
func indexes(trace []string, point string) []int {
	var out []int
	for i, p := range trace {
		if p == point {
			out = append(out, i+1)
		}
	}
	return out
}

// TestCrashAtEveryStep kills the agent (SIGKILL, from its test hook) at
// every crash point of preparing, then of cleaning up, two containers
// sharing a loop volume: after every checkpoint write, every plugin RPC
// (the attach and the detach included),
// every bind and unbind. The next agent must recover to a consistent
// state: a container whose prepare was interrupted is rolled back (absent)
// and can be prepared again, one whose PREPARED checkpoint was written
// stays prepared and mounted, an interrupted cleanup is finished; then
// Cleanup leaves no mount, no loop device and no record, and the volume's
// data survives every crash. The managed plugin lives on, adopted.
func TestCrashAtEveryStep(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	sweepOnExit(t, h)
	cc := &crashCase{t: t, h: h, typ: "loop.crash", ids: []string{"c1", "c2"}, sb: map[string]string{}, markers: map[string]string{}}
	cc.pool = h.loopPlugin(cc.typ)
	createVolume(t, cc.pool, "vol-1")
	for _, id := range cc.ids {
		cc.sb[id] = h.dir("sandbox-" + id)
	}

	// The points of the whole sequence, traced once.
	trace := filepath.Join(h.extra, "trace")
	ca := cc.start("CSIAGENT_TEST_CRASH_TRACE=" + trace)
	if err := cc.prepareAll(ca.client); err != nil {
		t.Fatal(err)
	}
	cc.checkPrepared(ca.client, cc.ids, "seed")
	prep := traceLines(t, trace)
	if err := cc.cleanupAll(ca.client); err != nil {
		t.Fatal(err)
	}
	all := traceLines(t, trace)
	clean := all[len(prep):]
	cc.assertClean(ca.client)
	ca.kill()
	t.Logf("prepare points: %q", prep)
	t.Logf("cleanup points: %q", clean)
	preparedAt := indexes(prep, "checkpoint container PREPARED")
	cleaningAt := indexes(clean, "checkpoint container CLEANING")
	if len(prep) <= 5 || len(clean) <= 5 || len(preparedAt) != 2 || len(cleaningAt) != 2 {
		t.Fatalf("trace has %d prepare and %d cleanup points, %d PREPARED and %d CLEANING checkpoints; want > 5, > 5, 2, 2",
			len(prep), len(clean), len(preparedAt), len(cleaningAt))
	}
	// csi-loop-plugin attaches: the attach and the detach are crash
	// points too.
	for _, p := range []struct {
		points []string
		want   string
	}{{prep, "checkpoint volume CONTROLLER_PUBLISH"}, {prep, "rpc ControllerPublishVolume"}, {clean, "rpc ControllerUnpublishVolume"}} {
		if !slices.Contains(p.points, p.want) {
			t.Errorf("no crash point %q in %q", p.want, p.points)
		}
	}

	crashRun := func(n int, what string, before func(*crashAgent), crashing func(*crashAgent) error) {
		ntrace := filepath.Join(h.extra, fmt.Sprintf("trace-%s-%d", what, n))
		ca := cc.start("CSIAGENT_TEST_CRASH_TRACE="+ntrace, "CSIAGENT_TEST_CRASH_AT="+strconv.Itoa(n))
		before(ca)
		if err := crashing(ca); err == nil {
			t.Fatalf("%s: the agent should have crashed at point %d (%s)", what, n, all[n-1])
		}
		ca.waitCrash(t)
		if got := traceLines(t, ntrace); !slices.Equal(got, all[:n]) {
			t.Fatalf("%s: the agent crashed after points %q, want %q", what, got, all[:n])
		}
	}

	for n := 1; n <= len(prep); n++ {
		crashRun(n, "prepare", func(*crashAgent) {}, func(ca *crashAgent) error { return cc.prepareAll(ca.client) })
		ca := cc.start()
		// Prepared iff its PREPARED checkpoint was written.
		var want []string
		for i, at := range preparedAt {
			if n >= at {
				want = append(want, cc.ids[i])
			}
		}
		cc.checkPrepared(ca.client, want, fmt.Sprintf("prepare-%d", n))
		// The runtime retries the failed Prepare.
		if err := cc.prepareAll(ca.client); err != nil {
			t.Fatalf("after a crash at prepare point %d (%s): retrying: %v", n, prep[n-1], err)
		}
		cc.checkPrepared(ca.client, cc.ids, fmt.Sprintf("prepare-%d-retried", n))
		if err := cc.cleanupAll(ca.client); err != nil {
			t.Fatalf("after a crash at prepare point %d (%s): %v", n, prep[n-1], err)
		}
		cc.assertClean(ca.client)
		ca.kill()
	}

	for n := 1; n <= len(clean); n++ {
		crashRun(len(prep)+n, "cleanup", func(ca *crashAgent) {
			if err := cc.prepareAll(ca.client); err != nil {
				t.Fatal(err)
			}
			cc.checkPrepared(ca.client, cc.ids, fmt.Sprintf("cleanup-%d", n))
		}, func(ca *crashAgent) error { return cc.cleanupAll(ca.client) })
		ca := cc.start()
		// A cleanup that began (CLEANING checkpointed) is finished.
		var want []string
		for i, at := range cleaningAt {
			if n < at {
				want = append(want, cc.ids[i])
			}
		}
		cc.checkPrepared(ca.client, want, fmt.Sprintf("cleanup-%d-after", n))
		if err := cc.cleanupAll(ca.client); err != nil {
			t.Fatalf("after a crash at cleanup point %d (%s): %v", n, clean[n-1], err)
		}
		cc.assertClean(ca.client)
		ca.kill()
	}

	// The data written along the way is all there.
	ca = cc.start()
	if err := cc.prepareAll(ca.client); err != nil {
		t.Fatal(err)
	}
	cc.checkPrepared(ca.client, cc.ids, "final")
	if err := cc.cleanupAll(ca.client); err != nil {
		t.Fatal(err)
	}
	cc.assertClean(ca.client)
}

// TestConcurrentContainers prepares 20 containers at once, each with 2 or 3
// of 5 shared loop volumes, then cleans them all up at once, three times:
// every volume's users must be exactly the containers using it, every
// mount point a mount of the right volume, and nothing may be left.
func TestConcurrentContainers(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	sweepOnExit(t, h)
	const typ = "loop.concurrent"
	pool := h.loopPlugin(typ)
	const nVolumes, nContainers, rounds = 5, 20, 3
	for v := range nVolumes {
		createVolume(t, pool, fmt.Sprintf("vol-%d", v))
	}
	h.start(fastConfig(h))
	h.waitPlugin(typ, "ready", ready)
	client := h.api()

	// Container i uses volumes i, i+1 and, for even i, i+3 (mod 5): every
	// pair of volumes is shared by several containers.
	uses := func(i int) []int {
		vs := []int{i % nVolumes, (i + 1) % nVolumes}
		if i%2 == 0 {
			vs = append(vs, (i+3)%nVolumes)
		}
		return vs
	}
	// parallel runs f for every container at once and fails on the errors.
	parallel := func(what string, f func(i int, id string) error, ids []string) {
		t.Helper()
		errs := make([]error, len(ids))
		var wg sync.WaitGroup
		for i, id := range ids {
			wg.Go(func() { errs[i] = f(i, id) })
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}

	for round := range rounds {
		ids := make([]string, nContainers)
		want := map[string][]string{}
		for i := range ids {
			ids[i] = fmt.Sprintf("r%d-c%02d", round, i)
			for _, v := range uses(i) {
				k := fmt.Sprintf("vol-%d", v)
				want[k] = append(want[k], ids[i])
			}
		}
		parallel("Prepare", func(i int, id string) error {
			req := &agentv1.PrepareRequest{ContainerId: id, Sandbox: h.dir("sandbox-" + id)}
			for _, v := range uses(i) {
				req.Volumes = append(req.Volumes, volumeSpec{plugin: typ, id: fmt.Sprintf("vol-%d", v), path: fmt.Sprintf("v%d", v)}.volume())
			}
			ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
			defer cancel()
			resp, err := client.Prepare(ctx, req)
			if err != nil {
				return fmt.Errorf("%s: %w", id, err)
			}
			if len(resp.Mounts) != len(req.Volumes) {
				return fmt.Errorf("%s: %d mounts, want %d", id, len(resp.Mounts), len(req.Volumes))
			}
			// Sign every volume through this container's mount.
			for _, m := range resp.Mounts {
				if ok, err := mountinfo.Mounted(m.MountPoint); err != nil || !ok {
					return fmt.Errorf("%s: %s is not a mount (%v)", id, m.MountPoint, err)
				}
				if err := os.WriteFile(filepath.Join(m.MountPoint, id), nil, 0o644); err != nil {
					return fmt.Errorf("%s: writing to %s: %w", id, m.VolumeId, err)
				}
			}
			return nil
		}, ids)

		vs := h.volumes()
		if len(vs) != nVolumes {
			t.Fatalf("round %d: %d volumes tracked, want %d: %v", round, len(vs), nVolumes, vs)
		}
		for _, v := range vs {
			if v.State != agentv1.VolumeStatus_PUBLISHED || !slices.Equal(v.Containers, want[v.VolumeId]) {
				t.Errorf("round %d: volume %s is %v with containers %v, want PUBLISHED with %v", round, v.VolumeId, v.State, v.Containers, want[v.VolumeId])
			}
		}
		cr, err := client.ListContainers(context.Background(), &agentv1.ListContainersRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if len(cr.Containers) != nContainers {
			t.Fatalf("round %d: %d containers tracked, want %d", round, len(cr.Containers), nContainers)
		}
		for _, cs := range cr.Containers {
			if cs.Phase != agentv1.ContainerStatus_PREPARED {
				t.Errorf("container %s is %v", cs.ContainerId, cs.Phase)
			}
			// Each of its mounts shows the volume: signed by exactly
			// this round's users of it.
			for _, m := range cs.Mounts {
				if ok, err := mountinfo.Mounted(m.MountPoint); err != nil || !ok {
					t.Errorf("container %s: %s is not a mount (%v)", cs.ContainerId, m.MountPoint, err)
					continue
				}
				entries, err := os.ReadDir(m.MountPoint)
				if err != nil {
					t.Fatal(err)
				}
				var signed []string
				for _, e := range entries {
					if strings.HasPrefix(e.Name(), fmt.Sprintf("r%d-", round)) {
						signed = append(signed, e.Name())
					}
				}
				if !slices.Equal(signed, want[m.VolumeId]) {
					t.Errorf("container %s sees in %s files of %v, want %v", cs.ContainerId, m.VolumeId, signed, want[m.VolumeId])
				}
			}
		}
		if t.Failed() {
			t.FailNow()
		}

		parallel("Cleanup", func(_ int, id string) error {
			ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
			defer cancel()
			_, err := client.Cleanup(ctx, &agentv1.CleanupRequest{ContainerId: id})
			return err
		}, ids)
		h.assertClean(pool)
		if t.Failed() {
			t.FailNow()
		}
	}
}

// logBuffer keeps an agent's log for a test to search.
type logBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// waitRecovered waits for the agent's first resync, as a client can: the
// API's volume calls wait for it, and a Cleanup of a container the agent
// does not know succeeds doing nothing.
func (h *harness) waitRecovered() {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	conn := dial(h.t, h.cfg.APISocket)
	defer conn.Close()
	if _, err := agentv1.NewAgentClient(conn).Cleanup(ctx, &agentv1.CleanupRequest{ContainerId: "no-such-container"}); err != nil {
		h.t.Fatalf("no recovery within %v: %v", waitTimeout, err)
	}
}

// globOne returns the one file matching pattern.
func globOne(t *testing.T, pattern string) string {
	t.Helper()
	m, err := filepath.Glob(pattern)
	if err != nil || len(m) != 1 {
		t.Fatalf("%s matches %v (%v), want one file", pattern, m, err)
	}
	return m[0]
}

// TestCorruptCheckpoint: the agent starts despite a checkpoint turned to
// garbage while it was down, keeps the file (moved aside) and reports it.
// A corrupt volume checkpoint is rebuilt from the container records and
// the mount table, so the volume stays in use and cleans up normally. A
// corrupt container checkpoint is quarantined: reported, its volume keeps
// the user and stays published, its bind mount is found in the mount table
// and removed by its cleanup.
func TestCorruptCheckpoint(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	sweepOnExit(t, h)
	const typ = "loop.corrupt"
	pool := h.loopPlugin(typ)
	createVolume(t, pool, "vol-c")
	logs := &logBuffer{}
	cfg := fastConfig(h)
	cfg.Logger = slog.New(slog.NewTextHandler(io.MultiWriter(testWriter{t}, logs), &slog.HandlerOptions{Level: slog.LevelDebug}))
	h.start(cfg)
	h.waitPlugin(typ, "ready", ready)
	spec := volumeSpec{plugin: typ, id: "vol-c", path: "data"}
	const garbage = "{\"state\": \"PUBL"

	// restartCorrupting stops the agent, turns file to garbage and starts
	// a new agent, returning once it has recovered.
	restartCorrupting := func(file string) {
		t.Helper()
		h.halt()
		if err := os.WriteFile(file, []byte(garbage), 0o600); err != nil {
			t.Fatal(err)
		}
		h.start(cfg)
		h.waitPlugin(typ, "ready", ready)
		h.waitRecovered()
		rel, err := filepath.Rel(h.work, file)
		if err != nil {
			t.Fatal(err)
		}
		aside := globOne(t, filepath.Join(h.work, "corrupt", strings.ReplaceAll(rel, "/", "_")+".*"))
		if b, err := os.ReadFile(aside); err != nil || string(b) != garbage {
			t.Errorf("%s holds %q (%v), want the corrupt content", aside, b, err)
		}
		if !strings.Contains(logs.String(), "corrupt checkpoint moved aside") || !strings.Contains(logs.String(), aside) {
			t.Errorf("the agent's log does not report %s moved aside to %s", file, aside)
		}
	}

	// A corrupt volume checkpoint.
	mp := h.mustPrepare("c1", h.dir("sandbox-c1"), "", spec).Mounts[0].MountPoint
	if err := os.WriteFile(filepath.Join(mp, "marker"), []byte("kept"), 0o644); err != nil {
		t.Fatal(err)
	}
	state := globOne(t, filepath.Join(h.work, "csi", typ, "default", "volumes", "*", "volume.state"))
	restartCorrupting(state)
	vs := h.volumes()
	if len(vs) != 1 || vs[0].VolumeId != "vol-c" || vs[0].State != agentv1.VolumeStatus_PUBLISHED || !slices.Equal(vs[0].Containers, []string{"c1"}) {
		t.Fatalf("reconstructed volume: %v; want vol-c PUBLISHED with containers [c1]", vs)
	}
	// The note reconstruct leaves in last_error ("checkpoint was corrupt
	// ...") is cleared by the same recovery pass once the mount table says
	// PUBLISHED, so the API does not show it: the log and the moved-aside
	// file are the report.
	t.Logf("reconstructed volume: %v", vs[0])
	if b, err := os.ReadFile(state); err != nil || bytes.Equal(b, []byte(garbage)) {
		t.Errorf("%s was not checkpointed anew: %q, %v", state, b, err)
	}
	if ok, err := mountinfo.Mounted(mp); err != nil || !ok {
		t.Fatalf("%s is no longer mounted (%v)", mp, err)
	}
	if b, err := os.ReadFile(filepath.Join(mp, "marker")); err != nil || string(b) != "kept" {
		t.Fatalf("volume data: %q, %v", b, err)
	}
	h.mustCleanup("c1")
	h.assertClean(pool)

	// A corrupt container checkpoint.
	mp = h.mustPrepare("c2", h.dir("sandbox-c2"), "", spec).Mounts[0].MountPoint
	restartCorrupting(filepath.Join(h.work, "isolators", "volume", "csi", "c2", "volumes.state"))
	// Quarantined: still listed (PHASE_UNKNOWN, the reason and the mount
	// found in the mount table), its volume keeps it as a user and stays
	// published, its mount stays; across a restart too.
	for round := range 2 {
		cr, err := h.api().ListContainers(context.Background(), &agentv1.ListContainersRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if len(cr.Containers) != 1 || cr.Containers[0].ContainerId != "c2" || cr.Containers[0].Phase != agentv1.ContainerStatus_PHASE_UNKNOWN ||
			!strings.Contains(cr.Containers[0].LastError, "quarantined") || len(cr.Containers[0].Mounts) != 1 || cr.Containers[0].Mounts[0].MountPoint != mp {
			t.Fatalf("round %d: containers %v; want c2 quarantined with its mount %s", round, cr.Containers, mp)
		}
		vs = h.volumes()
		if len(vs) != 1 || !slices.Equal(vs[0].Containers, []string{"c2"}) || vs[0].State != agentv1.VolumeStatus_PUBLISHED {
			t.Fatalf("round %d: volume %v; want vol-c PUBLISHED, used by c2", round, vs)
		}
		if ok, err := mountinfo.Mounted(mp); err != nil || !ok {
			t.Fatalf("round %d: %s: mounted %v (%v)", round, mp, ok, err)
		}
		if round == 0 {
			if _, err := h.prepare("c2", h.dir("sandbox-c2"), "", spec); status.Code(err) != codes.FailedPrecondition {
				t.Errorf("Prepare of a quarantined container: %v; want FailedPrecondition", err)
			}
			h.halt()
			h.start(cfg)
			h.waitPlugin(typ, "ready", ready)
			h.waitRecovered()
		}
	}
	// Its cleanup unmounts what was found and releases the volume.
	h.mustCleanup("c2")
	if ok, _ := mountinfo.Mounted(mp); ok {
		t.Errorf("%s still mounted after the quarantined container's cleanup", mp)
	}
	h.assertClean(pool)

	// The data survived both.
	mp = h.mustPrepare("c3", h.dir("sandbox-c3"), "", spec).Mounts[0].MountPoint
	if b, err := os.ReadFile(filepath.Join(mp, "marker")); err != nil || string(b) != "kept" {
		t.Fatalf("volume data: %q, %v", b, err)
	}
	h.mustCleanup("c3")
	h.assertClean(pool)
}

// publishCodes lists the codes NodePublishVolume calls ended with, as the
// test plugin logged them after offset in its stderr log.
func publishCodes(t *testing.T, logFile string, offset int64) []string {
	t.Helper()
	b, err := os.ReadFile(logFile)
	if err != nil {
		t.Fatal(err)
	}
	const prefix = "testplugin: rpc /csi.v1.Node/NodePublishVolume: "
	var out []string
	for line := range strings.Lines(string(b[offset:])) {
		if c, ok := strings.CutPrefix(strings.TrimSpace(line), prefix); ok {
			out = append(out, c)
		}
	}
	return out
}

func fileSize(t *testing.T, path string) int64 {
	t.Helper()
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return st.Size()
}

func writeAtomic(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path+".tmp", []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(path+".tmp", path); err != nil {
		t.Fatal(err)
	}
}

// TestRetryPolicy: a node RPC failing with a transient code (Unavailable)
// is retried until it succeeds; one failing with a final code
// (InvalidArgument) fails Prepare at once with that code, and the prepare
// is rolled back completely.
func TestRetryPolicy(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	sweepOnExit(t, h)
	const typ = "retry.test"
	data := h.dir("data")
	fail := filepath.Join(h.extra, "fail-publish")
	h.writeConfig(typ+".json", testPluginConfig(typ, "--data-dir="+data, "--fail-publish-file="+fail))
	h.start(fastConfig(h))
	h.waitPlugin(typ, "ready", ready)
	logDir := filepath.Join(h.work, "csi", typ, "default", "logs")
	logFile := filepath.Join(logDir, "container-0.stderr.log")
	client := h.api()
	req := &agentv1.PrepareRequest{ContainerId: "c1", Sandbox: h.dir("sandbox"), Volumes: []*agentv1.Volume{volumeSpec{plugin: typ, id: "vol-r", path: "data"}.volume()}}
	prepare := func() (*agentv1.PrepareResponse, error) {
		ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
		defer cancel()
		return client.Prepare(ctx, req)
	}

	// Unavailable: retried; the test lets the call through once it has
	// seen it fail.
	w, err := fsnotify.NewWatcher()
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if err := w.Add(logDir); err != nil {
		t.Fatal(err)
	}
	writeAtomic(t, fail, "Unavailable")
	offset := fileSize(t, logFile)
	type result struct {
		resp *agentv1.PrepareResponse
		err  error
	}
	done := make(chan result, 1)
	go func() {
		resp, err := prepare()
		done <- result{resp, err}
	}()
	timeout := time.After(waitTimeout)
	for len(publishCodes(t, logFile, offset)) == 0 {
		select {
		case <-w.Events:
		case err := <-w.Errors:
			t.Fatal(err)
		case r := <-done:
			t.Fatalf("Prepare returned before NodePublishVolume failed: %v, %v", r.resp, r.err)
		case <-timeout:
			t.Fatal("NodePublishVolume not called within the timeout")
		}
	}
	if err := os.Remove(fail); err != nil {
		t.Fatal(err)
	}
	var r result
	select {
	case r = <-done:
	case <-time.After(waitTimeout):
		t.Fatal("Prepare did not return after the failure stopped")
	}
	if r.err != nil {
		t.Fatalf("Prepare: %v; want success after a retry", r.err)
	}
	got := publishCodes(t, logFile, offset)
	if len(got) < 2 || got[len(got)-1] != "OK" || slices.ContainsFunc(got[:len(got)-1], func(c string) bool { return c != "Unavailable" }) {
		t.Errorf("NodePublishVolume ended with %v; want Unavailable at least once, then OK", got)
	}
	if ok, err := mountinfo.Mounted(r.resp.Mounts[0].MountPoint); err != nil || !ok {
		t.Errorf("%s is not a mount (%v)", r.resp.Mounts[0].MountPoint, err)
	}
	h.mustCleanup("c1")
	h.assertClean()

	// InvalidArgument: not retried, Prepare fails with it and undoes
	// everything.
	writeAtomic(t, fail, "InvalidArgument")
	offset = fileSize(t, logFile)
	_, err = prepare()
	if status.Code(err) != codes.InvalidArgument {
		t.Fatalf("Prepare: %v; want InvalidArgument", err)
	}
	if got := publishCodes(t, logFile, offset); !slices.Equal(got, []string{"InvalidArgument"}) {
		t.Errorf("NodePublishVolume ended with %v; want InvalidArgument once", got)
	}
	h.assertClean()

	// Nothing is poisoned: once the plugin works, so does Prepare.
	if err := os.Remove(fail); err != nil {
		t.Fatal(err)
	}
	if _, err := prepare(); err != nil {
		t.Fatal(err)
	}
	h.mustCleanup("c1")
	h.assertClean()
}
