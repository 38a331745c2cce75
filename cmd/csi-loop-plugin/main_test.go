package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/internal/loopdev"
	"github.com/csiagent/csiagent/internal/testhelp"
	"github.com/csiagent/csiagent/loopplugin"
	"github.com/csiagent/csiagent/proto/replication"
)

// pluginBin is the csi-loop-plugin binary built by TestMain: the tests run
// it as a real child process.
var pluginBin string

func TestMain(m *testing.M) {
	bins, remove, err := testhelp.BuildBinaries("github.com/csiagent/csiagent/cmd/csi-loop-plugin")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	pluginBin = bins[0]
	code := m.Run()
	remove()
	os.Exit(code)
}

// pluginReadyTimeout bounds the wait for a started plugin to log that it
// serves; it fails the test instead of hanging it.
const pluginReadyTimeout = 30 * time.Second

// plugin is a running csi-loop-plugin process.
type plugin struct {
	cmd     *exec.Cmd
	done    chan struct{} // closed when the process exited and its stderr is drained
	exitErr error         // set before done is closed
}

// startPlugin runs the binary and returns once it logged "serving" (it then
// listens). Its stderr goes to the test log. When the test ends, a process
// still running is killed and waited for.
func startPlugin(t *testing.T, args ...string) *plugin {
	t.Helper()
	cmd := exec.Command(pluginBin, args...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &plugin{cmd: cmd, done: make(chan struct{})}
	ready := make(chan struct{})
	pid := cmd.Process.Pid
	go func() {
		sc := bufio.NewScanner(stderr)
		signalled := false
		for sc.Scan() {
			t.Logf("plugin[%d]: %s", pid, sc.Text())
			if !signalled && strings.Contains(sc.Text(), "msg=serving") {
				close(ready)
				signalled = true
			}
		}
		p.exitErr = cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() { p.stop(syscall.SIGKILL) })
	select {
	case <-ready:
	case <-p.done:
		t.Fatalf("plugin exited before serving: %v", p.exitErr)
	case <-time.After(pluginReadyTimeout):
		t.Fatalf("plugin not serving after %v", pluginReadyTimeout)
	}
	return p
}

// stop sends sig unless the process has exited, waits for the exit and
// returns its error.
func (p *plugin) stop(sig syscall.Signal) error {
	select {
	case <-p.done:
	default:
		_ = p.cmd.Process.Signal(sig) // fails harmlessly if it just exited
		<-p.done
	}
	return p.exitErr
}

func connect(t *testing.T, sock string) (csi.NodeClient, csi.IdentityClient) {
	t.Helper()
	conn := dial(t, sock)
	return csi.NewNodeClient(conn), csi.NewIdentityClient(conn)
}

// dial is a connection to the plugin on sock, closed with the test.
func dial(t *testing.T, sock string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// controllerOf is a controller client of the plugin on sock.
func controllerOf(t *testing.T, sock string) csi.ControllerClient {
	t.Helper()
	return csi.NewControllerClient(dial(t, sock))
}

func runCLI(t *testing.T, args ...string) (string, error) {
	t.Helper()
	// A command that should end but serves instead is killed, not waited
	// for until go test's deadline.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, pluginBin, args...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	if stderr.Len() > 0 {
		t.Logf("%s: %s", strings.Join(args, " "), stderr.String())
	}
	return strings.TrimSpace(stdout.String()), err
}

// TestCLIVolumes: create-volume makes a sparse image of the given size,
// again with the same size succeeds, with another size fails;
// delete-volume removes it and is idempotent.
func TestCLIVolumes(t *testing.T) {
	pool := t.TempDir()
	for _, tc := range []struct {
		name    string
		args    []string
		wantErr bool
		check   func(t *testing.T)
	}{
		{name: "create", args: []string{"create-volume", "--pool", pool, "--name", "v1", "--size", "1GiB"}, check: func(t *testing.T) {
			var st unix.Stat_t
			if err := unix.Stat(filepath.Join(pool, "v1.img"), &st); err != nil {
				t.Fatal(err)
			}
			if st.Size != 1<<30 || st.Blocks != 0 {
				t.Errorf("image size %d, %d blocks; want 1 GiB, sparse", st.Size, st.Blocks)
			}
		}},
		{name: "create again, same size", args: []string{"create-volume", "--pool", pool, "--name", "v1", "--size", "1024MiB"}},
		{name: "create again, other size", args: []string{"create-volume", "--pool", pool, "--name", "v1", "--size", "2GiB"}, wantErr: true},
		{name: "bad name", args: []string{"create-volume", "--pool", pool, "--name", "../x", "--size", "1GiB"}, wantErr: true},
		{name: "bad size", args: []string{"create-volume", "--pool", pool, "--name", "v2", "--size", "lots"}, wantErr: true},
		{name: "missing pool", args: []string{"create-volume", "--name", "v2"}, wantErr: true},
		{name: "delete", args: []string{"delete-volume", "--pool", pool, "--name", "v1"}, check: func(t *testing.T) {
			if _, err := os.Stat(filepath.Join(pool, "v1.img")); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("image still there: %v", err)
			}
		}},
		{name: "delete again", args: []string{"delete-volume", "--pool", pool, "--name", "v1"}},
		{name: "version", args: []string{"--version"}},
		{name: "unknown flag", args: []string{"--bogus"}, wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, err := runCLI(t, tc.args...)
			if (err != nil) != tc.wantErr {
				t.Fatalf("err = %v, want error %v (stdout %q)", err, tc.wantErr, out)
			}
			if tc.check != nil {
				tc.check(t)
			}
		})
	}
}

