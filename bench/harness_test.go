package bench

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/csiagent/csiagent/internal/testhelp"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

var (
	full     = flag.Bool("full", false, "run every benchmark at full size (make bench); default: a short smoke run")
	outFile  = flag.String("out", "", "also write the result table (markdown) to this file")
	diskRoot = flag.String("disk-dir", "/var/tmp", "the directory the agents' work dirs go under: run the benchmarks on the filesystem (and mount options) your --work-dir uses")
)

// bins are the binaries under test, built once.
var bins struct{ agent, loop, test string }

// result is one row of the table: a benchmark against its target, or
// (info) a measured floor, which has none.
type result struct {
	name, figure, baseline, ratio, target string
	pass, info                            bool
}

// verdict is the result column.
func (r result) verdict() string {
	switch {
	case r.info:
		return "-"
	case r.pass:
		return "pass"
	}
	return "**FAIL**"
}

var results struct {
	mu   sync.Mutex
	rows []result
	// floors are TestFloors's figures, for the rows other tests compute
	// from them (zero when it did not run).
	floors floors
	// sections are headed markdown sections printed after the table
	// (section).
	sections []string
}

// floors are the kernel's costs TestFloors measures on this machine.
type floors struct {
	durable time.Duration // a durable checkpoint (atomicfile.Write)
	rtt     time.Duration // a gRPC round trip on a unix socket
}

func setFloors(f floors) {
	results.mu.Lock()
	results.floors = f
	results.mu.Unlock()
}

// measuredFloors returns TestFloors's figures; ok is false when it has
// not run in this process (go test -run without it).
func measuredFloors() (f floors, ok bool) {
	results.mu.Lock()
	defer results.mu.Unlock()
	return results.floors, results.floors != floors{}
}

// section adds a markdown section (a "## heading" and body) to print
// after the table, in the results file too.
func section(heading, body string) {
	results.mu.Lock()
	results.sections = append(results.sections, fmt.Sprintf("\n## %s\n\n%s", heading, body))
	results.mu.Unlock()
}

func report(t *testing.T, r result) {
	t.Helper()
	results.mu.Lock()
	results.rows = append(results.rows, r)
	results.mu.Unlock()
	t.Logf("%s: %s (baseline %s) ratio %s target %s: %s", r.name, r.figure, r.baseline, r.ratio, r.target, r.verdict())
}

func TestMain(m *testing.M) {
	flag.Parse()
	if os.Geteuid() != 0 {
		fmt.Println("bench: not root; every benchmark needs root (mounts, loop devices): skipping")
		os.Exit(0)
	}
	paths, remove, err := testhelp.BuildBinaries("github.com/csiagent/csiagent/cmd/csi-agent",
		"github.com/csiagent/csiagent/cmd/csi-loop-plugin", "github.com/csiagent/csiagent/internal/testplugin")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	bins.agent, bins.loop, bins.test = paths[0], paths[1], paths[2]
	code := m.Run()
	remove()
	printTable()
	os.Exit(code)
}

func printTable() {
	results.mu.Lock()
	defer results.mu.Unlock()
	if len(results.rows) == 0 {
		return
	}
	var b strings.Builder
	mode := "smoke run (sizes reduced; figures not comparable with the targets)"
	if *full {
		mode = "full run"
	}
	host, _ := os.Hostname()
	var uts unix.Utsname
	_ = unix.Uname(&uts)
	fmt.Fprintf(&b, "\ncsiagent benchmarks, %s, %s, kernel %s, %d CPUs, %s\n\n", mode, host, unix.ByteSliceToString(uts.Release[:]), nproc(), time.Now().UTC().Format(time.RFC3339))
	fmt.Fprintln(&b, "| benchmark | figure | baseline (same run) | ratio | target | result |")
	fmt.Fprintln(&b, "| --- | --- | --- | --- | --- | --- |")
	for _, r := range results.rows {
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s |\n", r.name, r.figure, r.baseline, r.ratio, r.target, r.verdict())
	}
	for _, s := range results.sections {
		b.WriteString(s)
	}
	fmt.Print(b.String())
	if *outFile != "" {
		_ = os.WriteFile(*outFile, []byte(b.String()), 0o644)
	}
}

func nproc() int {
	var set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &set); err != nil {
		return 0
	}
	return set.Count()
}

// size picks the smoke or the full size.
func size(smoke, fullSize int) int {
	if *full {
		return fullSize
	}
	return smoke
}

// --- directories and mounts ---

