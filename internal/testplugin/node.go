package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/mount"
)

// The node calls below work only with --data-dir: a volume is the directory
// <data-dir>/<path-escaped volume id>, staging bind-mounts it on the staging
// path, and publishing bind-mounts the staging path on the target path for
// mount access, or the file <data-dir>/<path-escaped volume id>.blk on the
// target file for block access (read-only if asked). Repeated calls that
// are already done succeed. Unstage and unpublish unmount only this
// plugin's own mounts of the volume, and remove only the targets publishing
// created (recorded below targetsDir, so this holds across restarts).

const (
	// blockSize is the size of a new block volume's backing file, which
	// is sparse.
	blockSize = 16 << 20
	// targetsDir, below --data-dir, holds one file per target path that
	// NodePublishVolume created. '#' never occurs in an escaped volume
	// id, so no volume directory can have this name.
	targetsDir = "#targets"
)

// begin starts a node call on a volume: it checks that the plugin has
// --data-dir and that the volume id is set, takes the volume's lock
// without waiting, then checks the other arguments (argErrs: what their
// checks returned, in order) and returns the volume's directory. The
// caller releases the lock with unlock.
func (p *plugin) begin(method, volumeID string, argErrs ...error) (dir string, unlock func(), err error) {
	if p.cfg.dataDir == "" {
		return "", nil, status.Errorf(codes.Unimplemented, "%s needs --data-dir", method)
	}
	if volumeID == "" {
		return "", nil, status.Error(codes.InvalidArgument, "volume_id is required")
	}
	// A second concurrent operation is refused with the CSI code for
	// that (Aborted), not queued.
	unlock, ok := p.volumes.TryLock(volumeID)
	if !ok {
		return "", nil, status.Errorf(codes.Aborted, "an operation on volume %q is in progress", volumeID)
	}
	for _, err := range argErrs {
		if err != nil {
			unlock()
			return "", nil, err
		}
	}
	if dir, err = p.volumeDir(volumeID); err != nil {
		unlock()
		return "", nil, err
	}
	return dir, unlock, nil
}

// volumeDir is the volume's directory; its block backing file is the same
// path plus ".blk".
func (p *plugin) volumeDir(id string) (string, error) {
	name := url.PathEscape(id)
	if name == "." || name == ".." {
		return "", status.Errorf(codes.InvalidArgument, "volume_id %q is not a usable name", id)
	}
	return filepath.Join(p.cfg.dataDir, name), nil
}

// requirePaths checks that each named path is set and absolute.
func requirePaths(namesAndPaths ...string) error {
	for i := 0; i < len(namesAndPaths); i += 2 {
		name, path := namesAndPaths[i], namesAndPaths[i+1]
		if path == "" {
			return status.Errorf(codes.InvalidArgument, "%s is required", name)
		}
		if !filepath.IsAbs(path) {
			return status.Errorf(codes.InvalidArgument, "%s %q is not absolute", name, path)
		}
	}
	return nil
}

// requireCapability checks that a capability with an access type was
// given and reports whether it is block.
func requireCapability(c *csi.VolumeCapability) (block bool, err error) {
	switch {
	case c.GetBlock() != nil:
		return true, nil
	case c.GetMount() != nil:
		return false, nil
	case c == nil:
		return false, status.Error(codes.InvalidArgument, "volume_capability is required")
	default:
		return false, status.Error(codes.InvalidArgument, "volume_capability has neither mount nor block access")
	}
}

// failFromFile is the error --fail-stage-file or --fail-publish-file asks
// for: nil while the file does not exist, else the code named in it.
func failFromFile(path, flagName, method string) error {
	if path == "" {
		return nil
	}
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return status.Errorf(codes.Internal, "%s: read %s: %v", method, flagName, err)
	}
	code, ok := parseCode(string(b))
	if !ok {
		return status.Errorf(codes.Internal, "%s fails: %s holds %q, which is not a gRPC error code (%s)", method, path, b, flagName)
	}
	return status.Errorf(code, "%s fails with %v while %s exists (%s)", method, code, path, flagName)
}

