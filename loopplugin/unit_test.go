package loopplugin

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Tests in this file need no root.

func TestValidateVolumeID(t *testing.T) {
	for _, tc := range []struct {
		id string
		ok bool
	}{
		{"vol-1", true},
		{"pvc-3f1b.data_01", true},
		{strings.Repeat("a", MaxVolumeIDLength), true},
		{strings.Repeat("a", MaxVolumeIDLength+1), false},
		{"", false},
		{"a/b", false},
		{"..", false},
		{"a..b", false},
		{".hidden", false},
		{"tab\there", false},
		{"nul\x00", false},
	} {
		t.Run(fmt.Sprintf("%q", tc.id), func(t *testing.T) {
			err := ValidateVolumeID(tc.id)
			if (err == nil) != tc.ok {
				t.Fatalf("err = %v, want ok=%v", err, tc.ok)
			}
			if err != nil && !errors.Is(err, ErrInvalid) {
				t.Fatalf("err = %v, want ErrInvalid", err)
			}
		})
	}
}

func TestParseEndpoint(t *testing.T) {
	for _, tc := range []struct {
		in, want string
	}{
		{"unix:///run/csi/csi.sock", "/run/csi/csi.sock"},
		{"unix:/run/csi.sock", "/run/csi.sock"},
		{"unix://rel/csi.sock", "rel/csi.sock"},
		{"/run/csi//csi.sock", "/run/csi/csi.sock"},
		{"csi.sock", "csi.sock"},
		{"tcp://127.0.0.1:10000", ""},
		{"unix://", ""},
		{"", ""},
	} {
		t.Run(tc.in, func(t *testing.T) {
			got, err := ParseEndpoint(tc.in)
			if tc.want == "" {
				if err == nil {
					t.Fatalf("ParseEndpoint = %q, want error", got)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("ParseEndpoint = %q, %v; want %q", got, err, tc.want)
			}
		})
	}
}

func TestVolumeSize(t *testing.T) {
	for _, tc := range []struct {
		name     string
		req, lim int64
		want     int64
		wantErr  error
	}{
		{name: "default", want: defaultVolumeSize},
		{name: "default capped by limit", lim: 100 << 20, want: 100 << 20},
		{name: "rounded to MiB", req: 10<<20 + 1, want: 11 << 20},
		{name: "rounded to 4K under a tight limit", req: 10<<20 + 1, lim: 10<<20 + 4096, want: 10<<20 + 4096},
		{name: "exact", req: 64 << 20, lim: 64 << 20, want: 64 << 20},
		{name: "no sector fits", req: 1000, lim: 1010, wantErr: ErrOutOfRange},
		{name: "required above limit", req: 2, lim: 1, wantErr: ErrInvalid},
		{name: "negative", req: -1, wantErr: ErrInvalid},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := volumeSize(&csi.CapacityRange{RequiredBytes: tc.req, LimitBytes: tc.lim})
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) {
					t.Fatalf("err = %v, want %v", err, tc.wantErr)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("volumeSize = %d, %v; want %d", got, err, tc.want)
			}
		})
	}
}

func TestToStatus(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want codes.Code
	}{
		{invalidf("x"), codes.InvalidArgument},
		{fmt.Errorf("outer: %w", notFoundf("x")), codes.NotFound},
		{incompatiblef("x"), codes.AlreadyExists},
		{preconditionf("x"), codes.FailedPrecondition},
		{fmt.Errorf("%w: x", ErrBusy), codes.Aborted},
		{invalidTokenf("x"), codes.Aborted},
		{outOfRangef("x"), codes.OutOfRange},
		{fmt.Errorf("%w", ErrNoSpace), codes.ResourceExhausted},
		{fmt.Errorf("wait: %w", context.DeadlineExceeded), codes.DeadlineExceeded},
		{fmt.Errorf("wait: %w", context.Canceled), codes.Canceled},
		{errors.New("disk on fire"), codes.Internal},
		{status.Error(codes.Unavailable, "x"), codes.Unavailable},
	} {
		t.Run(tc.err.Error(), func(t *testing.T) {
			got := toStatus(tc.err)
			if status.Code(got) != tc.want {
				t.Fatalf("code = %s, want %s", status.Code(got), tc.want)
			}
		})
	}
	if toStatus(nil) != nil {
		t.Fatal("toStatus(nil) != nil")
	}
}

