package snapcat

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/csiagent/csiagent/internal/atomicfile"
)

// Errors of the catalogue.
var (
	ErrNotFound = errors.New("no such snapshot in the catalogue")
	ErrInvalid  = errors.New("invalid snapshot name")
)

// Kind tells a snapshot from a group snapshot.
type Kind string

// The kinds of entries.
const (
	KindSnapshot Kind = "snapshot"
	KindGroup    Kind = "group"
)

// Entry is one snapshot or group snapshot.
type Entry struct {
	Name   string `json:"name"`
	Kind   Kind   `json:"kind"`
	Plugin string `json:"plugin"`
	// SourceVolumes are the volume ids snapshotted (one for a snapshot).
	SourceVolumes []string `json:"source_volumes"`
	// NamedVolume is the named volume a snapshot was asked of, if any.
	NamedVolume string `json:"named_volume,omitempty"`
	// Container is the container a group snapshot froze, if any.
	Container string `json:"container,omitempty"`
	// SnapshotID is a snapshot's id at the plugin.
	SnapshotID string `json:"snapshot_id,omitempty"`
	// GroupSnapshotID and Members (source volume id → snapshot id) are a
	// group snapshot's.
	GroupSnapshotID string            `json:"group_snapshot_id,omitempty"`
	Members         map[string]string `json:"members,omitempty"`
	Created         time.Time         `json:"created"`
	SizeBytes       int64             `json:"size_bytes,omitempty"`
	Ready           bool              `json:"ready"`
	// Intent: written before the plugin's create call, which has not
	// answered yet (or the agent stopped before it did).
	Intent bool `json:"intent,omitempty"`
}

// CSIName is the name the plugin's create call is given: derived from the
// entry's name, so that repeating the create (after a crash, or by
// running the command again) is idempotent. A group snapshot's is its
// name, as the agent gave it before it kept a catalogue.
func (e *Entry) CSIName() string {
	if e.Kind == KindGroup {
		return e.Name
	}
	return "csi-agent-" + e.Name
}

// SnapshotIDs are the group's snapshot ids, in the order of SourceVolumes.
func (e *Entry) SnapshotIDs() []string {
	var ids []string
	for _, v := range e.SourceVolumes {
		if id, ok := e.Members[v]; ok {
			ids = append(ids, id)
		}
	}
	return ids
}

var nameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)

// ValidateName checks a catalogue name: letters, digits, '.', '_', '-',
// not starting with a punctuation mark, at most 128 bytes.
func ValidateName(name string) error {
	if !nameRE.MatchString(name) {
		return fmt.Errorf("%w %q: use letters, digits, '.', '_' and '-' (at most 128, starting with a letter or digit)", ErrInvalid, name)
	}
	return nil
}

// Catalogue is the directory of entries, read once at Open and kept in
// memory; every change is written through before it returns.
type Catalogue struct {
	dir  string
	mu   sync.Mutex
	ents map[string]*Entry
}

// Open makes dir (and dir/frozen) if needed and loads every entry:
// leftover temporary files of an interrupted write are removed, a file
// that cannot be parsed is logged and skipped.
func Open(dir string, log *slog.Logger) (*Catalogue, error) {
	if err := atomicfile.MkdirAll(filepath.Join(dir, frozenDir), 0o700); err != nil {
		return nil, fmt.Errorf("creating the snapshot catalogue %s: %w", dir, err)
	}
	c := &Catalogue{dir: dir, ents: map[string]*Entry{}}
	files, err := readDir(dir, log)
	if err != nil {
		return nil, err
	}
	for name, data := range files {
		e := &Entry{}
		if err := json.Unmarshal(data, e); err != nil || e.Name != name {
			log.Warn("snapshot catalogue: skipping an unreadable entry (kept for inspection)", "file", filepath.Join(dir, name+".json"), "error", err)
			continue
		}
		c.ents[name] = e
	}
	return c, nil
}