// diskDir is a directory on the root filesystem (a real disk, so that
// fsync costs what it costs), removed at the end.
func diskDir(t *testing.T) string {
	t.Helper()
	d, err := os.MkdirTemp(*diskRoot, "csiagent-bench-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}

// privateTmpfs mounts a private tmpfs (mounts below it do not propagate
// anywhere) and detaches it, with everything mounted below, at the end.
func privateTmpfs(t *testing.T) string {
	t.Helper()
	d, err := os.MkdirTemp("", "csiagent-bench-tmpfs-")
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", d, "tmpfs", 0, "mode=0755"); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("", d, "", unix.MS_PRIVATE, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(d, unix.MNT_DETACH); err != nil {
			t.Errorf("detaching %s: %v", d, err)
		}
		os.Remove(d)
	})
	return d
}

func mkdirs(t *testing.T, dirs ...string) {
	t.Helper()
	for _, d := range dirs {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
}

// --- processes ---

// startPlugin runs a plugin binary serving on socket until the test ends.
func startPlugin(t *testing.T, socket string, bin string, args ...string) {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), "CSI_ENDPOINT=unix://"+socket, "MESOS_AGENT_ID=node-1")
	logf, err := os.Create(socket + ".log")
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Signal(unix.SIGTERM)
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		logf.Close()
	})
	waitSocket(t, socket)
}

func waitSocket(t *testing.T, socket string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		c, err := net.Dial("unix", socket)
		if err == nil {
			c.Close()
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("socket %s: %v", socket, err)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func dial(t *testing.T, socket string) *grpc.ClientConn {
	t.Helper()
	c, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// unmanagedConfig is a plugin config for a plugin already serving on
// socket (so benchmarks can call the very same process directly).
func unmanagedConfig(typ, socket, targetPathRoot string) string {
	m := map[string]any{
		"type":      typ,
		"endpoints": []any{map[string]any{"csi_service": "NODE_SERVICE", "endpoint": socket}},
	}
	if targetPathRoot != "" {
		m["target_path_root"] = targetPathRoot
	}
	b, _ := json.Marshal(m)
	return string(b)
}

// agentProc is a running csi-agent serve.
type agentProc struct {
	cmd     *exec.Cmd
	socket  string
	api     agentv1.AgentClient
	started time.Time
	ready   time.Duration // exec to READY=1 (recovery done)
	metrics string        // host:port
}

type agentOpts struct {
	work, conf string
	configs    map[string]string // file name -> content
	extraArgs  []string
}

// startAgent runs csi-agent serve and waits for READY=1 (sent once the API
// serves and the first recovery pass is done) on a NOTIFY_SOCKET.
func startAgent(t *testing.T, o agentOpts) *agentProc {
	t.Helper()
	run, err := os.MkdirTemp("", "cab")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(run) })
	if o.conf == "" {
		o.conf = filepath.Join(run, "conf")
	}
	mkdirs(t, o.conf, o.work)
	for name, c := range o.configs {
		if err := os.WriteFile(filepath.Join(o.conf, name), []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	notifyPath := filepath.Join(run, "notify")
	nl, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: notifyPath, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer nl.Close()
	socket := filepath.Join(run, "agent.sock")
	args := append([]string{"serve", "--csi-plugin-config-dir", o.conf, "--work-dir", o.work,
		"--runtime-dir", filepath.Join(run, "rt"), "--api-socket", socket, "--node-id", "node-1",
		"--log-level", "warn", "--metrics-address", "127.0.0.1:0"}, o.extraArgs...)
	cmd := exec.Command(bins.agent, args...)
	cmd.Env = append(os.Environ(), "NOTIFY_SOCKET="+notifyPath)
	logf, err := os.Create(filepath.Join(o.work, "..", filepath.Base(o.work)+"-agent.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr, cmd.Stdout = logf, logf
	ap := &agentProc{cmd: cmd, socket: socket, started: time.Now()}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ap.stop(t); logf.Close() })
	buf := make([]byte, 4096)
	_ = nl.SetReadDeadline(time.Now().Add(2 * time.Minute))
	for {
		n, err := nl.Read(buf)
		if err != nil {
			t.Fatalf("waiting for the agent's READY=1: %v (log: %s)", err, logf.Name())
		}
		if slices.Contains(strings.Split(string(buf[:n]), "\n"), "READY=1") {
			ap.ready = time.Since(ap.started)
			break
		}
	}
	ap.api = agentv1.NewAgentClient(dial(t, socket))
	return ap
}

func (ap *agentProc) stop(t *testing.T) {
	if ap.cmd == nil {
		return
	}
	_ = ap.cmd.Process.Signal(unix.SIGTERM)
	done := make(chan struct{})
	go func() { _ = ap.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		_ = ap.cmd.Process.Kill()
		<-done
	}
	ap.cmd = nil
}

// cpuTime is the process's user+system CPU time.
func cpuTime(t *testing.T, pid int) time.Duration {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		t.Fatal(err)
	}
	s := string(b)
	fields := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	ut, _ := strconv.ParseInt(fields[11], 10, 64)
	st, _ := strconv.ParseInt(fields[12], 10, 64)
	// USER_HZ is 100 on Linux.
	return time.Duration(ut+st) * 10 * time.Millisecond
}

// rss reads VmRSS (or another field) of /proc/pid/status, in bytes.
func procStatus(t *testing.T, pid int, field string) int64 {
	return procField(t, pid, "status", field) << 10
}

// procIO reads one field of /proc/<pid>/io, in bytes (read_bytes: what
// the process had read from the storage layer).
func procIO(t *testing.T, pid int, field string) int64 {
	return procField(t, pid, "io", field)
}

// procField reads the number of a "field: N ..." line of /proc/<pid>/file.
func procField(t *testing.T, pid int, file, field string) int64 {
	t.Helper()
	f, err := os.Open(fmt.Sprintf("/proc/%d/%s", pid, file))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), field+":"); ok {
			n, _ := strconv.ParseInt(strings.Fields(v)[0], 10, 64)
			return n
		}
	}
	return 0
}

