package pluginconfig

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"
)

// updateTimeout bounds how long a test waits for an expected update; it is
// a failure bound, not a synchronisation sleep.
const updateTimeout = 10 * time.Second

func pluginJSON(typ, cmd string) string {
	return fmt.Sprintf(`{"type":%q,"containers":[{"services":["NODE_SERVICE"],"command":{"value":%q}}]}`, typ, cmd)
}

func startWatch(t *testing.T, dir string) (*Watcher, context.CancelFunc) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	// A debounce long enough that the two or three syscalls of one write
	// pattern land in one burst even on a loaded machine.
	w, err := Watch(ctx, WatchConfig{Dir: dir, Debounce: 200 * time.Millisecond, MaxDelay: 2 * time.Second, CheckInterval: time.Second})
	if err != nil {
		t.Fatalf("Watch: %v", err)
	}
	return w, cancel
}

func nextUpdate(t *testing.T, w *Watcher) Update {
	t.Helper()
	select {
	case u, ok := <-w.Updates():
		if !ok {
			t.Fatal("updates channel closed")
		}
		return u
	case <-time.After(updateTimeout):
		t.Fatal("no update within", updateTimeout)
	}
	return Update{}
}

// summary renders events as "kind:type" sorted, e.g. "added:a changed:b".
func summary(u Update) string {
	var parts []string
	for _, e := range u.Events {
		parts = append(parts, e.Kind.String()+":"+e.Type)
	}
	sort.Strings(parts)
	return strings.Join(parts, " ")
}

func command(u Update, typ string) string {
	p := u.Plugins[typ]
	if p == nil {
		return "<none>"
	}
	return p.Info.Containers[0].Command.Value
}

