package crashstate

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
)

// Kind is the type of a Node.
type Kind uint8

// The kinds of node a Tree holds.
const (
	KindDir Kind = iota + 1
	KindFile
	KindSymlink
)

func (k Kind) String() string {
	switch k {
	case KindDir:
		return "dir"
	case KindFile:
		return "file"
	case KindSymlink:
		return "symlink"
	}
	return fmt.Sprintf("Kind(%d)", int(k))
}

// Node is a directory, regular file or symlink in a Tree. Nodes are shared
// between trees and must not be modified.
type Node struct {
	Kind Kind
	Mode fs.FileMode // permission bits (and setuid, setgid, sticky)
	Data []byte      // file content or symlink target
}

// Tree is a directory tree: the paths under a root (relative, "/"-separated,
// the root itself excluded) and their nodes. Paths that share a *Node are
// hard links of one file.
type Tree struct {
	nodes map[string]*Node
}

// Paths returns the paths of the tree, sorted (parents before children).
func (t *Tree) Paths() []string {
	ps := make([]string, 0, len(t.nodes))
	for p := range t.nodes {
		ps = append(ps, p)
	}
	slices.Sort(ps)
	return ps
}

// Lookup returns the node at path p.
func (t *Tree) Lookup(p string) (*Node, bool) {
	n, ok := t.nodes[p]
	return n, ok
}

// String lists the tree, one path a line, for test failures.
func (t *Tree) String() string {
	var b strings.Builder
	for _, p := range t.Paths() {
		n := t.nodes[p]
		switch n.Kind {
		case KindDir:
			fmt.Fprintf(&b, "%s/ %v\n", p, n.Mode)
		case KindSymlink:
			fmt.Fprintf(&b, "%s -> %s\n", p, n.Data)
		default:
			fmt.Fprintf(&b, "%s %v %q\n", p, n.Mode, n.Data)
		}
	}
	return b.String()
}

// Equal reports whether two trees have the same paths, nodes and hard links.
func (t *Tree) Equal(u *Tree) bool {
	return t.hash() == u.hash()
}

// hash is a digest of the tree's content, hard links included.
func (t *Tree) hash() [sha256.Size]byte {
	h := sha256.New()
	first := make(map[*Node]string)
	var num [8]byte
	field := func(b []byte) {
		binary.LittleEndian.PutUint64(num[:], uint64(len(b)))
		h.Write(num[:])
		h.Write(b)
	}
	for _, p := range t.Paths() {
		n := t.nodes[p]
		field([]byte(p))
		if f, ok := first[n]; ok {
			field([]byte{0})
			field([]byte(f))
			continue
		}
		first[n] = p
		field([]byte{byte(n.Kind)})
		binary.LittleEndian.PutUint64(num[:], uint64(n.Mode))
		h.Write(num[:])
		field(n.Data)
	}
	var sum [sha256.Size]byte
	h.Sum(sum[:0])
	return sum
}

// Snapshot reads the tree under root. A missing root is an empty tree.
// Sockets, FIFOs and devices are left out.
func Snapshot(root string) (*Tree, error) {
	t := &Tree{nodes: make(map[string]*Node)}
	if _, err := os.Lstat(root); errors.Is(err, fs.ErrNotExist) {
		return t, nil
	}
	type fileID struct{ dev, ino uint64 }
	links := make(map[fileID]*Node)
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if p == root {
			return nil
		}
		rel, err := filepath.Rel(root, p)
		if err != nil {
			return err
		}
		rel = filepath.ToSlash(rel)
		info, err := d.Info()
		if err != nil {
			return err
		}
		mode := info.Mode() & (fs.ModePerm | fs.ModeSetuid | fs.ModeSetgid | fs.ModeSticky)
		switch {
		case d.IsDir():
			t.nodes[rel] = &Node{Kind: KindDir, Mode: mode}
		case d.Type() == fs.ModeSymlink:
			target, err := os.Readlink(p)
			if err != nil {
				return err
			}
			t.nodes[rel] = &Node{Kind: KindSymlink, Mode: mode, Data: []byte(target)}
		case d.Type().IsRegular():
			st, _ := info.Sys().(*syscall.Stat_t)
			if st != nil && st.Nlink > 1 {
				if n, ok := links[fileID{st.Dev, st.Ino}]; ok {
					t.nodes[rel] = n
					return nil
				}
			}
			data, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			n := &Node{Kind: KindFile, Mode: mode, Data: data}
			if st != nil && st.Nlink > 1 {
				links[fileID{st.Dev, st.Ino}] = n
			}
			t.nodes[rel] = n
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("crashstate: snapshot of %s: %w", root, err)
	}
	return t, nil
}

// Materialize writes the tree into dir, which must exist and be empty:
// directories, regular files with their content and mode, symlinks, and
// hard links between paths that share a node.
func (t *Tree) Materialize(dir string) error {
	if err := t.materialize(dir); err != nil {
		return fmt.Errorf("crashstate: materialize into %s: %w", dir, err)
	}
	return nil
}

func (t *Tree) materialize(dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	if len(entries) > 0 {
		return errors.New("directory is not empty")
	}
	paths := t.Paths()
	written := make(map[*Node]string)
	for _, p := range paths {
		n := t.nodes[p]
		full := filepath.Join(dir, filepath.FromSlash(p))
		if _, err := os.Lstat(filepath.Dir(full)); err != nil {
			return fmt.Errorf("parent of %s: %w", p, err)
		}
		switch n.Kind {
		case KindDir:
			err = os.Mkdir(full, 0o700)
		case KindSymlink:
			err = os.Symlink(string(n.Data), full)
		case KindFile:
			if first, ok := written[n]; ok {
				err = os.Link(filepath.Join(dir, filepath.FromSlash(first)), full)
			} else {
				written[n] = p
				err = os.WriteFile(full, n.Data, 0o600)
			}
		default:
			err = fmt.Errorf("unknown node kind %v at %s", n.Kind, p)
		}
		if err != nil {
			return err
		}
	}
	// Modes last, children before parents, so that a read-only directory
	// does not stop the writing of what is below it.
	for _, p := range slices.Backward(paths) {
		n := t.nodes[p]
		if n.Kind == KindSymlink {
			continue
		}
		if err := os.Chmod(filepath.Join(dir, filepath.FromSlash(p)), n.Mode); err != nil {
			return err
		}
	}
	return nil
}
