package loopplugin

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Deadlines for the external tools. mkfs on a sparse image only writes
// metadata (seconds even for large volumes); e2fsck reads all metadata and
// discards every free range, so it gets longer. Neither is retried: a failure
// is reported and the caller (the CO) retries the RPC.
const (
	mkfsTimeout = 2 * time.Minute
	fsckTimeout = 10 * time.Minute
)

// toolDirs are searched after $PATH: plugins are often started with a
// minimal environment, and mkfs lives in sbin.
func toolDirs() []string { return []string{"/usr/sbin", "/sbin", "/usr/bin", "/bin"} }

// tools holds the absolute paths of the external programs found at start.
type tools struct {
	mkfs   map[string]string // fs type -> mkfs program
	e2fsck string            // "" if missing
	// grow: fs type -> the program that grows it online ("" if missing).
	grow map[string]string
}

func findTools() tools {
	t := tools{mkfs: map[string]string{}}
	for _, fs := range []string{"ext4", "ext3", "ext2", "xfs"} {
		if p := lookTool("mkfs." + fs); p != "" {
			t.mkfs[fs] = p
		}
	}
	t.e2fsck = lookTool("e2fsck")
	t.grow = map[string]string{"ext4": lookTool("resize2fs"), "ext3": lookTool("resize2fs"), "xfs": lookTool("xfs_growfs")}
	return t
}

func (t tools) fsTypes() []string {
	var fs []string
	for k := range t.mkfs {
		fs = append(fs, k)
	}
	slices.Sort(fs)
	return fs
}

func lookTool(name string) string {
	if p, err := exec.LookPath(name); err == nil {
		if abs, err := filepath.Abs(p); err == nil {
			return abs
		}
	}
	for _, d := range toolDirs() {
		p := filepath.Join(d, name)
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
			return p
		}
	}
	return ""
}

