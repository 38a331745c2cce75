package pluginconfig

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/fsnotify/fsnotify"
	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/internal/defaults"
)

// Default debounce timings: config tools write several files, or one file
// in several steps (write temp, rename; delete, recreate), within a few
// milliseconds. One reload after the burst sees the finished result.
const (
	DefaultDebounce = 100 * time.Millisecond
	DefaultMaxDelay = time.Second
)

// DefaultCheckInterval is how often the watcher checks that the
// directory it watches is still the one at its path, and still watched (a
// swap inotify cannot see: a symlink above it changed, the directory a
// symlink names removed and made again).
const DefaultCheckInterval = 10 * time.Second

// EventKind says what happened to a plugin.
type EventKind int

// The kinds of Event.
const (
	// Added: a plugin type appeared.
	Added EventKind = iota + 1
	// Changed: a plugin's config or source file changed.
	Changed
	// Removed: a plugin's file is gone (or no longer defines it).
	Removed
	// Invalid: a file could not be loaded. The plugin it defined before,
	// if any, keeps its last good config.
	Invalid
)

func (k EventKind) String() string {
	switch k {
	case Added:
		return "added"
	case Changed:
		return "changed"
	case Removed:
		return "removed"
	case Invalid:
		return "invalid"
	}
	return fmt.Sprintf("EventKind(%d)", int(k))
}

// Event is one change to the plugin set.
type Event struct {
	Kind EventKind
	// Type is the plugin's type; for Invalid, the type the file held
	// before (its last good config stays in force), or "".
	Type string
	// Plugin is the new config for Added and Changed, the last config for
	// Removed, the config kept in force for Invalid (or nil).
	Plugin *Plugin
	// File is the config file (for Invalid, possibly the directory).
	File string
	// Err is why the file is invalid.
	Err error
}

// Update is one reload's outcome: what changed, and the plugin set now in
// force (which the receiver may keep; the watcher does not modify it).
type Update struct {
	Events  []Event
	Plugins map[string]*Plugin
	// Errors lists every file that is invalid now (Events reports each
	// error once, when it first appears).
	Errors []*FileError
}

// WatchConfig configures Watch.
type WatchConfig struct {
	// Dir is the config directory.
	Dir string
	// Debounce is how long the directory must be quiet before a reload;
	// DefaultDebounce when 0.
	Debounce time.Duration
	// MaxDelay bounds how long a stream of changes can delay a reload;
	// DefaultMaxDelay when 0.
	MaxDelay time.Duration
	// CheckInterval is DefaultCheckInterval when 0.
	CheckInterval time.Duration
	// Logger receives one line per reload problem; none when nil.
	Logger *slog.Logger
}

// Watcher keeps a config directory's plugin set current.
type Watcher struct {
	cfg     WatchConfig
	fsw     *fsnotify.Watcher
	updates chan Update
	rescan  chan struct{}
	// dir is cfg.Dir absolute and clean, parent the directory it is in
	// ("" when dir is "/"), watched for dir's own replacement.
	dir, parent string
	dirID       fileID // the directory the watch on dir is on (zero: to be watched anew)

	plugins  map[string]*Plugin
	reported map[string]string // file -> error text last reported
	sentErrs string            // errorsKey of the last Update sent
}

// fileID identifies a file whatever its path.
type fileID struct{ dev, ino uint64 }

// statID is the identity of the file path reaches (symlinks followed).
func statID(path string) (fileID, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return fileID{}, err
	}
	return fileID{st.Dev, st.Ino}, nil
}

