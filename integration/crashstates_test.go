package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/csiagent/csiagent/internal/crashstate"
	"github.com/csiagent/csiagent/internal/testhelp"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	"github.com/csiagent/csiagent/supervisor"
)

// crashStates is how many crash states TestCrashStates recovers: make test
// a bounded sample, make powercut at least this many.
var crashStates = flag.Int("crash-states", 60, "crash states of the whole daemon TestCrashStates recovers (make powercut: 1000)")

// crashWorkloadEnv hands the workload's settings to the traced test
// binary (TestCrashStateWorkload).
const crashWorkloadEnv = "CSIAGENT_CRASH_WORKLOAD"

// crashWorkload is what the traced workload does, and where.
type crashWorkload struct {
	Conf, Work, Run, Log string
	Type                 string
	Volumes              []string
	// Sandboxes by container id.
	Sandboxes map[string]string
	Seed      uint64
}

// Markers the workload leaves in the trace (crashstate.Mark).
const (
	markBeginPrepare = "begin prepare "
	markAckPrepare   = "ack prepare "
	markBeginCleanup = "begin cleanup "
	markAckCleanup   = "ack cleanup "
)

// TestCrashStates: every file-system operation of the real daemon under
// its --work-dir is recorded (strace) during a workload of concurrent
// prepares and cleanups of containers sharing loop volumes; crash states
// are generated from the recording as POSIX allows (internal/crashstate:
// unsynced data lost or torn at 512 B and 4 KiB, unsynced directory
// entries present or absent, a lost directory taking its contents); each
// is recovered by a fresh csi-agent serve after a simulated reboot (every
// process killed, every mount and loop device gone, a new boot id) and
// checked: the agent starts; every container acknowledged prepared (and
// not being cleaned up) is PREPARED with its mounts back; every one
// acknowledged cleaned up is gone; no container is quarantined; each
// volume's users are the containers naming it and it is published while
// it has any; nothing is mounted that no record claims.
func TestCrashStates(t *testing.T) {
	testhelp.NeedRoot(t)
	if _, err := exec.LookPath("strace"); err != nil {
		t.Fatalf("strace is not installed (make deps installs Debian's strace): %v", err)
	}
	h := newHarness(t)
	sweepOnExit(t, h)
	w := crashWorkload{Conf: h.confDir, Work: h.work, Run: h.run, Log: filepath.Join(h.extra, "agent.log"),
		Type: "crash.loop", Volumes: []string{"vol-a", "vol-b", "vol-c"}, Sandboxes: map[string]string{}, Seed: 7}
	pool := h.loopPlugin(w.Type)
	for _, v := range w.Volumes {
		createVolumeSize(t, pool, v, "32MiB")
	}
	for i := range 6 {
		id := fmt.Sprintf("c%d", i)
		w.Sandboxes[id] = h.dir("sb-" + id)
	}

	// Record, from an empty work dir (as installed).
	if err := os.Mkdir(h.work, 0o755); err != nil {
		t.Fatal(err)
	}
	init, err := crashstate.Snapshot(h.work)
	if err != nil {
		t.Fatal(err)
	}
	traceLog := filepath.Join(h.extra, "strace.log")
	spec, _ := json.Marshal(w)
	cmd := exec.Command("strace", append(crashstate.StraceArgs(traceLog), os.Args[0], "-test.run=^TestCrashStateWorkload$", "-test.v", "-test.timeout=5m")...)
	cmd.Env = append(os.Environ(), crashWorkloadEnv+"="+string(spec), binsEnvValue())
	out, err := cmd.CombinedOutput()
	if err != nil {
		agentLog, _ := os.ReadFile(w.Log)
		t.Fatalf("recording the workload: %v\n%s\nagent log:\n%s", err, out, agentLog)
	}
	powerOff(t, h, func(string, ...any) {})
	f, err := os.Open(traceLog)
	if err != nil {
		t.Fatal(err)
	}
	trace, err := crashstate.Parse(f, h.work)
	f.Close()
	if err != nil {
		t.Fatalf("%v\n%s", err, keepTrace(t, traceLog))
	}
	t.Logf("recorded %d file-system operations under the work dir, %d markers", len(trace.Ops), len(trace.Markers))
	if !slices.ContainsFunc(trace.Ops, func(op crashstate.Op) bool {
		return op.Kind == crashstate.OpWrite && op.Offset > 0 && op.Offset%8192 == 0 && len(op.Data) > 4096
	}) {
		t.Error("the workload wrote no record version into a slot of 8 KiB")
	}

	// Recover crash states: boundaries spread over the whole trace, each
	// marker's among them (what was acknowledged changes there).
	rng := rand.New(rand.NewPCG(w.Seed, 3))
	bounds := map[int]bool{len(trace.Ops): true}
	for _, m := range trace.Markers {
		bounds[m.Op] = true
	}
	for range *crashStates {
		bounds[rng.IntN(len(trace.Ops)+1)] = true
	}
	ks := slices.Sorted(func(yield func(int) bool) {
		for k := range bounds {
			if !yield(k) {
				return
			}
		}
	})
	var all []crashstate.State
	for _, k := range ks {
		states, err := trace.States(init, k, rng, 2)
		if err != nil {
			t.Fatalf("%v\n%s", err, keepTrace(t, traceLog))
		}
		all = append(all, states...)
	}
	// make test: a sample, always with the last boundary's states.
	if len(all) > *crashStates {
		rng.Shuffle(len(all), func(i, j int) { all[i], all[j] = all[j], all[i] })
		all = all[:*crashStates]
	}
	sort.SliceStable(all, func(i, j int) bool { return all[i].K < all[j].K })
	recovered, violations := 0, 0
	for i, st := range all {
		problems := recoverCrashState(t, h, w, st, trace.Markers, fmt.Sprintf("boot-%d", i))
		for _, p := range problems {
			violations++
			t.Errorf("%s: %s", st.Name, p)
		}
		if len(problems) == 0 {
			recovered++
		}
		if violations > 20 {
			t.Fatalf("stopping after %d violations", violations)
		}
	}
	t.Logf("crash states: %d recovered, %d violations", recovered, violations)
	fmt.Printf("crash states: %d recovered, %d violations\n", recovered, violations)
}

