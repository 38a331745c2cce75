package pluginconfig

import (
	"context"
	"fmt"
	"log/slog"
	"sort"
	"time"

	"github.com/fsnotify/fsnotify"

	"github.com/csiagent/csiagent/internal/defaults"
)

// Default debounce timings: config tools write several files, or one file
// in several steps (write temp, rename; delete, recreate), within a few
// milliseconds. One reload after the burst sees the finished result.
const (
	DefaultDebounce = 100 * time.Millisecond
	DefaultMaxDelay = time.Second
)

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
	// Logger receives one line per reload problem; none when nil.
	Logger *slog.Logger
}

// Watcher keeps a config directory's plugin set current.
type Watcher struct {
	cfg     WatchConfig
	fsw     *fsnotify.Watcher
	updates chan Update
	rescan  chan struct{}

	plugins  map[string]*Plugin
	reported map[string]string // file -> error text last reported
}

// Watch loads cfg.Dir and watches it until ctx ends. The first Update
// holds the initial load (every plugin Added, every bad file Invalid);
// later ones are sent only when something changed. The Updates channel is
// closed when ctx ends. Watch fails when the directory cannot be read or
// watched; a bad file is never a reason to fail.
//
// Only the directory itself is watched: a change inside a file that a
// symlink points to outside it is seen at the next directory event or
// Rescan. Kubernetes ConfigMap volumes work, because their update swaps
// the "..data" symlink inside the directory.
func Watch(ctx context.Context, cfg WatchConfig) (*Watcher, error) {
	defaults.Set(&cfg.Debounce, DefaultDebounce)
	defaults.Set(&cfg.MaxDelay, DefaultMaxDelay)
	cfg.Logger = defaults.Logger(cfg.Logger)
	fsw, err := fsnotify.NewWatcher()
	if err != nil {
		return nil, fmt.Errorf("watching plugin config directory: %w", err)
	}
	if err := fsw.Add(cfg.Dir); err != nil {
		fsw.Close()
		return nil, fmt.Errorf("watching plugin config directory %s: %w", cfg.Dir, err)
	}
	w := &Watcher{
		cfg:      cfg,
		fsw:      fsw,
		updates:  make(chan Update),
		rescan:   make(chan struct{}, 1),
		plugins:  map[string]*Plugin{},
		reported: map[string]string{},
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
			w.cfg.Logger.Debug("plugin config directory event", "event", ev.String())
			arm(w.cfg.Debounce)
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
				u = w.dirError(err)
			}
			if len(u.Events) > 0 && !w.send(ctx, u) {
				return
			}
		}
	}
}

func (w *Watcher) send(ctx context.Context, u Update) bool {
	select {
	case w.updates <- u:
		return true
	case <-ctx.Done():
		return false
	}
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
	set, err := load(ctx, w.cfg.Dir, owners)
	if err != nil {
		return Update{}, err
	}
	if _, ok := w.reported[w.cfg.Dir]; ok {
		// The directory is back (it may have been recreated): watch it anew.
		delete(w.reported, w.cfg.Dir)
		if err := w.fsw.Add(w.cfg.Dir); err != nil {
			return Update{}, fmt.Errorf("watching plugin config directory %s: %w", w.cfg.Dir, err)
		}
	}
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

func (w *Watcher) snapshot() map[string]*Plugin {
	out := make(map[string]*Plugin, len(w.plugins))
	for t, p := range w.plugins {
		out[t] = p
	}
	return out
}