// parseCode reads a gRPC error code: a name as codes.Code prints it
// ("Unavailable"), or as the gRPC spec writes it ("UNAVAILABLE",
// "DEADLINE_EXCEEDED"), any case, or a number; empty is Internal. OK is
// not an error code.
func parseCode(s string) (codes.Code, bool) {
	s = strings.TrimPrefix(strings.TrimSpace(s), "codes.")
	if s == "" {
		return codes.Internal, true
	}
	if n, err := strconv.ParseUint(s, 10, 32); err == nil {
		return codes.Code(n), n > 0 && n <= uint64(codes.Unauthenticated)
	}
	name := strings.ReplaceAll(s, "_", "")
	for c := codes.Canceled; c <= codes.Unauthenticated; c++ {
		if strings.EqualFold(c.String(), name) {
			return c, true
		}
	}
	return codes.Internal, false
}

// checkSecrets fails with Unauthenticated unless got holds every key of
// want with the same value. It logs the keys it got, never the values.
func (p *plugin) checkSecrets(method string, got, want map[string]string) error {
	if len(got) > 0 {
		p.logger.Printf("%s: secrets with keys %q", method, slices.Sorted(maps.Keys(got)))
	}
	for _, k := range slices.Sorted(maps.Keys(want)) {
		if v, ok := got[k]; !ok || v != want[k] {
			return status.Errorf(codes.Unauthenticated, "missing or wrong secret %s", k)
		}
	}
	return nil
}

func (p *plugin) NodeStageVolume(_ context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	staging := req.GetStagingTargetPath()
	_, capErr := requireCapability(req.GetVolumeCapability())
	src, unlock, err := p.begin("NodeStageVolume", req.GetVolumeId(), requirePaths("staging_target_path", staging), capErr)
	if err != nil {
		return nil, err
	}
	defer unlock()
	if err := failFromFile(p.cfg.failStageFile, "--fail-stage-file", "NodeStageVolume"); err != nil {
		return nil, err
	}
	if err := p.checkSecrets("NodeStageVolume", req.GetSecrets(), p.cfg.requireStageSecrets); err != nil {
		return nil, err
	}
	// CSI: the CO creates the staging directory.
	if st, err := os.Lstat(staging); err != nil || !st.IsDir() {
		return nil, status.Errorf(codes.FailedPrecondition, "staging_target_path %s is not an existing directory (the CO creates it)", staging)
	}
	if err := os.MkdirAll(src, 0o750); err != nil {
		return nil, status.Errorf(codes.Internal, "create volume directory: %v", err)
	}
	if err := ensureBind(src, staging, false); err != nil {
		return nil, err
	}
	return &csi.NodeStageVolumeResponse{}, nil
}

func (p *plugin) NodeUnstageVolume(_ context.Context, req *csi.NodeUnstageVolumeRequest) (*csi.NodeUnstageVolumeResponse, error) {
	staging := req.GetStagingTargetPath()
	src, unlock, err := p.begin("NodeUnstageVolume", req.GetVolumeId(), requirePaths("staging_target_path", staging))
	if err != nil {
		return nil, err
	}
	defer unlock()
	// The staging directory is the CO's: only the mount goes.
	if err := unmountOwn(staging, src); err != nil {
		return nil, err
	}
	return &csi.NodeUnstageVolumeResponse{}, nil
}

