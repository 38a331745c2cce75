package crashstate

import (
	"cmp"
	"crypto/sha256"
	"fmt"
	"math/rand/v2"
	"path"
	"slices"
	"strings"
)

// State is one disk state a power cut after the first K ops may leave.
type State struct {
	K    int
	Name string // how it was chosen, e.g. "k=120 dir csi/x current, rest durable"
	Tree *Tree
}

// Materialize writes the state's tree into dir, which must exist and be
// empty.
func (s State) Materialize(dir string) error {
	return s.Tree.Materialize(dir)
}

// Current returns the tree after the first k ops with everything visible,
// as a process (not a power cut) would see it.
func (t *Trace) Current(init *Tree, k int) (*Tree, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	r, err := t.replayTo(init, k)
	if err != nil {
		return nil, err
	}
	return r.build(mix{current: true}), nil
}

// States returns the distinct crash states after the first k ops of the
// trace (0 <= k <= len(t.Ops)), starting from the tree init: the durable
// state, the current state, for each item (a directory or file whose
// current state is not durable) the state with that item current and the
// rest durable and the state with that item durable and the rest current,
// and random mixes in which each item is independently durable, current or
// (files) torn. Identical trees are returned once. The choice depends only
// on the trace, init, k, random and rnd.
//
// Calls with the same init and non-decreasing k replay only the new ops.
func (t *Trace) States(init *Tree, k int, rnd *rand.Rand, random int) ([]State, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	r, err := t.replayTo(init, k)
	if err != nil {
		return nil, err
	}
	var states []State
	seen := make(map[[sha256.Size]byte]bool)
	add := func(name string, m mix) {
		tree := r.build(m)
		h := tree.hash()
		if seen[h] {
			return
		}
		seen[h] = true
		states = append(states, State{K: k, Name: fmt.Sprintf("k=%d %s", k, name), Tree: tree})
	}
	add("durable", mix{})
	add("current", mix{current: true})
	items := r.items()
	for _, it := range items {
		add(fmt.Sprintf("%v %s current, rest durable", it.ino.kind, it.name),
			mix{flip: map[*inode]bool{it.ino: true}})
	}
	for _, it := range items {
		add(fmt.Sprintf("%v %s durable, rest current", it.ino.kind, it.name),
			mix{current: true, flip: map[*inode]bool{it.ino: true}})
	}
	for i := 1; i <= random; i++ {
		block := 512
		if i%2 == 0 {
			block = 4096
		}
		m := mix{flip: make(map[*inode]bool), torn: make(map[*inode][]byte)}
		for _, it := range items {
			choice := rnd.IntN(2)
			if it.ino.kind == KindFile {
				choice = rnd.IntN(3)
			}
			switch choice {
			case 1:
				m.flip[it.ino] = true
			case 2:
				m.torn[it.ino] = tear(it.ino, block, rnd)
			}
		}
		name := fmt.Sprintf("random#%d", i)
		if len(m.torn) > 0 {
			name += fmt.Sprintf(" torn %d", block)
		}
		add(name, m)
	}
	return states, nil
}

// replayTo returns the model after the first k ops, advancing the cached
// one when it can. t.mu must be held.
func (t *Trace) replayTo(init *Tree, k int) (*replayer, error) {
	if k < 0 || k > len(t.Ops) {
		return nil, fmt.Errorf("crashstate: k=%d out of range [0, %d]", k, len(t.Ops))
	}
	if t.cache == nil || t.cache.init != init || t.cache.k > k {
		r, err := newReplayer(init)
		if err != nil {
			return nil, err
		}
		t.cache = r
	}
	r := t.cache
	for ; r.k < k; r.k++ {
		if err := r.apply(t.Ops[r.k]); err != nil {
			t.cache = nil
			return nil, fmt.Errorf("crashstate: replaying op %d (%v): %w", r.k, t.Ops[r.k], err)
		}
	}
	return r, nil
}

