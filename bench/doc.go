// Package bench holds csiagent's performance benchmarks (make bench). They
// are Go tests that run the real csi-agent, csi-loop-plugin and test plugin
// binaries, and compare each figure with a baseline measured in the same
// run: the same kernel and plugin work done directly, the same agent on
// an empty host, or (TestClusterOverhead, with a 3-member etcd in the test
// process) an agent in no cluster. See docs/benchmarks.md for the method
// and the latest table.
//
// `go test ./bench` (part of make test) runs a short smoke version of every
// benchmark, so they keep working; `go test ./bench -args -full` (make
// bench) runs them at full size. Everything needs root (mounts, loop
// devices); without it the tests skip.
package bench