func TestWatch(t *testing.T) {
	t.Run("initial load, add, change, remove", func(t *testing.T) {
		dir := t.TempDir()
		writeFile(t, dir, "a.json", pluginJSON("a", "v1"))
		writeFile(t, dir, "bad.json", "{")
		w, _ := startWatch(t, dir)
		u := nextUpdate(t, w)
		if got := summary(u); got != "added:a invalid:" {
			t.Fatalf("initial update = %q", got)
		}
		writeFile(t, dir, "b.json", pluginJSON("b", "v1"))
		if u = nextUpdate(t, w); summary(u) != "added:b" || len(u.Plugins) != 2 {
			t.Fatalf("after add: %q, plugins %v", summary(u), u.Plugins)
		}
		writeFile(t, dir, "a.json", pluginJSON("a", "v2"))
		if u = nextUpdate(t, w); summary(u) != "changed:a" || command(u, "a") != "v2" {
			t.Fatalf("after change: %q, command %q", summary(u), command(u, "a"))
		}
		if err := os.Remove(filepath.Join(dir, "b.json")); err != nil {
			t.Fatal(err)
		}
		if u = nextUpdate(t, w); summary(u) != "removed:b" || u.Plugins["b"] != nil {
			t.Fatalf("after remove: %q", summary(u))
		}
	})

	t.Run("atomic write then rename", func(t *testing.T) {
		dir := t.TempDir()
		writeFile(t, dir, "a.json", pluginJSON("a", "v1"))
		w, _ := startWatch(t, dir)
		nextUpdate(t, w)
		writeFile(t, dir, ".a.json.tmp", pluginJSON("a", "v2"))
		if err := os.Rename(filepath.Join(dir, ".a.json.tmp"), filepath.Join(dir, "a.json")); err != nil {
			t.Fatal(err)
		}
		if u := nextUpdate(t, w); summary(u) != "changed:a" || command(u, "a") != "v2" {
			t.Fatalf("got %q, command %q", summary(u), command(u, "a"))
		}
	})

	t.Run("editor deletes and recreates", func(t *testing.T) {
		dir := t.TempDir()
		writeFile(t, dir, "a.json", pluginJSON("a", "v1"))
		w, _ := startWatch(t, dir)
		nextUpdate(t, w)
		if err := os.Remove(filepath.Join(dir, "a.json")); err != nil {
			t.Fatal(err)
		}
		writeFile(t, dir, "a.json", pluginJSON("a", "v2"))
		// Debounced: one change, never a remove that would stop the plugin.
		if u := nextUpdate(t, w); summary(u) != "changed:a" || command(u, "a") != "v2" {
			t.Fatalf("got %q", summary(u))
		}
	})

	t.Run("burst of files is one update", func(t *testing.T) {
		dir := t.TempDir()
		w, _ := startWatch(t, dir)
		if u := nextUpdate(t, w); len(u.Events) != 0 || len(u.Plugins) != 0 {
			t.Fatalf("empty dir: %+v", u)
		}
		for _, n := range []string{"x", "y", "z"} {
			writeFile(t, dir, n+".json", pluginJSON(n, "v1"))
		}
		if u := nextUpdate(t, w); summary(u) != "added:x added:y added:z" {
			t.Fatalf("got %q", summary(u))
		}
	})

	t.Run("configmap symlink swap", func(t *testing.T) {
		dir := t.TempDir()
		mkdir := func(name string) {
			if err := os.Mkdir(filepath.Join(dir, name), 0o755); err != nil {
				t.Fatal(err)
			}
		}
		symlink := func(target, name string) {
			if err := os.Symlink(target, filepath.Join(dir, name)); err != nil {
				t.Fatal(err)
			}
		}
		mkdir("..2026_11_22_01_00_00.1")
		writeFile(t, dir, "..2026_11_22_01_00_00.1/a.json", pluginJSON("a", "v1"))
		symlink("..2026_11_22_01_00_00.1", "..data")
		symlink("..data/a.json", "a.json")
		w, _ := startWatch(t, dir)
		if u := nextUpdate(t, w); summary(u) != "added:a" {
			t.Fatalf("initial: %q", summary(u))
		}
		// The kubelet's AtomicWriter: new timestamped dir, new ..data_tmp
		// link, rename it over ..data, remove the old dir.
		mkdir("..2026_11_22_01_05_00.2")
		writeFile(t, dir, "..2026_11_22_01_05_00.2/a.json", pluginJSON("a", "v2"))
		symlink("..2026_11_22_01_05_00.2", "..data_tmp")
		if err := os.Rename(filepath.Join(dir, "..data_tmp"), filepath.Join(dir, "..data")); err != nil {
			t.Fatal(err)
		}
		if err := os.RemoveAll(filepath.Join(dir, "..2026_11_22_01_00_00.1")); err != nil {
			t.Fatal(err)
		}
		if u := nextUpdate(t, w); summary(u) != "changed:a" || command(u, "a") != "v2" {
			t.Fatalf("after swap: %q, command %q", summary(u), command(u, "a"))
		}
	})

	t.Run("invalid file keeps last good config", func(t *testing.T) {
		dir := t.TempDir()
		writeFile(t, dir, "a.json", pluginJSON("a", "v1"))
		writeFile(t, dir, "b.json", pluginJSON("b", "v1"))
		w, _ := startWatch(t, dir)
		nextUpdate(t, w)
		writeFile(t, dir, "a.json", `{"type":"a","containers":[]}`)
		u := nextUpdate(t, w)
		if summary(u) != "invalid:a" {
			t.Fatalf("got %q", summary(u))
		}
		ev := u.Events[0]
		if ev.File != filepath.Join(dir, "a.json") || ev.Err == nil || !strings.Contains(ev.Err.Error(), "neither containers nor endpoints") {
			t.Errorf("invalid event = %+v", ev)
		}
		if command(u, "a") != "v1" || command(u, "b") != "v1" {
			t.Errorf("plugins in force changed: a=%q b=%q", command(u, "a"), command(u, "b"))
		}
		writeFile(t, dir, "a.json", pluginJSON("a", "v3"))
		if u = nextUpdate(t, w); summary(u) != "changed:a" || command(u, "a") != "v3" {
			t.Fatalf("after fix: %q", summary(u))
		}
	})

	t.Run("new file cannot take over a running plugin's type", func(t *testing.T) {
		dir := t.TempDir()
		writeFile(t, dir, "z.json", pluginJSON("a", "v1"))
		w, _ := startWatch(t, dir)
		nextUpdate(t, w)
		writeFile(t, dir, "a.json", pluginJSON("a", "intruder"))
		u := nextUpdate(t, w)
		if summary(u) != "invalid:" || command(u, "a") != "v1" {
			t.Fatalf("got %q, command %q", summary(u), command(u, "a"))
		}
		if !strings.Contains(u.Events[0].Err.Error(), "already defined in "+filepath.Join(dir, "z.json")) {
			t.Errorf("error = %v", u.Events[0].Err)
		}
	})

	t.Run("an invalid holder keeps its type from a copy", func(t *testing.T) {
		dir := t.TempDir()
		writeFile(t, dir, "a.json", pluginJSON("a", "v1"))
		writeFile(t, dir, "a.json.bak", pluginJSON("a", "backup"))
		w, _ := startWatch(t, dir)
		if u := nextUpdate(t, w); u.Plugins["a"].File != filepath.Join(dir, "a.json") {
			t.Fatalf("a is defined by %s; want a.json (first by name)", u.Plugins["a"].File)
		}
		writeFile(t, dir, "a.json", "{")
		u := nextUpdate(t, w)
		if !strings.Contains(summary(u), "invalid:a") || command(u, "a") != "v1" || u.Plugins["a"].File != filepath.Join(dir, "a.json") {
			t.Fatalf("a.json broken: %q, a = %q from %s; want a.json's last good config kept", summary(u), command(u, "a"), u.Plugins["a"].File)
		}
		writeFile(t, dir, "a.json", pluginJSON("a", "v2"))
		if u = nextUpdate(t, w); !strings.Contains(summary(u), "changed:a") || command(u, "a") != "v2" {
			t.Fatalf("a.json fixed: %q, a = %q", summary(u), command(u, "a"))
		}
	})

	t.Run("a fixed file clears its error", func(t *testing.T) {
		dir := t.TempDir()
		writeFile(t, dir, "a.json", pluginJSON("a", "v1"))
		w, _ := startWatch(t, dir)
		nextUpdate(t, w)
		writeFile(t, dir, "a.json", "{")
		if u := nextUpdate(t, w); summary(u) != "invalid:a" || len(u.Errors) != 1 {
			t.Fatalf("broken: %q, errors %v", summary(u), u.Errors)
		}
		// Restored as it was: no plugin changes, but the error is gone.
		writeFile(t, dir, "a.json", pluginJSON("a", "v1"))
		if u := nextUpdate(t, w); len(u.Errors) != 0 || summary(u) != "" {
			t.Fatalf("restored: %q, errors %v; want an update with no error", summary(u), u.Errors)
		}
	})

	t.Run("a directory replaced by a rename is still watched", func(t *testing.T) {
		base := t.TempDir()
		dir := filepath.Join(base, "conf")
		mkdir(t, dir)
		followsReplacement(t, dir, dir, func(*Watcher) {
			next := filepath.Join(base, "conf.new")
			mkdir(t, next)
			writeFile(t, next, "a.json", pluginJSON("a", "v2"))
			rename(t, dir, filepath.Join(base, "conf.old"))
			rename(t, next, dir)
		})
	})

	t.Run("a directory removed and made again later is watched", func(t *testing.T) {
		dir := filepath.Join(t.TempDir(), "conf")
		mkdir(t, dir)
		followsReplacement(t, dir, dir, func(w *Watcher) {
			if err := os.RemoveAll(dir); err != nil {
				t.Fatal(err)
			}
			if u := nextUpdate(t, w); len(u.Errors) != 1 || u.Errors[0].File != dir || command(u, "a") != "v1" {
				t.Fatalf("directory gone: errors %v, a = %q; want the directory's error, a kept", u.Errors, command(u, "a"))
			}
			mkdir(t, dir)
			writeFile(t, dir, "a.json", pluginJSON("a", "v2"))
		})
	})

	t.Run("a symlinked directory swapped is followed", func(t *testing.T) {
		base := t.TempDir()
		v1, v2 := filepath.Join(base, "v1"), filepath.Join(base, "v2")
		mkdir(t, v1)
		mkdir(t, v2)
		writeFile(t, v2, "a.json", pluginJSON("a", "v2"))
		dir := filepath.Join(base, "conf")
		if err := os.Symlink(v1, dir); err != nil {
			t.Fatal(err)
		}
		followsReplacement(t, dir, v2, func(*Watcher) {
			// ln -sfn: a new link renamed over the old one.
			if err := os.Symlink(v2, dir+".tmp"); err != nil {
				t.Fatal(err)
			}
			rename(t, dir+".tmp", dir)
		})
	})

	t.Run("the directory a symlink names removed and made again is watched", func(t *testing.T) {
		base := t.TempDir()
		target := filepath.Join(base, "target")
		mkdir(t, target)
		dir := filepath.Join(base, "conf")
		if err := os.Symlink(target, dir); err != nil {
			t.Fatal(err)
		}
		followsReplacement(t, dir, target, func(*Watcher) {
			if err := os.RemoveAll(target); err != nil {
				t.Fatal(err)
			}
			mkdir(t, target) // may reuse the inode number
			writeFile(t, target, "a.json", pluginJSON("a", "v2"))
		})
	})

	t.Run("rescan sees changes behind symlinks", func(t *testing.T) {
		dir, outside := t.TempDir(), t.TempDir()
		writeFile(t, outside, "real.json", pluginJSON("a", "v1"))
		if err := os.Symlink(filepath.Join(outside, "real.json"), filepath.Join(dir, "a.json")); err != nil {
			t.Fatal(err)
		}
		w, _ := startWatch(t, dir)
		nextUpdate(t, w)
		writeFile(t, outside, "real.json", pluginJSON("a", "v2"))
		w.Rescan()
		if u := nextUpdate(t, w); summary(u) != "changed:a" || command(u, "a") != "v2" {
			t.Fatalf("got %q", summary(u))
		}
	})

	t.Run("cancel closes updates", func(t *testing.T) {
		w, cancel := startWatch(t, t.TempDir())
		nextUpdate(t, w)
		cancel()
		select {
		case _, ok := <-w.Updates():
			if ok {
				t.Fatal("unexpected update after cancel")
			}
		case <-time.After(updateTimeout):
			t.Fatal("updates not closed after cancel")
		}
	})

	t.Run("missing directory fails", func(t *testing.T) {
		_, err := Watch(context.Background(), WatchConfig{Dir: filepath.Join(t.TempDir(), "nope")})
		if err == nil {
			t.Fatal("want an error for a missing directory")
		}
	})
}

