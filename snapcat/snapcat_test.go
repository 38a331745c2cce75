package snapcat

import (
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/csiagent/csiagent/internal/testhelp"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

func mustOpen(t *testing.T, dir string) *Catalogue {
	t.Helper()
	c, err := Open(dir, quiet)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestPutSurvivesReopen(t *testing.T) {
	dir := t.TempDir()
	c := mustOpen(t, dir)
	snap := &Entry{Name: "s1", Kind: KindSnapshot, Plugin: "p", SourceVolumes: []string{"v1"}, NamedVolume: "data", SnapshotID: "snap-1", Created: time.Unix(100, 0).UTC(), SizeBytes: 4096, Ready: true}
	group := &Entry{Name: "g1", Kind: KindGroup, Plugin: "p", SourceVolumes: []string{"v1", "v2"}, Container: "c1", GroupSnapshotID: "grp", Members: map[string]string{"v1": "a", "v2": "b"}, Ready: true}
	for _, e := range []*Entry{snap, group} {
		if err := c.Put(e); err != nil {
			t.Fatal(err)
		}
	}
	c = mustOpen(t, dir)
	got := c.List()
	if len(got) != 2 || got[0].Name != "g1" || got[1].Name != "s1" || got[1].NamedVolume != "data" || got[0].Members["v2"] != "b" {
		t.Fatalf("List after reopen = %+v", got)
	}
	if ids := got[0].SnapshotIDs(); strings.Join(ids, ",") != "a,b" {
		t.Errorf("SnapshotIDs = %v", ids)
	}
	if err := c.Remove("s1"); err != nil {
		t.Fatal(err)
	}
	if _, err := mustOpen(t, dir).Get("s1"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Get after Remove and reopen = %v, want ErrNotFound", err)
	}
	if err := c.Remove("s1"); err != nil {
		t.Errorf("second Remove = %v, want done", err)
	}
}

// TestLoadAfterCrash opens catalogues as a crash may leave them: an
// interrupted write's temporary file, a torn file, an intent without its
// result.
func TestLoadAfterCrash(t *testing.T) {
	dir := t.TempDir()
	c := mustOpen(t, dir)
	if err := c.Put(&Entry{Name: "ok", Kind: KindSnapshot, Plugin: "p", SourceVolumes: []string{"v"}, SnapshotID: "id", Ready: true}); err != nil {
		t.Fatal(err)
	}
	if err := c.Put(&Entry{Name: "pending", Kind: KindSnapshot, Plugin: "p", SourceVolumes: []string{"v"}, Intent: true}); err != nil {
		t.Fatal(err)
	}
	tmp := filepath.Join(dir, ".ok.json.tmp-123")
	if err := os.WriteFile(tmp, []byte(`{"name": "ok", "kind": "snap`), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "torn.json"), []byte(`{"name": "torn", "ki`), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "other.json"), []byte(`{"name": "notother"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	c = mustOpen(t, dir)
	if _, err := os.Stat(tmp); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the interrupted write's temporary file is still there: %v", err)
	}
	names := []string{}
	for _, e := range c.List() {
		names = append(names, e.Name)
	}
	if strings.Join(names, ",") != "ok,pending" {
		t.Errorf("entries after the crash = %v, want ok,pending (torn and misnamed files skipped)", names)
	}
	if _, err := os.Stat(filepath.Join(dir, "torn.json")); err != nil {
		t.Errorf("the torn file was not kept for inspection: %v", err)
	}
	p, err := c.Get("pending")
	if err != nil || !p.Intent || p.CSIName() != "csi-agent-pending" {
		t.Errorf("intent = %+v, %v", p, err)
	}
	if _, _, err := c.Lookup("pending"); err == nil || !strings.Contains(err.Error(), "interrupted") {
		t.Errorf("Lookup of an intent = %v, want it to say the create was interrupted", err)
	}
}

func TestLookup(t *testing.T) {
	c := mustOpen(t, t.TempDir())
	for _, e := range []*Entry{
		{Name: "s", Kind: KindSnapshot, Plugin: "p", SourceVolumes: []string{"v"}, SnapshotID: "sid", Ready: true},
		{Name: "slow", Kind: KindSnapshot, Plugin: "p", SourceVolumes: []string{"v"}, SnapshotID: "x"},
		{Name: "g", Kind: KindGroup, Plugin: "q", SourceVolumes: []string{"v1", "v2"}, GroupSnapshotID: "gid", Members: map[string]string{"v1": "m1", "v2": "m2"}, Ready: true},
	} {
		if err := c.Put(e); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct{ name, plugin, id, err string }{
		{name: "s", plugin: "p", id: "sid"},
		{name: "g/v2", plugin: "q", id: "m2"},
		{name: "g", err: "name one member as g/VOLUME_ID"},
		{name: "g/v3", err: "no member for volume v3"},
		{name: "s/v", err: "not a group snapshot"},
		{name: "slow", err: "not ready"},
		{name: "nope", err: "no such snapshot"},
	} {
		plugin, id, err := c.Lookup(tc.name)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("Lookup(%s) = %v, want an error with %q", tc.name, err, tc.err)
			}
			continue
		}
		if err != nil || plugin != tc.plugin || id != tc.id {
			t.Errorf("Lookup(%s) = %s, %s, %v; want %s, %s", tc.name, plugin, id, err, tc.plugin, tc.id)
		}
	}
	if err := c.Put(&Entry{Name: "../x"}); !errors.Is(err, ErrInvalid) {
		t.Errorf("Put of a bad name = %v, want ErrInvalid", err)
	}
}

// TestThawRecorded: a freeze record left by a crash is thawed (here: a
// filesystem that is not frozen, which FITHAW reports as EINVAL, is
// done) and removed; a path that is now another mount is left alone.
func TestThawRecorded(t *testing.T) {
	testhelp.NeedRoot(t) // FITHAW needs CAP_SYS_ADMIN
	dir := t.TempDir()
	c := mustOpen(t, dir)
	here, err := Identify(dir)
	if err != nil {
		t.Fatal(err)
	}
	other := here
	other.MountID++
	gone := FrozenFS{Path: filepath.Join(dir, "gone")}
	if err := c.RecordFreeze(&FreezeRecord{Group: "g", Container: "c", Deadline: time.Now(), Filesystems: []FrozenFS{here, other, gone}}); err != nil {
		t.Fatal(err)
	}
	if err := mustOpen(t, dir).ThawRecorded(quiet); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(c.freezePath("g")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("freeze record still there after recovery: %v", err)
	}
	if len(c.List()) != 0 {
		t.Errorf("a freeze record was read as a catalogue entry: %v", c.List())
	}
}
