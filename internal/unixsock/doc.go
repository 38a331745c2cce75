// Package unixsock creates the agent's listening unix sockets safely: the
// socket gets its final owner and mode before it appears at its path (it is
// made in a private directory beside the path and renamed into place), so
// no caller ever sees it with the umask's mode and the process umask, which
// is shared by all threads, is never changed. A path that holds something
// other than a socket, or a socket another process still answers on, is
// refused rather than replaced; only a stale socket is removed.
//
// Use it for sockets other processes connect to (the API, the engine
// endpoint). It does not lock anything: callers that must be the only
// server hold their own lock (the agent's runtime-dir lock).
package unixsock
