package cluster

import (
	"fmt"
	"net/url"
	"strings"
)

// keys builds and parses the keys under the prefix (the layout is in
// the package doc). Each name taken from a caller is one path segment,
// escaped with url.PathEscape, so that a volume id holding "/" cannot
// reach another key.
type keys struct{ prefix string }

func seg(s string) string { return url.PathEscape(s) }

func unseg(s string) (string, error) { return url.PathUnescape(s) }

func (k keys) nodes() string                { return k.prefix + "/nodes/" }
func (k keys) nodeInfo(node string) string  { return k.nodes() + seg(node) + "/info" }
func (k keys) nodeAlive(node string) string { return k.nodes() + seg(node) + "/alive" }
func (k keys) claims() string               { return k.prefix + "/claims/" }
func (k keys) claim(plugin, volume string) string {
	return k.claims() + seg(plugin) + "/" + seg(volume)
}
func (k keys) locks() string { return k.prefix + "/locks/" }
func (k keys) lock(kind, id string) string {
	return k.locks() + seg(kind) + "/" + seg(id)
}

// parseNodeKey splits a key under nodes() into the node and its leaf
// ("info" or "alive").
func (k keys) parseNodeKey(key string) (node, leaf string, err error) {
	rest, ok := strings.CutPrefix(key, k.nodes())
	esc, leaf, ok2 := strings.Cut(rest, "/")
	if !ok || !ok2 {
		return "", "", fmt.Errorf("unexpected key %q under %s", key, k.nodes())
	}
	node, err = unseg(esc)
	return node, leaf, err
}

// parseLockKey splits a lock's key into its kind, its id and the lease of
// its holder's session.
func (k keys) parseLockKey(key string) (kind, id, lease string, err error) {
	rest, ok := strings.CutPrefix(key, k.locks())
	parts := strings.Split(rest, "/")
	if !ok || len(parts) != 3 {
		return "", "", "", fmt.Errorf("unexpected key %q under %s", key, k.locks())
	}
	if kind, err = unseg(parts[0]); err == nil {
		id, err = unseg(parts[1])
	}
	return kind, id, parts[2], err
}