// TestServeLifecycle: the plugin serves on a bare socket path given through
// CSI_ENDPOINT, refuses to take over a live plugin's socket, and on SIGTERM
// stops cleanly and removes its socket.
func TestServeLifecycle(t *testing.T) {
	dir := testhelp.LeakCheckedDir(t)
	sock := filepath.Join(dir, "sub", "csi.sock") // directory gets created
	pool := filepath.Join(dir, "pool")
	if err := os.Mkdir(pool, 0o700); err != nil {
		t.Fatal(err)
	}
	t.Setenv("CSI_ENDPOINT", sock)
	t.Setenv("MESOS_AGENT_ID", "agent-7")
	p := startPlugin(t, "--pool", pool, "--name", "test.loop.example")
	node, id := connect(t, sock)
	info, err := id.GetPluginInfo(context.Background(), &csi.GetPluginInfoRequest{})
	if err != nil || info.GetName() != "test.loop.example" || info.GetVendorVersion() != loopplugin.Version {
		t.Errorf("GetPluginInfo = %v, %v", info, err)
	}
	ni, err := node.NodeGetInfo(context.Background(), &csi.NodeGetInfoRequest{})
	if err != nil || ni.GetNodeId() != "agent-7" {
		t.Errorf("NodeGetInfo = %v, %v; want node id from MESOS_AGENT_ID", ni, err)
	}

	if out, err := runCLI(t, "--endpoint", "unix://"+sock, "--pool", pool); err == nil {
		t.Errorf("second plugin on a live socket started (%q)", out)
	}
	if err := p.stop(syscall.SIGTERM); err != nil {
		t.Errorf("exit after SIGTERM: %v", err)
	}
	if _, err := os.Lstat(sock); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket left after clean stop: %v", err)
	}
}