// mix chooses, per inode, the durable or the current state: current
// unless flipped if current is set, durable unless flipped otherwise; torn
// files get the given content.
type mix struct {
	current bool
	flip    map[*inode]bool
	torn    map[*inode][]byte
}

func (m mix) isCurrent(ino *inode) bool {
	return m.current != m.flip[ino]
}

func (m mix) entries(d *inode) map[string]*inode {
	if m.isCurrent(d) {
		return d.entries
	}
	return d.durEntries
}

func (m mix) content(f *inode) []byte {
	if data, ok := m.torn[f]; ok {
		return data
	}
	if m.isCurrent(f) {
		return f.content()
	}
	return f.durData
}

// build returns the tree the mix leaves: from the root down, following
// the chosen entries of each directory. A directory reached a second time
// (possible only in a mix of renames of directories) is left out there.
func (r *replayer) build(m mix) *Tree {
	t := &Tree{nodes: make(map[string]*Node)}
	files := make(map[*inode]*Node)
	dirs := map[*inode]bool{r.root: true}
	var walk func(d *inode, prefix string)
	walk = func(d *inode, prefix string) {
		ents := m.entries(d)
		for _, name := range sortedNames(ents) {
			ino, p := ents[name], path.Join(prefix, name)
			switch ino.kind {
			case KindDir:
				if dirs[ino] {
					continue
				}
				dirs[ino] = true
				t.nodes[p] = &Node{Kind: KindDir, Mode: ino.mode}
				walk(ino, p)
			case KindSymlink:
				t.nodes[p] = &Node{Kind: KindSymlink, Mode: ino.mode, Data: []byte(ino.target)}
			case KindFile:
				n, ok := files[ino]
				if !ok {
					n = &Node{Kind: KindFile, Mode: ino.mode, Data: m.content(ino)}
					files[ino] = n
				}
				t.nodes[p] = n
			}
		}
	}
	walk(r.root, "")
	return t
}

func sortedNames(ents map[string]*inode) []string {
	names := make([]string, 0, len(ents))
	for name := range ents {
		names = append(names, name)
	}
	slices.Sort(names)
	return names
}

// item is an inode whose durable and current states differ and that a
// crash state can show.
type item struct {
	ino  *inode
	name string // its first path in the current, else the durable, state
}

// items returns the items of the model, sorted by name: the changed
// inodes reachable from the root through current or durable entries.
func (r *replayer) items() []item {
	names := map[*inode]string{r.root: "."}
	var walk func(d *inode, prefix string)
	walk = func(d *inode, prefix string) {
		for _, ents := range []map[string]*inode{d.entries, d.durEntries} {
			for _, name := range sortedNames(ents) {
				ino := ents[name]
				if _, ok := names[ino]; ok {
					continue
				}
				p := path.Join(prefix, name)
				names[ino] = p
				if ino.kind == KindDir {
					walk(ino, p)
				}
			}
		}
	}
	walk(r.root, "")
	var items []item
	for ino := range r.dirty {
		if name, ok := names[ino]; ok && ino.differs() {
			items = append(items, item{ino: ino, name: name})
		}
	}
	slices.SortFunc(items, func(a, b item) int {
		return cmp.Or(strings.Compare(a.name, b.name), cmp.Compare(a.ino.id, b.ino.id))
	})
	return items
}

// tear returns the content of file f with each block taken from its
// current or its durable content, and the current or the durable size;
// bytes past the end of the chosen source are zero.
func tear(f *inode, block int, rnd *rand.Rand) []byte {
	size := len(f.data)
	if rnd.IntN(2) == 0 {
		size = len(f.durData)
	}
	out := make([]byte, size)
	for off := 0; off < size; off += block {
		src := f.data
		if rnd.IntN(2) == 0 {
			src = f.durData
		}
		end := min(off+block, size)
		if off < len(src) {
			copy(out[off:end], src[off:min(end, len(src))])
		}
	}
	return out
}
