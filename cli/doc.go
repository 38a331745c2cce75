// Package cli implements the csi-agent command line: one cobra command
// tree (flags before or after positional arguments, -h on every command,
// completion scripts), doing the work through the other packages and
// printing for people (tables) or programs (--output json).
//
// Contract: Main never calls os.Exit and writes only to the writers it is
// given, so every command is testable in-process. Exit codes: 0 success,
// 1 the command ran and found a problem (e.g. an invalid config file),
// 2 the command line itself was wrong. Long flags also take one dash
// (-output), as Go's flag package did. The README's command lines are the
// contract: a test parses every one of them.
//
// It holds no logic of its own beyond presentation: validation lives in
// pluginconfig, volume lifecycle in isolator, the daemon in agent.
package cli