// keepTrace copies the strace log a failure came from out of the test's
// directories (which the test removes) and says where.
func keepTrace(t *testing.T, traceLog string) string {
	t.Helper()
	data, err := os.ReadFile(traceLog)
	if err != nil {
		return fmt.Sprintf("strace log not kept: %v", err)
	}
	kept := filepath.Join(os.TempDir(), fmt.Sprintf("csiagent-crashstates-%d.strace", os.Getpid()))
	if err := os.WriteFile(kept, data, 0o644); err != nil {
		return fmt.Sprintf("strace log not kept: %v", err)
	}
	return "strace log kept in " + kept
}

// expectation is what a crash after some operation allows of a container.
type expectation int

const (
	expectNothing  expectation = iota // never prepared (so far): absent
	expectPrepared                    // acknowledged prepared, no cleanup started
	expectGone                        // acknowledged cleaned up (and not prepared again)
	expectEither                      // a prepare or a cleanup in flight
)

// expectations reads the markers issued before a crash after op k.
func expectations(markers []crashstate.Marker, k int) map[string]expectation {
	out := map[string]expectation{}
	for _, m := range markers {
		if m.Op > k {
			break
		}
		for prefix, e := range map[string]expectation{markBeginPrepare: expectEither, markAckPrepare: expectPrepared, markBeginCleanup: expectEither, markAckCleanup: expectGone} {
			if id, ok := strings.CutPrefix(m.Text, prefix); ok {
				out[id] = e
			}
		}
	}
	return out
}