// run runs an external program under a deadline and returns its combined
// output in the error.
func run(ctx context.Context, timeout time.Duration, prog string, args ...string) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	out, err := exec.CommandContext(ctx, prog, args...).CombinedOutput()
	if err != nil {
		if ctx.Err() != nil {
			err = fmt.Errorf("%w (%w)", ctx.Err(), err)
		}
		return fmt.Errorf("%s %s: %w: %s", prog, strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return nil
}

// detectFS names the filesystem whose superblock starts r ("ext2", "ext3",
// "ext4", "xfs"), or "" if it recognizes none.
func detectFS(r io.ReaderAt) (string, error) {
	b := make([]byte, 2048)
	n, err := r.ReadAt(b, 0)
	if err != nil && !errors.Is(err, io.EOF) {
		return "", fmt.Errorf("read superblock: %w", err)
	}
	b = b[:n]
	if len(b) >= 4 && string(b[:4]) == "XFSB" {
		return "xfs", nil
	}
	const sb = 1024 // ext superblock offset
	if len(b) < sb+0x68 || binary.LittleEndian.Uint16(b[sb+0x38:]) != 0xEF53 {
		return "", nil
	}
	compat := binary.LittleEndian.Uint32(b[sb+0x5C:])
	incompat := binary.LittleEndian.Uint32(b[sb+0x60:])
	roCompat := binary.LittleEndian.Uint32(b[sb+0x64:])
	const (
		compatHasJournal = 0x4
		// ext3 knows filetype, recover, journal_dev, meta_bg ...
		incompatExt3 = 0x2 | 0x4 | 0x8 | 0x10
		// ... and sparse_super, large_file, btree_dir.
		roCompatExt3 = 0x1 | 0x2 | 0x4
	)
	switch {
	case incompat&^incompatExt3 != 0 || roCompat&^roCompatExt3 != 0:
		return "ext4", nil
	case compat&compatHasJournal != 0:
		return "ext3", nil
	}
	return "ext2", nil
}

// mountableAs reports whether a filesystem detected as have can be mounted
// as fs type want: the ext4 driver mounts ext2 and ext3, ext3 mounts ext2.
func mountableAs(have, want string) bool {
	switch want {
	case "ext4":
		return have == "ext2" || have == "ext3" || have == "ext4"
	case "ext3":
		return have == "ext2" || have == "ext3"
	}
	return have == want
}

// hasData reports whether the file at path has any data extent at all. A
// freshly created sparse image has none. Filesystems without SEEK_DATA
// report data, which is the safe answer.
func hasData(path string) (bool, error) {
	f, err := os.Open(path)
	if err != nil {
		return false, err
	}
	defer f.Close()
	_, err = unix.Seek(int(f.Fd()), 0, unix.SEEK_DATA)
	if errors.Is(err, unix.ENXIO) {
		return false, nil
	}
	return true, nil
}

// prepareFS makes sure the device (open as dev, attached to vol) holds a
// filesystem mountable as fsType. A blank volume (no data at all) gets one,
// unless the access is read-only; an existing filesystem of another type or
// data that is no filesystem are refused, never overwritten.
func (p *Plugin) prepareFS(ctx context.Context, vol Volume, dev *os.File, devPath, fsType string, readOnly bool) error {
	have, err := detectFS(dev)
	if err != nil {
		return fmt.Errorf("volume %s: %w", vol.ID, err)
	}
	if have != "" {
		if !mountableAs(have, fsType) {
			return preconditionf("volume %s holds an %s filesystem, requested fs_type %s", vol.ID, have, fsType)
		}
		return nil
	}
	data, err := hasData(vol.Path)
	if err != nil {
		return fmt.Errorf("volume %s: %w", vol.ID, err)
	}
	// A format record says the data is a mkfs of ours that did not finish
	// (the plugin was killed): formatting again loses nothing.
	var rec formatRecord
	interrupted := p.pool.readRecord(formattingKind, vol.ID, &rec) == nil
	if data && !interrupted {
		return preconditionf("volume %s holds data that is not a known filesystem; refusing to format it", vol.ID)
	}
	if readOnly {
		return preconditionf("volume %s is blank and the access is read-only: nothing to mount", vol.ID)
	}
	mkfs := p.tools.mkfs[fsType]
	if mkfs == "" {
		return preconditionf("mkfs.%s not found in $PATH or %s", fsType, strings.Join(toolDirs(), ":"))
	}
	if err := p.pool.writeRecord(formattingKind, vol.ID, formatRecord{FSType: fsType}); err != nil {
		return fmt.Errorf("format volume %s: %w", vol.ID, err)
	}
	args := []string{"-q", devPath}
	if interrupted {
		// What the killed mkfs left may look like a filesystem to mkfs.
		args = []string{forceFlag(fsType), "-q", devPath}
		p.log.Warn("formatting again after an interrupted format", "volume", vol.ID, "device", devPath, "fs_type", fsType)
	} else {
		p.log.Info("formatting blank volume", "volume", vol.ID, "device", devPath, "fs_type", fsType)
	}
	// mkfs runs to completion (within mkfsTimeout) even when the caller
	// goes away; if the plugin itself is killed, the record above lets
	// the next stage format again.
	if err := run(context.WithoutCancel(ctx), mkfsTimeout, mkfs, args...); err != nil {
		return fmt.Errorf("format volume %s: %w", vol.ID, err)
	}
	if err := p.pool.removeRecord(formattingKind, vol.ID); err != nil {
		return fmt.Errorf("format volume %s: %w", vol.ID, err)
	}
	return nil
}

// formattingKind records a mkfs under way, until it has finished.
const formattingKind = "formatting"

type formatRecord struct {
	FSType string `json:"fs_type"`
}

// forceFlag makes mkfs overwrite what looks like an existing filesystem.
func forceFlag(fsType string) string {
	if fsType == "xfs" {
		return "-f"
	}
	return "-F"
}
