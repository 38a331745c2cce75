package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/internal/testhelp"
	"github.com/csiagent/csiagent/proto/reclaimspace"
)

const (
	// startTimeout bounds waiting for a plugin to serve (it dials with a
	// short backoff until the socket accepts).
	startTimeout = 10 * time.Second
	// rpcTimeout bounds the calls of one subtest that are expected to
	// answer (a context shared by a dozen mount-making calls: 5 s ran out
	// on a loaded 2-CPU CI machine).
	rpcTimeout = 30 * time.Second
	// hangTimeout is the deadline of calls that are expected to hang.
	hangTimeout = 200 * time.Millisecond
	// exitTimeout bounds waiting for a plugin to exit.
	exitTimeout = 10 * time.Second
)

// lockedBuffer collects a child's output while the test reads it.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// proc is a running testplugin.
type proc struct {
	cmd            *exec.Cmd
	socket         string
	stdout, stderr *lockedBuffer
	exited         chan struct{} // closed when cmd.Wait returned
	conn           *grpc.ClientConn
}

// start launches the plugin with env (plus CSI_ENDPOINT unless env sets it)
// and a socket in a new temporary directory, unless socket is given.
func start(t *testing.T, bin, socket string, env []string, args ...string) *proc {
	t.Helper()
	if socket == "" {
		socket = filepath.Join(t.TempDir(), "csi.sock")
	}
	p := &proc{socket: socket, stdout: &lockedBuffer{}, stderr: &lockedBuffer{}, exited: make(chan struct{})}
	if !slices.ContainsFunc(env, func(kv string) bool { return strings.HasPrefix(kv, "CSI_ENDPOINT=") }) {
		env = append(env, "CSI_ENDPOINT=unix://"+socket)
	}
	p.cmd = exec.Command(bin, args...)
	p.cmd.Env = env
	p.cmd.Stdout, p.cmd.Stderr = p.stdout, p.stderr
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		_ = p.cmd.Wait()
		close(p.exited)
	}()
	t.Cleanup(func() {
		select {
		case <-p.exited:
		default:
			_ = p.cmd.Process.Kill()
			<-p.exited
		}
		if t.Failed() {
			t.Logf("plugin stderr:\n%s", p.stderr.String())
		}
	})
	conn, err := grpc.NewClient("unix://"+socket,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		// Retry the dial quickly while the plugin starts: the default
		// backoff waits a second after the first failure.
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 10 * time.Millisecond, Multiplier: 1.5, MaxDelay: 100 * time.Millisecond},
			MinConnectTimeout: time.Second,
		}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	p.conn = conn
	return p
}

// waitServing blocks until the plugin answers NodeGetInfo (which no flag
// makes misbehave).
func (p *proc) waitServing(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()
	if _, err := csi.NewNodeClient(p.conn).NodeGetInfo(ctx, &csi.NodeGetInfoRequest{}, grpc.WaitForReady(true)); err != nil {
		t.Fatalf("plugin not serving: %v\nstderr:\n%s", err, p.stderr.String())
	}
}

// wait waits for the plugin to exit and returns its exit status.
func (p *proc) wait(t *testing.T) int {
	t.Helper()
	select {
	case <-p.exited:
		return p.cmd.ProcessState.ExitCode()
	case <-time.After(exitTimeout):
		t.Fatalf("plugin did not exit within %v\nstderr:\n%s", exitTimeout, p.stderr.String())
		return 0
	}
}

// terminate sends SIGTERM and checks the plugin exits 0 and removes its
// socket.
func (p *proc) terminate(t *testing.T) {
	t.Helper()
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := p.wait(t); code != 0 {
		t.Fatalf("exit status after SIGTERM %d, want 0\nstderr:\n%s", code, p.stderr.String())
	}
	if _, err := os.Lstat(p.socket); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("socket after SIGTERM: %v, want it removed", err)
	}
}