// Watch loads cfg.Dir and watches it until ctx ends. The first Update
// holds the initial load (every plugin Added, every bad file Invalid);
// later ones are sent only when something changed. The Updates channel is
// closed when ctx ends. Watch fails when the directory cannot be read or
// watched; a bad file is never a reason to fail.
//
// The directory is watched, and so is the directory it is in, for its
// own replacement: renamed over, removed and made again, or a symlink to
// it swapped (ln -sfn); the new directory is watched from then on. A
// change inside a file that a symlink points to outside it is seen at the
// next directory event or Rescan, and a directory whose path changes its
// target higher up (a symlinked parent swapped), or whose watch ended
// unseen (the directory a symlink names removed and made again), within
// CheckInterval. Kubernetes
// ConfigMap volumes work, because their update swaps the "..data" symlink
// inside the directory.
func Watch(ctx context.Context, cfg WatchConfig) (*Watcher, error) {
	defaults.Set(&cfg.Debounce, DefaultDebounce)
	defaults.Set(&cfg.MaxDelay, DefaultMaxDelay)
	defaults.Set(&cfg.CheckInterval, DefaultCheckInterval)
	cfg.Logger = defaults.Logger(cfg.Logger)
	dir, err := filepath.Abs(cfg.Dir)
	if err != nil {
		return nil, fmt.Errorf("watching plugin config directory %s: %w", cfg.Dir, err)
	}
	fsw, err := fsnotify.NewWatcher()
	if err != nil {
		return nil, fmt.Errorf("watching plugin config directory: %w", err)
	}
	id, err := statID(dir)
	if err == nil {
		err = fsw.Add(dir)
	}
	if err != nil {
		fsw.Close()
		return nil, fmt.Errorf("watching plugin config directory %s: %w", cfg.Dir, err)
	}
	w := &Watcher{
		cfg:      cfg,
		fsw:      fsw,
		updates:  make(chan Update),
		rescan:   make(chan struct{}, 1),
		dir:      dir,
		dirID:    id,
		plugins:  map[string]*Plugin{},
		reported: map[string]string{},
	}
	if parent := filepath.Dir(dir); parent != dir {
		if err := fsw.Add(parent); err != nil {
			cfg.Logger.Warn("cannot watch the plugin config directory's parent: a replaced directory is seen within the check interval", "dir", parent, "error", err)
		} else {
			w.parent = parent
		}
	}
	first, err := w.reload(ctx)
	if err != nil {
		fsw.Close()
		return nil, err
	}
	go w.run(ctx, first)
	return w, nil
}

// Updates delivers the plugin set's changes.
func (w *Watcher) Updates() <-chan Update { return w.updates }

// Rescan asks for a reload now (e.g. on SIGHUP), whatever fsnotify saw.
func (w *Watcher) Rescan() {
	select {
	case w.rescan <- struct{}{}:
	default: // one is pending already
	}
}

func (w *Watcher) run(ctx context.Context, first Update) {
	defer close(w.updates)
	defer w.fsw.Close()
	if !w.send(ctx, first) {
		return
	}
	timer := time.NewTimer(0)
	<-timer.C
	check := time.NewTicker(w.cfg.CheckInterval)
	defer check.Stop()
	var burstStart time.Time // zero: no reload pending
	arm := func(d time.Duration) {
		now := time.Now()
		if burstStart.IsZero() {
			burstStart = now
		}
		if rest := w.cfg.MaxDelay - now.Sub(burstStart); d > rest {
			d = max(rest, 0)
		}
		timer.Reset(d)
	}
	for {
		select {
		case <-ctx.Done():
			timer.Stop()
			return
		case ev, ok := <-w.fsw.Events:
			if !ok {
				return
			}
			if name := filepath.Clean(ev.Name); name == w.dir {
				// The directory itself was removed, renamed, or made
				// (or its symlink replaced): watch what is there at the
				// reload, whatever its inode number (a directory made
				// again may reuse the old one's).
				w.dirID = fileID{}
			} else if w.parent != "" && filepath.Dir(name) == w.parent {
				continue // a sibling of the directory
			}
			w.cfg.Logger.Debug("plugin config directory event", "event", ev.String())
			arm(w.cfg.Debounce)
		case <-check.C:
			if id, err := statID(w.dir); err != nil || id != w.dirID || !w.watching() {
				arm(0)
			}
		case err, ok := <-w.fsw.Errors:
			if !ok {
				return
			}
			// Most likely an inotify queue overflow: events were lost, so
			// a reload is the only way to be sure.
			w.cfg.Logger.Warn("plugin config watch error; rescanning", "dir", w.cfg.Dir, "error", err)
			arm(0)
		case <-w.rescan:
			arm(0)
		case <-timer.C:
			burstStart = time.Time{}
			u, err := w.reload(ctx)
			if ctx.Err() != nil {
				return // the reload was cut short: nothing to report
			}
			if err != nil {
				w.dirID = fileID{} // its watch may be gone with it
				u = w.dirError(err)
			}
			if (len(u.Events) > 0 || errorsKey(u.Errors) != w.sentErrs) && !w.send(ctx, u) {
				return
			}
		}
	}
}

// send delivers u; an Update goes out when plugins changed, and also
// when only the files in error did (a file fixed back to its last good
// config: the receivers' list of errors must lose it).
func (w *Watcher) send(ctx context.Context, u Update) bool {
	select {
	case w.updates <- u:
		w.sentErrs = errorsKey(u.Errors)
		return true
	case <-ctx.Done():
		return false
	}
}

