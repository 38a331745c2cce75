// Package testhelp holds what the root and end-to-end tests of several
// packages share: the root check, a temporary directory that fails its
// test if a mount or loop device is left in it, and building the real
// binaries once per test binary.
//
// Only tests import it. The mount package cannot (testhelp imports it),
// so its own tests keep their helpers.
package testhelp
