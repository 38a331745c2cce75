// Package unixsock creates the agent's listening unix sockets safely: the
// socket gets its final owner and mode before it appears at its path (it is
// made in a private directory beside the path and renamed into place), so
// no caller ever sees it with the umask's mode and the process umask, which
// is shared by all threads, is never changed. A path that holds something
// other than a socket, or a socket another process still answers on, is
// refused rather than replaced; only a stale socket is removed.
//
// A path that fits a socket address is always usable: where the private
// name beside it would not fit, the socket is bound through the private
// directory's descriptor (/proc/self/fd/N/s).
//
// Use it for sockets other processes connect to (the agent's API and
// engine endpoint, the loop plugin's CSI and csi-addons endpoints). It
// does not lock anything: callers that must be the only server hold their
// own lock (the agent's runtime-dir lock).
package unixsock
