// Package bytesize parses the sizes operators type, such as "1GiB",
// "512MiB", "10G" or "4096", into bytes. Both binaries read them: the
// agent's CLI (csi-agent expand --size) and the loop plugin's
// create-volume --size. It is a package of its own so that the agent
// does not link the loop plugin to read a flag.
//
// Binary (KiB, MiB, GiB, TiB, and the short K, M, G, T) and decimal (KB,
// MB, GB, TB) units are accepted; a bare number, or one with B, is bytes.
// A size is a whole positive number: fractions, zero and negatives are
// refused, as is a size that does not fit an int64.
package bytesize