func TestVolumeLocks(t *testing.T) {
	l := newVolumeLocks()
	unlock, err := l.lock(context.Background(), "a")
	if err != nil {
		t.Fatal(err)
	}
	t.Run("try on held lock is busy", func(t *testing.T) {
		if _, err := l.tryLock("a"); !errors.Is(err, ErrBusy) {
			t.Fatalf("err = %v, want ErrBusy", err)
		}
	})
	t.Run("waiter whose context ends gets its error", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		errc := make(chan error, 1)
		go func() {
			_, err := l.lock(ctx, "a")
			errc <- err
		}()
		cancel()
		if err := <-errc; !errors.Is(err, context.Canceled) {
			t.Fatalf("err = %v, want context.Canceled", err)
		}
	})
	t.Run("other volume is free", func(t *testing.T) {
		u, err := l.tryLock("b")
		if err != nil {
			t.Fatal(err)
		}
		u()
	})
	t.Run("waiter gets the lock on release", func(t *testing.T) {
		got := make(chan func(), 1)
		go func() {
			u, err := l.lock(context.Background(), "a")
			if err != nil {
				t.Error(err)
			}
			got <- u
		}()
		unlock()
		(<-got)()
	})
	t.Run("mutual exclusion", func(t *testing.T) {
		var wg sync.WaitGroup
		n := 0
		for range 50 {
			wg.Go(func() {
				u, err := l.lock(context.Background(), "c")
				if err != nil {
					t.Error(err)
					return
				}
				n++ // the race detector flags this if the lock leaks
				u()
			})
		}
		wg.Wait()
		if n != 50 {
			t.Fatalf("n = %d", n)
		}
	})
	for _, id := range []string{"a", "b", "c"} {
		u, err := l.tryLock(id)
		if err != nil {
			t.Fatalf("%s left held: %v", id, err)
		}
		u()
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := l.lock(ctx, "free"); !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), "volume free") {
		t.Fatalf("an ended context on a free lock: err = %v, want context.Canceled naming the volume", err)
	}
}

