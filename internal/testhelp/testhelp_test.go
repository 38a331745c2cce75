package testhelp

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/moby/sys/mountinfo"

	"github.com/csiagent/csiagent/mount"
)

// recorder is a testing.TB whose errors and cleanups are kept, to check
// what LeakCheckedDir reports.
type recorder struct {
	testing.TB
	errs     []string
	cleanups []func()
}

func (r *recorder) Helper()          {}
func (r *recorder) Cleanup(f func()) { r.cleanups = append(r.cleanups, f) }
func (r *recorder) Errorf(format string, args ...any) {
	r.errs = append(r.errs, fmt.Sprintf(format, args...))
}
func (r *recorder) Error(args ...any) { r.errs = append(r.errs, fmt.Sprint(args...)) }

func (r *recorder) end() {
	for i := len(r.cleanups) - 1; i >= 0; i-- {
		r.cleanups[i]()
	}
}

// TestLeakCheckedDir: a mount left below the directory fails the test
// and is undone; a clean directory passes.
func TestLeakCheckedDir(t *testing.T) {
	NeedRoot(t)
	clean := &recorder{TB: t}
	LeakCheckedDir(clean)
	clean.end()
	if len(clean.errs) != 0 {
		t.Errorf("a clean directory reported %q", clean.errs)
	}

	leaky := &recorder{TB: t}
	dir := LeakCheckedDir(leaky)
	target := filepath.Join(dir, "m")
	if err := os.Mkdir(target, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := mount.Mount("tmpfs", target, "tmpfs", []string{"size=1m"}); err != nil {
		t.Fatal(err)
	}
	leaky.end()
	if len(leaky.errs) != 1 || !strings.Contains(leaky.errs[0], "left mounted: "+target) {
		t.Errorf("errors %q, want one naming %s", leaky.errs, target)
	}
	if ms, err := mount.List(mountinfo.SingleEntryFilter(target)); err != nil || len(ms) != 0 {
		t.Errorf("%s still mounted after the check: %v %v", target, ms, err)
	}
}
