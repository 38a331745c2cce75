// Package testhelp holds what the root and end-to-end tests of several
// packages share: the root check (which also skips under -short, so that
// make unit runs no root test even as root), a temporary directory that
// fails its test if a mount or loop device is left in it, building
// the real binaries once per test binary, and README.md's ```sh blocks
// with their walkthrough markers (run by the README walkthrough and by
// the fleet tests).
//
// Only tests import it, each of these once: no test keeps a copy of its
// own. Since it imports mount and loopdev, their tests import it from
// their external test packages (mount_test, loopdev_test).
package testhelp
