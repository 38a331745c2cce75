// Package keyedlock serialises work per key (a volume, a container, a
// plugin): one holder per key at a time, different keys never wait for
// each other, and a waiter gives up when its context ends.
//
// A Map holds an entry only while its key is held, so it does not grow
// with the keys ever seen. Waiters are not queued in order: when a key is
// released, whichever waiter runs first takes it.
//
// Not for: locks that must survive the process (use a lock file) or that
// need readers and writers (use sync.RWMutex).
package keyedlock