func rpcCtx(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func probe(t *testing.T, p *proc) (ready bool, code codes.Code) {
	t.Helper()
	resp, err := csi.NewIdentityClient(p.conn).Probe(rpcCtx(t, rpcTimeout), &csi.ProbeRequest{})
	if err != nil {
		return false, status.Code(err)
	}
	return resp.GetReady().GetValue(), codes.OK
}

func TestPlugin(t *testing.T) {
	bins, remove, err := testhelp.BuildBinaries("github.com/csiagent/csiagent/internal/testplugin")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(remove)
	bin := bins[0]

	t.Run("identity and node, launch recorded", func(t *testing.T) {
		t.Parallel()
		p := start(t, bin, "", []string{"MESOS_AGENT_ID=agent-7", "TESTPLUGIN_FOO=bar", "OTHER=hidden"},
			"--name", "my.plugin", "--controller", "extra-arg")
		p.waitServing(t)
		ctx := rpcCtx(t, rpcTimeout)
		id := csi.NewIdentityClient(p.conn)
		info, err := id.GetPluginInfo(ctx, &csi.GetPluginInfoRequest{})
		if err != nil || info.GetName() != "my.plugin" || info.GetVendorVersion() != "0.0.1" {
			t.Errorf("GetPluginInfo = %v, %v; want my.plugin 0.0.1", info, err)
		}
		caps, err := id.GetPluginCapabilities(ctx, &csi.GetPluginCapabilitiesRequest{})
		if err != nil || len(caps.GetCapabilities()) != 1 ||
			caps.GetCapabilities()[0].GetService().GetType() != csi.PluginCapability_Service_CONTROLLER_SERVICE {
			t.Errorf("GetPluginCapabilities = %v, %v; want CONTROLLER_SERVICE", caps, err)
		}
		if ready, code := probe(t, p); !ready || code != codes.OK {
			t.Errorf("Probe = %v, %v; want ready", ready, code)
		}
		node := csi.NewNodeClient(p.conn)
		ncaps, err := node.NodeGetCapabilities(ctx, &csi.NodeGetCapabilitiesRequest{})
		if err != nil || len(ncaps.GetCapabilities()) != 1 ||
			ncaps.GetCapabilities()[0].GetRpc().GetType() != csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME {
			t.Errorf("NodeGetCapabilities = %v, %v; want STAGE_UNSTAGE_VOLUME", ncaps, err)
		}
		ninfo, err := node.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
		if err != nil || ninfo.GetNodeId() != "agent-7" {
			t.Errorf("NodeGetInfo = %v, %v; want node id agent-7", ninfo, err)
		}
		if _, err := csi.NewControllerClient(p.conn).ControllerGetCapabilities(ctx, &csi.ControllerGetCapabilitiesRequest{}); err != nil {
			t.Errorf("ControllerGetCapabilities with --controller: %v", err)
		}
		_, err = node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "v"})
		if status.Code(err) != codes.Unimplemented {
			t.Errorf("NodeStageVolume without --data-dir = %v, want Unimplemented", err)
		}
		_, err = reclaimspace.NewReclaimSpaceNodeClient(p.conn).NodeReclaimSpace(ctx, &reclaimspace.NodeReclaimSpaceRequest{VolumeId: "v"})
		if status.Code(err) != codes.Unimplemented {
			t.Errorf("NodeReclaimSpace without --reclaim = %v, want Unimplemented", err)
		}
		p.terminate(t)

		var got self
		line, _, _ := strings.Cut(p.stdout.String(), "\n")
		if err := json.Unmarshal([]byte(line), &got); err != nil {
			t.Fatalf("stdout line %q: %v", line, err)
		}
		if want := []string{bin, "--name", "my.plugin", "--controller", "extra-arg"}; !slices.Equal(got.Argv, want) {
			t.Errorf("argv %q, want %q", got.Argv, want)
		}
		wantEnv := map[string]string{"CSI_ENDPOINT": "unix://" + p.socket, "MESOS_AGENT_ID": "agent-7", "TESTPLUGIN_FOO": "bar"}
		if fmt.Sprint(got.Env) != fmt.Sprint(wantEnv) {
			t.Errorf("env %v, want %v", got.Env, wantEnv)
		}
		if got.PID != p.cmd.Process.Pid || got.PPID != os.Getpid() || got.UID != os.Getuid() {
			t.Errorf("pid %d ppid %d uid %d, want %d %d %d", got.PID, got.PPID, got.UID, p.cmd.Process.Pid, os.Getpid(), os.Getuid())
		}
		stderr := p.stderr.String()
		for _, want := range []string{
			fmt.Sprintf("testplugin: serving on %s pid %d\n", p.socket, p.cmd.Process.Pid),
			"testplugin: rpc /csi.v1.Identity/Probe: OK\n",
			"testplugin: rpc /csi.v1.Node/NodeStageVolume: Unimplemented\n",
			"testplugin: terminated: stopping\n",
		} {
			if !strings.Contains(stderr, want) {
				t.Errorf("stderr lacks %q:\n%s", want, stderr)
			}
		}
	})

	t.Run("defaults, bare socket path", func(t *testing.T) {
		t.Parallel()
		socket := filepath.Join(t.TempDir(), "csi.sock")
		p := start(t, bin, socket, []string{"CSI_ENDPOINT=" + socket})
		p.waitServing(t)
		ctx := rpcCtx(t, rpcTimeout)
		info, err := csi.NewIdentityClient(p.conn).GetPluginInfo(ctx, &csi.GetPluginInfoRequest{})
		if err != nil || info.GetName() != "test.csi.csiagent.io" {
			t.Errorf("GetPluginInfo = %v, %v; want test.csi.csiagent.io", info, err)
		}
		caps, err := csi.NewIdentityClient(p.conn).GetPluginCapabilities(ctx, &csi.GetPluginCapabilitiesRequest{})
		if err != nil || len(caps.GetCapabilities()) != 0 {
			t.Errorf("GetPluginCapabilities = %v, %v; want none", caps, err)
		}
		ninfo, err := csi.NewNodeClient(p.conn).NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
		if err != nil || ninfo.GetNodeId() != "test-node" {
			t.Errorf("NodeGetInfo = %v, %v; want test-node", ninfo, err)
		}
		_, err = csi.NewControllerClient(p.conn).ControllerGetCapabilities(ctx, &csi.ControllerGetCapabilitiesRequest{})
		if status.Code(err) != codes.Unimplemented {
			t.Errorf("ControllerGetCapabilities without --controller = %v, want Unimplemented", err)
		}
		p.terminate(t)
	})

	t.Run("probe not ready", func(t *testing.T) {
		t.Parallel()
		p := start(t, bin, "", nil, "--probe-not-ready", "2")
		p.waitServing(t)
		var got []bool
		for range 4 {
			ready, code := probe(t, p)
			if code != codes.OK {
				t.Fatalf("Probe: %v", code)
			}
			got = append(got, ready)
		}
		if want := []bool{false, false, true, true}; !slices.Equal(got, want) {
			t.Errorf("ready %v, want %v", got, want)
		}
		p.terminate(t)
	})

	t.Run("probe fail", func(t *testing.T) {
		t.Parallel()
		p := start(t, bin, "", nil, "--probe-fail")
		p.waitServing(t)
		if _, code := probe(t, p); code != codes.Unavailable {
			t.Errorf("Probe code %v, want Unavailable", code)
		}
		p.terminate(t)
	})

	t.Run("probe fail file", func(t *testing.T) {
		t.Parallel()
		flag := filepath.Join(t.TempDir(), "unhealthy")
		p := start(t, bin, "", nil, "--probe-fail-file", flag)
		p.waitServing(t)
		for _, step := range []struct {
			exists bool
			code   codes.Code
		}{{false, codes.OK}, {true, codes.Unavailable}, {false, codes.OK}, {true, codes.Unavailable}} {
			if step.exists {
				if err := os.WriteFile(flag, nil, 0o644); err != nil {
					t.Fatal(err)
				}
			} else if err := os.Remove(flag); err != nil && !errors.Is(err, fs.ErrNotExist) {
				t.Fatal(err)
			}
			if ready, code := probe(t, p); code != step.code || code == codes.OK && !ready {
				t.Errorf("file exists %v: Probe = %v, %v; want %v", step.exists, ready, code, step.code)
			}
		}
		p.terminate(t)
	})

	t.Run("probe hang, SIGTERM with a call in flight", func(t *testing.T) {
		t.Parallel()
		p := start(t, bin, "", nil, "--probe-hang")
		p.waitServing(t)
		id := csi.NewIdentityClient(p.conn)
		if _, err := id.Probe(rpcCtx(t, hangTimeout), &csi.ProbeRequest{}); status.Code(err) != codes.DeadlineExceeded {
			t.Errorf("Probe = %v, want DeadlineExceeded", err)
		}
		// A call that hangs until the plugin stops: SIGTERM must still
		// end the plugin promptly, failing the call with Unavailable.
		hung := make(chan error, 1)
		go func() {
			_, err := id.Probe(rpcCtx(t, exitTimeout), &csi.ProbeRequest{})
			hung <- err
		}()
		waitFor(t, p, "testplugin: hanging (--probe-hang)", 2)
		p.terminate(t)
		if err := <-hung; status.Code(err) != codes.Unavailable {
			t.Errorf("hung Probe after SIGTERM = %v, want Unavailable", err)
		}
	})

	t.Run("hang info", func(t *testing.T) {
		t.Parallel()
		p := start(t, bin, "", nil, "--hang-info")
		p.waitServing(t)
		_, err := csi.NewIdentityClient(p.conn).GetPluginInfo(rpcCtx(t, hangTimeout), &csi.GetPluginInfoRequest{})
		if status.Code(err) != codes.DeadlineExceeded {
			t.Errorf("GetPluginInfo = %v, want DeadlineExceeded", err)
		}
		if ready, code := probe(t, p); !ready || code != codes.OK {
			t.Errorf("Probe = %v, %v; want ready", ready, code)
		}
		p.terminate(t)
	})

	t.Run("exit immediately", func(t *testing.T) {
		t.Parallel()
		p := start(t, bin, "", []string{"TESTPLUGIN_RUN=1"}, "--exit-immediately")
		if code := p.wait(t); code != 3 {
			t.Errorf("exit status %d, want 3", code)
		}
		if !strings.Contains(p.stdout.String(), `"TESTPLUGIN_RUN":"1"`) {
			t.Errorf("stdout %q lacks the start line", p.stdout.String())
		}
		if _, err := os.Lstat(p.socket); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("socket: %v, want none", err)
		}
	})

	t.Run("crash after, stale socket replaced", func(t *testing.T) {
		t.Parallel()
		p := start(t, bin, "", nil, "--crash-after", "300ms")
		p.waitServing(t)
		if code := p.wait(t); code != 3 {
			t.Errorf("exit status %d, want 3", code)
		}
		if st, err := os.Lstat(p.socket); err != nil || st.Mode().Type() != fs.ModeSocket {
			t.Fatalf("socket after the crash: %v, %v; want a stale socket", st, err)
		}
		q := start(t, bin, p.socket, nil)
		q.waitServing(t)
		q.terminate(t)
	})

	t.Run("start delay", func(t *testing.T) {
		t.Parallel()
		const delay = 300 * time.Millisecond
		began := time.Now()
		p := start(t, bin, "", nil, "--start-delay", delay.String())
		p.waitServing(t)
		if took := time.Since(began); took < delay {
			t.Errorf("serving after %v, before the %v start delay", took, delay)
		}
		p.terminate(t)
	})

	t.Run("SIGTERM during the start delay", func(t *testing.T) {
		t.Parallel()
		p := start(t, bin, "", nil, "--start-delay", "1h")
		waitFor(t, p, "testplugin: waiting 1h0m0s before listening (--start-delay)", 1)
		p.terminate(t)
	})

	t.Run("reclaim", func(t *testing.T) {
		t.Parallel()
		p := start(t, bin, "", nil, "--reclaim")
		p.waitServing(t)
		rs := reclaimspace.NewReclaimSpaceNodeClient(p.conn)
		resp, err := rs.NodeReclaimSpace(rpcCtx(t, rpcTimeout), &reclaimspace.NodeReclaimSpaceRequest{VolumeId: "v", VolumePath: "/x"})
		if err != nil || resp.GetPreUsage().GetUsageBytes() != 1<<20 || resp.GetPostUsage() == nil || resp.GetPostUsage().GetUsageBytes() != 0 {
			t.Errorf("NodeReclaimSpace = %v, %v; want pre 1048576 post 0", resp, err)
		}
		_, err = rs.NodeReclaimSpace(rpcCtx(t, rpcTimeout), &reclaimspace.NodeReclaimSpaceRequest{})
		if status.Code(err) != codes.InvalidArgument {
			t.Errorf("NodeReclaimSpace without volume_id = %v, want InvalidArgument", err)
		}
		p.terminate(t)
	})

	t.Run("usage errors", func(t *testing.T) {
		t.Parallel()
		dir := t.TempDir()
		notSocket := filepath.Join(dir, "file")
		if err := os.WriteFile(notSocket, []byte("keep"), 0o644); err != nil {
			t.Fatal(err)
		}
		for _, c := range []struct {
			name string
			env  []string
			args []string
		}{
			{"no endpoint", []string{"CSI_ENDPOINT="}, nil},
			{"tcp endpoint", []string{"CSI_ENDPOINT=tcp://127.0.0.1:1"}, nil},
			{"unknown flag", nil, []string{"--no-such-flag"}},
			{"negative count", nil, []string{"--probe-not-ready", "-1"}},
			{"secret without a value", nil, []string{"--require-stage-secret", "key"}},
			{"secret given twice", nil, []string{"--require-publish-secret", "k=1", "--require-publish-secret", "k=2"}},
			{"not a socket in the way", []string{"CSI_ENDPOINT=unix://" + notSocket}, nil},
		} {
			t.Run(c.name, func(t *testing.T) {
				p := start(t, bin, "", c.env, c.args...)
				if code := p.wait(t); code != 2 {
					t.Errorf("exit status %d, want 2\nstderr:\n%s", code, p.stderr.String())
				}
			})
		}
		if b, err := os.ReadFile(notSocket); err != nil || string(b) != "keep" {
			t.Errorf("file in the socket's place: %q, %v; want it untouched", b, err)
		}
	})

	t.Run("node volumes with --data-dir", func(t *testing.T) {
		testhelp.NeedRoot(t)
		t.Parallel()
		testNodeVolumes(t, bin)
	})

	t.Run("lie publish", func(t *testing.T) {
		t.Parallel()
		testLiePublish(t, bin)
	})

	for name, test := range map[string]func(*testing.T, string){
		"required secrets": testSecrets,
		"fail files":       testFailFiles,
		"targets":          testTargets,
		"block volumes":    testBlock,
	} {
		t.Run(name, func(t *testing.T) {
			testhelp.NeedRoot(t)
			t.Parallel()
			test(t, bin)
		})
	}

	t.Run("help", func(t *testing.T) {
		t.Parallel()
		p := start(t, bin, "", nil, "--help")
		if code := p.wait(t); code != 0 {
			t.Errorf("exit status %d, want 0", code)
		}
		for _, flag := range []string{"-start-delay", "-crash-after", "-exit-immediately", "-probe-not-ready", "-probe-fail", "-probe-hang", "-probe-fail-file", "-hang-info", "-reclaim", "-controller", "-name", "-data-dir",
			"-require-stage-secret", "-require-publish-secret", "-fail-stage-file", "-fail-publish-file", "-lie-publish"} {
			if !strings.Contains(p.stderr.String(), flag) {
				t.Errorf("--help does not document %s", flag)
			}
		}
	})
}