// recoverCrashState lays st out as the work dir, starts a fresh agent on
// it after the simulated reboot, checks the invariants and powers off
// again. It returns the violations found.
func recoverCrashState(t *testing.T, h *harness, w crashWorkload, st crashstate.State, markers []crashstate.Marker, bootID string) []string {
	t.Helper()
	if err := os.RemoveAll(h.work); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(h.work, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := st.Materialize(h.work); err != nil {
		t.Fatal(err)
	}
	defer powerOff(t, h, func(string, ...any) {})
	ca, err := startBinaryAgent(h, w.Log, "CSIAGENT_TEST_BOOT_ID="+bootID)
	if err != nil {
		agentLog, _ := os.ReadFile(w.Log)
		return []string{fmt.Sprintf("the agent did not start: %v\n%s", err, lastLines(agentLog, 20))}
	}
	defer ca.kill()
	want := expectations(markers, st.K)
	containers, volumes, why := settleBounded(ca.client, 20*time.Second)
	var problems []string
	if why != "" {
		problems = append(problems, "not settled: "+why)
	}
	listed := map[string]*agentv1.ContainerStatus{}
	users := map[string][]string{}
	var wantMounts []string
	for _, c := range containers {
		listed[c.ContainerId] = c
		if c.Phase == agentv1.ContainerStatus_PHASE_UNKNOWN {
			problems = append(problems, fmt.Sprintf("container %s quarantined: %s", c.ContainerId, c.LastError))
		}
		for _, m := range c.Mounts {
			k := m.PluginName + "/" + m.VolumeId
			users[k] = append(users[k], c.ContainerId)
			wantMounts = append(wantMounts, m.MountPoint)
			if ok, err := mountinfo.Mounted(m.MountPoint); err != nil || !ok {
				problems = append(problems, fmt.Sprintf("container %s: %s not mounted (%v)", c.ContainerId, m.MountPoint, err))
			}
		}
	}
	for id := range w.Sandboxes {
		c := listed[id]
		switch e := want[id]; {
		case e == expectPrepared && (c == nil || c.Phase != agentv1.ContainerStatus_PREPARED):
			problems = append(problems, fmt.Sprintf("container %s was acknowledged prepared but is %v", id, phaseOf(c)))
		case (e == expectGone || e == expectNothing) && c != nil:
			problems = append(problems, fmt.Sprintf("container %s is %v; want it gone (acknowledged cleaned up or never prepared)", id, c.Phase))
		}
	}
	for _, v := range volumes {
		k := v.PluginName + "/" + v.VolumeId
		u := slices.Sorted(slices.Values(users[k]))
		if !slices.Equal(slices.Sorted(slices.Values(v.Containers)), u) {
			problems = append(problems, fmt.Sprintf("volume %s has users %v; the container records name %v", k, v.Containers, u))
		}
		if len(u) > 0 && v.State != agentv1.VolumeStatus_PUBLISHED {
			problems = append(problems, fmt.Sprintf("volume %s is %v with users %v", k, v.State, u))
		}
		if v.State == agentv1.VolumeStatus_PUBLISHED {
			wantMounts = append(wantMounts, v.StagingPath, v.TargetPath)
		}
		delete(users, k)
	}
	for k, u := range users {
		problems = append(problems, fmt.Sprintf("volume %s is mounted by %v but not tracked", k, u))
	}
	gotMounts := mountsUnder(t, h.work, h.extra)
	sort.Strings(gotMounts)
	sort.Strings(wantMounts)
	if !slices.Equal(slices.Compact(gotMounts), slices.Compact(wantMounts)) {
		problems = append(problems, fmt.Sprintf("mounts %v; the records claim %v", gotMounts, wantMounts))
	}
	return problems
}

func phaseOf(c *agentv1.ContainerStatus) string {
	if c == nil {
		return "gone"
	}
	return c.Phase.String() + " (" + c.LastError + ")"
}

func lastLines(b []byte, n int) string {
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}

// settleBounded waits, up to limit, until every container is PREPARED
// (or quarantined: recovery leaves those alone) and every volume converged
// to its users, and returns the state with why it is not settled ("" if
// it is).
func settleBounded(c agentv1.AgentClient, limit time.Duration) ([]*agentv1.ContainerStatus, []*agentv1.VolumeStatus, string) {
	deadline := time.Now().Add(limit)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
		cr, cerr := c.ListContainers(ctx, &agentv1.ListContainersRequest{})
		vr, verr := c.ListVolumes(ctx, &agentv1.ListVolumesRequest{})
		cancel()
		if err := errors.Join(cerr, verr); err != nil {
			return nil, nil, err.Error()
		}
		var live []*agentv1.ContainerStatus
		for _, cs := range cr.Containers {
			if cs.Phase != agentv1.ContainerStatus_PHASE_UNKNOWN {
				live = append(live, cs)
			}
		}
		why := unsettled(live, vr.Volumes)
		if why == "" || time.Now().After(deadline) {
			return cr.Containers, vr.Volumes, why
		}
		time.Sleep(settlePoll)
	}
}

// binaryAgent is a csi-agent serve process with a client.
type binaryAgent struct {
	cmd    *exec.Cmd
	exited chan struct{}
	conn   *grpc.ClientConn
	client agentv1.AgentClient
}

