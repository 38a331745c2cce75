// Package proclog keeps the stdout and stderr of plugin processes in plain,
// size-capped, rotated files that outlive the agent.
//
// Open returns a file to hand to a child process as its Stdout or Stderr: the
// child writes straight into the file through its own descriptor, so nothing
// sits between the child and the disk and the agent can be killed, restarted
// and re-attached (it simply keeps calling Rotate on the same path) without
// the child noticing. There is no pipe, no reader goroutine and no buffer to
// lose.
//
// Rotate caps a file with the copytruncate scheme (as logrotate's
// copytruncate): path.1 .. path.keep hold the older content, newest first,
// and path itself is truncated in place. Because Open uses O_APPEND, the
// child's next write lands at the new end of the file, not at its old offset,
// so no sparse hole appears. The known cost of copytruncate applies: what the
// child writes between the end of the copy and the truncation is lost. The
// two system calls follow each other directly, so that is nothing or a line
// or two for a plugin logging at ordinary rates; a child writing megabytes a
// second loses a few kilobytes per rotation.
//
// When not to use it: for the agent's own logs (log to stderr and let the
// service manager keep them), for a child that does not get its descriptor
// from Open (without O_APPEND copytruncate leaves a sparse file that keeps
// its old size), or when losing any line at rotation is unacceptable (then
// the child must reopen its log on a signal, which CSI plugins do not do).
//
// Rotate calls for the same path serialise on an advisory lock (flock) on the
// file, so two agents, or an agent and a leftover instance, never rotate a
// file at the same time; the loser reports nothing rotated.
package proclog
