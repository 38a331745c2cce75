package cli

import (
	"os"
	"path/filepath"
	"testing"
)

// TestReadBundleUser: the hook passes a non-root container's
// process.user as UID:GID, nothing for root.
func TestReadBundleUser(t *testing.T) {
	for config, want := range map[string]string{
		`{"root":{"path":"rootfs"},"process":{"user":{"uid":1000,"gid":1001}}}`: "1000:1001",
		`{"root":{"path":"rootfs"},"process":{"user":{"uid":0,"gid":0}}}`:       "",
		`{"root":{"path":"rootfs"}}`:                                            "",
	} {
		bundle := t.TempDir()
		if err := os.WriteFile(filepath.Join(bundle, "config.json"), []byte(config), 0o600); err != nil {
			t.Fatal(err)
		}
		b, err := readBundle(bundle)
		if err != nil || b.user != want || b.rootfs != filepath.Join(bundle, "rootfs") {
			t.Errorf("%s: rootfs %q user %q, %v; want user %q", config, b.rootfs, b.user, err, want)
		}
	}
}