// waitFor waits until the plugin's stderr holds line at least n times: the
// plugin logs each RPC as it starts, so this is how a test knows a call has
// arrived. Polling the buffer is bounded by exitTimeout.
func waitFor(t *testing.T, p *proc, line string, n int) {
	t.Helper()
	deadline := time.Now().Add(exitTimeout)
	for strings.Count(p.stderr.String(), line) < n {
		if time.Now().After(deadline) {
			t.Fatalf("stderr has not shown %q %d times within %v:\n%s", line, n, exitTimeout, p.stderr.String())
		}
		select {
		case <-p.exited:
			t.Fatalf("plugin exited:\n%s", p.stderr.String())
		case <-time.After(5 * time.Millisecond):
		}
	}
}

func testNodeVolumes(t *testing.T, bin string) {
	dir := t.TempDir()
	data := filepath.Join(dir, "data")
	staging := filepath.Join(dir, "mounts", "staging")
	target := filepath.Join(dir, "mounts", "target")
	roTarget := filepath.Join(dir, "mounts", "ro")
	if err := os.MkdirAll(staging, 0o750); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Runs before t.TempDir's removal: never leave mounts behind.
		for _, m := range []string{roTarget, target, staging} {
			_ = unix.Unmount(m, unix.MNT_DETACH)
		}
	})
	p := start(t, bin, "", nil, "--data-dir", data)
	p.waitServing(t)
	node := csi.NewNodeClient(p.conn)
	ctx := rpcCtx(t, rpcTimeout)
	const id = "pool/vol-1" // escaped to one directory name
	capability := &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
	mustOK := func(what string, err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	mounted := func(path string) bool {
		t.Helper()
		ok, err := mountinfo.Mounted(path)
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			t.Fatal(err)
		}
		return ok
	}

	for _, c := range []struct {
		name string
		req  *csi.NodeStageVolumeRequest
	}{
		{"no staging path", &csi.NodeStageVolumeRequest{VolumeId: id, VolumeCapability: capability}},
		{"no capability", &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging}},
		{"no volume id", &csi.NodeStageVolumeRequest{StagingTargetPath: staging, VolumeCapability: capability}},
		{"dot-dot volume id", &csi.NodeStageVolumeRequest{VolumeId: "..", StagingTargetPath: staging, VolumeCapability: capability}},
	} {
		if _, err := node.NodeStageVolume(ctx, c.req); status.Code(err) != codes.InvalidArgument {
			t.Errorf("NodeStageVolume, %s = %v, want InvalidArgument", c.name, err)
		}
	}

	for range 2 { // the second call finds it done
		_, err := node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: capability})
		mustOK("NodeStageVolume", err)
		_, err = node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, TargetPath: target, VolumeCapability: capability})
		mustOK("NodePublishVolume", err)
		_, err = node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: id, StagingTargetPath: staging, TargetPath: roTarget, VolumeCapability: capability, Readonly: true})
		mustOK("NodePublishVolume read-only", err)
	}
	for _, path := range []string{staging, target, roTarget} {
		mounts, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(path))
		if err != nil {
			t.Fatal(err)
		}
		if len(mounts) != 1 {
			t.Errorf("%s is mounted %d times after two calls, want once", path, len(mounts))
		}
	}
	mustOK("write through the target", os.WriteFile(filepath.Join(target, "hello"), []byte("hi"), 0o644))
	if b, err := os.ReadFile(filepath.Join(data, "pool%2Fvol-1", "hello")); err != nil || string(b) != "hi" {
		t.Errorf("volume directory holds %q, %v; want what was written through the target", b, err)
	}
	if b, err := os.ReadFile(filepath.Join(roTarget, "hello")); err != nil || string(b) != "hi" {
		t.Errorf("read-only target holds %q, %v", b, err)
	}
	if err := os.WriteFile(filepath.Join(roTarget, "nope"), nil, 0o644); !errors.Is(err, unix.EROFS) {
		t.Errorf("write through the read-only target: %v, want EROFS", err)
	}

	for range 2 {
		for _, tp := range []string{target, roTarget} {
			_, err := node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: tp})
			mustOK("NodeUnpublishVolume", err)
		}
		_, err := node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
		mustOK("NodeUnstageVolume", err)
	}
	for _, path := range []string{target, roTarget} {
		if _, err := os.Lstat(path); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s after unpublish: %v, want removed", path, err)
		}
	}
	if mounted(staging) {
		t.Errorf("%s still mounted after unstage", staging)
	}
	p.terminate(t)
}