func TestPool(t *testing.T) {
	dir := t.TempDir()
	p, err := OpenPool(dir)
	if err != nil {
		t.Fatal(err)
	}
	v, created, err := p.Create("v1", 256<<20)
	if err != nil || !created || v.Size != 256<<20 {
		t.Fatalf("Create = %+v, %v, %v", v, created, err)
	}
	var st unix.Stat_t
	if err := unix.Stat(v.Path, &st); err != nil || st.Blocks != 0 || st.Size != 256<<20 {
		t.Fatalf("image not sparse: %v, %d blocks, size %d", err, st.Blocks, st.Size)
	}
	if _, created, err := p.Create("v1", 1<<20); err != nil || created {
		t.Fatalf("second Create: created=%v, %v", created, err)
	}
	if _, err := p.CreateExact("v1", 1<<20); !errors.Is(err, ErrIncompatible) {
		t.Fatalf("CreateExact other size: %v, want ErrIncompatible", err)
	}
	if v, err := p.CreateExact("v2", 1000); err != nil || v.Size != 1024 {
		t.Fatalf("CreateExact rounds to sectors: %+v, %v", v, err)
	}
	for _, junk := range []string{".v3.tmp-123", "notes.txt", "bad..name.img"} {
		if err := os.WriteFile(filepath.Join(dir, junk), nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Mkdir(filepath.Join(dir, "d.img"), 0o700); err != nil {
		t.Fatal(err)
	}
	vols, err := p.List()
	if err != nil || len(vols) != 2 || vols[0].ID != "v1" || vols[1].ID != "v2" {
		t.Fatalf("List = %+v, %v", vols, err)
	}
	if _, err := p.Get("nope"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Get unknown: %v", err)
	}
	if _, err := p.Get("../etc/passwd"); !errors.Is(err, ErrInvalid) {
		t.Fatalf("Get traversal: %v", err)
	}
	for range 2 {
		if err := p.Delete("v1"); err != nil {
			t.Fatal(err)
		}
	}
	if avail, err := p.Available(); err != nil || avail <= 0 {
		t.Fatalf("Available = %d, %v", avail, err)
	}
	if _, err := OpenPool(filepath.Join(dir, "notes.txt")); !errors.Is(err, ErrInvalid) {
		t.Fatalf("OpenPool on a file: %v", err)
	}
	// A pool that does not exist yet is made (before: "no such file or
	// directory", and the README's commands needed a mkdir -p first).
	fresh := filepath.Join(dir, "new", "pool")
	if p, err := OpenPool(fresh); err != nil || p.Dir() != fresh {
		t.Fatalf("OpenPool(%s) = %v, %v", fresh, p, err)
	}
	if fi, err := os.Stat(fresh); err != nil || !fi.IsDir() || fi.Mode().Perm() != 0o700 {
		t.Errorf("the new pool: %v, %v; want a 0700 directory", fi, err)
	}
}

// mkfs on a plain file needs no root; detectFS must name what it made.
func TestDetectFS(t *testing.T) {
	tl := findTools()
	for _, fs := range []string{"ext2", "ext3", "ext4", "xfs", ""} {
		t.Run(fs, func(t *testing.T) {
			img := filepath.Join(t.TempDir(), "img")
			if err := os.WriteFile(img, nil, 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Truncate(img, 320<<20); err != nil {
				t.Fatal(err)
			}
			if fs != "" {
				mkfs := tl.mkfs[fs]
				if mkfs == "" {
					t.Fatalf("mkfs.%s is not installed: make deps installs it", fs)
				}
				force := "-F" // mke2fs: a regular file is fine
				if fs == "xfs" {
					force = "-f"
				}
				if out, err := exec.Command(mkfs, "-q", force, img).CombinedOutput(); err != nil {
					t.Fatalf("%v: %s", err, out)
				}
			}
			f, err := os.Open(img)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			got, err := detectFS(f)
			if err != nil || got != fs {
				t.Fatalf("detectFS = %q, %v; want %q", got, err, fs)
			}
			data, err := hasData(img)
			if err != nil || data != (fs != "") {
				t.Fatalf("hasData = %v, %v", data, err)
			}
		})
	}
	for _, tc := range []struct {
		have, want string
		ok         bool
	}{
		{"ext2", "ext4", true}, {"ext3", "ext4", true}, {"ext4", "ext3", false},
		{"ext2", "ext3", true}, {"ext3", "ext2", false}, {"xfs", "ext4", false}, {"xfs", "xfs", true},
	} {
		if got := mountableAs(tc.have, tc.want); got != tc.ok {
			t.Errorf("mountableAs(%s, %s) = %v", tc.have, tc.want, got)
		}
	}
}

func TestListenUnix(t *testing.T) {
	dir := t.TempDir()
	t.Run("stale socket is replaced", func(t *testing.T) {
		sock := filepath.Join(dir, "stale.sock")
		l, err := net.Listen("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		l.(*net.UnixListener).SetUnlinkOnClose(false)
		l.Close() // leaves the file, like a killed plugin
		l2, err := listenUnix(sock)
		if err != nil {
			t.Fatal(err)
		}
		l2.Close()
	})
	t.Run("live socket is not taken", func(t *testing.T) {
		sock := filepath.Join(dir, "live.sock")
		l, err := net.Listen("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		if l2, err := listenUnix(sock); err == nil {
			l2.Close()
			t.Fatal("took over a live socket")
		}
	})
	t.Run("non-socket is not removed", func(t *testing.T) {
		f := filepath.Join(dir, "file")
		if err := os.WriteFile(f, []byte("keep"), 0o600); err != nil {
			t.Fatal(err)
		}
		if _, err := listenUnix(f); err == nil {
			t.Fatal("listened over a regular file")
		}
		if b, _ := os.ReadFile(f); string(b) != "keep" {
			t.Fatal("file clobbered")
		}
	})
}

// TestControllerAndErrorCodes drives the services over gRPC through paths
// that need no root: every error is a status with the CSI code.
func TestControllerAndErrorCodes(t *testing.T) {
	e := newEnv(t, slog.LevelError)
	ctx := context.Background()
	c := mountCap("", snw)

	info, err := e.id.GetPluginInfo(ctx, &csi.GetPluginInfoRequest{})
	if err != nil || info.GetName() != DefaultName || info.GetVendorVersion() != Version {
		t.Fatalf("GetPluginInfo = %v, %v", info, err)
	}
	if pr, err := e.id.Probe(ctx, &csi.ProbeRequest{}); err != nil || !pr.GetReady().GetValue() {
		t.Fatalf("Probe = %v, %v", pr, err)
	}

	for i := range 5 {
		e.createVolume(t, fmt.Sprintf("v%d", i), 1<<20)
	}
	t.Run("ListVolumes pages", func(t *testing.T) {
		var ids []string
		tok := ""
		for {
			resp, err := e.ctrl.ListVolumes(ctx, &csi.ListVolumesRequest{MaxEntries: 2, StartingToken: tok})
			if err != nil {
				t.Fatal(err)
			}
			for _, en := range resp.GetEntries() {
				ids = append(ids, en.GetVolume().GetVolumeId())
			}
			if tok = resp.GetNextToken(); tok == "" {
				break
			}
		}
		if strings.Join(ids, ",") != "v0,v1,v2,v3,v4" {
			t.Fatalf("listed %v", ids)
		}
	})
	t.Run("GetCapacity", func(t *testing.T) {
		resp, err := e.ctrl.GetCapacity(ctx, &csi.GetCapacityRequest{VolumeCapabilities: []*csi.VolumeCapability{c}})
		if err != nil || resp.GetAvailableCapacity() <= 0 {
			t.Fatalf("GetCapacity = %v, %v", resp, err)
		}
		multi := mountCap("", csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)
		resp, err = e.ctrl.GetCapacity(ctx, &csi.GetCapacityRequest{VolumeCapabilities: []*csi.VolumeCapability{multi}})
		if err != nil || resp.GetAvailableCapacity() != 0 {
			t.Fatalf("GetCapacity for unsupported capability = %v, %v", resp, err)
		}
	})
	t.Run("ValidateVolumeCapabilities", func(t *testing.T) {
		resp, err := e.ctrl.ValidateVolumeCapabilities(ctx, &csi.ValidateVolumeCapabilitiesRequest{VolumeId: "v0", VolumeCapabilities: []*csi.VolumeCapability{c, blockCap(snw)}})
		if err != nil || resp.GetConfirmed() == nil {
			t.Fatalf("supported: %v, %v", resp, err)
		}
		for _, bad := range []*csi.VolumeCapability{
			mountCap("", csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY),
			mountCap("btrfs", snw),
			mountCap("", snw, "bind"),
		} {
			resp, err := e.ctrl.ValidateVolumeCapabilities(ctx, &csi.ValidateVolumeCapabilitiesRequest{VolumeId: "v0", VolumeCapabilities: []*csi.VolumeCapability{bad}})
			if err != nil || resp.GetConfirmed() != nil || resp.GetMessage() == "" {
				t.Errorf("unsupported %v: %v, %v", bad, resp, err)
			}
		}
	})

	for _, tc := range []struct {
		name string
		call func() error
		want codes.Code
	}{
		{"create: bad name", func() error {
			_, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "a/b", VolumeCapabilities: []*csi.VolumeCapability{c}})
			return err
		}, codes.InvalidArgument},
		{"create: multi-node", func() error {
			_, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "m", VolumeCapabilities: []*csi.VolumeCapability{
				mountCap("", csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)}})
			return err
		}, codes.InvalidArgument},
		{"create: existing, too small", func() error {
			_, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "v0", VolumeCapabilities: []*csi.VolumeCapability{c},
				CapacityRange: &csi.CapacityRange{RequiredBytes: 2 << 20}})
			return err
		}, codes.AlreadyExists},
		{"create: clone", func() error {
			resp, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "s", VolumeCapabilities: []*csi.VolumeCapability{c},
				VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: "v0"}}}})
			if err == nil && resp.GetVolume().GetContentSource().GetVolume().GetVolumeId() != "v0" {
				return fmt.Errorf("content source = %v", resp.GetVolume().GetContentSource())
			}
			return err
		}, codes.OK},
		{"create: clone of an unknown volume", func() error {
			_, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "s2", VolumeCapabilities: []*csi.VolumeCapability{c},
				VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: "ghost"}}}})
			return err
		}, codes.NotFound},
		{"create: empty content source", func() error {
			_, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "s2", VolumeCapabilities: []*csi.VolumeCapability{c},
				VolumeContentSource: &csi.VolumeContentSource{}})
			return err
		}, codes.InvalidArgument},
		{"create: existing blank volume as a clone", func() error {
			_, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "v0", VolumeCapabilities: []*csi.VolumeCapability{c},
				VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: "s"}}}})
			return err
		}, codes.AlreadyExists},
		{"delete: traversal", func() error {
			_, err := e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "../pool/v0"})
			return err
		}, codes.InvalidArgument},
		{"list: bad token", func() error {
			_, err := e.ctrl.ListVolumes(ctx, &csi.ListVolumesRequest{StartingToken: "99"})
			return err
		}, codes.Aborted},
		{"controller publish: not offered", func() error {
			_, err := e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: "v0"})
			return err
		}, codes.Unimplemented},
		{"stage: unknown volume", func() error {
			_, err := e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "nope", StagingTargetPath: e.dir + "/s", VolumeCapability: c})
			return err
		}, codes.NotFound},
		{"stage: relative staging path", func() error {
			_, err := e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "v0", StagingTargetPath: "rel", VolumeCapability: c})
			return err
		}, codes.InvalidArgument},
		{"stage: unknown fs type", func() error {
			_, err := e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "v0", StagingTargetPath: e.dir + "/s", VolumeCapability: mountCap("ntfs", snw)})
			return err
		}, codes.InvalidArgument},
		{"stage: no access type", func() error {
			_, err := e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "v0", StagingTargetPath: e.dir + "/s",
				VolumeCapability: &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: snw}}})
			return err
		}, codes.InvalidArgument},
		{"publish: before stage", func() error {
			_, err := e.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: "v0", StagingTargetPath: e.dir + "/s", TargetPath: e.dir + "/t", VolumeCapability: c})
			return err
		}, codes.FailedPrecondition},
		{"publish: no staging path", func() error {
			_, err := e.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: "v0", TargetPath: e.dir + "/t", VolumeCapability: c})
			return err
		}, codes.InvalidArgument},
		{"publish: unknown volume", func() error {
			_, err := e.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: "nope", StagingTargetPath: e.dir + "/s", TargetPath: e.dir + "/t", VolumeCapability: c})
			return err
		}, codes.NotFound},
		{"unpublish: unknown volume", func() error {
			_, err := e.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: "nope", TargetPath: e.dir + "/t"})
			return err
		}, codes.NotFound},
		{"unstage: unknown volume", func() error {
			_, err := e.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "nope", StagingTargetPath: e.dir + "/s"})
			return err
		}, codes.NotFound},
		{"unpublish: not published is done", func() error {
			_, err := e.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: "v0", TargetPath: e.dir + "/t"})
			return err
		}, codes.OK},
		{"unstage: not staged is done", func() error {
			_, err := e.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "v0", StagingTargetPath: e.dir + "/s"})
			return err
		}, codes.OK},
		{"stats: not staged", func() error {
			_, err := e.node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: "v0", VolumePath: e.dir})
			return err
		}, codes.NotFound},
		{"expand: no volume_path", func() error {
			_, err := e.node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: "v0"})
			return err
		}, codes.InvalidArgument},
		{"expand: not staged", func() error {
			_, err := e.node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: "v0", VolumePath: e.dir})
			return err
		}, codes.NotFound},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.call()
			if _, ok := status.FromError(err); !ok {
				t.Fatalf("not a status error: %v", err)
			}
			wantCode(t, err, tc.want)
		})
	}
}

