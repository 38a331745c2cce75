// Package cli implements the csi-agent command line: it parses each
// subcommand's flags, does the work through the other packages, and prints
// for people (tables) or programs (--output json).
//
// Contract: Main never calls os.Exit and writes only to the writers it is
// given, so every command is testable in-process. Exit codes: 0 success,
// 1 the command ran and found a problem (e.g. an invalid config file),
// 2 the command line itself was wrong.
//
// It holds no logic of its own beyond presentation: validation lives in
// pluginconfig, volume lifecycle in isolator, the daemon in agent.
package cli