// stop stops the agent cleanly (SIGTERM), within waitTimeout.
func (ba *binaryAgent) stop() error {
	if err := ba.cmd.Process.Signal(unix.SIGTERM); err != nil {
		return err
	}
	defer ba.conn.Close()
	select {
	case <-ba.exited:
	case <-time.After(waitTimeout):
		ba.kill()
		return fmt.Errorf("the agent did not stop within %v of SIGTERM", waitTimeout)
	}
	if !ba.cmd.ProcessState.Success() {
		return fmt.Errorf("the agent's clean stop: %v", ba.cmd.ProcessState)
	}
	return nil
}

func (ba *binaryAgent) kill() {
	_ = ba.cmd.Process.Signal(unix.SIGKILL)
	<-ba.exited
	if ba.conn != nil {
		ba.conn.Close()
	}
}

// startBinaryAgent runs csi-agent serve on h's directories (its log
// appended to logFile) and waits until its first recovery pass is done:
// the API's Cleanup of an unknown container waits for it.
func startBinaryAgent(h *harness, logFile string, env ...string) (*binaryAgent, error) {
	log, err := os.OpenFile(logFile, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		return nil, err
	}
	defer log.Close()
	cmd := exec.Command(bins.agent, "serve", "--csi-plugin-config-dir", h.confDir, "--work-dir", h.work,
		"--runtime-dir", h.run, "--node-id", "node-1", "--plugin-probe-interval", "100ms", "--log-level", "info",
		"--reclaim-interval", "0")
	cmd.Env = append(os.Environ(), env...)
	cmd.Stdout, cmd.Stderr = log, log
	socket := filepath.Join(h.run, "agent.sock")
	if err := os.Remove(socket); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	ba := &binaryAgent{cmd: cmd, exited: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		close(ba.exited)
	}()
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	if err := supervisor.WaitForSocket(ctx, socket, ba.exited); err != nil {
		ba.kill()
		return nil, fmt.Errorf("API socket: %w (exit: %v)", err, cmd.ProcessState)
	}
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		ba.kill()
		return nil, err
	}
	ba.conn, ba.client = conn, agentv1.NewAgentClient(conn)
	if _, err := ba.client.Cleanup(ctx, &agentv1.CleanupRequest{ContainerId: "no-such-container"}, grpc.WaitForReady(true)); err != nil {
		ba.kill()
		return nil, fmt.Errorf("no recovery within %v: %w", waitTimeout, err)
	}
	return ba, nil
}

// waitPluginReady waits until plugin typ is ready through ba.
func (ba *binaryAgent) waitPluginReady(typ string) error {
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	stream, err := ba.client.WatchPlugins(ctx, &agentv1.ListPluginsRequest{}, grpc.WaitForReady(true))
	if err != nil {
		return err
	}
	for {
		resp, err := stream.Recv()
		if err != nil {
			return fmt.Errorf("plugin %s not ready: %w", typ, err)
		}
		for _, p := range resp.Plugins {
			if p.Type == typ && ready(p) {
				return nil
			}
		}
	}
}