// readDir reads the NAME.json files of dir, removing the temporary files
// atomicfile.Write leaves when it is interrupted.
func readDir(dir string, log *slog.Logger) (map[string][]byte, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("reading the snapshot catalogue: %w", err)
	}
	out := map[string][]byte{}
	for _, de := range ents {
		if !de.Type().IsRegular() {
			continue
		}
		p := filepath.Join(dir, de.Name())
		if strings.HasPrefix(de.Name(), ".") && strings.Contains(de.Name(), ".tmp-") {
			log.Info("snapshot catalogue: removing an interrupted write", "file", p)
			if err := os.Remove(p); err != nil {
				return nil, fmt.Errorf("removing %s: %w", p, err)
			}
			continue
		}
		name, ok := strings.CutSuffix(de.Name(), ".json")
		if !ok || ValidateName(name) != nil {
			continue
		}
		data, err := os.ReadFile(p)
		if err != nil {
			return nil, fmt.Errorf("reading the snapshot catalogue: %w", err)
		}
		out[name] = data
	}
	return out, nil
}

func (c *Catalogue) path(name string) string { return filepath.Join(c.dir, name+".json") }

// Put writes e, durably, replacing the entry of its name.
func (c *Catalogue) Put(e *Entry) error {
	if err := ValidateName(e.Name); err != nil {
		return err
	}
	data, err := json.MarshalIndent(e, "", "  ")
	if err != nil {
		return fmt.Errorf("encoding snapshot %s: %w", e.Name, err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := atomicfile.Write(c.path(e.Name), append(data, '\n'), 0o600); err != nil {
		return fmt.Errorf("recording snapshot %s: %w", e.Name, err)
	}
	cp := *e
	c.ents[e.Name] = &cp
	return nil
}

// Get returns a copy of the entry of name.
func (c *Catalogue) Get(name string) (*Entry, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.ents[name]
	if !ok {
		return nil, fmt.Errorf("%w: %s ('csi-agent snapshot ls' lists them)", ErrNotFound, name)
	}
	cp := *e
	return &cp, nil
}

// List returns copies of every entry, sorted by name.
func (c *Catalogue) List() []*Entry {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]*Entry, 0, len(c.ents))
	for _, e := range c.ents {
		cp := *e
		out = append(out, &cp)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// Remove deletes the entry of name, durably; an unknown name is done.
func (c *Catalogue) Remove(name string) error {
	if err := ValidateName(name); err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := removeDurably(c.path(name)); err != nil {
		return fmt.Errorf("removing snapshot %s from the catalogue: %w", name, err)
	}
	delete(c.ents, name)
	return nil
}

// removeDurably removes path and fsyncs its directory; a missing path is
// done.
func removeDurably(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	d, err := os.Open(filepath.Dir(path))
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// Lookup is what restoring from a snapshot needs: the plugin and the
// snapshot id of a catalogue name, NAME for a snapshot or
// GROUP/SOURCE_VOLUME_ID for one member of a group snapshot. A snapshot
// whose create was interrupted, or not ready, is an error saying so.
func (c *Catalogue) Lookup(name string) (plugin, snapshotID string, err error) {
	group, member, isMember := strings.Cut(name, "/")
	e, err := c.Get(group)
	if err != nil {
		return "", "", err
	}
	if e.Intent {
		return "", "", fmt.Errorf("snapshot %s: its create was interrupted: run the create command again", e.Name)
	}
	if !e.Ready {
		return "", "", fmt.Errorf("snapshot %s is not ready to use yet: check it with 'csi-agent snapshot ls'", e.Name)
	}
	switch {
	case e.Kind == KindSnapshot && !isMember:
		return e.Plugin, e.SnapshotID, nil
	case e.Kind == KindSnapshot:
		return "", "", fmt.Errorf("%s is a snapshot, not a group snapshot: name it without /%s", e.Name, member)
	case !isMember:
		return "", "", fmt.Errorf("%s is a group snapshot: name one member as %s/VOLUME_ID (one of %s)", e.Name, e.Name, strings.Join(e.SourceVolumes, ", "))
	}
	id, ok := e.Members[member]
	if !ok {
		return "", "", fmt.Errorf("%w: group snapshot %s has no member for volume %s (it has %s)", ErrNotFound, e.Name, member, strings.Join(slices.Sorted(maps.Keys(e.Members)), ", "))
	}
	return e.Plugin, id, nil
}
