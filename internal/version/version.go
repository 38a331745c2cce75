package version

// Version is the release version of csiagent's binaries. It is a var only so
// that the linker can set it.
var Version = "dev"
