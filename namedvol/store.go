package namedvol

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strings"

	"github.com/csiagent/csiagent/internal/atomicfile"
)

// Errors of the Store.
var (
	ErrNotFound = errors.New("no such named volume")
	ErrExists   = errors.New("named volume exists with another definition")
)

// Store keeps definitions as DIR/NAME.json. Changes to one name must not
// race each other: the caller serialises them (the agent holds the
// volume's lock).
type Store struct {
	dir    string
	commit *atomicfile.Committer
}

// OpenStore makes the directory if needed; commit is the daemon's
// Committer of the work dir dir is in.
func OpenStore(commit *atomicfile.Committer, dir string) (*Store, error) {
	s := &Store{dir: dir, commit: commit}
	if err := s.commit.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("creating the named volume directory: %w", err)
	}
	return s, nil
}

func (s *Store) path(name string) string { return filepath.Join(s.dir, name+".json") }

// Create stores d, durably. The same definition again (whoever its
// Creator) is no change; another one under the same name is ErrExists; one larger than
// MaxDefinition is ErrInvalid.
func (s *Store) Create(ctx context.Context, d *Definition) error {
	if err := d.Validate(); err != nil {
		return err
	}
	if n := d.Size(); n > MaxDefinition {
		return fmt.Errorf("%w: %s: the definition is %d bytes as JSON options, more than the cap of %d bytes on a named volume definition; keep volume_context small", ErrInvalid, d.Name, n, MaxDefinition)
	}
	old, err := s.Get(d.Name)
	switch {
	case err == nil && sameDefinition(old, d):
		return s.Sync(ctx)
	case err == nil:
		return fmt.Errorf("%w: %s (remove it first)", ErrExists, d.Name)
	case !errors.Is(err, ErrNotFound):
		return err
	}
	return s.put(ctx, d)
}

// Sync waits until every change made so far is durable: an answer that
// finds a change made already (a repeated create, a removal repeated
// after its caller's wait ended) acknowledges it only once it is, as the
// call that made it would have.
func (s *Store) Sync(ctx context.Context) error { return s.commit.Sync(ctx) }

// Replace stores d over the definition of its name, durably: a
// provisioned volume's intent completed with CreateVolume's answer.
func (s *Store) Replace(ctx context.Context, d *Definition) error {
	if err := d.Validate(); err != nil {
		return err
	}
	return s.put(ctx, d)
}

func (s *Store) put(ctx context.Context, d *Definition) error {
	data, err := json.MarshalIndent(d, "", "  ")
	if err != nil {
		return fmt.Errorf("encoding %s: %w", d.Name, err)
	}
	n, err := s.commit.Put(s.path(d.Name), append(data, '\n'), 0o600)
	if err != nil {
		return fmt.Errorf("storing %s: %w", d.Name, err)
	}
	return s.commit.Wait(ctx, n)
}

// sameDefinition reports whether a and b define the same volume, whoever
// created them.
func sameDefinition(a, b *Definition) bool {
	b2 := *b
	b2.Creator = a.Creator
	return reflect.DeepEqual(a, &b2)
}

// Get reads one definition.
func (s *Store) Get(name string) (*Definition, error) {
	if err := ValidateName(name); err != nil {
		return nil, err
	}
	data, _, err := atomicfile.ReadRecord(s.commit.Root(), s.path(name))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%w: %s", ErrNotFound, name)
	}
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", name, err)
	}
	d := &Definition{}
	if err := json.Unmarshal(data, d); err != nil {
		return nil, fmt.Errorf("reading %s: %s: %w", name, s.path(name), err)
	}
	if d.Name != name {
		return nil, fmt.Errorf("reading %s: %s defines %q", name, s.path(name), d.Name)
	}
	return d, nil
}

// Names lists the names of the definitions, sorted, without reading them.
func (s *Store) Names() ([]string, error) {
	ents, err := os.ReadDir(s.dir)
	if err != nil {
		return nil, fmt.Errorf("listing named volumes: %w", err)
	}
	var out []string
	for _, e := range ents {
		name, ok := strings.CutSuffix(e.Name(), ".json")
		if ok && e.Type().IsRegular() && ValidateName(name) == nil {
			out = append(out, name)
		}
	}
	sort.Strings(out)
	return out, nil
}

// List reads every definition, sorted by name; a file that cannot be read
// is reported in the error and skipped.
func (s *Store) List() ([]*Definition, error) {
	names, err := s.Names()
	if err != nil {
		return nil, err
	}
	var out []*Definition
	var errs []error
	for _, name := range names {
		d, err := s.Get(name)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		out = append(out, d)
	}
	return out, errors.Join(errs...)
}

// Remove deletes a definition, durably; an unknown name is ErrNotFound.
func (s *Store) Remove(ctx context.Context, name string) error {
	if _, err := s.Get(name); err != nil {
		if errors.Is(err, ErrNotFound) {
			// Maybe removed by a call whose wait ended first.
			if serr := s.Sync(ctx); serr != nil {
				return serr
			}
		}
		return err
	}
	n, err := s.commit.Remove(s.path(name))
	if err != nil {
		return fmt.Errorf("removing %s: %w", name, err)
	}
	return s.commit.Wait(ctx, n)
}
