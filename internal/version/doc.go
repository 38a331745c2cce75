// Package version holds the build's version string, set at link time with
// -ldflags "-X github.com/csiagent/csiagent/internal/version.Version=...".
// It is read-only at run time; a binary built without the flag reports "dev".
package version