// errorsKey sums up a list of file errors for comparison.
func errorsKey(errs []*FileError) string {
	var b strings.Builder
	for _, fe := range errs {
		b.WriteString(fe.File + "\x00" + fe.Err.Error() + "\x00")
	}
	return b.String()
}

// dirError reports, once, that the directory itself could not be read.
// Every plugin keeps its config.
func (w *Watcher) dirError(err error) Update {
	u := Update{Plugins: w.snapshot(), Errors: []*FileError{{File: w.cfg.Dir, Err: err}}}
	if w.reported[w.cfg.Dir] != err.Error() {
		w.reported[w.cfg.Dir] = err.Error()
		w.cfg.Logger.Error("cannot read plugin config directory; keeping every plugin's current config", "dir", w.cfg.Dir, "error", err)
		u.Events = append(u.Events, Event{Kind: Invalid, File: w.cfg.Dir, Err: err})
	}
	return u
}

// reload loads the directory and works out what changed.
func (w *Watcher) reload(ctx context.Context) (Update, error) {
	owners := make(map[string]string, len(w.plugins))
	for t, p := range w.plugins {
		owners[t] = p.File
	}
	// Watched first: what is written while the directory is read is
	// seen by the next reload.
	if err := w.watchDir(); err != nil {
		return Update{}, err
	}
	set, err := load(ctx, w.cfg.Dir, owners)
	if err != nil {
		return Update{}, err
	}
	delete(w.reported, w.cfg.Dir)
	next := make(map[string]*Plugin, len(set.Plugins))
	for t, p := range set.Plugins {
		next[t] = p
	}
	var events []Event
	bad := map[string]bool{}
	for _, fe := range set.Errors {
		bad[fe.File] = true
		var kept *Plugin
		for t, p := range w.plugins {
			if p.File == fe.File && next[t] == nil {
				next[t], kept = p, p
			}
		}
		if w.reported[fe.File] == fe.Err.Error() {
			continue
		}
		w.reported[fe.File] = fe.Err.Error()
		ev := Event{Kind: Invalid, File: fe.File, Err: fe.Err, Plugin: kept}
		if kept != nil {
			ev.Type = kept.Info.Type
			w.cfg.Logger.Warn("invalid plugin config; keeping its last good config", "file", fe.File, "plugin", ev.Type, "error", fe.Err)
		} else {
			w.cfg.Logger.Warn("invalid plugin config; ignored", "file", fe.File, "error", fe.Err)
		}
		events = append(events, ev)
	}
	for f := range w.reported {
		if !bad[f] {
			delete(w.reported, f)
		}
	}
	for t, p := range w.plugins {
		if next[t] == nil {
			events = append(events, Event{Kind: Removed, Type: t, Plugin: p, File: p.File})
		}
	}
	for t, p := range next {
		old := w.plugins[t]
		switch {
		case old == nil:
			events = append(events, Event{Kind: Added, Type: t, Plugin: p, File: p.File})
		case old != p && (old.File != p.File || !old.Info.Equal(p.Info)):
			events = append(events, Event{Kind: Changed, Type: t, Plugin: p, File: p.File})
		case old != p:
			next[t] = old // unchanged: keep the instance receivers already have
		}
	}
	sort.SliceStable(events, func(i, j int) bool {
		if events[i].Type != events[j].Type {
			return events[i].Type < events[j].Type
		}
		return events[i].File < events[j].File
	})
	w.plugins = next
	return Update{Events: events, Plugins: w.snapshot(), Errors: set.Errors}, nil
}

// watching reports whether the directory's watch is still there (the
// kernel ends it with the directory; one made again may reuse its inode
// number, so the identity alone does not tell).
func (w *Watcher) watching() bool { return slices.Contains(w.fsw.WatchList(), w.dir) }

// watchDir moves the directory's watch to the directory now at its path,
// if that is another one (replaced, or made again after its removal,
// which ended the watch).
func (w *Watcher) watchDir() error {
	id, err := statID(w.dir)
	if err == nil && id == w.dirID && w.watching() {
		return nil
	}
	_ = w.fsw.Remove(w.dir) // gone with its directory, or on the old one
	if err == nil {
		err = w.fsw.Add(w.dir)
	}
	if err != nil {
		w.dirID = fileID{}
		return fmt.Errorf("watching plugin config directory %s: %w", w.cfg.Dir, err)
	}
	w.dirID = id
	w.cfg.Logger.Info("plugin config directory replaced; watching the new one", "dir", w.cfg.Dir)
	return nil
}

func (w *Watcher) snapshot() map[string]*Plugin {
	out := make(map[string]*Plugin, len(w.plugins))
	for t, p := range w.plugins {
		out[t] = p
	}
	return out
}