func (p *plugin) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	staging, target := req.GetStagingTargetPath(), req.GetTargetPath()
	block, capErr := requireCapability(req.GetVolumeCapability())
	dir, unlock, err := p.begin("NodePublishVolume", req.GetVolumeId(), requirePaths("staging_target_path", staging, "target_path", target), capErr)
	if err != nil {
		return nil, err
	}
	defer unlock()
	if err := failFromFile(p.cfg.failPublishFile, "--fail-publish-file", "NodePublishVolume"); err != nil {
		return nil, err
	}
	if err := p.checkSecrets("NodePublishVolume", req.GetSecrets(), p.cfg.requirePublishSecrets); err != nil {
		return nil, err
	}
	if p.cfg.liePublish {
		p.logger.Printf("NodePublishVolume: reporting success without mounting anything on %s (--lie-publish)", target)
		return &csi.NodePublishVolumeResponse{}, nil
	}
	misbehave, err := p.publishMisbehaviour()
	if err != nil {
		return nil, err
	}
	if answered, err := p.misbehaveBeforePublish(ctx, misbehave, target); answered {
		if err != nil {
			return nil, err
		}
		return &csi.NodePublishVolumeResponse{}, nil
	}
	if mounted, err := isMountOf(staging, dir); err != nil {
		return nil, err
	} else if !mounted {
		return nil, status.Errorf(codes.FailedPrecondition, "volume %q is not staged at %s", req.GetVolumeId(), staging)
	}
	src := staging
	if block {
		src = dir + ".blk"
		if err := ensureBackingFile(src); err != nil {
			return nil, status.Errorf(codes.Internal, "block backing file: %v", err)
		}
	}
	created, err := p.prepareTarget(target, block)
	if err != nil {
		return nil, err
	}
	if err := ensureBind(src, target, req.GetReadonly()); err != nil {
		if created {
			_ = p.removeCreatedTarget(target)
		}
		return nil, err
	}
	resp := &csi.NodePublishVolumeResponse{}
	p.misbehaveAfterPublish(misbehave, resp)
	return resp, nil
}

func (p *plugin) NodeUnpublishVolume(_ context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	target := req.GetTargetPath()
	dir, unlock, err := p.begin("NodeUnpublishVolume", req.GetVolumeId(), requirePaths("target_path", target))
	if err != nil {
		return nil, err
	}
	defer unlock()
	if err := unmountOwn(target, dir, dir+".blk"); err != nil {
		return nil, err
	}
	if err := p.removeCreatedTarget(target); err != nil {
		return nil, err
	}
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

// prepareTarget makes sure the target exists and has the right type: a
// directory for mount access, a regular file for block access. A missing
// target is created (and recorded as created) if its parent exists.
func (p *plugin) prepareTarget(target string, block bool) (created bool, err error) {
	want := "a directory"
	if block {
		want = "a regular file"
	}
	st, err := os.Lstat(target)
	switch {
	case err == nil && (block && st.Mode().IsRegular() || !block && st.IsDir()):
		return false, nil
	case err == nil:
		return false, status.Errorf(codes.FailedPrecondition, "target_path %s is not %s (mode %v)", target, want, st.Mode().Type())
	case !errors.Is(err, fs.ErrNotExist):
		return false, status.Errorf(codes.Internal, "target_path: %v", err)
	case p.cfg.targetMustExist:
		return false, status.Errorf(codes.FailedPrecondition, "target_path %s does not exist: this plugin expects the CO to make it (--target-must-exist)", target)
	}
	// CSI: the CO makes sure the parent exists.
	if st, err := os.Stat(filepath.Dir(target)); err != nil || !st.IsDir() {
		return false, status.Errorf(codes.FailedPrecondition, "the parent directory of target_path %s does not exist (the CO creates it)", target)
	}
	// Record first: a crash in between leaves a record of a target that
	// is missing, which unpublish takes as done.
	if err := p.recordTarget(target); err != nil {
		return false, status.Errorf(codes.Internal, "record the target: %v", err)
	}
	if block {
		var f *os.File
		if f, err = os.OpenFile(target, os.O_CREATE|os.O_EXCL|os.O_RDONLY, 0o640); err == nil {
			err = f.Close()
		}
	} else {
		err = os.Mkdir(target, 0o750)
	}
	if err != nil {
		_ = os.Remove(p.targetRecord(target))
		return false, status.Errorf(codes.Internal, "create target_path as %s: %v", want, err)
	}
	return true, nil
}

// targetRecord is the file that says NodePublishVolume created target.
func (p *plugin) targetRecord(target string) string {
	sum := sha256.Sum256([]byte(filepath.Clean(target)))
	return filepath.Join(p.cfg.dataDir, targetsDir, hex.EncodeToString(sum[:]))
}

func (p *plugin) recordTarget(target string) error {
	record := p.targetRecord(target)
	if err := os.MkdirAll(filepath.Dir(record), 0o750); err != nil {
		return err
	}
	return os.WriteFile(record, []byte(filepath.Clean(target)+"\n"), 0o640)
}

// removeCreatedTarget removes target (not recursively) if
// NodePublishVolume created it, and forgets it; other targets stay.
func (p *plugin) removeCreatedTarget(target string) error {
	record := p.targetRecord(target)
	if _, err := os.Stat(record); errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err := os.Remove(target); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return status.Errorf(codes.Internal, "remove the target_path this plugin created: %v", err)
	}
	if err := os.Remove(record); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return status.Errorf(codes.Internal, "forget the target: %v", err)
	}
	return nil
}

