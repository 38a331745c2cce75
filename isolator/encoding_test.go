package isolator

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/csiagent/csiagent/internal/atomicfile"
	statev1 "github.com/csiagent/csiagent/proto/state/v1"
)

// Records written by earlier releases (JSON payloads in the record
// format) load as they were; new writes are binary.
func TestLoadsJSONRecordsOfEarlierReleases(t *testing.T) {
	work := t.TempDir()
	c, err := atomicfile.New(work)
	if err != nil {
		t.Fatal(err)
	}
	vdir := filepath.Join(work, "csi", "loop", "default", "volumes", "vol-1")
	cdir := filepath.Join(work, "isolators", "volume", "csi", "c1")
	put := func(dir, name string, m proto.Message) {
		t.Helper()
		b, err := protojson.MarshalOptions{UseProtoNames: true, Multiline: true}.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		if err := c.MkdirAll(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Put(filepath.Join(dir, name), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	put(vdir, volumeStateFile, &statev1.VolumeCheckpoint{State: stPublished, PluginName: "loop", Users: []string{"c1"}, StagingPath: "/s", TargetPath: "/t", BootId: "b"})
	put(cdir, containerStateFile, &statev1.ContainerCheckpoint{ContainerId: "c1", Phase: statev1.ContainerCheckpoint_PREPARED})
	if err := c.Checkpoint(context.Background()); err != nil {
		t.Fatal(err)
	}
	iso, err := newTestIsolator(t, Config{WorkDir: work, Plugins: fakePlugins{}, BootID: "b"})
	if err != nil {
		t.Fatal(err)
	}
	v := iso.volumes[volumeKey{"loop", "vol-1"}]
	if v == nil || v.cp.GetState() != stPublished || v.cp.GetUsers()[0] != "c1" {
		t.Fatalf("volume not loaded as written: %v", v)
	}
	if ct := iso.containers["c1"]; ct == nil || ct.cp.GetPhase() != statev1.ContainerCheckpoint_PREPARED {
		t.Fatalf("container not loaded as written: %v", ct)
	}
	if err := iso.updateVolume(v, func(cp *statev1.VolumeCheckpoint) { cp.LastError = "x" }); err != nil {
		t.Fatal(err)
	}
	b, _, err := atomicfile.ReadRecord(work, filepath.Join(vdir, volumeStateFile))
	if err != nil || strings.HasPrefix(string(b), "{") {
		t.Fatalf("the update is not binary: %q, %v", b, err)
	}
}

// tenVolumeContainer is a container record with ten volumes; long: ids
// and paths as Docker and ceph-csi make them, else as benchmark 2 does.
func tenVolumeContainer(long bool) *statev1.ContainerCheckpoint {
	cid, sandbox, plugin, idFormat := "ctr-17", "/tmp/sandboxes/ctr-17", "fast.csiagent.io", "v-17-%d"
	if long {
		cid = strings.Repeat("c", 64)
		sandbox = "/var/lib/docker/overlay2/" + strings.Repeat("l", 64) + "/merged"
		plugin, idFormat = "rbd.csi.ceph.com", "pvc-"+strings.Repeat("0", 32)+"-%d"
	}
	req := &statev1.PrepareRequest{ContainerId: cid, Sandbox: sandbox}
	cp := &statev1.ContainerCheckpoint{ContainerId: cid, Phase: statev1.ContainerCheckpoint_PREPARED, Request: req}
	for i := range 10 {
		id := fmt.Sprintf(idFormat, i)
		target := filepath.Join("/var/lib/csiagent/csi", plugin, "default/mounts", id, "target")
		req.Volumes = append(req.Volumes, &statev1.Volume{
			ContainerPath: fmt.Sprintf("/data/vol%d", i), Mode: statev1.Volume_RW,
			Source: &statev1.Volume_Source{Type: statev1.Volume_Source_CSI_VOLUME, CsiVolume: &statev1.CSIVolume{
				PluginName: plugin,
				StaticProvisioning: &statev1.StaticProvisioning{VolumeId: id,
					VolumeCapability: &csi.VolumeCapability{
						AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"}},
						AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}}},
			}},
		})
		cp.Mounts = append(cp.Mounts, &statev1.ContainerMount{PluginName: plugin, VolumeId: id, ContainerPath: fmt.Sprintf("/data/vol%d", i),
			HostPath: target, MountPoint: filepath.Join(sandbox, fmt.Sprintf("data/vol%d", i)), MountId: 1234, UniqueMountId: 1 << 40})
	}
	return cp
}

// A container with ten volumes takes its new versions in place, in a
// slot of its record file: as benchmark 2 makes them (2.3 KB) and with
// ids and paths as Docker and ceph-csi make them (4.2 KB, more than the
// 4 KiB slots every record file had, so each of its writes replaced the
// file whole, with two fsyncs). Its binary record is under half its JSON.
func TestTenVolumeContainerRecordSize(t *testing.T) {
	for _, long := range []bool{false, true} {
		cp := tenVolumeContainer(long)
		j, _ := protojson.MarshalOptions{UseProtoNames: true, Multiline: true}.Marshal(cp)
		work := t.TempDir()
		c, err := atomicfile.New(work)
		if err != nil {
			t.Fatal(err)
		}
		path := filepath.Join(work, containerStateFile)
		var inode uint64
		for i := range 4 {
			cp.Mounts[i].MountId++ // a mount made again
			b, err := encodeCheckpoint(cp)
			if err != nil {
				t.Fatal(err)
			}
			if 2*len(b) > len(j) {
				t.Errorf("binary %d bytes, JSON %d: not half", len(b), len(j))
			}
			n, err := c.Put(path, b, 0o600)
			if err == nil {
				err = c.Wait(context.Background(), n)
			}
			if err != nil {
				t.Fatal(err)
			}
			var st unix.Stat_t
			if err := unix.Stat(path, &st); err != nil {
				t.Fatal(err)
			}
			switch {
			case i == 0:
				inode = st.Ino
				t.Logf("ten volumes, long ids %v: %d bytes (JSON: %d)", long, len(b), len(j))
			case st.Ino != inode:
				t.Errorf("ten volumes, long ids %v: version %d replaced the record file (%d bytes)", long, i+1, len(b))
			}
		}
	}
}

// A checkpoint holding a frame's magic (a string an API caller chose) is
// written as JSON, which cannot carry a frame's header, and reads back
// as written.
func TestCheckpointWithFrameMagicIsJSON(t *testing.T) {
	cp := tenVolumeContainer(false)
	cp.Request.Volumes[3].Source.CsiVolume.StaticProvisioning.VolumeContext = map[string]string{"k": "CSR2\x00\x01\x00\x00forged"}
	b, err := encodeCheckpoint(cp)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(string(b), "{") || strings.ContainsRune(string(b), 0) {
		t.Fatalf("encoded as %q, want JSON without NUL", b)
	}
	got := &statev1.ContainerCheckpoint{}
	if err := decodeCheckpoint(b, got); err != nil || !proto.Equal(got, cp) {
		t.Fatalf("read back %v (%v), want %v", got, err, cp)
	}
	plain, err := encodeCheckpoint(tenVolumeContainer(false))
	if err != nil || strings.HasPrefix(string(plain), "{") {
		t.Fatalf("a checkpoint without the magic: %q, %v; want binary", plain, err)
	}
}

// A container id of 123 bytes encodes as 0x0a 0x7b ('{') ...: still
// binary, never JSON (it was read as JSON and the container quarantined).
func TestDecodeCheckpointIDOf123Bytes(t *testing.T) {
	for _, n := range []int{10, 123, 128} {
		cp := &statev1.ContainerCheckpoint{ContainerId: strings.Repeat("x", n), Phase: statev1.ContainerCheckpoint_PREPARED}
		b, err := encodeCheckpoint(cp)
		if err != nil {
			t.Fatal(err)
		}
		got := &statev1.ContainerCheckpoint{}
		if err := decodeCheckpoint(b, got); err != nil || !proto.Equal(got, cp) {
			t.Errorf("id of %d bytes: read back %v (%v)", n, got, err)
		}
	}
}