// TestCrashStateWorkload is the workload TestCrashStates records under
// strace: it runs only as that test's child. It starts csi-agent serve,
// runs three workers, each preparing and cleaning up its two containers
// on random volumes (shared between workers), with a clean stop and a new
// agent halfway, marks each call's start and acknowledgement in the
// trace, and ends by killing the agent (SIGKILL).
func TestCrashStateWorkload(t *testing.T) {
	spec := os.Getenv(crashWorkloadEnv)
	if spec == "" {
		t.Skip("the child of TestCrashStates only")
	}
	var w crashWorkload
	if err := json.Unmarshal([]byte(spec), &w); err != nil {
		t.Fatal(err)
	}
	h := &harness{t: t, confDir: w.Conf, work: w.Work, run: w.Run}
	t.Cleanup(func() { killPlugins(t, w.Work) })
	ba, err := startBinaryAgent(h, w.Log)
	if err != nil {
		t.Fatal(err)
	}
	defer ba.kill()
	if err := ba.waitPluginReady(w.Type); err != nil {
		t.Fatal(err)
	}
	ids := slices.Sorted(func(yield func(string) bool) {
		for id := range w.Sandboxes {
			if !yield(id) {
				return
			}
		}
	})
	// prepare a, prepare b; a clean stop and a new agent (which starts
	// from the start image); cleanup a, prepare a, cleanup b: a ends
	// prepared, b cleaned up; each on 1-2 volumes.
	type step struct {
		id      string
		prepare bool
	}
	rngs := make([]*rand.Rand, len(ids)/2)
	for worker := range rngs {
		rngs[worker] = rand.New(rand.NewPCG(w.Seed, uint64(worker)))
	}
	run := func(steps func(a, b string) []step) {
		var wg sync.WaitGroup
		errs := make(chan error, len(ids))
		for worker := range len(ids) / 2 {
			mine := ids[2*worker : 2*worker+2]
			wg.Go(func() {
				for _, st := range steps(mine[0], mine[1]) {
					if err := workloadStep(ba.client, w, st.id, st.prepare, rngs[worker]); err != nil {
						errs <- err
						return
					}
				}
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Error(err)
		}
	}
	run(func(a, b string) []step { return []step{{a, true}, {b, true}} })
	if err := ba.stop(); err != nil {
		t.Fatal(err)
	}
	if ba, err = startBinaryAgent(h, w.Log); err != nil {
		t.Fatal(err)
	}
	defer ba.kill()
	if err := ba.waitPluginReady(w.Type); err != nil {
		t.Fatal(err)
	}
	if log, _ := os.ReadFile(w.Log); !regexp.MustCompile(`records loaded.*from_start_image=[1-9]`).Match(log) {
		t.Fatalf("the agent after the clean stop read no record from the start image; its log:\n%s", lastLines(log, 20))
	}
	run(func(a, b string) []step { return []step{{a, false}, {a, true}, {b, false}} })
	crashstate.Mark("done")
	// The power cut: the agent and then (a cleanup) its plugin die.
	ba.kill()
}

// killPlugins kills the plugin processes the agent on work started:
// strace ends with the last process it traces, whether the workload
// ended or failed.
func killPlugins(t *testing.T, work string) {
	records, _ := filepath.Glob(filepath.Join(work, "csi", "*", "*", "containers", "*", "process.json"))
	for _, f := range records {
		var rec struct {
			PID int `json:"pid"`
		}
		if err := readProcessRecord(work, f, &rec); err != nil {
			t.Error(err)
			continue
		}
		killAndWait(t, rec.PID)
	}
}

// workloadStep prepares or cleans up container id, marking the call's
// start and acknowledgement.
func workloadStep(c agentv1.AgentClient, w crashWorkload, id string, prepare bool, rng *rand.Rand) error {
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	if !prepare {
		crashstate.Mark(markBeginCleanup + id)
		if _, err := c.Cleanup(ctx, &agentv1.CleanupRequest{ContainerId: id}); err != nil {
			return fmt.Errorf("cleanup %s: %w", id, err)
		}
		crashstate.Mark(markAckCleanup + id)
		return nil
	}
	req := &agentv1.PrepareRequest{ContainerId: id, Sandbox: w.Sandboxes[id]}
	vols := slices.Clone(w.Volumes)
	rng.Shuffle(len(vols), func(i, j int) { vols[i], vols[j] = vols[j], vols[i] })
	for _, v := range vols[:1+rng.IntN(2)] {
		vol := volumeSpec{plugin: w.Type, id: v, path: "d-" + v}.volume()
		if v == w.Volumes[0] {
			// Its records, and those of the containers using it, are
			// over 4 KiB: files with larger slots crash too.
			vol.Source.CsiVolume.StaticProvisioning.VolumeContext = map[string]string{"padding": strings.Repeat("p", 5000)}
		}
		req.Volumes = append(req.Volumes, vol)
	}
	crashstate.Mark(markBeginPrepare + id)
	resp, err := c.Prepare(ctx, req)
	if err != nil {
		return fmt.Errorf("prepare %s: %w", id, err)
	}
	crashstate.Mark(markAckPrepare + id)
	// Data written through the container's mounts is the volume's, not
	// the work dir's: it must not disturb the recording.
	for _, m := range resp.Mounts {
		if err := os.WriteFile(filepath.Join(m.MountPoint, id), bytes.Repeat([]byte(id), 100), 0o644); err != nil {
			return err
		}
	}
	return nil
}
