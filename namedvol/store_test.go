package namedvol

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/csiagent/csiagent/internal/atomicfile"
)

// Store.Create takes a definition of MaxDefinition bytes and refuses a
// larger one, naming the cap; nothing of it is stored.
func TestStoreCapsDefinitionSize(t *testing.T) {
	ctx := context.Background()
	s := newTestStore(t)
	// Exactly MaxDefinition: 500-byte context values, then one to fill.
	d := &Definition{Name: "full", Plugin: "p", VolumeID: "v", VolumeContext: map[string]string{}}
	for i := 0; d.Size() <= MaxDefinition-1000; i++ {
		d.VolumeContext[fmt.Sprint("k", i)] = strings.Repeat("x", 500)
	}
	d.VolumeContext["z"] = ""
	d.VolumeContext["z"] = strings.Repeat("x", MaxDefinition-d.Size())
	if d.Size() != MaxDefinition {
		t.Fatalf("test definition of %d bytes, want %d", d.Size(), MaxDefinition)
	}
	if err := s.Create(ctx, d); err != nil {
		t.Fatalf("a definition of exactly MaxDefinition bytes: %v", err)
	}
	d.Name = "over"
	d.VolumeContext["z"] += "x"
	err := s.Create(ctx, d)
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), fmt.Sprintf("is %d bytes as JSON options, more than the cap of 65536 bytes", MaxDefinition+1)) {
		t.Errorf("a definition of MaxDefinition+1 bytes: %v, want ErrInvalid naming the 65536-byte cap", err)
	}
	if _, err := s.Get("over"); !errors.Is(err, ErrNotFound) {
		t.Errorf("the refused definition: %v, want ErrNotFound", err)
	}
}

// newTestStore opens a Store in a new work dir of its own.
func newTestStore(t *testing.T) *Store {
	t.Helper()
	dir := t.TempDir()
	commit, err := atomicfile.New(dir)
	if err != nil {
		t.Fatal(err)
	}
	s, err := OpenStore(commit, filepath.Join(dir, "named"))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestRepeatedCallsAnswerOnceDurable: a create repeated after its first
// call's wait ended (its change written, not yet durable) answers once
// the change is durable, as does a removal repeated so; before, the
// repeat answered at once, and a power cut could then lose what it
// acknowledged.
func TestRepeatedCallsAnswerOnceDurable(t *testing.T) {
	dir := t.TempDir()
	commit, err := atomicfile.New(dir)
	if err != nil {
		t.Fatal(err)
	}
	var hold sync.Mutex // held: the commit rounds' fsyncs wait
	commit.Fsync = func(path string) error {
		hold.Lock() // a gate: it waits while the test holds it
		defer hold.Unlock()
		f, err := os.Open(path)
		if err != nil {
			return err
		}
		defer f.Close()
		return f.Sync()
	}
	s, err := OpenStore(commit, filepath.Join(dir, "named"))
	if err != nil {
		t.Fatal(err)
	}
	d := &Definition{Name: "v", Plugin: "loop", VolumeID: "vol-1", AccessMode: "SINGLE_NODE_WRITER"}
	for _, step := range []struct {
		what string
		call func(ctx context.Context) error
	}{
		{"create", func(ctx context.Context) error { return s.Create(ctx, d) }},
		{"remove", func(ctx context.Context) error { return s.Remove(ctx, "v") }},
	} {
		hold.Lock()
		short, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
		if err := step.call(short); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("%s with its commit held: %v, want DeadlineExceeded", step.what, err)
		}
		cancel()
		short, cancel = context.WithTimeout(t.Context(), 50*time.Millisecond)
		err := step.call(short)
		cancel()
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("the repeated %s answered %v before the first one's change was durable", step.what, err)
		}
		hold.Unlock()
		if err := commit.Sync(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
}