// TestSharedPool: readers on many nodes only with --shared-pool, which
// needs --node-only; they are read-only (a read-only device, mounted ro).
func TestSharedPool(t *testing.T) {
	pool := t.TempDir()
	if _, err := New(Config{Pool: pool, NodeID: "n", SharedPool: true}); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "--node-only") {
		t.Fatalf("a shared pool in attach mode: %v, want ErrInvalid naming --node-only", err)
	}
	readers := mountCap("", csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY)
	local, err := New(Config{Pool: pool, NodeID: "n", NodeOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := local.parseCapability(readers); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "--shared-pool") {
		t.Fatalf("readers on a local pool: %v, want ErrInvalid naming --shared-pool", err)
	}
	shared, err := New(Config{Pool: pool, NodeID: "n", NodeOnly: true, SharedPool: true})
	if err != nil {
		t.Fatal(err)
	}
	acc, err := shared.parseCapability(readers)
	if err != nil || !acc.readOnlyMode() || !acc.sharedReaders() || !slices.Contains(acc.mountOptions(), "ro") {
		t.Fatalf("readers on a shared pool: %+v, %v; want read-only", acc, err)
	}
	if _, err := shared.parseCapability(mountCap("", csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)); !errors.Is(err, ErrInvalid) {
		t.Fatalf("many writers on a shared pool: %v, want ErrInvalid", err)
	}
}