// metric reads one sample of the agent's /metrics.
func (ap *agentProc) metric(t *testing.T, name string) float64 {
	t.Helper()
	addr := ap.metricsAddr(t)
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
	b, _ := io.ReadAll(c)
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			f, _ := strconv.ParseFloat(strings.TrimSpace(v), 64)
			return f
		}
	}
	return -1
}

// waitSettled waits until every checkpoint the agent wrote is durable and
// every removal it left after an answer is made
// (csi_agent_checkpoint_pending is 0).
func waitSettled(t *testing.T, ap *agentProc) {
	t.Helper()
	for {
		pending := ap.metric(t, "csi_agent_checkpoint_pending")
		if pending < 0 {
			t.Fatal("the agent exports no csi_agent_checkpoint_pending")
		}
		if pending == 0 {
			return
		}
		time.Sleep(time.Millisecond)
	}
}

// metricsAddr finds the port the agent's metrics listener bound (":0").
func (ap *agentProc) metricsAddr(t *testing.T) string {
	t.Helper()
	if ap.metrics != "" {
		return ap.metrics
	}
	inodes := map[string]bool{}
	fds, _ := filepath.Glob(fmt.Sprintf("/proc/%d/fd/*", ap.cmd.Process.Pid))
	for _, fd := range fds {
		if l, err := os.Readlink(fd); err == nil && strings.HasPrefix(l, "socket:[") {
			inodes[strings.TrimSuffix(strings.TrimPrefix(l, "socket:["), "]")] = true
		}
	}
	b, _ := os.ReadFile("/proc/net/tcp")
	for line := range strings.SplitSeq(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 9 && f[3] == "0A" && inodes[f[9]] {
			port, _ := strconv.ParseUint(f[1][strings.IndexByte(f[1], ':')+1:], 16, 16)
			ap.metrics = fmt.Sprintf("127.0.0.1:%d", port)
			return ap.metrics
		}
	}
	t.Fatal("metrics listener not found")
	return ""
}

// --- requests ---

func mountVolume(plugin, id, containerPath string) *agentv1.Volume {
	return mountVolumeCap(plugin, id, containerPath, mountCap())
}

// mountVolumeCap is mountVolume with the given capability.
func mountVolumeCap(plugin, id, containerPath string, capability *csi.VolumeCapability) *agentv1.Volume {
	return &agentv1.Volume{
		ContainerPath: containerPath,
		Mode:          agentv1.Volume_RW,
		Source: &agentv1.Volume_Source{
			Type: agentv1.Volume_Source_CSI_VOLUME,
			CsiVolume: &agentv1.CSIVolume{
				PluginName: plugin,
				StaticProvisioning: &agentv1.StaticProvisioning{
					VolumeId: id, VolumeCapability: capability,
				},
			},
		},
	}
}

func mountCap() *csi.VolumeCapability {
	return mountCapMode(csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER)
}

// mountCapMode is a mount capability with the given access mode.
func mountCapMode(mode csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
	}
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// --- statistics ---

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func medianF(fs []float64) float64 {
	s := slices.Clone(fs)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func ms(d time.Duration) string { return fmt.Sprintf("%.2f ms", float64(d)/1e6) }