func mkdir(t *testing.T, dir string) {
	t.Helper()
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
}

func rename(t *testing.T, from, to string) {
	t.Helper()
	if err := os.Rename(from, to); err != nil {
		t.Fatal(err)
	}
}

// waitCommand waits for the update that gives plugin typ the command
// want (an error or another change may come first).
func waitCommand(t *testing.T, w *Watcher, typ, want string) {
	t.Helper()
	deadline := time.After(updateTimeout)
	for {
		select {
		case u, ok := <-w.Updates():
			if !ok {
				t.Fatal("updates channel closed")
			}
			if command(u, typ) == want {
				return
			}
		case <-deadline:
			t.Fatalf("plugin %s never got command %q within %v", typ, want, updateTimeout)
		}
	}
}

// followsReplacement writes a.json (command v1) into the directory dir
// names and watches dir; replace then puts another directory in its place
// whose a.json says v2. The watch must see that, and a later edit in live
// (the directory dir leads to now).
func followsReplacement(t *testing.T, dir, live string, replace func(*Watcher)) {
	t.Helper()
	writeFile(t, dir, "a.json", pluginJSON("a", "v1"))
	w, _ := startWatch(t, dir)
	nextUpdate(t, w)
	replace(w)
	waitCommand(t, w, "a", "v2")
	writeFile(t, live, "a.json", pluginJSON("a", "v3"))
	waitCommand(t, w, "a", "v3")
}