// TestKillBetweenStageAndPublish attaches (ControllerPublishVolume) and
// stages a volume, SIGKILLs the plugin, starts a new process on the same
// (now stale) socket and finishes the sequence: publish, write, unpublish,
// unstage, and again stage, publish, read the same data, then detach.
// Nothing of the volume's state lived only in the dead process.
func TestKillBetweenStageAndPublish(t *testing.T) {
	testhelp.NeedRoot(t)
	for _, tc := range []struct {
		name string
		cap  *csi.VolumeCapability
	}{
		{"mount", &csi.VolumeCapability{
			AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		}},
		{"block", &csi.VolumeCapability{
			AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := testhelp.LeakCheckedDir(t)
			pool, sock := filepath.Join(dir, "pool"), filepath.Join(dir, "csi.sock")
			staging, target := filepath.Join(dir, "staging"), filepath.Join(dir, "pods", "p", "vol")
			if err := os.Mkdir(pool, 0o700); err != nil {
				t.Fatal(err)
			}
			if out, err := runCLI(t, "create-volume", "--pool", pool, "--name", "vol", "--size", "64MiB"); err != nil || out != "vol" {
				t.Fatalf("create-volume: %q, %v", out, err)
			}
			args := []string{"--endpoint", "unix://" + sock, "--pool", pool, "--node-id", "n1"}
			ctx := context.Background()
			block := tc.cap.GetBlock() != nil
			stageReq := &csi.NodeStageVolumeRequest{VolumeId: "vol", StagingTargetPath: staging, VolumeCapability: tc.cap}
			publishReq := &csi.NodePublishVolumeRequest{VolumeId: "vol", StagingTargetPath: staging, TargetPath: target, VolumeCapability: tc.cap}
			unpublishReq := &csi.NodeUnpublishVolumeRequest{VolumeId: "vol", TargetPath: target}
			unstageReq := &csi.NodeUnstageVolumeRequest{VolumeId: "vol", StagingTargetPath: staging}

			first := startPlugin(t, args...)
			node, _ := connect(t, sock)
			attach, err := controllerOf(t, sock).ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: "vol", NodeId: "n1", VolumeCapability: tc.cap})
			if err != nil {
				t.Fatal(err)
			}
			stageReq.PublishContext = attach.GetPublishContext()
			if _, err := node.NodeStageVolume(ctx, stageReq); err != nil {
				t.Fatal(err)
			}
			if err := first.stop(syscall.SIGKILL); err == nil {
				t.Fatal("SIGKILLed plugin exited cleanly?")
			}
			if _, err := loopdev.Find(filepath.Join(pool, "vol.img")); err != nil {
				t.Fatalf("stage did not survive the plugin: %v", err)
			}

			startPlugin(t, args...) // removes the stale socket
			node, _ = connect(t, sock)
			if _, err := node.NodeStageVolume(ctx, stageReq); err != nil {
				t.Fatalf("stage again after restart: %v", err)
			}
			if _, err := node.NodePublishVolume(ctx, publishReq); err != nil {
				t.Fatal(err)
			}
			payload := make([]byte, 64<<10)
			rand.Read(payload)
			writeVolume(t, target, block, payload)
			for _, call := range []func() error{
				func() error { _, err := node.NodeUnpublishVolume(ctx, unpublishReq); return err },
				func() error { _, err := node.NodeUnstageVolume(ctx, unstageReq); return err },
			} {
				if err := call(); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := node.NodePublishVolume(ctx, publishReq); status.Code(err) != codes.FailedPrecondition {
				t.Fatalf("publish after unstage: %v, want FailedPrecondition", err)
			}
			if _, err := node.NodeStageVolume(ctx, stageReq); err != nil {
				t.Fatal(err)
			}
			if _, err := node.NodePublishVolume(ctx, publishReq); err != nil {
				t.Fatal(err)
			}
			if got := readVolume(t, target, block, len(payload)); !bytes.Equal(got, payload) {
				t.Error("data written after the restart did not come back")
			}
			if _, err := node.NodeUnpublishVolume(ctx, unpublishReq); err != nil {
				t.Fatal(err)
			}
			if _, err := node.NodeUnstageVolume(ctx, unstageReq); err != nil {
				t.Fatal(err)
			}
			if _, err := controllerOf(t, sock).ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: "vol", NodeId: "n1"}); err != nil {
				t.Fatal(err)
			}
			if _, err := runCLI(t, "delete-volume", "--pool", pool, "--name", "vol"); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func writeVolume(t *testing.T, target string, block bool, data []byte) {
	t.Helper()
	path, flag := filepath.Join(target, "data"), os.O_WRONLY|os.O_CREATE
	if block {
		path, flag = target, os.O_WRONLY
	}
	f, err := os.OpenFile(path, flag, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write(data); err != nil {
		t.Fatal(err)
	}
	if err := errors.Join(f.Sync(), f.Close()); err != nil {
		t.Fatal(err)
	}
}

func readVolume(t *testing.T, target string, block bool, n int) []byte {
	t.Helper()
	path := filepath.Join(target, "data")
	if block {
		path = target
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, n)
	if _, err := f.ReadAt(b, 0); err != nil {
		t.Fatal(err)
	}
	return b
}

// TestServeReplicaPool: with --replica-pool the served plugin advertises
// the group controller and replicates a volume into the replica pool;
// a replica pool that is not a directory is refused at start (one that
// does not exist yet is made).
func TestServeReplicaPool(t *testing.T) {
	dir := testhelp.LeakCheckedDir(t)
	pool, replica, sock := filepath.Join(dir, "pool"), filepath.Join(dir, "replica"), filepath.Join(dir, "csi.sock")
	for _, p := range []string{pool, replica} {
		if err := os.Mkdir(p, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	notDir := filepath.Join(dir, "file")
	if err := os.WriteFile(notDir, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := runCLI(t, "--endpoint", sock, "--pool", pool, "--replica-pool", notDir); err == nil {
		t.Error("started with a replica pool that is a file")
	}
	if out, err := runCLI(t, "create-volume", "--pool", pool, "--name", "rv", "--size", "8MiB"); err != nil {
		t.Fatalf("create-volume: %q, %v", out, err)
	}
	startPlugin(t, "--endpoint", "unix://"+sock, "--pool", pool, "--replica-pool", replica, "--node-id", "n1")
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx := context.Background()
	caps, err := csi.NewIdentityClient(conn).GetPluginCapabilities(ctx, &csi.GetPluginCapabilitiesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	group := false
	for _, c := range caps.GetCapabilities() {
		group = group || c.GetService().GetType() == csi.PluginCapability_Service_GROUP_CONTROLLER_SERVICE
	}
	if !group {
		t.Errorf("capabilities %v lack GROUP_CONTROLLER_SERVICE", caps)
	}
	r := replication.NewControllerClient(conn)
	src := &replication.ReplicationSource{Type: &replication.ReplicationSource_Volume{Volume: &replication.ReplicationSource_VolumeSource{VolumeId: "rv"}}}
	if _, err := r.EnableVolumeReplication(ctx, &replication.EnableVolumeReplicationRequest{ReplicationSource: src}); err != nil {
		t.Fatalf("EnableVolumeReplication: %v", err)
	}
	if fi, err := os.Stat(filepath.Join(replica, "rv.img")); err != nil || fi.Size() != 8<<20 {
		t.Errorf("replica image: %v, %v", fi, err)
	}
	info, err := r.GetVolumeReplicationInfo(ctx, &replication.GetVolumeReplicationInfoRequest{ReplicationSource: src})
	if err != nil || info.GetLastSyncTime() == nil {
		t.Errorf("GetVolumeReplicationInfo = %v, %v", info, err)
	}
}