// ensureBackingFile creates a sparse block backing file if there is none.
func ensureBackingFile(path string) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o640)
	if errors.Is(err, fs.ErrExist) {
		return nil
	}
	if err != nil {
		return err
	}
	err = f.Truncate(blockSize)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		_ = os.Remove(path)
	}
	return err
}

// isMountOf reports whether path is a mount point showing one of srcs (the
// same file: device and inode). A missing path is not one. The mount
// package's check asks the kernel about path alone (statx's mount root
// attribute): mountinfo.Mounted read the whole mount table for a bind of
// the same filesystem, which made this plugin's stage and publish slower
// with every unrelated mount on the host (benchmark 3 measured it, not
// the agent).
func isMountOf(path string, srcs ...string) (bool, error) {
	mounted, err := mount.IsMountPoint(path)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, status.Errorf(codes.Internal, "check mount at %s: %v", path, err)
	}
	if !mounted {
		return false, nil
	}
	at, err := os.Stat(path)
	if err != nil {
		return false, status.Errorf(codes.Internal, "%v", err)
	}
	for _, src := range srcs {
		if st, err := os.Stat(src); err == nil && os.SameFile(st, at) {
			return true, nil
		}
	}
	return false, status.Errorf(codes.FailedPrecondition, "%s holds a mount that is not this volume; leaving it alone", path)
}

// ensureBind bind-mounts src on dst, read-only if asked. A dst that is
// already a mount of src with the same read-only setting is done; another
// mount there is AlreadyExists (CSI: published, but incompatibly).
func ensureBind(src, dst string, readonly bool) error {
	mounted, err := isMountOf(dst, src)
	if status.Code(err) == codes.FailedPrecondition {
		return status.Errorf(codes.AlreadyExists, "%s already holds another mount", dst)
	}
	if err != nil {
		return err
	}
	if mounted {
		var st unix.Statfs_t
		if err := unix.Statfs(dst, &st); err != nil {
			return status.Errorf(codes.Internal, "statfs %s: %v", dst, err)
		}
		if ro := st.Flags&unix.ST_RDONLY != 0; ro != readonly {
			return status.Errorf(codes.AlreadyExists, "%s is already mounted with readonly %v", dst, ro)
		}
		return nil
	}
	if err := bindMount(src, dst, readonly); err != nil {
		return status.Errorf(codes.Internal, "%v", err)
	}
	return nil
}

// bindMount bind-mounts src on dst, which exists.
func bindMount(src, dst string, readonly bool) error {
	if err := unix.Mount(src, dst, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind mount %s on %s: %w", src, dst, err)
	}
	if readonly {
		if err := unix.Mount("", dst, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY, ""); err != nil {
			_ = unix.Unmount(dst, unix.MNT_DETACH)
			return fmt.Errorf("remount %s read-only: %w", dst, err)
		}
	}
	return nil
}

// unmountOwn unmounts path if it is a mount of one of srcs; a path that is
// missing or not a mount point is done, and any other mount is left alone
// (FailedPrecondition).
func unmountOwn(path string, srcs ...string) error {
	mounted, err := isMountOf(path, srcs...)
	if err != nil || !mounted {
		return err
	}
	err = unix.Unmount(path, 0)
	if err == nil || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT) {
		return nil
	}
	return status.Errorf(codes.Internal, "unmount %s: %v", path, err)
}
